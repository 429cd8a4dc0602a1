"""eaglet.drafter: The EAGLE-3 drafter: its model and file format in the trainer (eagle3), the DFlash
block drafter with its objective (dflash), its rotary
embedding (rope), the training-time-test unroll (ttt, ttt_attention), and the exact greedy chain
that scores it (chain).
"""

# The packages this one may import (tests/workflow/test_layering.py reads it): nothing above it.
MAY_IMPORT = ('base', 'target')
