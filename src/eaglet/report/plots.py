"""Plots for the HTML report, drawn from the stage artifacts (matplotlib, PNG):

- ``coverage.png``: draft-vocab coverage against its size, the chosen size marked;
- ``training.png``: training and validation loss, per-TTT-step teacher-forced accuracy, and τ
  (teacher-forced estimate, and the validation chain τ); for a DFlash drafter its block loss, the
  accuracy per block position and the validation block τ;
- ``tables.html``: the tokenize metadata, the draft-vocab summary with its pinned tokens, the export
  contract (every check: pass, FAIL, or not run, both in red) and the evaluation summary, as HTML tables.

    python -m eaglet.report.plots --vocab results/r/vocab_map/vocab.json \
        --metrics results/r/train/metrics.parquet [--contract results/r/drafter/contract.json] \
        --out-dir results/r/plots
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from eaglet.base.digests import verify_recorded
from eaglet.base.files import atomic_path, read_json, read_parquet, write_text


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def coverage_plot(vocab_json: str | Path, out: str | Path) -> None:
    plt = _plt()
    v = read_json(vocab_json)
    curve = v["coverage_curve"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([p["draft_vocab_size"] for p in curve], [100 * p["coverage"] for p in curve], marker=".")
    ax.axvline(v["draft_vocab_size"], color="tab:red", linestyle="--",
               label=f"chosen V_d = {v['draft_vocab_size']:,}: {100 * v['coverage']:.2f}%")
    ax.set_xscale("log")
    ax.set_xlabel("draft vocabulary size")
    ax.set_ylabel("assistant-token coverage (%)")
    ax.set_title(f"Draft vocabulary coverage (target vocab {v['vocab_size']:,})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def training_plot(metrics_parquet: str | Path, out: str | Path) -> None:
    """The trainer's curves: EAGLE-3's (TTT loss, per-step accuracy, τ), or a block-parallel drafter's
    when the rows are eaglet.train.dflash_train's (``block_tau``) or eaglet.train.p_eagle_train's
    (``parallel_tau``): block_training_plot."""
    plt = _plt()
    df = read_parquet(metrics_parquet).to_pandas()
    if "block_tau" in df.columns or "parallel_tau" in df.columns:
        return block_training_plot(df, out)
    tr, va = df[df["split"] == "train"], df[df["split"] == "val"]
    acc_cols = sorted((c for c in df.columns if c.startswith("tf_acc_")), key=lambda c: int(c[7:]))
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(15, 4))
    a1.plot(tr["step"], tr["loss"], label="train", alpha=0.8)
    if len(va):
        a1.plot(va["step"], va["loss"], marker="o", label="validation")
    a1.set_title("TTT loss (sum of γ^k-weighted steps)")
    a1.set_xlabel("optimizer step")
    a1.legend()
    src = va if len(va) else tr
    for c in acc_cols:
        a2.plot(src["step"], src[c], marker="o" if len(src) < 20 else None, label=f"step {c[7:]}")
    a2.set_title(f"per-TTT-step teacher-forced accuracy ({'validation' if len(va) else 'train'})")
    a2.set_xlabel("optimizer step")
    a2.legend(fontsize=7)
    a3.plot(tr["step"], tr["tf_tau"], label="train, teacher-forced 1 + Σ_k Π_{i≤k} acc_i", alpha=0.8)
    if len(va):
        a3.plot(va["step"], va["tf_tau"], marker="o", label="validation, teacher-forced")
        a3.plot(va["step"], va["chain_tau"], marker="s", label="validation, exact greedy chain")
    a3.set_title("τ (chain: k = ttt_steps drafts per round)")
    a3.set_xlabel("optimizer step")
    a3.legend()
    _save_grid(plt, fig, (a1, a2, a3), out)


def _save_grid(plt, fig, axes, out: str | Path) -> None:
    """The training figures' finish: a light grid on each panel, written as PNG atomically."""
    for a in axes:
        a.grid(alpha=0.3)
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


# A block-parallel trainer's rows (tau column) and the names its figure gives them
BLOCK_CURVES = {
    "block_tau": ("block loss (position-weighted cross-entropy)", "block position",
                  "validation, exact block τ (T = 0)", "block τ (1 + accepted drafts per block)"),
    "parallel_tau": ("P-EAGLE loss (sum over draft depths of the mean cross-entropy)", "draft depth",
                     "validation, exact parallel round τ (T = 0)", "parallel τ (1 + accepted drafts per round)"),
}


