"""Recipe ablation (issue 15): the speculators-style choices one at a time against eaglet's default,
each trained on identical data and batches with two seeds, scored by the exact chain τ
(k = ttt_steps) on the same validation positions.

    python benchmarks/bench_ablation.py [--quick] [--run-dir results/<run>] [--identity ID.json]
        [--epochs E] [--seeds 0 1] [--only baseline,norm_before_fc,lr=3e-3] [--val results/mix-mtval]
        [--out results/ablation.json]
    python benchmarks/bench_ablation.py --losses [--val results/mix-mtval] [--hf-prompts 16] ...   # objectives
    python benchmarks/bench_ablation.py --curve 0.125,0.25,0.5 [--params '{"loss": "lk_alpha"}'] ...   # data
    ... --reuse results/ablation.json   # the runs an earlier --out recorded with the same params and data

``--curve F1,F2,..``: the learning curve: the base params (``--params`` adds e.g. a loss) on nested
fractions of the training samples (``data_fraction``) and on all of them, each seed, scored at both
temperatures; per temperature the gain per doubling of the data (a least-squares line of τ on
log2 tokens, per seed) and how much data that line needs for τ 1.5.

``--losses``: the training objectives on identical data and batches, three seeds each (``--seeds``
overrides): soft cross-entropy (the baseline, pinned whatever train.loss defaults to), KL, and the
LK losses (``lk_lambda``, the KL/acceptance hybrid, and ``lk_alpha``, the negative log-acceptance;
eaglet.drafter.ttt.step_loss),
each scored at T = 0 (the exact greedy chain τ) and T = 1 (the expected chain τ, Σ min(p, q) chained
along the validation unroll: ``exp_tau``), one table per temperature with the seed spread, and a
third table with τ at T = 1 measured by the HF loop's real speculative sampling (``--hf-prompts``
MT-Bench questions per drafter, default 16, ``--hf-tokens`` new tokens each, the same seeded
generators for every drafter: ``hf_tau``). With it, on the same questions along the target's own
seeded samples at T = 1, the offline expected τ under each rule vLLM serves at T > 0
(eaglet.engines.hf_loop.expected_prompt; vLLM's ``draft_sample_method``): ``exp_tau_greedy``, greedy
drafts accepted with probability p(argmax q) (vLLM's default), and ``exp_tau_probabilistic``, drafts
sampled from q, Σ min(p, q); one table each (issue 43: which objective to pick for which serving
setting). The verdict line names an objective that beats soft CE beyond the spread of the expected
τ at T = 1 without falling beyond it at T = 0, or says none does.

Data: a run's stored hidden states (``<run-dir>/extract/shard_*/index.json`` and
``vocab_map/vocab.safetensors``; the first ``results/*`` that has both, e.g. the SmolLM2 default run)
with the target's ``identity.json`` (``--identity``, default the SmolLM2 one under resources/);
without them, or with ``--quick``, a store built here from the tiny in-process Llama target
(``eaglet.data.target_model``'s ``tiny``: greedy continuations of random prompts, their aux and pre-norm
final states). Each run is ``eaglet.train.train.train`` itself with the base params below plus one option;
the validation split is by sample-id hash and the batch plan depends only on (data, params, seed),
so every option of a seed sees the same batches and the same validation positions, and its drafter
starts from the same initial weights (the variants' extra norm starts at 1). The score is
``best_val.chain_tau`` of ``train_summary.json`` (validation only at the end: the last weights).

Prints one row per option: τ per seed, mean, Δ of the mean vs the baseline, the paired Δ per seed,
and whether |Δ| exceeds the seed-to-seed spread (the larger range over seeds of the baseline and
the option): "yes" = beyond noise by that yardstick, "no" = within it. Last, ``ratio: <best option's
mean τ / baseline mean τ>`` for ``make bench``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from eaglet.base.tensors import save_tensors  # noqa: E402
from eaglet.train.train import resolve_params, train  # noqa: E402

# One option per row, on top of BASE (speculators' eagle3 defaults, issue 15 / docs/eagle3.md §11).
OPTIONS = {
    "baseline": {},
    "norm_before_fc": {"norm_before_fc": True},
    "norm_before_residual": {"norm_before_residual": True},
    "norm_output": {"norm_output": True},
    "freeze_lm_head": {"freeze_lm_head": True},
    "loss=kl": {"loss": "kl"},
    "gamma=1.0": {"gamma": 1.0},
    "weight_decay=0.01": {"weight_decay": 0.01},
    "all speculators": {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True,
                        "freeze_lm_head": True, "loss": "kl", "gamma": 1.0, "weight_decay": 0.01},
    "loss=lk_lambda": {"loss": "lk_lambda"},
    "loss=lk_alpha": {"loss": "lk_alpha"},
}
# --losses: the objectives compared (the baseline is soft CE)
LOSSES = ["baseline", "loss=kl", "loss=lk_lambda", "loss=lk_alpha"]
# The learning-curve run's settings on SmolLM2 (k = 3 as vLLM serves it), validation at the end only.
BASE = {"ttt_steps": 3, "gamma": 0.8, "lr": 1e-3, "warmup_ratio": 0.05, "token_budget": 2048,
        "oov_rule": "label", "val_fraction": 0.2, "val_every": 10**9, "checkpoint_every": 10**9,
        "lm_head_init": "target"}


def find_run(results: Path) -> Path | None:
    for run in sorted(results.glob("*")):
        if sorted(run.glob("extract/shard_*/index.json")) and (run / "vocab_map/vocab.safetensors").exists():
            return run
    return None


def tiny_store(out: Path, n: int, new_tokens: int) -> tuple[list[str], str, dict, str]:
    """A hidden-state store of the tiny in-process target's own greedy continuations."""
    from eaglet.data.target_model import materialise
    from eaglet.hidden.store import ShardWriter
    from eaglet.target.load import load_identity, load_model

    materialise({"name": "tiny", "tiny": {}}, out / "target")
    ident = load_identity(out / "target" / "identity.json")
    layers = [2, 4, 5]
    model = load_model(ident["path"])
    captured = {}
    model.model.norm.register_forward_hook(lambda mod, inp, o: captured.__setitem__("pre", inp[0]))
    g = torch.Generator().manual_seed(0)
    w = ShardWriter(out / "shard_0", 0, 1, layers, True, "float32", ident["hidden_size"], ident["digest"], 1 << 20)
    V, P = ident["vocab_size"], 6
    counts = torch.zeros(V, dtype=torch.long)
    with torch.no_grad():
        prompts = torch.randint(100, 5000, (n, P), generator=g)
        seqs = model.generate(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=0, attention_mask=torch.ones_like(prompts))
        o = model(seqs, output_hidden_states=True)
    aux = torch.stack([o.hidden_states[j] for j in layers], 2)
    for i in range(n):
        T = P + new_tokens // 2 + i % (new_tokens // 2)
        mask = torch.zeros(T, dtype=torch.int8)
        mask[P:] = 1
        lg = o.logits[i, :T].float()  # the target's own full-vocabulary statistics, as extraction stores them
        w.add(f"s{i:04d}", seqs[i, :T], mask, aux[i, :T], captured["pre"][i, :T], torch.logsumexp(lg, -1),
              lg.argmax(-1))
        v, top = o.logits[i, :T:5].topk(2, -1)
        w.add_references([[f"s{i:04d}", 5 * j, int(top[j, 0]), float(v[j, 0] - v[j, 1])] for j in range(len(top))])
        counts.index_add_(0, seqs[i, P:T], torch.ones(T - P, dtype=torch.long))
    w.finish()
    vd = 256
    used = counts.argsort(descending=True)[:vd].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    save_tensors(out / "vocab.safetensors", {"d2t": used - torch.arange(vd), "t2d": t2d})
    return [str(out / "shard_0" / "index.json")], str(out / "vocab.safetensors"), ident, \
        f"tiny in-process Llama target ({n} greedy continuations, {new_tokens} new tokens max)"


