"""eaglet.data: Stages of workflow/rules/data.smk: the target's checkpoint and identity (target_model),
the prompts (prompts), the chat-templated tokens with the assistant-only mask (tokenize), token
counts (freq) and the draft vocabulary (vocab).
"""

# The packages this one may import (tests/workflow/test_layering.py reads it): nothing above it.
MAY_IMPORT = ('base', 'target')