def block_training_plot(df, out: str | Path) -> None:
    """A block-parallel drafter's curves: DFlash's (eaglet.train.dflash_train's rows, ``block_tau``) or
    P-EAGLE's (eaglet.train.p_eagle_train's, ``parallel_tau``): the training loss, the teacher-forced
    accuracy of each block position or draft depth (train rows' ``tf_acc_k``), and the validation τ (1 +
    accepted drafts per block or parallel round at T = 0 along the labels)."""
    plt = _plt()
    col = "block_tau" if "block_tau" in df.columns else "parallel_tau"
    loss_title, position, val_label, tau_title = BLOCK_CURVES[col]
    tr, va = df[df["split"] == "train"], df[df["split"] == "val"]
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(15, 4))
    a1.plot(tr["step"], tr["loss"], label="train", alpha=0.8)
    a1.set_title(loss_title)
    a1.set_xlabel("optimizer step")
    a1.legend()
    accs = [list(a) for a in tr["tf_acc_k"]] if "tf_acc_k" in tr.columns else []
    for k in range(len(accs[0]) if accs else 0):
        a2.plot(tr["step"], [a[k] for a in accs], label=f"{position} {k + 1}", alpha=0.8)
    a2.set_title(f"teacher-forced accuracy per {position} (train)")
    a2.set_xlabel("optimizer step")
    if accs:
        a2.legend(fontsize=7)
    if len(va):
        a3.plot(va["step"], va[col], marker="o", label=val_label)
        a3.legend()
    a3.set_title(tau_title)
    a3.set_xlabel("optimizer step")
    _save_grid(plt, fig, (a1, a2, a3), out)


def _kv_table(d: dict) -> str:
    import html

    cell = lambda v: html.escape(json.dumps(v) if isinstance(v, (dict, list)) else str(v))
    rows = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{cell(v)}</td></tr>" for k, v in d.items())
    return f"<table>{rows}</table>"


# A check that did not run is not a pass: it is red like a failure, labelled "not run".
STATUS_STYLE = {True: ("pass", "#1a7f37"), False: ("FAIL", "#cf222e"), None: ("not run", "#cf222e")}


def contract_table(report: dict) -> str:
    """The export contract as an HTML table: one row per check (format B's as speculators.*), its
    status coloured, the reason a check did not run and whether export.accept_not_run accepts it."""
    import html

    checks = list(report["checks"]) + [{**c, "name": f"speculators.{c['name']}"}
                                       for c in (report.get("speculators") or {}).get("checks", [])]
    not_run = [c for c in checks if c["ok"] is None]
    verdict = "passed" if report.get("ok") else "FAILED"
    head = (f"<p>contract {verdict}: {sum(c['ok'] is True for c in checks)} pass, "
            f"{sum(c['ok'] is False for c in checks)} FAIL, "
            f"<span style='color:#cf222e;font-weight:bold'>{len(not_run)} not run</span></p>") if not_run else \
        f"<p>contract {verdict}: every check ran</p>"
    rows = []
    for c in checks:
        label, colour = STATUS_STYLE[c["ok"]]
        note = ""
        if c["ok"] is None:
            note = html.escape(str(c.get("reason") or "")) + (
                " <b>(accepted by export.accept_not_run)</b>" if c.get("accepted") else " <b>(not accepted)</b>")
        elif c["ok"] is False:
            note = html.escape(json.dumps(c.get("details"))[:400])
        rows.append(f"<tr><td>{html.escape(c['name'])}</td>"
                    f"<td style='color:{colour};font-weight:bold'>{label}</td><td>{note}</td></tr>")
    return head + "<table><tr><th>check</th><th>status</th><th>why</th></tr>" + "".join(rows) + "</table>"


def domain_table(summary: dict) -> str:
    """τ per domain at the headline k (exact offline chain), with its interval and verdict."""
    import html

    h = summary.get("headline") or {}
    dom = h.get("tau_by_domain") or {}
    if not dom:
        return ""
    num = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
    rows = "".join(f"<tr><td>{html.escape(d)}</td><td>{v['prompts']}</td><td>{num(v['tau'])}</td>"
                   f"<td>{num(v['ci'][0])} - {num(v['ci'][1])}</td>"
                   f"<td>{'yes' if v['conclusive'] else 'no'}</td><td>{html.escape(v['note'])}</td></tr>"
                   for d, v in dom.items())
    return (f"<h3>τ per domain (k={h.get('k')}, exact offline chain, interval over prompts)</h3>"
            "<table><tr><th>domain</th><th>prompts</th><th>τ</th><th>interval</th><th>conclusive</th>"
            f"<th>note</th></tr>{rows}</table>")


