"""Hidden-state storage: fp8 (e4m3, per-token scale) vs bf16, bytes per token and the τ it costs (one run).

    python benchmarks/bench_fp8.py [--tokens results/smollm2/tokenize/tokens.parquet] [--n 48]
        [--vocab results/smollm2/vocab_map/vocab.safetensors] [--epochs 2] [--token-budget 768]
        [--params '{"lr": 3e-4}'] [--eval-prompts 2] [--eval-max-new 48] [--device auto] [--threads 0]

The same ``--n`` samples (the first of the tokens file; without it, ShareGPT conversations through
the tokenize stage) go through the extraction stage (eaglet.features.extract.extract) twice, once with
``dtype bfloat16`` and once with ``dtype fp8``, from one loaded target. Stored bytes per token =
every file of the shard folder (chunks + index.json) / stored tokens; the ratio fp8 / bf16 is the
row's figure (goal <= 0.55; the format's own formula gives 0.504). Beside it, what fp8 does to the
data: the relative RMS error of the decoded fp8 states against the bf16 ones (per aux layer and
the final state), and how often the target's greedy token over the draft vocab (its training
target, from the stored final state) stays the same. The draft vocab is the run's vocab map, or
one built from these samples by the freq and vocab stages when it is missing.

Then a drafter is trained on each store by eaglet.train.train.train with identical params and seed
(config/config.yaml's train section, ttt_steps 3, ``--epochs`` over the samples at
``--token-budget``, val_fraction 0.2: the held-out ids are the same for both). Reported: the
trainer's validation chain τ (the exact greedy chain at k = ttt_steps over the held-out samples,
each drafter on its own store; teacher-forced accuracies beside it), and, unless
``--eval-prompts 0``, the offline τ of eaglet.eval.evaluate_offline on that many MT-Bench prompts (the fp32
target's real hidden states, identical for both drafters). A few dozen steps leave the drafter far
from trained: the τ difference says whether fp8 storage visibly hurts this early, not what it costs a converged drafter.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from eaglet.base.conversations import write_conversations  # noqa: E402
from eaglet.base.files import read_parquet, write_parquet  # noqa: E402
from eaglet.base.logs import quiet_third_party, setup_logging  # noqa: E402
from eaglet.base.tensors import load_tensors  # noqa: E402
from eaglet.features.extract import extract, load_cached, pick_device  # noqa: E402
from eaglet.hidden.dtypes import bytes_per_token  # noqa: E402
from eaglet.hidden.reader import HiddenStateDataset  # noqa: E402
from eaglet.target import capture  # noqa: E402
from eaglet.target.load import default_layer_ids, load_identity  # noqa: E402
from eaglet.train.setup import DraftLabels  # noqa: E402
from eaglet.train.train import resolve_params, train  # noqa: E402


def subset_tokens(src: Path, dst: Path, n: int, identity: str) -> tuple[int, str]:
    """The first n samples of ``src`` into ``dst``; without ``src``, n ShareGPT conversations
    (their original answers, not the target's) through the tokenize stage."""
    if src.exists():
        table = read_parquet(src)
        table = table.slice(0, min(n, table.num_rows))
        write_parquet(dst, table)
        return table.num_rows, f"first of {src}"
    from eaglet.data import prompts, tokenization

    rows = prompts.build_prompts("sharegpt", n=n, heldout=0, seed=0, max_turns=2)["train"]
    write_conversations(dst.parent / "conv.parquet", rows)
    meta = tokenization.run(dst.parent / "conv.parquet", identity, dst.parent, max_length=1024)
    return meta["samples_processed"], f"{src} missing: ShareGPT seed 0 through eaglet.data.tokenization"


def ensure_vocab(vocab_map: Path | None, tokens: Path, identity: str, work: Path, vd: int) -> Path:
    """The run's vocab map when it exists, else one built from ``tokens`` by the stages' code."""
    if vocab_map is not None and vocab_map.exists():
        return vocab_map
    from eaglet.data import freq, vocab

    freq.run(tokens, identity, work / "freq")
    vocab.run(work / "freq/freq.safetensors", identity, work / "vocab", vd)
    return work / "vocab/vocab.safetensors"


def store_bytes(shard: Path) -> int:
    return sum(f.stat().st_size for f in shard.iterdir() if f.is_file())


@torch.no_grad()
def compare_stores(bf16: Path, fp8: Path, head: DraftLabels) -> dict:
    """fp8 vs bf16 decoded states: relative RMS error per aux layer and final; greedy agreement."""
    a, b = HiddenStateDataset([bf16], verify="header"), HiddenStateDataset([fp8], verify="header")
    order = {s: i for i, s in enumerate(b.ids)}
    err = torch.zeros(4, dtype=torch.float64)
    ref = torch.zeros(4, dtype=torch.float64)
    same = total = 0
    kl = 0.0
    for i, sid in enumerate(a.ids):
        x, y = a.sample(i), b.sample(order[sid])
        xs = torch.cat([x["aux"], x["final"][:, None]], 1)  # [T, 4, H]
        ys = torch.cat([y["aux"], y["final"][:, None]], 1)
        err += (ys - xs).double().pow(2).sum((0, 2))
        ref += xs.double().pow(2).sum((0, 2))
        px, _, _ = head(x["final"][None])
        py, _, _ = head(y["final"][None])
        same += int((px.argmax(-1) == py.argmax(-1)).sum())
        kl += float((px * (px.clamp_min(1e-30).log() - py.clamp_min(1e-30).log())).sum())
        total += px.shape[1]
    return {"rel_rms": (err / ref).sqrt().tolist(), "greedy_agree": same / total, "kl": kl / total}


def offline_tau(drafter: Path, identity: str, out: Path, prompts: int, max_new: int) -> dict:
    from eaglet.eval.evaluate_offline import evaluate_offline

    res = evaluate_offline(drafter, identity, ["mtbench"], out, num_prompts=prompts,
                           max_new_tokens=max_new, k_values=[1, 2, 3])
    o = res["overall"]
    tau = {int(k): v for k, v in o["tau"].items()}
    chain = {int(k): v for k, v in (o.get("tau_chain") or {}).items()}
    return {"tau": tau, "tau_chain": chain, "new_tokens": res["new_tokens"], "prompts": res["prompts"]}


def fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--identity", default=str(ROOT / "resources/targets/smollm2-135m-instruct/identity.json"))
    ap.add_argument("--tokens", default=str(ROOT / "results/smollm2/tokenize/tokens.parquet"))
    ap.add_argument("--vocab", default=str(ROOT / "results/smollm2/vocab_map/vocab.safetensors"),
                    help="draft vocab map (built from --tokens when missing)")
    ap.add_argument("--n", type=int, default=48, help="samples (the first of --tokens)")
    ap.add_argument("--extract-budget", type=int, default=2048,
                    help="extraction token budget (speed only: the stored bytes do not depend on it)")
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--token-budget", type=int, default=768, help="training micro-batch token budget")
    ap.add_argument("--val-fraction", type=float, default=0.2)
    ap.add_argument("--params", default="{}", help="more train params (JSON), over config/config.yaml's")
    ap.add_argument("--eval-prompts", type=int, default=2, help="MT-Bench prompts for offline τ (0: skip)")
    ap.add_argument("--eval-max-new", type=int, default=48)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    return ap.parse_args()


def main() -> None:
    a = parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    setup_logging()
    quiet_third_party()

    import yaml

    conf = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    ident = load_identity(a.identity)
    params = {**(conf.get("train") or {}), "ttt_steps": 3, "epochs": a.epochs, "token_budget": a.token_budget,
              "val_fraction": a.val_fraction, "val_every": 10**9, "checkpoint_every": 10**9, "seed": 0,
              **json.loads(a.params)}
    p = resolve_params(params)
    vd = int((conf.get("vocab") or {}).get("draft_vocab_size", 8192))
    print_report(ident, p, measure(a, ident, p, vd))


def extract_both(a: argparse.Namespace, ident: dict, tokens: Path, tmp: Path) -> dict:
    """Both stores from one loaded target: their paths, seconds, bytes and bytes per token."""
    dev = pick_device(a.device)
    ngpu = torch.cuda.device_count() if dev.startswith("cuda") else 0
    mdtype = "bfloat16" if dev.startswith("cuda") else "float32"
    t0 = time.perf_counter()
    load_cached(ident["path"], ident["digest"], mdtype, dev, ngpu)  # once, reused by both extractions
    t_load = time.perf_counter() - t0
    stores, secs, nbytes = {}, {}, {}
    for dt in ("bfloat16", "fp8"):
        stores[dt] = tmp / dt / "shard_0"
        t0 = time.perf_counter()
        idx = extract(tokens, a.identity, stores[dt], dtype=dt, token_budget=a.extract_budget,
                      device=dev, progress=False)
        secs[dt] = time.perf_counter() - t0
        nbytes[dt] = store_bytes(stores[dt])
    ntok = sum(s["num_tokens"] for s in idx["samples"])
    bpt = {dt: nbytes[dt] / ntok for dt in nbytes}
    capture.LOADED.clear()
    return {"dev": dev, "t_load": t_load, "stores": stores, "secs": secs, "nbytes": nbytes, "ntok": ntok,
            "bpt": bpt}


def measure(a: argparse.Namespace, ident: dict, p: dict, vd: int) -> dict:
    """Both stores, their comparison, a drafter trained on each, and their offline τ."""
    with tempfile.TemporaryDirectory(prefix="bench_fp8.") as tmp:
        tmp = Path(tmp)
        tokens = tmp / "tokens.parquet"
        n, source = subset_tokens(Path(a.tokens), tokens, a.n, a.identity)
        vocab = ensure_vocab(Path(a.vocab) if a.vocab else None, tokens, a.identity, tmp, vd)
        m = extract_both(a, ident, tokens, tmp)
        stores = m["stores"]

        vt = load_tensors(vocab, ["t2d"])
        head = DraftLabels(ident, vt["t2d"].bool(), True, False, "cpu")
        cmp = compare_stores(stores["bfloat16"], stores["fp8"], head)
        del head

        runs = {}
        for dt in ("bfloat16", "fp8"):
            t0 = time.perf_counter()
            s = train([str(stores[dt] / "index.json")], str(vocab), ident, tmp / f"train_{dt}", p)
            runs[dt] = {"seconds": time.perf_counter() - t0, "summary": s}

        evals = {}
        if a.eval_prompts > 0:
            for dt in ("bfloat16", "fp8"):
                evals[dt] = offline_tau(tmp / f"train_{dt}" / "drafter.safetensors", a.identity,
                                        tmp / f"eval_{dt}", a.eval_prompts, a.eval_max_new)
    return {**m, "n": n, "source": source, "cmp": cmp, "runs": runs, "evals": evals}


def print_report(ident: dict, p: dict, m: dict) -> None:
    H = ident["hidden_size"]
    runs, evals, cmp, secs, nbytes, bpt = m["runs"], m["evals"], m["cmp"], m["secs"], m["nbytes"], m["bpt"]
    sb, s8 = runs["bfloat16"]["summary"], runs["fp8"]["summary"]
    vb, v8 = sb["final_val"], s8["final_val"]
    print(f"samples {m['n']} ({m['source']}), {m['ntok']} tokens; target {ident['name']} (hidden {H}, "
          f"layers {default_layer_ids(ident['num_layers'])}), loaded in {m['t_load']:.1f} s on {m['dev']}")
    for dt, name in (("bfloat16", "bf16"), ("fp8", "fp8 ")):
        print(f"extract {name}: {secs[dt]:6.1f} s, store {nbytes[dt] / 1e6:7.2f} MB = {bpt[dt]:7.1f} B/token "
              f"(format formula {bytes_per_token(dt, H)})")
    rr = ", ".join(f"{x:.4f}" for x in cmp["rel_rms"])
    print(f"fp8 vs bf16 stored states: rel. RMS error aux/aux/aux/final {rr}; target greedy token over the "
          f"draft vocab unchanged at {100 * cmp['greedy_agree']:.2f}% of tokens, mean KL {cmp['kl']:.2e}")
    print(f"train (identical params, seed {p['seed']}): {sb['steps']} steps, ttt_steps {p['ttt_steps']}, "
          f"token_budget {p['token_budget']}, lr {p['lr']}, {sb['train_samples']} train / "
          f"{sb['val_samples']} val samples; bf16 {runs['bfloat16']['seconds']:.1f} s, "
          f"fp8 {runs['fp8']['seconds']:.1f} s")
    note = []
    if vb and v8:
        acc = " | ".join(f"tf_acc_{k} {vb[f'tf_acc_{k}']:.3f}/{v8[f'tf_acc_{k}']:.3f}" for k in range(p["ttt_steps"]))
        print(f"val chain τ (trainer, exact greedy chain, {vb['chain_rounds']}/{v8['chain_rounds']} rounds, each on "
              f"its own store): bf16 {vb['chain_tau']:.4f}, fp8 {v8['chain_tau']:.4f}, "
              f"Δ {v8['chain_tau'] - vb['chain_tau']:+.4f}  "
              f"(bf16/fp8 {acc}; val loss {vb['loss']:.3f}/{v8['loss']:.3f})")
        note.append(f"val chain τ bf16 {vb['chain_tau']:.3f} fp8 {v8['chain_tau']:.3f} "
                    f"Δ {v8['chain_tau'] - vb['chain_tau']:+.3f}")
        if max(vb["chain_tau"], v8["chain_tau"]) < 1.2:
            print("  (both τ near 1: too little training for the difference to mean much; raise --n / --epochs)")
    else:
        print("val τ: no held-out samples (raise --n or --val-fraction)")
    if evals:
        eb, e8 = evals["bfloat16"], evals["fp8"]
        k = max(eb["tau"])
        print(f"offline τ (eaglet.eval.evaluate_offline, every position, {eb['prompts']} MT-Bench prompts, "
              f"{eb['new_tokens']} new tokens, fp32 target states): " + ", ".join(
                  f"k={j} bf16 {fmt(eb['tau'][j])} fp8 {fmt(e8['tau'][j])}" for j in sorted(eb["tau"])))
        if eb["tau"][k] is not None and e8["tau"][k] is not None:
            note.append(f"offline τ(k={k}) bf16 {eb['tau'][k]:.3f} fp8 {e8['tau'][k]:.3f} "
                        f"Δ {e8['tau'][k] - eb['tau'][k]:+.3f}")
    note.append(f"greedy agree {100 * cmp['greedy_agree']:.1f}%")
    print("note: " + "; ".join(note))
    print(f"ratio fp8/bf16 bytes per token: {bpt['fp8'] / bpt['bfloat16']:.3f}  (goal <= 0.55)")


if __name__ == "__main__":
    main()
