"""eaglet.learning_curve: The stage of workflow/rules/learning_curve.smk: τ against the training data's
size (learning_curve) and its fit (curve_fit).
"""

# The packages this one may import (tests/workflow/test_layering.py reads it): nothing above it.
MAY_IMPORT = ('base',)