def option_params(name: str) -> dict:
    """A named option of OPTIONS, or ad-hoc train params: ``lr=3e-3`` or ``lr=3e-3+norm_output=true``
    (values read as JSON; keys must be train params)."""
    if name in OPTIONS:
        return OPTIONS[name]
    params = {}
    for part in name.split("+"):
        if part in OPTIONS:
            params.update(OPTIONS[part])
            continue
        key, sep, value = part.partition("=")
        if not sep or key not in resolve_params({}):
            raise SystemExit(f"unknown option {part!r}: known {list(OPTIONS)}, or key=value with a train "
                             f"param key ({sorted(resolve_params({}))})")
        try:
            params[key] = json.loads(value)
        except json.JSONDecodeError:
            params[key] = value
    return params


def run_one(hidden, vocab, ident, out: Path, params: dict, val_hidden: list[str] | None = None,
            hf: dict | None = None) -> dict:
    t0 = time.time()
    s = train(hidden, vocab, ident, out, params, val_hidden=val_hidden)
    bv = s["best_val"] or {}
    r = {"chain_tau": bv.get("chain_tau"), "exp_tau": bv.get("exp_tau"), "tf_tau": bv.get("tf_tau"),
         "loss": bv.get("loss"),
         "rounds": bv.get("chain_rounds"), "steps": s["steps"], "seconds": round(time.time() - t0, 1),
         "train_tokens": s.get("train_tokens"),
         "acc": [bv.get(f"tf_acc_{k}") for k in range(params["ttt_steps"])]}
    if hf:
        r.update(hf_tau(out / "drafter.safetensors", k=int(params["ttt_steps"]), **hf))
    return r


