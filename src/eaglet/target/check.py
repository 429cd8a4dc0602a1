"""Facts about the target that decide, before any job runs, whether the run can succeed.

Called by workflow/rules/common.smk at parse time (so ``snakemake -n`` already refuses a wrong
target, naming the config key) and by the first job. Everything here reads files only: no
transformers, no torch, no vLLM import, so parsing the workflow stays fast.

- ``read_config``          the target's config.json (``text_config`` of a multimodal one)
- ``eagle3_architectures`` the architectures the INSTALLED vLLM can serve an EAGLE-3 drafter for,
                           read from its source (models implementing ``SupportsEagle3``)
- ``cpu_mla_block_sizes``  on a vLLM-CPU build: the KV block sizes its MLA and standard attention
                           kernels accept (an MLA target's drafter needs one both accept)
- ``serving``              one verdict line for the target's architecture

The chat template is read by eaglet.target.chat_template; the workflow's parse-time check of a
whole config by eaglet.workflow.checks.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

_CLASS = re.compile(r"^class\s+(\w+)\s*\(([^)]*)\)\s*:", re.M)
_SERVED = ("_TEXT_GENERATION_MODELS", "_MULTIMODAL_MODELS", "_TRANSFORMERS_SUPPORTED_MODELS")


def read_config(path: str | Path, key: str = "target.path") -> dict:
    """``<path>/config.json`` as a dict; a missing folder or file is an error naming ``key``."""
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"{key}: {str(path)!r} is not a folder (expected a local Hugging Face checkpoint)")
    conf = p / "config.json"
    if not conf.is_file():
        raise ValueError(f"{key}: {str(path)!r} has no config.json (not a Hugging Face checkpoint folder)")
    try:
        return json.loads(conf.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{key}: {conf} is not valid JSON: {e}") from None


def text_config(conf: dict) -> dict:
    """The language model's part of a config: ``text_config`` for multimodal checkpoints."""
    return conf.get("text_config") or conf


def architecture(conf: dict) -> str:
    return (conf.get("architectures") or ["?"])[0]


def check_layer_ids(layer_ids: list[int] | None, num_layers: int) -> list[int]:
    """``extract.layer_ids`` (or vLLM's default) valid for an ``num_layers``-layer target."""
    from eaglet.target.load import default_layer_ids, validate_layer_ids

    return validate_layer_ids(layer_ids or default_layer_ids(num_layers), num_layers)


# --------------------------------------------------------------------------- vLLM serving
def vllm_package(env: str | Path) -> Path | None:
    """The ``vllm`` package folder inside a virtual environment, or None when not installed."""
    for sp in sorted(Path(env).glob("lib/python3*/site-packages")):
        if (sp / "vllm" / "model_executor" / "models" / "registry.py").is_file():
            return sp / "vllm"
    return None


def _registry(registry_py: Path) -> dict[str, tuple[str, str]]:
    """{architecture: (module, class)} from every ``"Arch": ("module", "Class")`` dict entry."""
    tree = ast.parse(registry_py.read_text())
    # Served-generation tables only (not embedding, reward or drafter models); any dict if the
    # layout changed.
    dicts = [n.value for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Dict)
             and any(isinstance(t, ast.Name) and t.id in _SERVED for t in n.targets)]
    out: dict[str, tuple[str, str]] = {}
    for node in dicts or [n for n in ast.walk(tree) if isinstance(n, ast.Dict)]:
        if isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values, strict=True):
                if (isinstance(k, ast.Constant) and isinstance(k.value, str) and isinstance(v, ast.Tuple)
                        and len(v.elts) == 2 and all(isinstance(e, ast.Constant) for e in v.elts)):
                    out[k.value] = (v.elts[0].value, v.elts[1].value)
    return out


def _classes(files) -> dict[str, dict[str, list[str]]]:
    """{file: {class: base names}} (last dotted component, generics stripped)."""
    out = {}
    for f in files:
        text = f.read_text(errors="replace")
        found = {}
        for name, bases in _CLASS.findall(text):
            names = []
            for b in bases.split(","):
                b = re.sub(r"\[.*", "", b.strip())
                if b and "=" not in b:
                    names.append(b.split(".")[-1])
            found[name] = names
        if found:
            out[str(f)] = found
    return out


def eagle3_architectures(env: str | Path) -> list[str] | None:
    """Architectures the vLLM installed in ``env`` maps to a model class implementing its EAGLE-3
    interface (``SupportsEagle3``, directly or through a base class); None when no vLLM is there.
    Read from the source files: importing vLLM takes many seconds."""
    pkg = vllm_package(env)
    if pkg is None:
        return None
    models = pkg / "model_executor" / "models"
    files = [f for root in (models, pkg / "models") if root.is_dir() for f in root.rglob("*.py")]
    per_file = _classes(files)
    everywhere: dict[str, list[list[str]]] = {}
    for found in per_file.values():
        for name, bases in found.items():
            everywhere.setdefault(name, []).append(bases)
    memo: dict[str, bool] = {}

    def supports(name: str, bases_list: list[list[str]] | None = None, depth: int = 0) -> bool:
        if name == "SupportsEagle3":
            return True
        if bases_list is None:
            if name in memo:
                return memo[name]
            bases_list = everywhere.get(name, [])
        ok = depth < 20 and any(supports(b, None, depth + 1) for bases in bases_list for b in bases if b != name)
        memo.setdefault(name, ok)
        return ok

    archs = []
    for arch, (module, cls) in _registry(models / "registry.py").items():
        rel = module.removeprefix("vllm.").split(".") if module.startswith("vllm.") else None
        base = pkg.joinpath(*rel) if rel else models / module
        # The class as the registry's module defines it (a package: any file in it).
        cands = [found[cls] for f, found in per_file.items()
                 if cls in found and (f == f"{base}.py" or f.startswith(f"{base}/"))]
        if cands and supports(cls, cands):
            archs.append(arch)
    return sorted(set(archs))


