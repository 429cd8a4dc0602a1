"""eaglet: a Snakemake workflow that turns a target LLM into a trained EAGLE-3 drafter.

Two layers, and what each may import (tests/test_layering.py checks it on every module):

- **stages**: the modules a rule runs with ``python -m eaglet.<stage>`` (workflow/rules/*.smk):
  target_model, prompts, generate, tokenize, freq, vocab, extract, train, learning_curve, export,
  evaluate, evaluate_vllm, eval_summary, plots, provenance. A stage imports the library only, never
  another stage: stages meet through artifacts on disk. Code two stages share moves into the library.
- **library**: everything else (io, target, target_check, model, rope, chain, labels, hidden_store,
  hf_loop, contract and its checks, export_format, known_answer, eval_sets, eval_stats, families,
  plan, storage, capture, online, curve_fit, job_records, vllm_env, vllm_server, gpu_slots, ...).
  The library never imports a stage; the workflow imports only the library at parse time.

Each rule lists the code its stage runs as inputs (``code=src(...)``), the stage's whole import
closure, so that editing a module reruns exactly the stages that run it.
"""

__version__ = "0.1.0"
