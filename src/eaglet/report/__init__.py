"""eaglet.report: Stages of workflow/rules/report.smk: the report's plots (plots) and the run's
provenance (provenance), and the drafter's model card (card).
"""

# The packages this one may import (tests/workflow/test_layering.py reads it): nothing above it.
MAY_IMPORT = ('base',)
