"""eaglet's trainer against the anchor, the speculators library's Eagle3 model, on the same data.

    python benchmarks/bench_anchor.py [--quick] [--seeds 0 1 2] [--results results] [--run smollm2]
        [--epochs 3] [--data-fraction 1.0] [--autocast float32] [--optimizer adamw|muon]
        [--anchor-python envs/anchor/.venv/bin/python] [--keep DIR] [--out results/anchor.json]
        [--gamma G] [--loss L] [--set KEY=VALUE ...] [--eaglet-only]   # eaglet's recipe varied; eaglet alone

Both drafters train on the SAME stored hidden states (a real store: results/<run>/extract, the run
with the most tokens, with its vocab map and its trainer's params from train/train_summary.json,
else config/config.yaml's train section; with no store but a tokens file, a small one is
extracted here with eaglet.features.extract) in the SAME micro-batches in the same order (eaglet's plan:
eaglet.train.data.plan_micro_batches, read by eaglet.hidden.reader.HiddenStateDataset), once per seed
(the seed orders the batches and draws both initial weights):

- eaglet: its own loop, eaglet.train.train.train, on those params (k = ttt_steps), in the dtype its
  ``train.autocast`` picks (bf16 autocast on a CPU with bf16 units under ``auto``);
- the anchor: benchmarks/anchor_worker.py in envs/anchor/.venv (``make anchor-env``; it cannot share
  a process with eaglet's stack), a CPU loop around speculators' Eagle3DraftModel with its eagle3
  defaults (see the worker's docstring), the same embedding and head rows, the same learning rate
  and number of steps, in fp32; the tensors travel through safetensors files in a temp dir.

Both are scored by the trainer's own validation code (eaglet.train.loop.validate's pieces) on the same
validation positions, at T = 0 the exact greedy-chain τ at k = ttt_steps (chain_positions,
chain_counts) and at T = 1 the expected chain τ (Σ min(p, q) per draft step, chained along the
unroll: expected_counts_BT), p being the target's probability of each draft-vocab token as vLLM's
rejection sampler sees it and q each drafter's own softmax (the anchor's read off its lm_head in its
own process). Each drafter is taken at its kept validation pass, by the rule ``train.select_temperature``
names for eaglet's trainer (passes every ``val_every`` steps and the last; the later on a tie). The
scorer first re-scores eaglet's kept drafter under the trainer's autocast and must reproduce the
trainer's own best_val chain_tau and exp_tau. Speed: training tokens / the summed time of the
training steps (validation excluded; the first step, warm-up, excluded from both); the dtypes are
named in the speed note.

Prints a row per seed, then each ratio's mean with its 95 % interval over seeds: ``ratio tau: X``
(expected τ at T = 1, eaglet / anchor, goal >= 1.05), ``ratio tau_t0: X`` (exact chain τ at T = 0,
goal >= 1.0) and ``ratio speed: Y`` (eaglet tok/s / anchor tok/s, goal >= 2.0), each with a
``note <key>:`` line; ``skipped`` when the anchor env or the data is missing. ``--quick``: one
epoch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

IDENTITY = ROOT / "resources/targets/smollm2-135m-instruct/identity.json"
ANCHOR_PY = ROOT / "envs/anchor/.venv/bin/python"


def skip(why: str) -> None:
    for key in ("tau", "tau_t0", "speed"):
        print(f"ratio {key}: skipped")
        print(f"note {key}: {why}")
    sys.exit(0)


def find_store(results: Path, run: str | None) -> tuple[str, list[Path], Path, dict | None] | None:
    """(run, shard indexes, vocab file, the run's trainer params or None) of a real store."""
    runs = [results / run] if run else sorted(p for p in results.glob("*") if p.is_dir())
    found = []
    for r in runs:
        idx = sorted(r.glob("extract/shard_*/index.json"))
        vocab = r / "vocab_map/vocab.safetensors"
        if idx and vocab.is_file():
            tokens = sum(x["num_tokens"] for i in idx for x in json.loads(i.read_text()).get("samples", []))
            summ = r / "train/train_summary.json"
            params = json.loads(summ.read_text())["params"] if summ.is_file() else None
            found.append((tokens or sum(i.stat().st_size for i in idx), r.name, idx, vocab, params))
    if not found:
        return None
    _, name, idx, vocab, params = max(found, key=lambda f: f[0])
    return name, idx, vocab, params


def extract_store(results: Path, tmp: Path, ident_path: Path,
                  n: int) -> tuple[str, list[Path], Path, dict | None] | None:
    """No stored hidden states: extract the first ``n`` samples of a run's tokens file here."""
    import pandas as pd

    from eaglet.features.extract import extract

    for r in sorted(results.glob("*")):
        tok, vocab = r / "tokenize/tokens.parquet", r / "vocab_map/vocab.safetensors"
        if tok.is_file() and vocab.is_file():
            small = tmp / "tokens.parquet"
            pd.read_parquet(tok).head(n).to_parquet(small)
            extract(small, ident_path, tmp / "extract/shard_0", dtype="bfloat16", progress=False)
            return f"{r.name} (first {n} samples extracted here)", [tmp / "extract/shard_0/index.json"], vocab, None
    return None


def train_params(run_params: dict | None, a) -> dict:
    import yaml

    from eaglet.train.train import resolve_params

    if run_params is None:
        run_params = yaml.safe_load((ROOT / "config/config.yaml").read_text())["train"]
        run_params.setdefault("val_fraction", 0.2)
    for item in getattr(a, "set", None) or []:  # --set KEY=VALUE: a train key of eaglet's recipe, checked below
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE (a train.* key, the value as YAML)")
        run_params = {**run_params, key: yaml.safe_load(value)}
    p = resolve_params(run_params)
    p.update(checkpoint_every=10**9, gpus=0, max_steps=None, hidden_states="offline", data_fraction=a.data_fraction)
    if a.autocast is not None:
        p["autocast"] = a.autocast
    if getattr(a, "gamma", None) is not None:
        p["gamma"] = a.gamma
    if getattr(a, "loss", None) is not None:
        p["loss"] = a.loss
    if a.epochs is not None:
        p["epochs"] = a.epochs
    elif a.quick:
        p["epochs"] = 1
    return p


class Scorer:
    """eaglet's validation figures for any drafter, by the very code of eaglet.train.loop.validate:
    the exact greedy chain τ (valid_positions, chain_positions, chain_counts) from the drafter's
    per-step greedy tokens, and the expected chain τ at T = 1 (expected_counts_BT) from its per-step
    acceptance α = Σ min(p, q), p being the target's probabilities of the draft vocab (DraftLabels with
    the draft vocab's mass from the store's statistics, as the trainer's validation reads it)."""

    def __init__(self, ds, ident, d2t, t2d, p, val_batches, K):
        import torch

        from eaglet.drafter import ttt
        from eaglet.train.data import collate
        from eaglet.train.setup import DraftLabels

        self.ds, self.val_batches, self.K, self.d2t, self.t2d = ds, val_batches, K, d2t, t2d
        head = DraftLabels(ident, t2d, bool(ds.meta["final_is_prenorm"]), p["oov_rule"] == "greedy", "cpu")
        self.batches = []
        with torch.no_grad():
            for vb in val_batches:
                b = collate([ds.sample(i) for i in vb], "cpu")
                p_BTVd, inv, mass_BT = head(b["final"], b["target_lse"], b["target_top1"], mass=True)
                valid = ttt.valid_positions(b, t2d, inv)
                self.batches.append((vb, b, p_BTVd, mass_BT, ttt.chain_positions(b, valid, p_BTVd, d2t)))

    def target_p(self) -> dict:
        """Per validation sample ``{i}``: the target's probability of each draft-vocab token, [n, Vd]."""
        out = {}
        for vb, _b, p_BTVd, mass_BT, _ in self.batches:
            for r, i in enumerate(vb):
                n = int(self.ds.num_tokens[i])
                out[str(i)] = (p_BTVd[r, :n] * mass_BT[r, :n, None]).contiguous()
        return out

    def score(self, drafter) -> dict:
        """drafter(vb, b, p_BTVd, mass_BT) -> (drafts [B, T, K] draft-vocab tokens, index t of step k
        drafting x_{t+2+k}; alpha [B, T, K], 0 past the end) -> {"chain": [τ per k], "exp": [τ per k]}."""
        import torch

        from eaglet.drafter.ttt import chain_counts, expected_counts_BT

        ch = torch.zeros(self.K, 2, dtype=torch.float64)
        ex = torch.zeros(self.K, 2, dtype=torch.float64)
        for vb, b, p_BTVd, mass_BT, chain_BT in self.batches:
            D, alpha = drafter(vb, b, p_BTVd, mass_BT)
            tgt = p_BTVd.argmax(-1)
            B, T = b["x"].shape
            hits = torch.zeros(B, T, self.K, dtype=torch.bool)
            for k in range(self.K):
                n = T - 2 - k
                if n > 0:
                    hits[:, :n, k] = (D[:, :n, k] == tgt[:, 1 + k:1 + k + n]) & chain_BT[:, 1 + k:1 + k + n]
            ch += chain_counts(hits, b["mask"])
            ex += expected_counts_BT(alpha, b["mask"])

        def taus(c):
            return [1 + a / n if n > 0 else None for a, n in c.tolist()]

        return {"chain": taus(ch), "exp": taus(ex)}


def interval(xs: list[float]) -> str:
    """mean and its 95 % Student-t interval over seeds (the range too)."""
    import statistics

    T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
    m = statistics.mean(xs)
    if len(xs) < 2:
        return f"{m:.4f} (one seed: no interval)"
    h = T975.get(len(xs) - 1, 2.0) * statistics.stdev(xs) / len(xs) ** 0.5
    return f"{m:.4f} [95% {m - h:.4f}, {m + h:.4f}] (range {min(xs):.4f}-{max(xs):.4f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=str(ROOT / "results"), help="where the runs are (another clone's)")
    ap.add_argument("--run", default=None, help="results/<run> with extract/ and vocab_map/ (default: the largest)")
    ap.add_argument("--identity", default=str(IDENTITY))
    ap.add_argument("--quick", action="store_true", help="one epoch")
    ap.add_argument("--epochs", type=float, default=None, help="override the run's train.epochs")
    ap.add_argument("--data-fraction", type=float, default=1.0, help="train on this share of the training samples")
    from eaglet.base import schema

    ap.add_argument("--autocast", default=None, choices=schema.allowed("train.autocast"),
                    help="eaglet's train.autocast instead of the run's: float32 compares both trainers in fp32 on "
                    "a CPU whose bf16 units auto would use")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="one paired run of both per seed")
    ap.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                    help="the anchor's (speculators' builder): adamw, its TrainerConfig default, or muon, its CLI's")
    ap.add_argument("--anchor-python", default=os.path.relpath(ANCHOR_PY, ROOT))
    ap.add_argument("--extract-n", type=int, default=48, help="samples to extract when no store exists")
    ap.add_argument("--keep", default=None, help="keep the exchange files and both outputs in this folder")
    ap.add_argument("--out", default=None, help="write every seed's figures as JSON here")
    ap.add_argument("--gamma", type=float, default=None,
                    help="eaglet's train.gamma (the TTT steps' loss decay) instead of the run's (the anchor's is 1)")
    ap.add_argument("--loss", default=None, choices=schema.allowed("train.loss"),
                    help="eaglet's train.loss instead of the run's (the anchor's is KL)")
    ap.add_argument("--set", action="append", metavar="KEY=VALUE",
                    help="eaglet's train.KEY (VALUE as YAML) instead of the run's, checked by the trainer's own "
                    "resolve_params; repeatable (e.g. --set norm_before_fc=true --set freeze_lm_head=true)")
    ap.add_argument("--eaglet-only", action="store_true",
                    help="train and score eaglet alone (no anchor, no ratio): to compare a recipe of eaglet's "
                    "with an anchor row measured before on the same seeds and data (--out's JSON)")
    a = ap.parse_args()

    anchor_py = Path(a.anchor_python) if Path(a.anchor_python).is_absolute() else ROOT / a.anchor_python
    if not anchor_py.exists():
        skip(f"no anchor env ({a.anchor_python} missing: `make anchor-env` builds it)")
    if not Path(a.identity).exists():
        skip(f"target {a.identity} not materialised")

    import torch
    from safetensors.torch import save_file

    from eaglet.hidden.reader import HiddenStateDataset
    from eaglet.target.load import load_identity
    from eaglet.train.loop import SELECT_KEY, autocast_on
    from eaglet.train.setup import DraftLabels, check_vocab

    tmp_ctx = tempfile.TemporaryDirectory(prefix="bench_anchor_") if a.keep is None else None
    tmp = Path(a.keep or tmp_ctx.name)
    tmp.mkdir(parents=True, exist_ok=True)
    ident = load_identity(a.identity)
    results = Path(a.results)
    store = find_store(results, a.run) or extract_store(results, tmp, Path(a.identity), a.extract_n)
    if store is None:
        skip("no hidden-state store (results/*/extract) and no tokens file to extract one from")
    run, index, vocab, run_params = store
    p = train_params(run_params, a)
    K = int(p["ttt_steps"])
    if int(p["grad_accum"]) != 1:
        skip(f"train.grad_accum {p['grad_accum']}: the anchor loop takes one micro-batch per step")
    ds = HiddenStateDataset([str(i) for i in index], verify="sha")
    d2t, t2d = check_vocab(str(vocab), ident)
    plans = {s: plan_for(ds, {**p, "seed": s}) for s in a.seeds}
    val_batches = plans[a.seeds[0]]["val_batches"]
    if any(pl["val_batches"] != val_batches for pl in plans.values()):
        raise SystemExit("the validation split depends on the seed: the seeds would not score the same positions")
    threads = torch.get_num_threads()
    pl0 = plans[a.seeds[0]]
    bf16 = autocast_on(p["autocast"], torch.device("cpu"))
    sel = SELECT_KEY[float(p["select_temperature"])]
    kind = "extracted here" if "extracted" in run else "a real store"
    print(f"data: {results}/{run} ({kind}, {ds.meta['dtype']}, layers {ds.meta['layer_ids']}): "
          f"{len(pl0['train_idx'])} training samples ({pl0['train_tokens']} tokens), {len(pl0['val_idx'])} validation "
          f"samples in {len(val_batches)} batches; {pl0['total']} steps ({p['epochs']} epochs, data_fraction "
          f"{p['data_fraction']}, token_budget {p['token_budget']}, lr {p['lr']}), k = {K}, seeds {a.seeds}, "
          f"{threads} threads; eaglet {'bf16 autocast' if bf16 else 'fp32'} (train.autocast {p['autocast']}), "
          f"the anchor fp32 (its CPU loop); kept weights by {sel} (train.select_temperature "
          f"{p['select_temperature']}) for both", flush=True)

    # -- the exchange files shared by every seed: each sample any plan reads, eaglet's frozen rows,
    # the target's probabilities at the validation positions
    head = DraftLabels(ident, t2d, bool(ds.meta["final_is_prenorm"]), False, "cpu")
    exact = torch.bfloat16 if ds.meta["dtype"] == "bfloat16" else torch.float32  # lossless for the store
    used = sorted({i for pl in plans.values() for mb in pl["micro"] for i in mb}
                  | {i for vb in val_batches for i in vb})
    tensors = {}
    for i in used:
        smp = ds.sample(i)
        n = len(smp["input_ids"])
        tensors.update({f"{i}.ids": smp["input_ids"], f"{i}.mask": smp["loss_mask"].bool(),
                        f"{i}.aux": smp["aux"].reshape(n, -1).to(exact).contiguous(),
                        f"{i}.final": smp["final"].to(exact).contiguous()})
    save_file(tensors, str(tmp / "samples.safetensors"))
    del tensors
    from eaglet.target.load import load_target_embedding

    save_file({"embed": load_target_embedding(ident["path"]).float().contiguous(),
               "head_rows": head.w_VdH.float().contiguous(),
               "norm": head.head.norm.weight.detach().float().contiguous(), "d2t": d2t, "t2d": t2d},
              str(tmp / "heads.safetensors"))
    scorer = Scorer(ds, ident, d2t, t2d, p, val_batches, K)
    save_file(scorer.target_p(), str(tmp / "target_p.safetensors"))

    rows = []
    for seed in a.seeds:
        rows.append(one_seed(a, seed, plans[seed], p, ds, index, vocab, ident, d2t, t2d, scorer, anchor_py,
                             tmp, bf16, sel, threads))
    if a.eaglet_only:
        for key in ("tau", "tau_t0", "speed"):
            print(f"ratio {key}: skipped")
            print(f"note {key}: --eaglet-only (gamma {p['gamma']}, loss {p['loss']}): no anchor run")
        if a.out:
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps({"data": f"{results}/{run}", "params": p, "seeds": a.seeds, "rows": rows,
                                               "eaglet_only": True}, indent=1, default=str) + "\n")
        if tmp_ctx is not None:
            tmp_ctx.cleanup()
        return
    # -- the table: per seed, then the mean with its interval over seeds
    print(f"\nchain τ(k={K}) at T = 0 and expected τ(k={K}) at T = 1 (Σ min(p, q) chained), the same "
          f"{len(pl0['val_idx'])} validation samples, each at its kept pass; speed: training tok/s, steps 2..")
    print("| seed | eaglet τ T=0 | anchor τ T=0 | ratio T=0 | eaglet τ T=1 | anchor τ T=1 | ratio T=1 | "
          "eaglet tok/s | anchor tok/s | speed ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['seed']} | {r['eaglet']['chain']:.4f} | {r['anchor']['chain']:.4f} | {r['ratio_t0']:.4f} | "
              f"{r['eaglet']['exp']:.4f} | {r['anchor']['exp']:.4f} | {r['ratio_t1']:.4f} | "
              f"{r['eaglet']['tok_s']:.0f} | {r['anchor']['tok_s']:.0f} | {r['ratio_speed']:.3f} |")
    agg = {}
    for key, what in (("ratio_t0", "τ ratio at T = 0"), ("ratio_t1", "τ ratio at T = 1"),
                      ("ratio_speed", "speed ratio")):
        agg[key] = [r[key] for r in rows]
        print(f"{what}: {interval(agg[key])}")
    for who in ("eaglet", "anchor"):
        print(f"{who}: τ T=0 {interval([r[who]['chain'] for r in rows])}; τ T=1 "
              f"{interval([r[who]['exp'] for r in rows])}")
    import statistics

    t0m, t1m, spm = (statistics.mean(agg[k]) for k in ("ratio_t0", "ratio_t1", "ratio_speed"))
    dt = f"eaglet {'bf16 autocast' if bf16 else 'fp32'}, anchor fp32"
    print(f"ratio tau: {t1m:.4f}")
    print(f"note tau: expected τ(k={K}) at T = 1, eaglet / anchor, mean of {len(rows)} seeds "
          f"{interval(agg['ratio_t1'])}; at T = 0 (exact chain) {interval(agg['ratio_t0'])}; {run}, "
          f"{pl0['total']} steps")
    print(f"ratio tau_t0: {t0m:.4f}")
    print(f"note tau_t0: exact chain τ(k={K}) at T = 0, eaglet / anchor, {interval(agg['ratio_t0'])}")
    print(f"ratio speed: {spm:.4f}")
    print(f"note speed: train tok/s eaglet / anchor, {interval(agg['ratio_speed'])}, {threads} threads, "
          f"load {os.getloadavg()[0]:.1f}; dtypes: {dt}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"data": f"{results}/{run}", "params": p, "seeds": a.seeds, "rows": rows,
                                           "dtypes": dt, "select": sel}, indent=1, default=str) + "\n")
    if tmp_ctx is not None:
        tmp_ctx.cleanup()