def matrix_table(summary: dict) -> str:
    """summary.json's results matrix: τ per domain × k × T × engine with its interval over prompts
    (eaglet.eval.eval_summary gathers the rows; "all" = a whole set or every prompt)."""
    import html

    rows = summary.get("matrix") or []
    if not rows:
        return ""
    order = {"chain": 0, "expected": 1, "hf_loop": 2, "vllm": 3}
    rows = sorted(rows, key=lambda r: (r["set"] == "all", str(r["set"]), r["domain"] != "all", str(r["domain"]),
                                       r["k"], r["temperature"], order.get(r["engine"], 9), str(r["engine"]),
                                       str(r.get("rule"))))
    num = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
    body = "".join(f"<tr><td>{html.escape(str(r['set']))}</td><td>{html.escape(str(r['domain']))}</td>"
                   f"<td>{r['k']}</td><td>{r['temperature']:g}</td><td>{html.escape(str(r['engine']))}</td>"
                   f"<td>{html.escape(str(r.get('rule')))}</td>"
                   f"<td>{num(r['tau'])}</td>"
                   f"<td>{'-' if not r.get('ci') else num(r['ci'][0]) + ' - ' + num(r['ci'][1])}</td>"
                   f"<td>{r.get('prompts')}</td></tr>" for r in rows)
    return ("<h3 id='matrix'>Results matrix (τ; chain: exact greedy offline, expected: offline under the rule, "
            "hf_loop / vllm: measured; rule: greedy drafts accepted with p(draft), probabilistic: sampled drafts, "
            "Σ min(p, q))</h3><table><tr><th>set</th><th>domain</th><th>k</th><th>T</th>"
            f"<th>engine</th><th>rule</th><th>τ</th><th>interval</th><th>prompts</th></tr>{body}</table>")


def tables_html(out: str | Path, metadata: str | Path | None = None, vocab: str | Path | None = None,
                evaluation: str | Path | None = None, contract: str | Path | None = None) -> None:
    """One self-contained HTML page with the run's tables, for the report."""
    import html

    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>eaglet tables</title><style>"
             "body{font-family:sans-serif;margin:1em} table{border-collapse:collapse;margin-bottom:1.5em}"
             "th,td{border:1px solid #ccc;padding:3px 8px;text-align:left;font-size:13px}"
             "th{background:#f3f3f3}</style></head><body>"]
    if metadata:
        parts += ["<h2 id='tokenize'>Tokenisation (metadata.json)</h2>", _kv_table(read_json(metadata))]
    if vocab:
        v = read_json(vocab)
        head = {k: v[k] for k in v if k not in ("pinned", "coverage_curve")}
        parts += ["<h2 id='vocab'>Draft vocabulary</h2>", _kv_table(head), "<h3>Pinned tokens</h3>",
                  "<table><tr><th>id</th><th>token</th><th>why</th><th>count</th><th>frequency rank</th>"
                  "<th>in without pinning</th></tr>"]
        parts += [f"<tr><td>{p['id']}</td><td>{html.escape(repr(p['token']))}</td><td>{html.escape(p['why'])}</td>"
                  f"<td>{p['count']}</td><td>{p['frequency_rank']}</td><td>{p['would_be_in_without_pin']}</td></tr>"
                  for p in v["pinned"]]
        parts.append("</table>")
    if contract:
        parts += ["<h2 id='contract'>Export contract (drafter/contract.json)</h2>",
                  contract_table(read_json(contract))]
    if evaluation:
        e = read_json(evaluation)
        parts += ["<h2 id='evaluation'>Evaluation summary</h2>"]
        if (e.get("recommendation") or {}).get("sentence"):
            parts.append(f"<p><b>{html.escape(e['recommendation']['sentence'])}</b></p>")
        parts += [domain_table(e), matrix_table(e), _kv_table(e.get("headline", e))]
        if e.get("headline") is not None:
            parts += [_kv_table({k: v for k, v in e.items() if k not in ("headline", "matrix")})]
    parts.append("</body></html>")
    write_text(out, "\n".join(parts))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", default=None)
    p.add_argument("--metrics", default=None)
    p.add_argument("--metadata", default=None, help="tokenize metadata.json, for the tables page")
    p.add_argument("--evaluation", default=None, help="eval summary.json, for the tables page")
    p.add_argument("--contract", default=None, help="the export's contract.json, for the tables page")
    p.add_argument("--out-dir", required=True)
    a = p.parse_args(argv)
    out = Path(a.out_dir)
    if a.vocab:
        coverage_plot(a.vocab, out / "coverage.png")
    if a.metrics:
        verify_recorded(a.metrics, Path(a.metrics).with_name("train_summary.json"))  # train's record
        training_plot(a.metrics, out / "training.png")
    if a.metadata or a.vocab or a.evaluation or a.contract:
        tables_html(out / "tables.html", a.metadata, a.vocab, a.evaluation, a.contract)


if __name__ == "__main__":
    main()
