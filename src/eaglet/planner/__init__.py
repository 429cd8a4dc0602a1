"""eaglet.planner: Plans made before a job runs: the target's shapes (shapes), the memory plan of every
job (plan, text), where hidden states live (storage), and the GPU-slot launcher a rule puts in front
of a GPU stage (gpu_slots).
"""

# The packages this one may import (tests/workflow/test_layering.py reads it): nothing above it.
MAY_IMPORT = ('base', 'target', 'hidden')