def plan_for(ds, p: dict) -> dict:
    """eaglet's plan for these params (eaglet.train.data): micro-batches, validation batches and steps."""
    from eaglet.train.data import plan_batches, plan_micro_batches

    lengths = list(ds.num_tokens)
    micro, train_idx, val_idx = plan_micro_batches(ds.ids, lengths, p)
    total = len(micro) // int(p["grad_accum"])
    val_batches = plan_batches(val_idx, lengths, p["token_budget"], p["seed"], 0, shuffle=False)
    if p["val_max_batches"] is not None:
        val_batches = val_batches[:int(p["val_max_batches"])]
    val_steps = sorted({s for s in range(1, total + 1) if s % p["val_every"] == 0} | {total})
    return {"micro": micro[:total], "train_idx": train_idx, "val_idx": val_idx, "total": total,
            "val_batches": val_batches, "val_steps": val_steps,
            "train_tokens": sum(lengths[i] for i in train_idx)}


def one_seed(a, seed, pl, p, ds, index, vocab, ident, d2t, t2d, scorer, anchor_py, tmp, bf16, sel, threads) -> dict:
    """Both trainers on seed ``seed``'s batches, both scored at T = 0 and T = 1 by ``scorer``."""
    import pandas as pd
    import torch
    from safetensors.torch import load_file

    from eaglet.drafter.ttt import is_better
    from eaglet.train.train import train

    p = {**p, "seed": seed}
    K, total = int(p["ttt_steps"]), pl["total"]
    d = tmp / f"seed_{seed}"
    d.mkdir(parents=True, exist_ok=True)
    for f in ("samples.safetensors", "heads.safetensors", "target_p.safetensors"):
        if not (d / f).exists():
            (d / f).symlink_to((tmp / f).absolute())
    (d / "plan.json").write_text(json.dumps({
        "micro": pl["micro"], "total": total, "val_batches": pl["val_batches"], "val_steps": pl["val_steps"],
        "ttt_steps": K, "lr": p["lr"], "weight_decay": 0.01, "optimizer": a.optimizer, "seed": seed,
        "layer_ids": ds.meta["layer_ids"], "target_path": ident["path"], "threads": threads}))

    # -- eaglet, its own loop
    t0 = time.time()
    summary = train([str(i) for i in index], str(vocab), ident, d / "eaglet", p, dataset=ds)
    eaglet_wall = time.time() - t0
    rows = pd.read_parquet(d / "eaglet/metrics.parquet")
    tr_rows = rows[rows["split"] == "train"].sort_values("step")
    if len(tr_rows) != total:
        raise SystemExit(f"eaglet ran {len(tr_rows)} steps, the plan has {total}")
    e_tok = tr_rows["tokens"].iloc[1:].sum()
    e_sec = (tr_rows["tokens"] / tr_rows["tok_s"]).iloc[1:].sum()
    best = summary["best_val"]

    if a.eaglet_only:
        return eaglet_only(seed, total, summary, scorer, ident, d, K, bf16, e_tok / e_sec, eaglet_wall)
    # -- the anchor, in its own environment
    t0 = time.time()
    proc = subprocess.run([str(anchor_py), str(ROOT / "benchmarks/anchor_worker.py"), str(d)], cwd=ROOT,
                          capture_output=True, text=True)
    anchor_wall = time.time() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        raise SystemExit(f"anchor worker failed (rc {proc.returncode})")
    res = json.loads((d / "result.json").read_text())
    a_rows = res["rows"][1:]
    a_tok, a_sec = sum(r["tokens"] for r in a_rows), sum(r["seconds"] for r in a_rows)
    if a_tok != e_tok:
        raise SystemExit(f"token counts differ: eaglet {e_tok}, anchor {a_tok} (not the same micro-batches)")

    e = score_eaglet(seed, best, scorer, ident, d, K, bf16)

    # -- the anchor at each of its validation passes, kept by the same rule
    a_best = None
    for s in pl["val_steps"]:
        dr = load_file(str(d / f"drafts_{s}.safetensors"))
        al = load_file(str(d / f"alpha_{s}.safetensors"))

        def anchor_drafter(vb, b, p_BTVd, mass_BT, dr=dr, al=al):
            B, T = b["x"].shape
            D = torch.full((B, T, K), -1, dtype=torch.long)
            A = torch.zeros(B, T, K)
            for r, i in enumerate(vb):
                x, y = dr[str(i)], al[str(i)]  # [K, n - 1] each
                D[r, :x.shape[1]] = x.T
                A[r, :y.shape[1]] = y.T
            return D, A

        sc = scorer.score(anchor_drafter)
        row = {"chain_tau": sc["chain"][-1], "exp_tau": sc["exp"][-1]}
        # is_better reads the kept pass as {"tau": its τ by the rule}, as the trainer keeps it
        if is_better(row, a_best and {"tau": a_best["row"][sel]}, sel):
            a_best = {"row": row, "step": s, "sc": sc}
    a_sc = a_best["sc"]
    out = {"seed": seed, "steps": total,
           "eaglet": {"chain": e["chain"][-1], "exp": e["exp"][-1], "chain_k": e["chain"], "exp_k": e["exp"],
                      "kept_step": summary["selected"]["step"], "tok_s": float(e_tok / e_sec),
                      "wall_s": eaglet_wall},
           "anchor": {"chain": a_sc["chain"][-1], "exp": a_sc["exp"][-1], "chain_k": a_sc["chain"],
                      "exp_k": a_sc["exp"], "kept_step": a_best["step"], "tok_s": a_tok / a_sec,
                      "wall_s": anchor_wall, "versions": res["versions"], "optimizers": res["optimizers"],
                      "same_init_max_abs_diff": res["same_init_max_abs_diff"]}}
    out["ratio_t0"] = out["eaglet"]["chain"] / out["anchor"]["chain"]
    out["ratio_t1"] = out["eaglet"]["exp"] / out["anchor"]["exp"]
    out["ratio_speed"] = out["eaglet"]["tok_s"] / out["anchor"]["tok_s"]
    print(f"seed {seed}: eaglet {total} steps in {eaglet_wall:.0f} s, kept step {out['eaglet']['kept_step']}: τ T=0 "
          f"{out['eaglet']['chain']:.4f}, T=1 {out['eaglet']['exp']:.4f}, {out['eaglet']['tok_s']:.0f} tok/s; "
          f"anchor (speculators {res['versions']['speculators']}, {'+'.join(res['optimizers'])}) in "
          f"{anchor_wall:.0f} s, "
          f"kept step {a_best['step']}: τ T=0 {out['anchor']['chain']:.4f}, T=1 {out['anchor']['exp']:.4f}, "
          f"{out['anchor']['tok_s']:.0f} tok/s; initial rows vs eaglet's max |diff| "
          + ", ".join(f"{k} {v:.1e}" for k, v in res["same_init_max_abs_diff"].items()), flush=True)
    return out


