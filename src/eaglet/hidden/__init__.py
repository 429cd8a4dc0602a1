"""eaglet.hidden: Hidden states on disk: the dtypes and bytes per stored token (dtypes), the sharded
store extraction writes and training reads (store), and its chunk reader (reader).
"""

# The packages this one may import (tests/workflow/test_layering.py reads it): nothing above it.
MAY_IMPORT = ('base',)
