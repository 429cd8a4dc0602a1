"""Print the measured table of a finished run (what `make run` ends with; the table of
docs/measurements.md, "The default run, measured", is pasted from it).

    python -m eaglet.workflow.summary results/smollm2            # markdown table: stage | result | wall
    python -m eaglet.workflow.summary results/smollm2 --short    # a few lines
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _f(x, fmt: str = ".3f") -> str:
    return "n/a" if x is None else format(x, fmt)


def train_line(t: dict) -> str:
    """The training figures train_summary.json holds (eaglet.train.train): steps, the last train and
    validation loss, and the validation chain τ of the kept weights (teacher-forced τ beside it)."""
    tr, va = t.get("final_train") or {}, t.get("final_val") or {}
    best = t.get("best_val") or va
    k = (t.get("params") or {}).get("ttt_steps")
    parts = [f"{t.get('steps')} steps", f"loss {_f(tr.get('loss'))} (validation {_f(va.get('loss'))})"]
    if best:
        parts.append(f"validation chain tau {_f(best.get('chain_tau'))} at k={k} "
                     f"(teacher-forced {_f(best.get('tf_tau'))})")
    if t.get("selected"):
        parts.append(f"kept step {t['selected']['step']}")
    return ", ".join(parts)


def _load(run_dir: Path, rel: str):
    p = run_dir / rel
    return json.loads(p.read_text()) if p.exists() else None


def _n(x) -> str:
    return "n/a" if x is None else f"{x:,}"


def _minutes(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    return f"{seconds:.0f} s" if seconds < 60 else f"{seconds / 60:.1f} min"


# Which rules each row of the table stands for (their wall times are summed).
ROWS = {"target": ["target_model"], "generate": ["generate"],
        "tokenize / vocab": ["prompts", "tokenize", "token_freq", "vocab_map"],
        "extract": ["extract_hidden_states"], "train": ["train"],
        "learning curve": ["train_fraction", "learning_curve"], "export": ["export"],
        "evaluate": ["evaluate_offline", "evaluate_speculative", "evaluate_vllm", "eval_summary"],
        "plots / provenance": ["plots", "provenance"]}


IDLE_S = 300  # a pause this long between jobs separates two invocations of the workflow


def _walls(prov: dict | None) -> tuple[dict[str, float], float | None]:
    """(seconds per row, the span of the last invocation: from the first job's start to the last
    one's end, over the jobs that ran without a pause of IDLE_S; a stage kept from an earlier
    invocation, such as a target built hours before, is not in it)."""
    times = (prov or {}).get("stage_wall_times") or []
    per = {row: sum(t["seconds"] for t in times if t["rule"] in rules) for row, rules in ROWS.items()}
    spans = sorted(((t["start"], t["end"]) for t in times if "start" in t), key=lambda x: x[1], reverse=True)
    if not spans:
        return {r: v for r, v in per.items() if v}, None
    first, last = spans[0]
    for start, end in spans[1:]:
        if end < first - IDLE_S:
            break
        first = min(first, start)
    return {r: v for r, v in per.items() if v}, last - first


def _ci(x: dict | None, fmt: str = ".2f") -> str:
    if not x or x.get("tau") is None:
        return "n/a"
    lo, hi = (x.get("ci") or [None, None])[:2]
    iv = f" [{lo:{fmt}}, {hi:{fmt}}]" if lo is not None and hi is not None else " (no interval)"
    return f"{x['tau']:{fmt}}{iv}"


def _generate(g: dict) -> str:
    errors = g.get("errors_by_kind") or {}
    err = ", ".join(f"{n} `{k}`" for k, n in sorted(errors.items())) or "no errors"
    # samples counts the ok rows only (it once printed samples - errors of samples)
    over = g.get("filtered", 0)
    over = f"; {over} prompts over the length limit not sent" if over else ""
    original = g.get("original") or 0
    mix = (f"; data.mix {g.get('mix')}: {g.get('regenerated', 0)} regenerated, {original} with the dataset's "
           "responses" if original else "")
    rate, made = g.get("tokens_per_s"), g.get("regenerated", g["samples"])
    if not made:
        gen = "nothing generated"
    elif rate is None:
        gen = f"{_n(g.get('completion_tokens'))} completion tokens, all kept from an earlier run"
    else:
        gen = (f"{_n(g.get('completion_tokens'))} completion tokens at {rate:.1f} tok/s (concurrency "
               f"{g.get('concurrency')}); {g.get('hit_max_tokens', 0)} hit max_tokens "
               f"{(g.get('sampling') or {}).get('max_tokens')}")
    return f"{g.get('backend')} backend; {g['samples']} of {g.get('input', g['samples'])} ok ({err}{over}{mix}); {gen}"


def _skipped(m: dict) -> str:
    reasons = m.get("skipped_by_reason") or {}
    return f"{m['samples_skipped']} skipped" + (
        ": " + ", ".join(f"{n} `{r}`" for r, n in sorted(reasons.items())) if reasons else "")


def _extract(run_dir: Path) -> str | None:
    shards = sorted((run_dir / "extract").glob("shard_*/index.json"))
    if not shards:
        return None
    tokens = nbytes = 0
    dtype = layers = None
    for f in shards:
        idx = json.loads(f.read_text())
        tokens += sum(c["num_tokens"] for c in idx["chunks"])
        nbytes += sum((f.parent / c["file"]).stat().st_size for c in idx["chunks"] if (f.parent / c["file"]).exists())
        dtype, layers = idx.get("dtype"), idx.get("layer_ids")
    return (f"{_n(tokens)} tokens, {nbytes / 1e9:.3f} GB {dtype} in {len(shards)} shard(s); aux layers {layers} "
            "+ the final pre-norm state")


def _train_dflash(t: dict) -> str:
    """A DFlash drafter's training (eaglet.train.dflash_train): its validation is block τ, its labels
    the target's stored greedy tokens (no label check to prove)."""
    tr, va, sel = t.get("final_train") or {}, t.get("final_val") or {}, t.get("selected") or {}
    return (f"DFlash, block {t.get('block_size')}: {t.get('steps')} steps, loss {_f(tr.get('loss'))}, validation "
            f"block tau {_f(va.get('block_tau'))} (every held-out anchor, T = 0), kept step {sel.get('step')}; "
            f"labels: {t.get('labels')}; {_minutes(t.get('seconds_this_run'))} of training"
            f"{', bf16 autocast' if t.get('bf16_autocast') else ''}")


