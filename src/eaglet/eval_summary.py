"""Summarise the evaluation: headline figures, offline-vs-real agreement, the draft-length
recommendation with the table behind it, and the plots for the report.

    python -m eaglet.eval_summary --eval-dir results/RUN/eval [--vllm results/RUN/eval/vllm.json] \
        [--config '{"tie_eps": 1e-5, "headline_k": 3}'] [--log LOG]

Reads offline.json, speculative.json (+ their rounds/positions Parquet) and, when given, vllm.json
from the eval folder. Writes summary.json (``headline``, ``agreement``, ``recommendation``) and
tau_per_position.png, tau_per_k.png, speedup_vs_k.png.

Recommendation: expected speedup(k) = τ(k) · c_target(1) / (c_target(k+1) + k · c_draft), with τ(k)
the offline acceptance length from every position (measured acceptance per position) and the costs
the median measured forward times of the HF loop: one target decode step, one verify forward of
k+1 tokens, one drafter step. The k that maximises it is recommended; nothing else picks k.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pandas as pd

from eaglet import io

log = logging.getLogger("eaglet.eval_summary")

DEFAULTS = dict(tie_eps=1e-5, headline_k=3, tau_goal=2.5, speedup_goal=1.5)
PLOTS = ("tau_per_position.png", "tau_per_k.png", "speedup_vs_k.png")


def _k(d: dict, k) -> object:
    """A value keyed by k in a JSON dict (keys are strings after a round trip)."""
    return d.get(str(k), d.get(k)) if d else None


# --------------------------------------------------------------------------- agreement
def agreement(eval_dir: Path, eps: float) -> dict:
    """Offline chain replay vs the real loop, round by round, per prompt and k. A difference is
    explained only by a logged near-tie (target or drafter top-2 gap < eps) where it starts."""
    a = io.read_parquet(eval_dir / "offline_rounds.parquet").to_pandas()
    b = io.read_parquet(eval_dir / "speculative_rounds.parquet").to_pandas()
    pos = io.read_parquet(eval_dir / "offline_positions.parquet").to_pandas()
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
        row = {"k": k, "tau_offline": tau, "accept_rate_pos_k": offline["overall"]["accept_rate_per_pos"][k - 1],
               "verify_over_step": None, "predicted_speedup": None,
               "measured_speedup": measured["speedup"] if measured else None,
               "measured_tau": measured["tau"] if measured else None}
        if tau is not None and c1 and cd is not None:
            cv = verify_cost(costs, k + 1)
            row["verify_over_step"] = cv / c1
            row["draft_over_step"] = cd / c1
            row["predicted_speedup"] = tau * c1 / (cv + k * cd)
        rows.append(row)
    scored = [r for r in rows if r["predicted_speedup"] is not None]
    best = max(scored, key=lambda r: r["predicted_speedup"]) if scored else None
    meas = [r for r in rows if r["measured_speedup"] is not None]
    best_meas = max(meas, key=lambda r: r["measured_speedup"]) if meas else None
    return {"table": rows, "recommended_k": best["k"] if best else None,
            "predicted_speedup": best["predicted_speedup"] if best else None,
            "best_measured_k": best_meas["k"] if best_meas else None,
            # below 1 at every k, speculative decoding with this drafter costs more than it saves
            "speculation_pays": bool(best and best["predicted_speedup"] > 1.0),
            "costs": {"target_step_s": c1, "draft_step_s": cd, "target_forward_s": costs},
            "rule": "argmax_k tau(k) * c_target(1) / (c_target(k+1) + k * c_draft)"}


# --------------------------------------------------------------------------- headline
def headline(offline: dict, spec: dict, vllm: dict | None, agree: dict, rec: dict, o: dict) -> dict:
    k = o["headline_k"]
    h = {"k": k,
         "tau_offline": {s: _k(v["tau"], k) for s, v in offline["sets"].items()},
         "tau_offline_chain": {s: _k(v["tau_chain"], k) for s, v in offline["sets"].items()},
         "tau_hf_loop": {s: (_k(v["k"], k) or {}).get("tau") for s, v in spec["sets"].items()},
         "speedup_hf_loop": (_k(spec["overall"]["k"], k) or {}).get("speedup"),
         "greedy_tok_s": spec["overall"]["greedy_tok_s"],
         "spec_tok_s": (_k(spec["overall"]["k"], k) or {}).get("tok_s"),
         "best_speedup_hf_loop": max((v["speedup"] for v in spec["overall"]["k"].values() if v["speedup"]),
                                     default=None),
         "lossless_hf_loop": spec["lossless"]["pass"],
         "offline_matches_real_loop": agree["pass"],
         "recommended_k": rec["recommended_k"]}
    if vllm:
        run = next((r for r in vllm["runs"] if r["k"] == k and not r["iomp"]), None) or \
            next((r for r in vllm["runs"] if r["k"] is not None and not r["iomp"]), None)
        if run:
            h["vllm_k"] = run["k"]
            h["tau_vllm"] = {s: v.get("tau") for s, v in run["sets"].items()}
            h["speedup_vllm"] = {s: v.get("speedup") for s, v in run["sets"].items()}
        h["lossless_vllm"] = vllm["lossless"]
        ag = vllm.get("hf_greedy_agreement")
        h["vllm_plain_equals_hf_greedy"] = f"{ag['identical']}/{ag['prompts']} prompts" if ag else None
        h["vllm_agrees_with_offline"] = not vllm["disagreements"]
    mt = h["tau_offline"].get("mtbench")
    h["goals"] = {f"tau_k{k}_mtbench>={o['tau_goal']}": None if mt is None else mt >= o["tau_goal"],
                  f"speedup>={o['speedup_goal']}": None if h["best_speedup_hf_loop"] is None
                  else h["best_speedup_hf_loop"] >= o["speedup_goal"]}
    return h


# --------------------------------------------------------------------------- plots
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
    fig.savefig(out / PLOTS[0], dpi=110)
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
    fig.savefig(out / PLOTS[1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    t = rec["table"]
    ax.plot([r["k"] for r in t], [r["predicted_speedup"] for r in t], "o-", label="predicted (τ and step costs)")
    ax.plot([r["k"] for r in t], [r["measured_speedup"] for r in t], "s--", label="measured, HF loop")
    for r in (vllm or {}).get("runs", []):
        if r["k"] is not None:
            for s, v in r["sets"].items():
                if v.get("speedup"):
                    ax.plot([r["k"]], [v["speedup"]], "^", ms=9,
                            label=f"vLLM {s}" + (" (iomp)" if r["iomp"] else ""))
    ax.axhline(1.0, color="grey", lw=0.8)
    if rec["recommended_k"]:
        ax.axvline(rec["recommended_k"], color="green", ls=":", label=f"recommended k={rec['recommended_k']}")
    ax.set(xlabel="draft length k", ylabel="speedup vs plain greedy", title="Speedup per draft length",
           xticks=[r["k"] for r in t])
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / PLOTS[2], dpi=110)
    plt.close(fig)
    return [str(out / p) for p in PLOTS]


def summarise(eval_dir: str | Path, vllm: str | Path | None = None, **opts) -> dict:
    o = {**DEFAULTS, **{k: v for k, v in opts.items() if v is not None}}
    out = Path(eval_dir)
    offline, spec = io.read_json(out / "offline.json"), io.read_json(out / "speculative.json")
    vl = io.read_json(vllm) if vllm else None
    agree = agreement(out, o["tie_eps"])
    rec = recommend(offline, spec)
    res = {"headline": headline(offline, spec, vl, agree, rec, o), "agreement": agree, "recommendation": rec,
           "vllm_disagreements": (vl or {}).get("disagreements"), "plots": plots(out, offline, spec, vl, rec)}
    io.write_parquet(out / "recommendation.parquet", pd.DataFrame(rec["table"]))
    io.write_json(out / "summary.json", res)
    log.info("headline: %s", res["headline"])
    return res


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--eval-dir", required=True)
    p.add_argument("--vllm", default=None, help="vllm.json (optional)")
    p.add_argument("--config", default=None, help="JSON options: " + ", ".join(DEFAULTS))
    p.add_argument("--log", default=None)
    a = p.parse_args(argv)
    io.setup_logging(a.log)
    summarise(a.eval_dir, a.vllm, **io.parse_json_arg(a.config, {}))


if __name__ == "__main__":
    main()
