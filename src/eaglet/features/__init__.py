"""eaglet.features: The stage of workflow/rules/features.smk: the target's hidden states, extracted
shard by shard (extract).
"""

# The packages this one may import (tests/workflow/test_layering.py reads it): nothing above it.
MAY_IMPORT = ('base', 'target', 'hidden')
