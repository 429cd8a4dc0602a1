"""eaglet.generate: The stage of workflow/rules/generate.smk: the target regenerates the answers
(generate), through a backend (backends: a vLLM server, an OpenAI-compatible URL, or in-process),
turn by turn (turns), in resumable parts (parts).
"""

# The packages this one may import (tests/workflow/test_layering.py reads it): nothing above it.
MAY_IMPORT = ('base', 'target', 'engines')
