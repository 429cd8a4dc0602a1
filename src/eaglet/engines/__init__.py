"""eaglet.engines: The engines a drafter runs in: vLLM's environment (vllm_env), server (vllm_server)
and the engine-side runner scripts copied into its venv (vllm_check_runner, vllm_eval_runner, and
vllm_dflash_probe: vLLM's DFlash module on given inputs), and the Hugging Face speculative loop
(hf_loop).
"""

# The packages this one may import (tests/workflow/test_layering.py reads it): nothing above it.
MAY_IMPORT = ('base', 'target', 'drafter')