def _train_p_eagle(t: dict) -> str:
    """A P-EAGLE drafter's training (eaglet.train.p_eagle_train): its validation is the parallel round's τ."""
    tr, va, sel = t.get("final_train") or {}, t.get("final_val") or {}, t.get("selected") or {}
    return (f"P-EAGLE, K {t.get('parallel_k')}: {t.get('steps')} steps, loss {_f(tr.get('loss'))}, validation "
            f"parallel tau {_f(va.get('parallel_tau'))} (every held-out start, T = 0), kept step {sel.get('step')}; "
            f"labels: {t.get('labels')}; {_minutes(t.get('seconds_this_run'))} of training"
            f"{', bf16 autocast' if t.get('bf16_autocast') else ''}")


def _train(t: dict) -> str:
    if t.get("kind") == "dflash":
        return _train_dflash(t)
    if t.get("kind") == "p_eagle":
        return _train_p_eagle(t)
    lc = t.get("label_check") or {}
    labels = (f"labels proven: top-1 agreement {100 * lc['agreement']:.1f} % on {lc['judged']} positions"
              if lc.get("ok") else f"labels NOT proven ({lc.get('reason', 'no label check')})")
    return f"{train_line(t)}; {labels}"


def _export(c: dict) -> str:
    checks = {x["name"]: x for x in c.get("checks", [])}
    passed = sum(1 for x in checks.values() if x.get("status") == "pass")
    head = (f"contract {'passed' if c.get('ok') else 'FAILED'}: {passed} of {len(checks)} checks pass"
            + (f", failed {c['failed']}" if c.get("failed") else "")
            + (f", not run (accepted) {[x['name'] for x in c['not_run']]}" if c.get("not_run") else ""))
    parts = [head]
    if checks.get("vllm.lossless", {}).get("status") == "pass":
        d = checks["vllm.lossless"]["details"]
        parts.append(f"real vLLM: output = plain greedy on {d['prompts']} prompts ({d['tokens']} tokens)")
    ka = checks.get("vllm.known_answer", {})
    if ka.get("status") == "pass":
        d = ka["details"]
        parts.append(f"known-answer drafter: {d['first_accepted']}/{d['num_drafts']} first drafts accepted")
    acc = checks.get("vllm.acceptance", {})
    if acc.get("status") in ("pass", "FAIL"):
        d = acc["details"]
        if d.get("chain") is not None:  # kind dflash / p_eagle: vLLM's counters against eaglet's chain
            what = "parallel" if c.get("kind") == "p_eagle" else "block"
            parts.append(f"vLLM's counters {'equal' if d['vllm'] == d['chain'] else 'differ from'} eaglet's {what} "
                         f"chain ({d['chain']['drafts']} rounds, τ {_f(d.get('tau'))}; {acc['status']})")
        elif d.get("served_tau") is not None and d.get("simulated_tau") is not None:
            parts.append(f"vLLM τ {d['served_tau']:.3f} vs eaglet's chain {d['simulated_tau']:.3f} pooled over "
                         f"{d['served']['rounds']} rounds on the same text ({acc['status']})")
        else:
            parts.append(f"vLLM τ {d.get('vllm_tau')} ({acc['status']}: {d.get('rule')})")
    return "; ".join(parts)


