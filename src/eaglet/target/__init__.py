"""eaglet.target: The target model as every stage reads it: its identity, tokenizer and weights (load),
its chat template (chat_template) and how it reads reasoning (reasoning), the generation settings
that define the text it answers with (engine_key), what the installed
engine can serve and other file-only facts (check), the layer ids from its config (shape), a target
named by its hub id, resolved in huggingface_hub's cache (hub), the
tiny in-process families (families, family_templates), the capture of its aux + final hidden
states from its own forward (capture), and its logits and full-vocabulary statistics from pre-norm
final states by its own norm and head (head).
"""

# The packages this one may import (tests/workflow/test_layering.py reads it): nothing above it.
MAY_IMPORT = ('base',)
