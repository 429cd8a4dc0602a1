"""Regenerated, original or mixed responses at equal CPU time (issue 15, ``data.mix``): drafters
trained on the stored states of runs that differ only in ``data.mix`` and ``prompts.n`` (sized so
that making their data took about the same CPU time), each scored by the exact chain τ
(k = ttt_steps) on one validation store of the target's own answers to other prompts — by default
the 80 MT-Bench questions — so every arm is judged on the same positions, none on its own data.

    python benchmarks/bench_mix.py --write-val-prompts results/mix-prompts/mtbench.json
    for c in mtval regenerated original mixed; do   # the data: one workflow run each
        snakemake results/mix-$c/extract/shard_0 results/mix-$c/vocab_map/vocab.safetensors --cores 2 \\
            --configfile config/config.yaml benchmarks/mix/$c.yaml; done
    python benchmarks/bench_mix.py [--arm regenerated=results/mix-regenerated --arm original=... ...]
        [--val results/mix-mtval] [--epochs 3] [--seeds 0 1] [--out FILE]

The arms' settings are in benchmarks/mix/*.yaml (overlays of config/config.yaml; the defaults of
``--arm`` and ``--val`` are their run folders). Without them the row prints ``ratio: skipped``.

Each arm is a run folder with ``extract/shard_*/index.json``, ``vocab_map/vocab.safetensors`` (its
own draft vocab, as its workflow made it), ``generate/generate_summary.json`` and
``tokenize/metadata.json``; ``--val`` a run folder (or index.json files) of the validation store.
Training is ``eaglet.train.train`` with every sample of the arm trained on (``val_hidden``), the
learning-curve run's params (bench_ablation's BASE) and validation at the end (the last weights).

The cost of an arm's data is printed from its own records: generation seconds (the stage's wall,
server start included) and extraction seconds (Snakemake's job record), and, comparable across
runs made under different load, the same priced at one rate each (``--gen-tok-s``, default the
arms' median measured rate; ``--extract-tok-s``, default the arms' median). Rows: the arm, its
data, its cost, τ per seed, the mean, Δ vs the first arm (paired per seed) and whether |Δ| exceeds
the seed-to-seed range. Last, ``ratio: <best arm's mean τ / first arm's>`` for ``make bench``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_ablation import BASE  # noqa: E402

from eaglet import io  # noqa: E402
from eaglet import train as tr  # noqa: E402
from eaglet.job_records import stage_times  # noqa: E402


def stores(run: Path) -> list[str]:
    found = [str(p) for p in sorted(run.glob("extract/shard_*/index.json"))]
    if not found:
        raise SystemExit(f"{run}: no extract/shard_*/index.json (run the workflow to extract first)")
    return found


def arm_data(run: Path) -> dict:
    """What the arm's data is and what it cost, from the run's own records."""
    gen = io.read_json(run / "generate/generate_summary.json")
    tok = io.read_json(run / "tokenize/metadata.json")
    rel = run.resolve().relative_to(ROOT) if run.resolve().is_relative_to(ROOT) else run
    jobs = stage_times(rel, ROOT)  # Snakemake records paths relative to the workflow folder
    ext_s = sum(j["seconds"] for j in jobs if j["rule"] == "extract_hidden_states") or None
    gen_s = gen.get("wall_s") if gen.get("regenerated") else 0.0
    # a rate only from a run that generated all its answers itself (none reused from earlier parts)
    whole = gen.get("regenerated") and gen.get("this_run", {}).get("completion_tokens") == gen.get("completion_tokens")
    return {"run": str(run), "regenerated": gen.get("regenerated", 0), "original": gen.get("original", 0),
            "completion_tokens": gen.get("completion_tokens", 0) if gen.get("regenerated") else 0,
            "gen_tok_s": gen.get("tokens_per_s") if whole else None,
            "samples": tok["samples_processed"], "tokens": tok["total_tokens"],
            "assistant_tokens": tok["total_assistant_tokens"], "truncated": tok.get("truncated"),
            "generate_s": gen_s, "extract_s": ext_s,
            "extract_tok_s": tok["total_tokens"] / ext_s if ext_s else None}


def write_val_prompts(path: Path) -> None:
    """The MT-Bench first turns as prompts with a placeholder answer (every one is regenerated)."""
    from eaglet.eval_sets import mtbench

    rows = [{"id": r["id"], "messages": [*r["messages"], {"role": "assistant", "content": "(regenerated)"}]}
            for r in mtbench()]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows) + "\n")
    print(f"{path}: {len(rows)} MT-Bench first turns")


def priced(d: dict, gen_rate: float, ext_rate: float, server_s: float) -> float:
    """The arm's data at one generation and one extraction rate (server start once if it generated)."""
    gen = d["completion_tokens"] / gen_rate + server_s if d["regenerated"] else 0.0
    return gen + d["tokens"] / ext_rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--arm", action="append", default=None, help="NAME=RUN_DIR (first = the reference); default "
                    "regenerated, original, mixed = results/mix-<name>")
    ap.add_argument("--val", default="results/mix-mtval",
                    help="a run folder with extract/, or index.json files (comma-separated)")
    ap.add_argument("--write-val-prompts", default=None, metavar="PATH",
                    help="write the 80 MT-Bench first turns as a prompts file (benchmarks/mix/mtval.yaml) and exit")
    ap.add_argument("--identity", default=str(ROOT / "resources/targets/smollm2-135m-instruct/identity.json"))
    ap.add_argument("--epochs", type=float, default=3.0)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--params", default="{}", help="JSON overriding the base train params")
    ap.add_argument("--gen-tok-s", type=float, default=None)
    ap.add_argument("--extract-tok-s", type=float, default=None)
    ap.add_argument("--server-s", type=float, default=60.0, help="vLLM server start, priced once per generating arm")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if a.write_val_prompts:
        write_val_prompts(Path(a.write_val_prompts))
        return
    arms = {}
    for spec in a.arm or [f"{n}=results/mix-{n}" for n in ("regenerated", "original", "mixed")]:
        name, sep, run = spec.partition("=")
        if not sep:
            raise SystemExit(f"--arm {spec!r}: want NAME=RUN_DIR")
        arms[name] = ROOT / run if not Path(run).is_absolute() else Path(run)
    dirs = [*arms.values()] + ([] if a.val.endswith(".json") else [ROOT / a.val])
    missing = [str(r) for r in dirs if not sorted(r.glob("extract/shard_*/index.json"))]
    if missing:
        print(f"note: no stored states in {missing} (make them with benchmarks/mix/*.yaml, see --help)")
        print("ratio: skipped")
        return
    from eaglet.target import load_identity

    ident = load_identity(a.identity)
    val = stores(ROOT / a.val) if (ROOT / a.val).is_dir() else a.val.split(",")
    data = {n: arm_data(r) for n, r in arms.items()}
    gen_rate = a.gen_tok_s or statistics.median([d["gen_tok_s"] for d in data.values() if d["gen_tok_s"]] or [1.0])
    ext_rate = a.extract_tok_s or statistics.median([d["extract_tok_s"] for d in data.values() if d["extract_tok_s"]]
                                                     or [1.0])
    base = {**BASE, "epochs": a.epochs, **json.loads(a.params)}
    print(f"validation store: {val}")
    print(f"base params: {json.dumps(base, sort_keys=True)}")
    print(f"priced at generation {gen_rate:.1f} tok/s (+{a.server_s:.0f} s server start), "
          f"extraction {ext_rate:.1f} tok/s")
    for n, d in data.items():
        d["priced_s"] = priced(d, gen_rate, ext_rate, a.server_s)
        print(f"  {n:<12} {d['samples']} samples ({d['regenerated']} regenerated, {d['original']} original), "
              f"{d['tokens']:,} tokens, {d['assistant_tokens']:,} assistant; measured generate "
              f"{d['generate_s'] or 0:.0f} s + extract {d['extract_s'] or 0:.0f} s; priced {d['priced_s']:.0f} s",
              flush=True)
    res: dict = {}
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for n, run in arms.items():
            res[n] = {}
            for seed in a.seeds:
                t1 = time.time()
                s = tr.train(stores(run), str(run / "vocab_map/vocab.safetensors"), ident,
                             Path(tmp) / f"{n}_{seed}", {**base, "seed": seed}, val_hidden=val)
                bv = s["best_val"] or {}
                res[n][seed] = {"chain_tau": bv.get("chain_tau"), "rounds": bv.get("chain_rounds"),
                                "steps": s["steps"], "train_tokens": s["train_tokens"],
                                "seconds": round(time.time() - t1, 1),
                                "acc": [bv.get(f"tf_acc_{k}") for k in range(base["ttt_steps"])]}
                r = res[n][seed]
                print(f"  {n:<12} seed {seed}: chain tau {r['chain_tau']:.4f} ({r['rounds']} rounds, "
                      f"{r['steps']} steps, {r['seconds']:.0f} s)", flush=True)
    ref = next(iter(arms))
    ref_t = [res[ref][s]["chain_tau"] for s in a.seeds]
    head = f"{'arm':<12}{'train tok':>10}{'priced s':>9}" + "".join(f"{'tau s' + str(s):>9}" for s in a.seeds) + \
        f"{'mean':>8}{'delta':>9}{'paired':>18}  beyond the seed spread"
    print(f"\nchain tau at k = {base['ttt_steps']} on the validation store ({time.time() - t0:.0f} s)")
    print(head + "\n" + "-" * len(head))
    table = {}
    for n in arms:
        taus = [res[n][s]["chain_tau"] for s in a.seeds]
        mean, paired = statistics.mean(taus), [t - b for t, b in zip(taus, ref_t)]
        spread = max(max(taus) - min(taus), max(ref_t) - min(ref_t))
        delta = mean - statistics.mean(ref_t)
        beyond = "-" if n == ref else ("yes" if abs(delta) > spread else "no")
        table[n] = {"taus": taus, "mean": mean, "delta": delta, "paired": paired, "beyond_spread": beyond}
        print(f"{n:<12}{res[n][a.seeds[0]]['train_tokens']:>10,}{data[n]['priced_s']:>9.0f}"
              + "".join(f"{t:>9.4f}" for t in taus) + f"{mean:>8.4f}"
              + (f"{delta:>+9.4f}" if n != ref else f"{'':>9}")
              + f"{' '.join(f'{p:+.4f}' for p in paired):>18}  {beyond}")
    best = max(table, key=lambda n: table[n]["mean"])
    print(f"note: best arm {best}")
    print(f"ratio: {table[best]['mean'] / table[ref]['mean']:.4f}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"val": val, "base": base, "seeds": a.seeds, "data": data,
                                           "runs": res, "table": table}, indent=2) + "\n")


if __name__ == "__main__":
    main()