ENGINES = {"expected": "expected offline", "hf_loop": "HF loop", "vllm": "vLLM", "chain": "exact chain",
           "regen": "along its regenerated answers"}


def regenerated_part(rg: dict, matrix: list[dict], k) -> str:
    """What the target regenerated for the evaluation (answers per temperature, the backend, tok/s)
    and the drafter's τ at k along them at T = 0 (the exact chain; T > 0 is in sampled_parts)."""
    t = rg.get("texts") or {}
    per_t = ", ".join(f"{x['answers']} at T={x['temperature']:g}" for x in rg.get("temperatures") or [])
    head = (f"the target regenerated {per_t or 'nothing scored'} ({t.get('completion_tokens')} tokens through "
            f"{t.get('backend')} at {t.get('tokens_per_s')} tok/s)")
    at0 = [r for r in matrix if r["engine"] == "regen" and r["temperature"] == 0 and r["k"] == k
           and r["set"] == "all" and r["domain"] == "all"]
    if rg.get("status") == "not run":
        return head + "; not scored (the HF target does not run here)"
    return head + (f"; τ(k={k}) along its greedy answers {_ci(at0[0])}" if at0 else "")


def sampled_parts(matrix: list[dict], k) -> list[str]:
    """One phrase per temperature T > 0 of summary.json's results matrix: τ at k over every prompt,
    per engine, with its interval."""
    out = []
    for temp in sorted({r["temperature"] for r in matrix if r["temperature"] > 0}):
        at = [r for r in matrix if r["temperature"] == temp and r["k"] == k and r["set"] == "all"
              and r["domain"] == "all"]
        if at:
            out.append(f"at T={temp:g} τ(k={k}) with 95% CI: "
                       + ", ".join(f"{ENGINES.get(r['engine'], r['engine'])}"
                                   f"{' (' + r['rule'] + ')' if r.get('rule') else ''} {_ci(r)}" for r in at))
    return out


def _evaluate(e: dict) -> str:
    h = e.get("headline") or {}
    k = h.get("k")
    doms = h.get("tau_by_domain") or {}
    parts = []
    if doms:
        parts.append(f"exact chain τ(k={k}) with 95% CI: " + ", ".join(f"{d} {_ci(v)}" for d, v in doms.items()))
    loop = h.get("tau_hf_loop") or {}
    chain = h.get("tau_offline_chain") or {}
    if loop:
        same = h.get("offline_matches_real_loop")
        parts.append(f"HF loop τ {'equals' if same else 'DIFFERS from'} the offline chain "
                     f"({', '.join(f'{s} {v:.2f}' for s, v in loop.items() if v is not None)})")
    if e.get("regenerated"):
        parts.append(regenerated_part(e["regenerated"], e.get("matrix") or [], k))
    parts += sampled_parts(e.get("matrix") or [], k)
    if h.get("hf_loop") == "not run":  # never a pass: said, with the reason
        parts.append(f"HF loop NOT RUN ({h.get('hf_loop_reason')})")
    if "lossless_hf_loop" in h:
        hf = h["lossless_hf_loop"]
        lossless = [f"HF loop {'not run' if hf is None else 'yes' if hf else 'NO'}"]
        if "lossless_vllm" in h:
            lossless.append(f"vLLM {'yes' if h['lossless_vllm'] else 'NO'}")
        parts.append("lossless: " + ", ".join(lossless))
    if h.get("speedup_hf_loop_note"):
        parts.append(f"HF-loop {h['speedup_hf_loop_note']}")
    if h.get("tau_vllm"):
        parts.append(f"vLLM τ(k={h.get('vllm_k')}) " + ", ".join(
            f"{s} {v:.2f}" for s, v in h["tau_vllm"].items() if v is not None)
            + ("" if h.get("vllm_agrees_with_offline") else " (offline agreement not tested)"
               if h.get("hf_loop") == "not run" else " (DISAGREES with offline)"))
    if h.get("recommendation"):
        parts.append(h["recommendation"])
    if not chain and not parts:
        return json.dumps(h)[:300]
    return "; ".join(parts)


