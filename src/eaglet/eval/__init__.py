"""eaglet.eval: Stages of workflow/rules/eval.smk, one module per rule: the exact offline simulator
(evaluate_offline), the real speculative loop on the HF target (evaluate_speculative), the offline
figures per chat-template mode (evaluate_modes), real vLLM (evaluate_vllm), the drafter along the
target's regenerated answers (regenerated, rule evaluate_regenerated) and the summary with its
recommendation (eval_summary); what they share: their settings, read from the config schema
(options), the HF-loop stages' command line, seeding and not-run outputs (hf_stage) and the
statistics (stats).
"""

# The packages this one may import (tests/workflow/test_layering.py reads it): nothing above it.
MAY_IMPORT = ('base', 'target', 'drafter', 'engines')