def score_eaglet(seed, best, scorer, ident, d, K, bf16) -> dict:
    """eaglet's kept drafter re-scored the way the trainer validated (under its autocast): it must
    reproduce the trainer's own figures (``best``) at both temperatures, else the scorer is not the trainer's."""
    import torch

    from eaglet.drafter.eagle3 import load_drafter
    from eaglet.drafter.ttt import acceptance

    model, _, _, _ = load_drafter(d / "eaglet/drafter.safetensors", ident)

    def eaglet_drafter(vb, b, p_BTVd, mass_BT):
        B, T = b["x"].shape
        D = torch.zeros(B, T, K, dtype=torch.long)
        alpha = torch.zeros(B, T, K)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            for k, lg, _ in model.ttt_unroll(b["x"], model.project(b["aux"]), K):
                n = T - 2 - k
                if n > 0:
                    lp = torch.log_softmax(lg[:, :n].float(), -1)
                    D[:, :n, k] = lp.argmax(-1)
                    alpha[:, :n, k] = acceptance(lp.exp(), p_BTVd[:, 1 + k:1 + k + n], mass_BT[:, 1 + k:1 + k + n])
        return D, alpha

    e = scorer.score(eaglet_drafter)
    for key, got, want in (("chain", e["chain"][-1], best["chain_tau"]), ("exp", e["exp"][-1], best["exp_tau"])):
        if abs(got - want) > 1e-6:
            raise SystemExit(f"scorer check (seed {seed}): eaglet's kept drafter re-scored {key} τ {got:.6f}, the "
                             f"trainer said {want:.6f} (not the same positions or rule)")
    return e


def eaglet_only(seed, total, summary, scorer, ident, d, K, bf16, tok_s, wall) -> dict:
    """--eaglet-only: eaglet's kept drafter scored as in a paired run, no anchor."""
    e = score_eaglet(seed, summary["best_val"], scorer, ident, d, K, bf16)
    out = {"seed": seed, "steps": total,
           "eaglet": {"chain": e["chain"][-1], "exp": e["exp"][-1], "chain_k": e["chain"], "exp_k": e["exp"],
                      "kept_step": summary["selected"]["step"], "tok_s": float(tok_s), "wall_s": wall}}
    print(f"seed {seed}: eaglet alone, {total} steps in {wall:.0f} s, kept step {out['eaglet']['kept_step']}: τ T=0 "
          f"{out['eaglet']['chain']:.4f}, T=1 {out['eaglet']['exp']:.4f}, {tok_s:.0f} tok/s", flush=True)
    return out


if __name__ == "__main__":
    main()