def table(run_dir: str | Path) -> list[str]:
    """The "default run, measured" table of docs/measurements.md, made from the run's artifacts: one row per
    stage (what it produced, its wall time from provenance.json), absent stages left out."""
    run_dir = Path(run_dir)
    prov = _load(run_dir, "provenance.json")
    walls, total = _walls(prov)
    rows: list[tuple[str, str]] = []
    ident = (prov or {}).get("target")
    if ident:
        rows.append(("target", f"{ident.get('name')} ({ident.get('architecture')}, {ident.get('num_layers')} layers, "
                               f"hidden {ident.get('hidden_size')}, vocab {_n(ident.get('vocab_size'))})"))
    if (g := _load(run_dir, "generate/generate_summary.json")):
        rows.append(("generate", _generate(g)))
    m, v = _load(run_dir, "tokenize/metadata.json"), _load(run_dir, "vocab_map/vocab.json")
    if m and v:
        rows.append(("tokenize / vocab",
                     f"{m['samples_processed']} samples ({_skipped(m)}), {_n(m['total_tokens'])} "
                     f"tokens, {_n(m['total_assistant_tokens'])} assistant tokens "
                     f"({_n(v.get('distinct_assistant_tokens'))} distinct); draft vocab {_n(v['draft_vocab_size'])} "
                     f"covers {100 * v['coverage']:.2f} %"))
    if (x := _extract(run_dir)):
        rows.append(("extract", x))
    if (t := _load(run_dir, "train/train_summary.json")):
        rows.append(("train", _train(t)))
    if (lc := _load(run_dir, "learning_curve/learning_curve.json")):
        from eaglet.learning_curve.curve_fit import describe

        rows.append(("learning curve", describe(lc)))
    if (c := _load(run_dir, "drafter/contract.json")):
        rows.append(("export", _export(c)))
    if (e := _load(run_dir, "eval/summary.json")):
        rows.append(("evaluate", _evaluate(e)))
    if prov:
        rows.append(("plots / provenance", "plots, provenance.json"
                     + (f"; report {run_dir / 'report.html'}" if (run_dir / "report.html").exists() else "")))
    hw = (prov or {}).get("hardware") or {}
    out = [f"eaglet run {run_dir.name}: {hw.get('cores', '?')} cores {hw.get('cpu', '')}, "
           f"{hw.get('gpu_count', 0)} GPUs", "", "| stage | result | wall |", "|---|---|---|"]
    for name, text in rows:
        out.append(f"| {name} | {text.replace('|', '/')} | {_minutes(walls.get(name))} |")
    out.append(f"| **total** | first job start to last job end (this invocation) | **{_minutes(total)}** |")
    return out


def lines(run_dir: Path) -> list[str]:
    """Short lines (kept for the log); ``table`` is what ``main`` prints."""
    out = [f"eaglet run {run_dir.name}:"]
    if (m := _load(run_dir, "tokenize/metadata.json")):
        out.append(f"  tokenize   {m['samples_processed']} samples ({m['samples_skipped']} skipped), "
                   f"{m['total_tokens']:,} tokens, {m['total_assistant_tokens']:,} assistant tokens")
    if (v := _load(run_dir, "vocab_map/vocab.json")):
        out.append(f"  vocab_map  coverage {100 * v['coverage']:.2f}% at draft vocab {v['draft_vocab_size']:,}"
                   f" of {v['vocab_size']:,} ({len(v['pinned'])} pinned tokens)")
    if (t := _load(run_dir, "train/train_summary.json")):
        out.append("  train      " + train_line(t))
    if (e := _load(run_dir, "eval/summary.json")):
        out.append("  evaluate   " + _evaluate(e))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--short", action="store_true", help="a few lines instead of the markdown table")
    a = p.parse_args(argv)
    run_dir = Path(a.run_dir)
    if not run_dir.is_dir():
        p.error(f"{run_dir}: no such run folder (results/<run>, as config's `run` names it)")
    print("\n".join(lines(run_dir) if a.short else table(run_dir)))


if __name__ == "__main__":
    main()
