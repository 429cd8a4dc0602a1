"""eaglet.eval: Stages of workflow/rules/eval.smk: offline chain and HF-loop evaluation (evaluate),
real vLLM (evaluate_vllm), the statistics they share (stats) and the summary with its recommendation
(summary).
"""

# The packages this one may import (tests/workflow/test_layering.py reads it): nothing above it.
MAY_IMPORT = ('base', 'target', 'drafter', 'engines')
