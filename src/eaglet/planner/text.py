"""The memory plan's text (eaglet.planner.plan): the one line `snakemake -n` logs and the CLI's table."""

from __future__ import annotations

from eaglet.planner.shapes import GIB, TYPICAL_TOKENS


def _gib(x: int | None) -> str:
    return "?" if x is None else f"{x / GIB:.1f} GiB"


def summary_line(p: dict) -> str:
    """The one line `snakemake -n` logs."""
    h, t, e, v = p["hidden_states"], p["train"], p["extract"], p["vllm"]
    parts = [("hidden states: none stored (train.hidden_states online; the target runs in each training rank)"
              if p.get("online") else
              f"hidden states <= {h['total'] / 1e12:.2f} TB ({h['per_shard'] / 1e12:.2f} TB per shard)"),
             f"training rank {_gib(t['peak'])} ({t['shape']['dtype']}, B={t['shape']['B']} x T={t['shape']['T']}, "
             + (f"DFlash {t['shape']['anchors']} anchors x block {t['shape']['block_size']})" if "anchors" in t["shape"]
                else f"TTT attention {t['shape']['attention']})")]
    if e["gpus"] and not p.get("online"):
        parts.append(f"extraction {_gib(e['peak'])} per GPU")
    if v:
        parts.append(f"vLLM {_gib(v['reserved'])} per GPU reserved (weights {_gib(v['weights'])})")
    limit = "no GPU limit declared" if p["gpu_memory_gb"] is None else f"fits {p['gpu_memory_gb']} GiB per GPU"
    return "memory plan: " + "; ".join(parts) + f"; {limit} (python -m eaglet.planner.plan for the table)"


def table(p: dict) -> str:
    """The readable table of the CLI: job | part | figure."""
    rows = [("hidden states", "bytes per token", f"{p['hidden_states']['bytes_per_token']:,} B"),
            ("hidden states", f"total (<= {p['hidden_states']['max_tokens']:,} tokens)",
             f"{p['hidden_states']['total'] / 1e12:.3f} TB"),
            ("hidden states", "per shard", f"{p['hidden_states']['per_shard'] / 1e12:.3f} TB"),
            ("hidden states", f"at {TYPICAL_TOKENS:,} tokens per conversation",
             f"{p['hidden_states']['typical_total'] / 1e12:.3f} TB")]
    t = p["train"]
    rows += [("training rank", k, _gib(x)) for k, x in t["parts"].items()]
    rows += [("training rank", f"  activations: {k}", _gib(x)) for k, x in t.get("activation_parts", {}).items()]
    what = (f"DFlash {t['shape']['anchors']} anchors x block {t['shape']['block_size']}" if "anchors" in t["shape"]
            else f"attention {t['shape']['attention']}")
    rows.append(("training rank", f"PEAK ({t['shape']['dtype']}, B={t['shape']['B']}, T={t['shape']['T']}, {what})",
                 _gib(t["peak"])))
    if "attention_why" in t:
        rows.append(("training rank", f"TTT attention {t['shape']['attention']}", t["attention_why"]))
    rows += [("extraction shard /GPU", k, _gib(x)) for k, x in p["extract"]["parts"].items()]
    rows.append(("extraction shard /GPU", "PEAK", _gib(p["extract"]["peak"])))
    if p["vllm"]:
        v = p["vllm"]
        rows += [("vLLM server /GPU", f"reserved ({v['utilization']:.2f} x GPU)", _gib(v["reserved"])),
                 ("vLLM server /GPU", f"weights (/ tp {v['tensor_parallel_size']})", _gib(v["weights"])),
                 ("vLLM server /GPU", "left for the KV cache", _gib(v["kv_cache"]))]
    w = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
    lines = [f"{'job':<{w[0]}} | {'part':<{w[1]}} | figure", f"{'-' * w[0]}-|-{'-' * w[1]}-|-------"]
    lines += [f"{a:<{w[0]}} | {b:<{w[1]}} | {c}" for a, b, c in rows]
    lim = p["gpu_memory_gb"]
    lines.append(f"resources.gpu_memory_gb: {'null (no GPU limit)' if lim is None else f'{lim} GiB per GPU'}")
    return "\n".join(lines)