def reused(path: str | None, name: str, seed: int, base: dict, source: str, hf: dict | None,
           hidden_all_trained: list[str] | None = None) -> dict | None:
    """The run of ``name`` and ``seed`` from an earlier --out JSON when it was made with the same base
    params, data and HF-loop measurement; else None (train it). ``hidden_all_trained``: the stores'
    indexes when every sample is trained on (--val), for a run recorded without its token count."""
    if not path:
        return None
    old = json.loads(Path(path).read_text())
    run = old.get("runs", {}).get(name, {}).get(str(seed))
    if run is None or old.get("base") != base or old.get("data") != source or \
            (hf and not all(x in run for x in ("hf_tau", *RULE_KEYS.values()))):
        return None
    if run.get("train_tokens") is None:  # written before runs reported it: all the data, when --val trained on all
        if not (hidden_all_trained and name == "baseline" and base.get("data_fraction", 1.0) == 1.0):
            return None
        run["train_tokens"] = sum(x["num_tokens"] for i in hidden_all_trained
                                  for x in json.loads(Path(i).read_text())["samples"])
    print(f"  {name} seed {seed}: taken from {path} (same base params and data)", flush=True)
    return run


# The offline expected τ at T = 1 under each rule vLLM serves (eaglet.drafter.chain.ACCEPT), by run key
RULE_KEYS = {"greedy": "exp_tau_greedy", "probabilistic": "exp_tau_probabilistic"}


def hf_tau(drafter: Path, identity: str, prompts: int, max_new: int, k: int, temperature: float = 1.0,
           seed: int = 0) -> dict:
    """τ measured by the HF loop's real speculative sampling (eaglet.engines.hf_loop.speculative_sampling,
    as evaluate_speculative runs it) at ``temperature`` over the first ``prompts`` MT-Bench questions,
    ``max_new`` tokens each, k drafts: 1 + accepted / rounds over every round, and the per-prompt τ.
    Each prompt's generator is seeded from (seed, prompt) alone, the same for every drafter. Beside
    it, on the same questions along the target's own seeded sample, the expected τ at k under each
    rule vLLM serves (RULE_KEYS; eaglet.engines.hf_loop.expected_prompt, as evaluate_offline)."""
    from eaglet.base.datasets import load_prompts
    from eaglet.drafter.chain import expected_counts, rounds_tau
    from eaglet.engines.hf_loop import expected_prompt, setup, speculative_sampling
    from eaglet.eval.hf_stage import run_generator

    t0 = time.time()
    _, target, proposer, _, tok = setup(drafter, identity, None)
    rows = load_prompts(["mtbench"], tok, prompts, 1024)
    rounds, per = [], []
    for i, p in enumerate(rows):
        res = speculative_sampling(target, proposer, p["prompt_ids"], k, max_new, temperature,
                                   run_generator(seed, "bench_ablation", temperature, i))
        rounds += res["rounds"]
        per.append(rounds_tau(res["rounds"]))
    sums = {r: [0.0, 0] for r in RULE_KEYS}
    for i, p in enumerate(rows):
        e = expected_prompt(target, proposer, p["prompt_ids"], k, temperature, max_new,
                            run_generator(seed, "bench_ablation_expected", temperature, i))
        valid = [s["valid"] for s in e["starts"]]
        for r in RULE_KEYS:
            a, n = expected_counts([s["alpha_by_rule"][r] for s in e["starts"]], valid, k)
            sums[r][0] += a
            sums[r][1] += n
    return {"hf_tau": rounds_tau(rounds), "hf_prompts": len(rows), "hf_rounds": sum(r[1] > 0 for r in rounds),
            "hf_per_prompt": per, **{key: 1 + sums[r][0] / sums[r][1] if sums[r][1] else None
                                     for r, key in RULE_KEYS.items()},
            "hf_seconds": round(time.time() - t0, 1)}


