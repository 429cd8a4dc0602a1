"""eaglet: a Snakemake workflow that turns a target LLM into a trained EAGLE-3 drafter.

One package per stage family of the DAG, named like the rule file that runs it
(workflow/rules/<name>.smk runs ``python -m eaglet.<name>.<module>``), over a few shared packages:

    workflow                                   parse-time checks, code inputs, the run's summary
    data  generate  features  train  export  eval  learning_curve  report        (stages)
    planner                                    shapes, memory plan, storage choice, GPU slots
    engines                                    vLLM and the Hugging Face speculative loop
    drafter                                    the drafter model, its TTT unroll and chain
    target  hidden                             the target; hidden states on disk
    base                                       I/O, machine capability, records, data sets

Imports point only downward. Each package's ``MAY_IMPORT`` names the packages it may import; no
stage package imports another (stages meet through artifacts on disk); the Snakefile imports only
``workflow`` and the shared packages at parse time. tests/workflow/test_layering.py checks all of it, and
that each rule lists as inputs exactly the code its stage runs (eaglet.workflow.code_inputs).
"""

__version__ = "0.1.0"
