"""eaglet's trainer against the anchor, the speculators library's Eagle3 model, on the same data.

    python benchmarks/bench_anchor.py [--quick] [--results results] [--run lcreal] [--epochs 3] [--optimizer adamw|muon]
        [--anchor-python envs/anchor/.venv/bin/python] [--keep DIR]

Both drafters train on the SAME stored hidden states (a real store: results/<run>/extract, the run
with the most tokens, with its vocab map and its trainer's params from train/train_summary.json,
else config/config.yaml's train section; with no store but a tokens file, a small one is
extracted here with eaglet.features.extract) in the SAME micro-batches in the same order (eaglet's plan:
eaglet.train.data.plan_micro_batches, read by eaglet.hidden.store.HiddenStateDataset):

- eaglet: its own loop, eaglet.train.train.train, on those params (k = ttt_steps);
- the anchor: benchmarks/anchor_worker.py in envs/anchor/.venv (``make anchor-env``; it cannot share
  a process with eaglet's stack), a CPU loop around speculators' Eagle3DraftModel with its eagle3
  defaults (see the worker's docstring), the same embedding and head rows, the same learning rate
  and number of steps; the tensors travel through safetensors files in a temp dir.

Both are scored by eaglet's exact greedy-chain τ at k = ttt_steps (eaglet.drafter.ttt.chain_positions and
chain_counts, as the trainer's validation computes ``best_val.chain_tau``) on the same validation
positions, each at its best validation pass (the trainer's rule: passes at every ``val_every`` steps
and the last; the best chain τ, the later on a tie). The scorer first re-scores eaglet's kept
drafter and must reproduce the trainer's own best_val.chain_tau. Speed: training tokens / the summed
time of the training steps (validation excluded; the first step, warm-up, excluded from both).

Prints ``ratio tau: X`` (eaglet τ / anchor τ, goal >= 1.05) and ``ratio speed: Y`` (eaglet tok/s /
anchor tok/s, goal >= 2.0), each with a ``note <key>:`` line; ``skipped`` when the anchor env or the
data is missing. Default: the run's full recipe (6.5 min on 2 shared cores for the 147-sample lcreal store, 42
steps); ``--quick``: one epoch (~3.5 min, most of it fixed costs).
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
    for key in ("tau", "speed"):
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
            tokens = sum(json.loads(i.read_text()).get("num_tokens_total", 0) or 0 for i in idx)
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
    p = resolve_params(run_params)
    p.update(checkpoint_every=10**9, gpus=0, max_steps=None, hidden_states="offline", data_fraction=1.0)
    if a.epochs is not None:
        p["epochs"] = a.epochs
    elif a.quick:
        p["epochs"] = 1
    return p


class Scorer:
    """eaglet's validation chain τ for any drafter's per-step greedy draft tokens: the very code of
    eaglet.train.train.validate (valid_positions, chain_positions, chain_counts) with the drafts given."""

    def __init__(self, ds, ident, d2t, t2d, p, val_batches, K):
        import torch

        from eaglet.drafter import ttt
        from eaglet.train import data as train_data
        from eaglet.train import setup as train_setup

        self.ds, self.val_batches, self.K, self.d2t, self.t2d = ds, val_batches, K, d2t, t2d
        head = train_setup.TargetHead(ident, t2d, bool(ds.meta["final_is_prenorm"]), p["oov_rule"] == "greedy", "cpu")
        self.batches = []
        with torch.no_grad():
            for vb in val_batches:
                b = train_data.collate([ds.sample(i) for i in vb], "cpu")
                p_BTVd, inv, _ = head(b["final"])
                valid = ttt.valid_positions(b, t2d, inv)
                self.batches.append((vb, b, p_BTVd.argmax(-1), ttt.chain_positions(b, valid, p_BTVd, d2t)))

    def tau(self, drafts) -> list[float | None]:
        """drafts(vb, b) -> [B, T, K] draft-vocab tokens (index t of step k drafts x_{t+2+k})."""
        import torch

        from eaglet.drafter.ttt import chain_counts

        ch = torch.zeros(self.K, 2, dtype=torch.float64)
        for vb, b, tgt, chain_BT in self.batches:
            D = drafts(vb, b)
            B, T = b["x"].shape
            hits = torch.zeros(B, T, self.K, dtype=torch.bool)
            for k in range(self.K):
                n = T - 2 - k
                if n > 0:
                    hits[:, :n, k] = (D[:, :n, k] == tgt[:, 1 + k:1 + k + n]) & chain_BT[:, 1 + k:1 + k + n]
            ch += chain_counts(hits, b["mask"])
        return [1 + a / n if n > 0 else None for a, n in ch.tolist()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=str(ROOT / "results"), help="where the runs are (another clone's)")
    ap.add_argument("--run", default=None, help="results/<run> with extract/ and vocab_map/ (default: the largest)")
    ap.add_argument("--identity", default=str(IDENTITY))
    ap.add_argument("--quick", action="store_true", help="one epoch (~3.5 min)")
    ap.add_argument("--epochs", type=float, default=None, help="override the run's train.epochs")
    ap.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                    help="the anchor's (speculators' builder): adamw, its TrainerConfig default, or muon, its CLI's")
    ap.add_argument("--anchor-python", default=os.path.relpath(ANCHOR_PY, ROOT))
    ap.add_argument("--extract-n", type=int, default=48, help="samples to extract when no store exists")
    ap.add_argument("--keep", default=None, help="keep the exchange files and both outputs in this folder")
    a = ap.parse_args()

    anchor_py = Path(a.anchor_python) if Path(a.anchor_python).is_absolute() else ROOT / a.anchor_python
    if not anchor_py.exists():
        skip(f"no anchor env ({a.anchor_python} missing: `make anchor-env` builds it)")
    if not Path(a.identity).exists():
        skip(f"target {a.identity} not materialised")

    import pandas as pd
    import torch
    from safetensors.torch import save_file

    from eaglet.drafter.model import load_drafter
    from eaglet.hidden.reader import HiddenStateDataset
    from eaglet.target.load import load_identity
    from eaglet.train import data as train_data
    from eaglet.train import setup as train_setup
    from eaglet.train import train as tr
    from eaglet.train.loop import autocast_on

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
    ds = HiddenStateDataset([str(i) for i in index], verify="sha")
    check_vocab = getattr(tr, "check_vocab", None)
    if check_vocab is None:  # moved with the trainer's set-up on main (eaglet.train.setup)
        from eaglet.train.setup import check_vocab
    d2t, t2d = check_vocab(str(vocab), ident)
    lengths = list(ds.num_tokens)
    micro, train_idx, val_idx = train_data.plan_micro_batches(ds.ids, lengths, p)
    total = len(micro) // int(p["grad_accum"])
    val_batches = train_data.plan_batches(val_idx, lengths, p["token_budget"], p["seed"], 0, shuffle=False)
    if p["val_max_batches"] is not None:
        val_batches = val_batches[:int(p["val_max_batches"])]
    val_steps = sorted({s for s in range(1, total + 1) if s % p["val_every"] == 0} | {total})
    if int(p["grad_accum"]) != 1:
        skip(f"train.grad_accum {p['grad_accum']}: the anchor loop takes one micro-batch per step")
    threads = torch.get_num_threads()
    train_tokens = sum(lengths[i] for i in train_idx)
    kind = "extracted here" if "extracted" in run else "a real store"
    print(f"data: {results}/{run} ({kind}"
          f", {ds.meta['dtype']}, layers {ds.meta['layer_ids']}): {len(train_idx)} training samples "
          f"({train_tokens} tokens), {len(val_idx)} validation samples in {len(val_batches)} batches; "
          f"{total} steps ({p['epochs']} epochs, token_budget {p['token_budget']}, lr {p['lr']}), k = {K}, "
          f"{threads} threads", flush=True)

    # -- the exchange files for the anchor: every sample it reads, eaglet's frozen rows, the plan
    head = train_setup.TargetHead(ident, t2d, bool(ds.meta["final_is_prenorm"]), False, "cpu")
    exact = torch.bfloat16 if ds.meta["dtype"] == "bfloat16" else torch.float32  # lossless for the store
    used = sorted({i for mb in micro for i in mb} | {i for vb in val_batches for i in vb})
    tensors = {}
    for i in used:
        s = ds.sample(i)
        n = len(s["input_ids"])
        tensors.update({f"{i}.ids": s["input_ids"], f"{i}.mask": s["loss_mask"].bool(),
                        f"{i}.aux": s["aux"].reshape(n, -1).to(exact).contiguous(),
                        f"{i}.final": s["final"].to(exact).contiguous()})
    save_file(tensors, str(tmp / "samples.safetensors"))
    del tensors
    from eaglet.drafter.model import load_target_embedding

    save_file({"embed": load_target_embedding(ident["path"]).float().contiguous(),
               "head_rows": head.w_VdH.float().contiguous(),
               "norm": head.head.norm.weight.detach().float().contiguous(), "d2t": d2t, "t2d": t2d},
              str(tmp / "heads.safetensors"))
    (tmp / "plan.json").write_text(json.dumps({
        "micro": micro[:total], "total": total, "val_batches": val_batches, "val_steps": val_steps,
        "ttt_steps": K, "lr": p["lr"], "weight_decay": 0.01, "optimizer": a.optimizer, "seed": p["seed"],
        "layer_ids": ds.meta["layer_ids"], "target_path": ident["path"], "threads": threads}))

    # -- eaglet, its own loop
    t0 = time.time()
    summary = tr.train([str(i) for i in index], str(vocab), ident, tmp / "eaglet", p, dataset=ds)
    eaglet_wall = time.time() - t0
    rows = pd.read_parquet(tmp / "eaglet/metrics.parquet")
    tr_rows = rows[rows["split"] == "train"].sort_values("step")
    if len(tr_rows) != total:
        raise SystemExit(f"eaglet ran {len(tr_rows)} steps, the plan has {total}")
    e_tok = tr_rows["tokens"].iloc[1:].sum()
    e_sec = (tr_rows["tokens"] / tr_rows["tok_s"]).iloc[1:].sum()
    best = summary["best_val"]
    print(f"eaglet: {total} steps in {eaglet_wall:.0f} s; kept step {summary['selected']['step']}: chain τ "
          + ", ".join(f"k={k + 1} {best[f'chain_tau_{k + 1}']:.4f}" for k in range(K))
          + f"; {e_tok / e_sec:.0f} tok/s (steps 2..{total})", flush=True)

    # -- the anchor, in its own environment
    t0 = time.time()
    proc = subprocess.run([str(anchor_py), str(ROOT / "benchmarks/anchor_worker.py"), str(tmp)], cwd=ROOT,
                          capture_output=True, text=True)
    anchor_wall = time.time() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        raise SystemExit(f"anchor worker failed (rc {proc.returncode})")
    res = json.loads((tmp / "result.json").read_text())
    a_rows = res["rows"][1:]
    a_tok, a_sec = sum(r["tokens"] for r in a_rows), sum(r["seconds"] for r in a_rows)
    if a_tok != e_tok:
        raise SystemExit(f"token counts differ: eaglet {e_tok}, anchor {a_tok} (not the same micro-batches)")

    # -- one scorer for both; first it must reproduce eaglet's own validation figure
    scorer = Scorer(ds, ident, d2t, t2d, p, val_batches, K)
    model, _, _, _ = load_drafter(tmp / "eaglet/drafter.safetensors", ident)

    # the drafts as the trainer's validation computed them: under its autocast (bf16 on a CPU with
    # bf16 units with train.autocast auto), else the re-score differs in the last digits
    bf16 = autocast_on(p["autocast"], torch.device("cpu"))

    def eaglet_drafts(vb, b):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            return torch.stack([lg.argmax(-1) for _, lg, _ in model.ttt_unroll(b["x"], model.project(b["aux"]), K)], -1)

    e_tau = scorer.tau(eaglet_drafts)
    if abs(e_tau[-1] - best["chain_tau"]) > 1e-9:
        raise SystemExit(f"scorer check: eaglet's kept drafter re-scored {e_tau[-1]:.6f}, the trainer said "
                         f"{best['chain_tau']:.6f} (not the same positions or rule)")
    from safetensors.torch import load_file

    from eaglet.drafter.ttt import is_better

    a_best = None
    for s in val_steps:
        dr = load_file(str(tmp / f"drafts_{s}.safetensors"))

        def anchor_drafts(vb, b, dr=dr):
            B, T = b["x"].shape
            D = torch.full((B, T, K), -1, dtype=torch.long)
            for r, i in enumerate(vb):
                x = dr[str(i)]  # [K, n - 1]
                D[r, :x.shape[1]] = x.T
            return D

        taus = scorer.tau(anchor_drafts)
        if is_better({"chain_tau": taus[-1]}, a_best):
            a_best = {"tau": taus[-1], "step": s, "taus": taus}
    a_tau = a_best["taus"]
    same = res["same_init_max_abs_diff"]
    print(f"anchor (speculators {res['versions']['speculators']}, transformers {res['versions']['transformers']}, "
          f"{'+'.join(res['optimizers'])}): {total} steps in {anchor_wall:.0f} s; kept step {a_best['step']}: chain τ "
          + ", ".join(f"k={k + 1} {t:.4f}" for k, t in enumerate(a_tau))
          + f"; {a_tok / a_sec:.0f} tok/s (steps 2..{total}); its initial rows vs eaglet's: max |diff| "
          + ", ".join(f"{k} {v:.1e}" for k, v in same.items()), flush=True)
    print(f"ratio tau: {e_tau[-1] / a_tau[-1]:.4f}")
    print(f"note tau: chain τ(k={K}) eaglet {e_tau[-1]:.3f} / anchor {a_tau[-1]:.3f}, {run}, "
          f"{len(val_idx)} validation samples, {total} steps")
    print(f"ratio speed: {(e_tok / e_sec) / (a_tok / a_sec):.4f}")
    print(f"note speed: train tok/s eaglet {e_tok / e_sec:.0f} / anchor {a_tok / a_sec:.0f}, {threads} threads, "
          f"load {os.getloadavg()[0]:.1f}; dtypes: eaglet {'bf16 autocast' if bf16 else 'fp32'} "
          f"(train.autocast {p['autocast']}), anchor fp32 (its CPU loop)")
    if tmp_ctx is not None:
        tmp_ctx.cleanup()


if __name__ == "__main__":
    main()