def table(res: dict, seeds: list[int], key: str = "chain_tau") -> tuple[list[str], dict]:
    base = res["baseline"]
    b_taus = [base[s][key] for s in seeds]
    b_mean, b_range = statistics.mean(b_taus), max(b_taus) - min(b_taus)
    pw = 8 * len(seeds) + 2  # the paired deltas' column
    head = f"{'option':<22}" + "".join(f"{'tau s' + str(s):>9}" for s in seeds) + \
        f"{'mean':>8}{'delta':>9}{'paired delta':>{pw}}{'spread':>8}  beyond noise"
    lines, verdict = [head, "-" * len(head)], {}
    for name, by_seed in res.items():
        taus = [by_seed[s][key] for s in seeds]
        mean = statistics.mean(taus)
        spread = max(b_range, max(taus) - min(taus))
        delta = mean - b_mean
        paired = [t - b for t, b in zip(taus, b_taus)]
        if name == "baseline":
            beyond = "-"
        else:
            beyond = "yes" if abs(delta) > spread else "no"
            if all(p == 0 for p in paired):
                beyond = "no (identical)"
        verdict[name] = {"taus": taus, "mean": mean, "delta": delta, "paired": paired, "spread": spread,
                         "beyond_noise": beyond}
        lines.append(f"{name:<22}" + "".join(f"{t:>9.4f}" for t in taus) + f"{mean:>8.4f}"
                     + (f"{delta:>+9.4f}" if name != "baseline" else f"{'':>9}")
                     + f"{' '.join(f'{p:+.4f}' for p in paired):>{pw}}" + f"{spread:>8.4f}  {beyond}")
    return lines, verdict


def curve(res: dict, seeds: list[int], key: str, goal: float = 1.5) -> list[str]:
    """The learning curve from the data_fraction runs and the baseline (all the data): per seed the
    least-squares line τ = a + b log2(training tokens); b is the gain per doubling of the data, and
    (goal - τ at all the data) / b doublings reach ``goal`` on this line (a straight-line
    extrapolation: an estimate, not a measurement)."""
    gains, lines = [], []
    full = statistics.mean(res["baseline"][s][key] for s in seeds)
    tokens = res["baseline"][seeds[0]]["train_tokens"]
    names = sorted(res, key=lambda n: res[n][seeds[0]]["train_tokens"])
    for n in names:
        lines.append(f"  {n:<22} {res[n][seeds[0]]['train_tokens']:>10,} tokens: "
                     + ", ".join(f"{res[n][s][key]:.4f}" for s in seeds)
                     + f"  (mean {statistics.mean(res[n][s][key] for s in seeds):.4f})")
    for s in seeds:
        xs = [math.log2(res[n][s]["train_tokens"]) for n in names]
        ys = [res[n][s][key] for n in names]
        mx, my = statistics.mean(xs), statistics.mean(ys)
        gains.append(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs))
    b = statistics.mean(gains)
    lines.append(f"  gain per doubling {b:+.4f} (per seed {', '.join(f'{g:+.4f}' for g in gains)})")
    def times(d):  # 2^d as "N x", held to something printable
        return f"{2 ** d:,.0f}x" if d <= 40 else "more than 1e12x"

    if b > 0 and full < goal:
        d = (goal - full) / b
        lines.append(f"  τ {goal} on this line: {d:.1f} more doublings, {times(d)} the data "
                     + (f"(~{tokens * 2 ** d / 1e6:,.1f}M training tokens; " if d <= 40 else "(")
                     + f"range over the seeds' gains {times((goal - full) / max(gains))}-"
                     + (f"{times((goal - full) / min(gains))})" if min(gains) > 0 else "unbounded)"))
    elif full >= goal:
        lines.append(f"  τ {goal} reached with all the data")
    else:
        lines.append(f"  no gain per doubling: τ {goal} is not on this line")
    return lines


