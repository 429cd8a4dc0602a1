"""eaglet.base: The ground every package stands on: artifact I/O with recorded digests (io), what this
machine can run (capability), job records (job_records), and the packaged data sets (datasets:
ShareGPT, MT-Bench, HumanEval, CHAMP).
"""

# The packages this one may import (tests/workflow/test_layering.py reads it): nothing above it.
MAY_IMPORT = ()