def _block_sizes(py: Path) -> list[int | tuple[str, int]] | None:
    """What ``get_supported_kernel_block_sizes`` returns in one attention backend's source file:
    ints, and ``("multiple", n)`` for ``MultipleOf(n)``; None when the file or function is absent
    or returns something else."""
    if not py.is_file():
        return None
    for node in ast.walk(ast.parse(py.read_text(errors="replace"))):
        if isinstance(node, ast.FunctionDef) and node.name == "get_supported_kernel_block_sizes":
            ret = next((n.value for n in ast.walk(node) if isinstance(n, ast.Return)), None)
            if not isinstance(ret, ast.List):
                return None
            out: list[int | tuple[str, int]] = []
            for e in ret.elts:
                if isinstance(e, ast.Constant) and isinstance(e.value, int):
                    out.append(e.value)
                elif (isinstance(e, ast.Call) and getattr(e.func, "id", getattr(e.func, "attr", "")) == "MultipleOf"
                      and e.args and isinstance(e.args[0], ast.Constant)):
                    out.append(("multiple", e.args[0].value))
                else:
                    return None
            return out
    return None


def _accepts(sizes: list, size: int) -> bool:
    return any(size == s if isinstance(s, int) else size % s[1] == 0 for s in sizes)


def _show(sizes: list) -> str:
    return "[" + ", ".join(str(s) if isinstance(s, int) else f"multiples of {s[1]}" for s in sizes) + "]"


def cpu_mla_block_sizes(env: str | Path) -> tuple[list, list, list[int]] | None:
    """On a vLLM-CPU build: (MLA kernel block sizes, standard-attention kernel block sizes, the
    sizes both accept) read from the engine's own backends (``CPUMLABackend``, ``CPUAttentionBackend``);
    None for a GPU build or when the files are not where vLLM 0.32 keeps them.

    An EAGLE-3 drafter is a Llama decoder layer with standard attention: with an MLA target (DeepSeek-V3,
    Kimi) the engine needs one KV block size both kernels take, or it stops with "No common block size".
    (vLLM-CPU's AMX MLA kernel takes multiples of 32, but only in bf16 on AMX CPUs; eaglet serves fp32.)"""
    pkg = vllm_package(env)
    if pkg is None or not any(pkg.parent.glob("vllm_cpu-*.dist-info")):
        return None
    backends = pkg / "v1" / "attention" / "backends"
    mla, attn = _block_sizes(backends / "mla" / "cpu_mla.py"), _block_sizes(backends / "cpu_attn.py")
    if mla is None or attn is None:
        return None
    cands = sorted({s for s in mla + attn if isinstance(s, int)} | {16 * i for i in range(1, 65)})
    return mla, attn, [c for c in cands if _accepts(mla, c) and _accepts(attn, c)]


# What each drafter kind is called in the serving lines. vLLM 0.32 serves both through the same target
# interface: a DFlash drafter reads the target's aux hidden states as EAGLE-3's does (GPUModelRunner sets
# use_aux_hidden_state_outputs for DFlashProposer, and load_model then requires SupportsEagle3:
# vllm/v1/worker/gpu_model_runner.py), so the architectures that serve one serve the other.
DRAFTER_NAMES = {"eagle3": "an EAGLE-3 drafter", "dflash": "a DFlash drafter (method dflash, through the EAGLE-3 "
                                                             "target interface)"}


def serving(arch: str, env: str | Path, attention: str | None = None, kind: str = "eagle3") -> tuple[str, str]:
    """(status, line): status is ``supported``, ``unsupported`` or ``not-run`` (no vLLM in ``env``).
    ``attention`` is the target's kind (``mla`` for DeepSeek-V3/Kimi; eaglet.target.load.family_facts);
    ``kind`` the drafter's (drafter.kind), named in the line (DRAFTER_NAMES: the same targets)."""
    what = DRAFTER_NAMES[kind]
    archs = eagle3_architectures(env)
    if archs is None:
        return "not-run", (f"vLLM serving of {what} for {arch}: not checked (not run): no vLLM installed in "
                           f"{env} (envs/vllm/setup.sh installs it)")
    pkg = vllm_package(env)
    version = next((p.name.removesuffix(".dist-info").split("-")[-1] for p in pkg.parent.glob("vllm*.dist-info")),
                   "?")
    listed = ", ".join(archs)
    if arch not in archs:
        return "unsupported", (f"vLLM {version} ({env}) can NOT serve {what} for {arch}: the model "
                               f"class does not implement vLLM's EAGLE-3 interface (SupportsEagle3 / "
                               f"set_aux_hidden_state_layers); EAGLE-3 targets: {listed}")
    cpu = cpu_mla_block_sizes(env) if attention == "mla" else None
    if cpu is not None and not cpu[2]:
        return "unsupported", (f"vLLM {version} ({env}) can NOT serve {what} for {arch} on this CPU "
                               f"build: the target's MLA attention kernel (CPU_MLA) takes KV block sizes "
                               f"{_show(cpu[0])} and the drafter's standard attention (CPU_ATTN) "
                               f"{_show(cpu[1])}: no common KV block size (vLLM stops with 'No common block "
                               f"size'). A GPU build of vLLM serves it; eaglet trains and exports it here")
    return "supported", (f"vLLM {version} ({env}) can serve {what} for {arch}: supported "
                         f"(EAGLE-3 targets: {listed})")