def loss_verdict(t0: dict, t1: dict) -> str:
    """The objective that beats soft CE beyond the seed spread at T = 1 without falling beyond it at
    T = 0 (the best such by its T = 1 mean), or a sentence saying none does."""
    wins = [n for n in t1 if n != "baseline" and t1[n]["delta"] > t1[n]["spread"]
            and t0[n]["delta"] >= -t0[n]["spread"]]
    if not wins:
        return "winner: none (no objective beats soft CE beyond the seed spread at T = 1 without losing at T = 0)"
    best = max(wins, key=lambda n: t1[n]["mean"])
    return (f"winner: {best} (T = 1 delta {t1[best]['delta']:+.4f} > spread {t1[best]['spread']:.4f}; "
            f"T = 0 delta {t0[best]['delta']:+.4f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--quick", action="store_true", help="the tiny in-process target, a few steps (a smoke run)")
    ap.add_argument("--run-dir", default=None, help="a run folder with extract/ and vocab_map/ (default: the "
                    "first under results/ that has both)")
    ap.add_argument("--identity", default=str(ROOT / "resources/targets/smollm2-135m-instruct/identity.json"))
    ap.add_argument("--epochs", type=float, default=None, help="default 1 (real data), 3 (tiny), 1 (--quick)")
    ap.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 (0 1 2 with --losses)")
    ap.add_argument("--losses", action="store_true", help="the training objectives (soft CE, KL, the LK losses) "
                    "scored at T = 0 and T = 1")
    ap.add_argument("--only", default=None, help="comma-separated option names (baseline is always run), or "
                    "ad-hoc train params such as lr=3e-3 or lr=3e-3+norm_output")
    ap.add_argument("--params", default="{}", help="JSON overriding the base train params")
    ap.add_argument("--val", default=None, help="score on this store instead of the run's val_fraction split: a run "
                    "folder with extract/ (e.g. the target's answers to MT-Bench) or index.json files, comma-separated")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--reuse", default=None, help="an --out JSON of an earlier run: its runs of the same option, "
                    "seed, base params and data are taken from it instead of trained again (e.g. the baseline)")
    ap.add_argument("--curve", default=None, help="comma-separated data fractions (e.g. 0.125,0.25,0.5): the "
                    "learning curve of the base params (with --params, e.g. another loss) at T = 0 and T = 1")
    ap.add_argument("--hf-prompts", type=int, default=None, help="with --losses: also measure τ at T = 1 with the HF "
                    "loop's speculative sampling on this many MT-Bench questions per drafter (default 16; 2 with "
                    "--quick; 0: off)")
    ap.add_argument("--hf-tokens", type=int, default=64, help="new tokens per question for --hf-prompts")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(max(1, torch.get_num_threads()))

    a.seeds = a.seeds or ([0, 1, 2] if a.losses else [0, 1])
    names = LOSSES if a.losses else list(OPTIONS) if not a.only else \
        ["baseline"] + [n for n in a.only.split(",") if n != "baseline"]
    if a.curve:
        names = ["baseline"] + [f"data_fraction={float(x)}" for x in a.curve.split(",")]
    chosen = {n: option_params(n) for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        run = None if a.quick else (Path(a.run_dir) if a.run_dir else find_run(ROOT / "results"))
        base = dict(BASE)
        if run is not None and Path(a.identity).exists():
            from eaglet.target.load import load_identity

            hidden = [str(s) for s in sorted(run.glob("extract/shard_*/index.json"))]
            vocab, ident = str(run / "vocab_map/vocab.safetensors"), load_identity(a.identity)
            source = f"{run} (stored hidden states of {ident.get('name')})"
            base["epochs"] = a.epochs or 1.0
        else:
            n, new = (24, 40) if a.quick else (96, 96)
            hidden, vocab, ident, source = tiny_store(Path(tmp) / "data", n, new)
            a.identity = str(Path(tmp) / "data" / "target" / "identity.json")
            base.update(epochs=a.epochs or (1.0 if a.quick else 3.0), token_budget=512, lr=3e-3,
                        label_min_agreement=0.9)
            if run is None and not a.quick:
                source += "; no stored run found under results/"
        if a.losses:  # the objectives against soft cross-entropy, whatever train.loss defaults to
            base["loss"] = "soft_ce"
        base.update(json.loads(a.params))
        val = None
        if a.val:
            from bench_mix import val_stores  # here: bench_mix imports this module

            val = val_stores(a.val)
            source += f"; scored on {a.val} (every sample of the data trained on)"
        n_hf = 0 if not a.losses else a.hf_prompts if a.hf_prompts is not None else (2 if a.quick else 16)
        hf = {"identity": a.identity, "prompts": n_hf, "max_new": a.hf_tokens if not a.quick else 16} if n_hf else None
        print(f"data: {source}", flush=True)
        print(f"base params: {json.dumps(base, sort_keys=True)}", flush=True)
        res: dict = {}
        t0 = time.time()
        for name in names:
            res[name] = {}
            for seed in a.seeds:
                params = {**base, **chosen[name], "seed": seed}
                earlier = reused(a.reuse, name, seed, base, source, hf, hidden if val else None)
                r = earlier or run_one(hidden, vocab, ident, Path(tmp) / "runs" / f"{name}_{seed}", params, val, hf)
                res[name][seed] = r
                measured = f", HF loop tau (T = 1) {r['hf_tau']:.4f} over {r['hf_rounds']} rounds" if hf else ""
                print(f"  {name:<22} seed {seed}: chain tau {r['chain_tau']:.4f}, expected tau (T = 1) "
                      f"{r['exp_tau']:.4f}{measured} (teacher-forced {r['tf_tau']:.4f}, {r['rounds']} rounds, "
                      f"{r['steps']} steps, {r['seconds']:.0f} s)", flush=True)
        lines, verdict = table(res, a.seeds)
        lines1, verdict1 = table(res, a.seeds, "exp_tau")
        lines_hf, verdict_hf = table(res, a.seeds, "hf_tau") if hf else (None, None)
        by_rule = {r: table(res, a.seeds, key) for r, key in RULE_KEYS.items()} if hf else {}
    print(f"\nT = 0: chain tau at k = {base['ttt_steps']} on the same validation positions; delta = mean - baseline "
          f"mean; beyond noise = |delta| > the larger seed-to-seed range of the two ({time.time() - t0:.0f} s)")
    print("\n".join(lines))
    print(f"\nT = 1: expected tau at k = {base['ttt_steps']} (sum min(p, q) chained along the validation unroll), "
          "same positions and rule")
    print("\n".join(lines1))
    if lines_hf:
        print(f"\nT = 1 measured: the HF loop's speculative sampling, k = {base['ttt_steps']}, the first {n_hf} "
              f"MT-Bench questions, {hf['max_new']} new tokens each, every drafter with the same seeded "
              "generators; tau = 1 + accepted / rounds, same rule")
        print("\n".join(lines_hf))
    for rule, (lines_r, _) in by_rule.items():
        how = ("greedy drafts (argmax q, vLLM's default) accepted with probability p(argmax q)" if rule == "greedy"
               else "drafts sampled from q, accepted with min(1, p/q): sum min(p, q)")
        print(f"\nT = 1 offline, vLLM draft_sample_method {rule}: expected tau at k = {base['ttt_steps']}, {how}, "
              f"along the target's own seeded samples of the same {n_hf} MT-Bench questions")
        print("\n".join(lines_r))
    if a.losses:
        print(loss_verdict(verdict, verdict1))
    if a.curve:
        for key, what in (("chain_tau", "T = 0, exact chain τ"), ("exp_tau", "T = 1, expected chain τ")):
            print(f"\nlearning curve, {what} (training tokens: τ per seed):")
            print("\n".join(curve(res, a.seeds, key)))
    others = {n: v for n, v in verdict.items() if n != "baseline"}
    if others:
        best = max(others, key=lambda n: others[n]["mean"])
        print(f"note: best option {best} (delta {others[best]['delta']:+.4f}, beyond noise: "
              f"{others[best]['beyond_noise']})")
        print(f"ratio: {others[best]['mean'] / verdict['baseline']['mean']:.4f}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"data": source, "base": base, "seeds": a.seeds, "runs": res,
                                           "table": verdict, "table_t1": verdict1, "table_hf": verdict_hf,
                                           **{f"table_{r}": v[1] for r, v in by_rule.items()},
                                           "hf": hf}, indent=2) + "\n")


if __name__ == "__main__":
    main()
