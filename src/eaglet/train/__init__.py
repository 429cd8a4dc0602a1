"""eaglet.train: The stage of workflow/rules/train.smk: training the drafter (train), its setup,
batches, loop and resumable state (setup, data, loop, state), the proof of its labels against the
target (labels), and online hidden states computed in the job (online).
"""

# The packages this one may import (tests/workflow/test_layering.py reads it): nothing above it.
MAY_IMPORT = ('base', 'target', 'hidden', 'drafter', 'planner')
