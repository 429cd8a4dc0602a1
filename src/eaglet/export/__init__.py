"""eaglet.export: The stage of workflow/rules/export.smk: the drafter in the format vLLM loads (export,
vllm_format; a DFlash drafter's: dflash_format) and the contract it must pass (the sub-package
contract: static checks, loaders, numeric parity, the real-vLLM checks in vllm_checks, the
known-answer drafter of known_answer and twin, recorded by record).
"""

# The packages this one may import (tests/workflow/test_layering.py reads it): nothing above it.
MAY_IMPORT = ('base', 'target', 'drafter', 'engines')
