"""The drafter's model card, ``drafter/README.md``, generated from the run's artifacts: what a person
who picks the drafter up needs, in the format the model hubs read (YAML front matter: base model,
library, tags, datasets, metrics; then Markdown).

    python -m eaglet.report.card --drafter-dir results/RUN/drafter \
        --identity resources/targets/NAME/identity.json --evaluation results/RUN/eval/summary.json \
        --train results/RUN/train/train_summary.json --tokenize results/RUN/tokenize/metadata.json \
        --vocab results/RUN/vocab_map/vocab.json --prompts results/RUN/prompts/summary.json \
        --config '{"base_model": "HuggingFaceTB/SmolLM2-135M-Instruct", "serving": {...}}' [--log LOG]

The card says what the drafter is for (target, k, layer ids, draft vocabulary), the data it saw,
how it trained, the results matrix of the evaluation (τ per domain × temperature × engine at the
headline k, and over every prompt per k; per chat-template mode when evaluate.modes lists them),
which vLLM ``draft_sample_method`` serves it best at each T > 0 (the higher predicted τ, with the
numbers: :func:`serving_recommendation`),
the export contract's verdict, the files' digests, and how to serve it: vLLM's Python API (the
block marked ``# eaglet: vllm-snippet``, which tests/report/test_card.py runs on the CPU build),
``vllm serve`` and SGLang's launch command, and how to check a downloaded copy (``python -m eaglet.export.contract``).

A block-parallel drafter gets its own card (:func:`block_card`): DFlash (drafter.kind dflash: config.json
names ``DFlash*``) and P-EAGLE (drafter.kind p_eagle: config.json says ``parallel_drafting: true``). The
kind, its block size or K and taps, training time, the matrix at the one k vLLM serves it at, the timed
HF loop's (one drafter forward per round, for either kind) and vLLM's paired speedups over plain
decoding per temperature with their lossless checks, the contract, the files, and vLLM's snippet and
server line (method ``dflash``, or ``eagle3`` with ``parallel_drafting``) at that k (no SGLang line:
eaglet does not run SGLang on these folders).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from eaglet.base import schema
from eaglet.base.digests import DIGESTS_KEY
from eaglet.base.files import read_json
from eaglet.base.logs import setup_logging
from eaglet.base.settings_files import parse_json_arg

log = logging.getLogger("eaglet.report.card")

SNIPPET_MARK = "# eaglet: vllm-snippet"
# The prompt data sets eaglet reads, by their names on the model hubs
DATASETS = {"sharegpt": "anon8231489123/ShareGPT_Vicuna_unfiltered"}
EVAL_DATASETS = {"mtbench": "HuggingFaceH4/mt_bench_prompts", "humaneval": "openai/openai_humaneval"}
ENGINES = {"chain": "exact chain (offline)", "expected": "expected (offline)",
           "regen": "along the target's regenerated answers", "hf_loop": "HF loop (measured)",
           "vllm": "vLLM (measured)"}


def _fmt(r: dict | None) -> str:
    if not r or r.get("tau") is None:
        return "—"
    ci = r.get("ci")
    return f"{r['tau']:.2f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")


# How drafts are made and accepted at T > 0 (a matrix row's ``rule``, vLLM's draft_sample_method)
RULES = {"greedy": "greedy drafts, p(draft)", "probabilistic": "sampled drafts, Σmin(p,q)"}


def columns(rows: list[dict]) -> list[tuple[str, float, str | None]]:
    """The (engine, temperature, rule) columns of matrix rows: by temperature, then in ENGINES'
    order, then by rule (the rule named only at T > 0, where it matters)."""
    return sorted({(r["engine"], r["temperature"], r.get("rule") if r["temperature"] > 0 else None) for r in rows},
                  key=lambda c: (c[1], list(ENGINES).index(c[0]) if c[0] in ENGINES else 9, c[0], str(c[2])))


def _label(e: str, t: float, rule: str | None) -> str:
    return f"{ENGINES.get(e, e)}, T={t:g}" + (f", {RULES.get(rule, rule)}" if rule else "")


def _key(r: dict, *extra) -> tuple:
    """A matrix row's cell: engine, temperature, rule (at T > 0), then ``extra`` fields of it."""
    return (r["engine"], r["temperature"], r.get("rule") if r["temperature"] > 0 else None,
            *(r[x] for x in extra))


def matrix_tables(matrix: list[dict], k: int) -> str:
    """Two Markdown tables from summary.json's results matrix: τ per domain (rows) by engine and
    temperature (columns) at the headline k; and over every prompt, per k."""
    if not matrix:
        return "No evaluation results were recorded.\n"
    cols = columns(matrix)
    head = "| domain | " + " | ".join(_label(*c) for c in cols) + " |\n"
    sep = "|---" * (len(cols) + 1) + "|\n"
    rows = sorted({(r["set"], r["domain"]) for r in matrix if r["k"] == k and r["domain"] != "all"})
    by = {_key(r, "k", "set", "domain"): r for r in matrix}
    out = [f"τ (accepted tokens per target forward, 95% bootstrap interval over prompts) at k = {k}:\n\n",
           head, sep]
    for s, d in rows + [("all", "all")]:
        out.append(f"| {'**every prompt**' if d == 'all' else d} | "
                   + " | ".join(_fmt(by.get((*c, k, s, d))) for c in cols) + " |\n")
    ks = sorted({r["k"] for r in matrix})
    out += ["\nOver every prompt, per draft length k:\n\n", "| k | " + " | ".join(
        _label(*c) for c in cols) + " |\n", sep]
    for kk in ks:
        out.append(f"| {kk} | " + " | ".join(_fmt(by.get((*c, kk, "all", "all"))) for c in cols) + " |\n")
    return "".join(out)


def serving_recommendation(matrix: list[dict], k: int) -> str:
    """Which vLLM ``draft_sample_method`` serves this drafter best at each T > 0: the rule with the
    higher expected τ (offline, every prompt, at k), both figures with their intervals, and vLLM's
    measured τ under each rule where it ran. Empty without T > 0 rows."""
    def cell(engine, T, rule):
        return next((r for r in matrix if r["engine"] == engine and r["temperature"] == T and r.get("rule") == rule
                     and r["k"] == k and r["set"] == "all" and r["domain"] == "all"), None)

    out = []
    for T in sorted({r["temperature"] for r in matrix if r["temperature"] > 0 and r["engine"] == "expected"}):
        exp = {rule: cell("expected", T, rule) for rule in RULES}
        known = {rule: r["tau"] for rule, r in exp.items() if r and r.get("tau") is not None}
        if not known:
            continue
        best = max(known, key=known.get)
        others = [r for r in known if r != best]
        cfg = json.dumps({"draft_sample_method": best})
        line = (f"- T = {T:g}: serve with `{cfg}` in vLLM's speculative config: expected τ "
                f"{_fmt(exp[best])} under the {best} rule")
        if others:
            o = others[0]
            ci_b, ci_o = (exp[best] or {}).get("ci"), (exp[o] or {}).get("ci")
            overlap = ci_b and ci_o and ci_b[0] <= ci_o[1] and ci_o[0] <= ci_b[1]
            line += (f", against {_fmt(exp[o])} under the {o} rule"
                     + (" (the intervals overlap: either setting serves it about as well)" if overlap else "")
                     + ("" if known[best] > known[o] else " (a tie)"))
        measured = {rule: cell("vllm", T, rule) for rule in RULES}
        seen = [f"{rule} {_fmt(r)}" for rule, r in measured.items() if r and r.get("tau") is not None]
        if seen:
            line += f"; vLLM measured τ: {', '.join(seen)}"
        out.append(line + ".\n")
    if not out:
        return ""
    return ("\n## Serving at temperature > 0\n\n"
            "vLLM drafts greedily by default (`draft_sample_method: greedy`: the drafter's argmax, accepted with "
            "the target's probability of it); with `probabilistic` it samples each draft from the drafter's "
            f"distribution and accepts it with min(1, p/q). The setting with the higher predicted τ at k = {k}:\n\n"
            + "".join(out))


def verifier_fix_line(fix: dict | None) -> str:
    """The card's word on vLLM-CPU's verifier at T > 0 (vllm.json ``verifier_fix``,
    eaglet.engines.vllm_verifier_fix): empty unless the installed vLLM's own expansion was found wrong."""
    if not fix or not fix.get("defect"):
        return ""
    return ("\nvLLM's figures at T > 0 were measured with eaglet's mend of vLLM-CPU's verifier: this vLLM's own "
            "leaves the per-token temperature it verifies drafts with uninitialised (found in "
            f"{fix.get('processes')} engine process(es) of the evaluation), so served as installed its output at "
            "T > 0 is not the target's distribution. On that build serve speculative decoding at T = 0 "
            "(eaglet.engines.vllm_verifier_fix).\n")


def modes_section(modes: dict | None, rows: list[dict], k: int) -> str:
    """τ per chat-template mode (summary.json's ``modes``, evaluate.modes): one line per mode over
    every prompt, then each mode's own tables. Empty when the run evaluated one mode only."""
    if not modes:
        return ""
    if modes.get("status") == "not run":
        return f"\n## By chat-template mode\n\nNot run: {modes.get('hf_loop_reason')}.\n"
    cols = columns(rows)
    by = {(r["mode"], *_key(r, "k", "set", "domain")): r for r in rows}
    out = ["\n## By chat-template mode\n\n",
           "A drafter trained in one mode of the template (thinking on, say) can collapse in another, so "
           f"each mode was evaluated on the same prompts rendered its way. τ at k = {k} over every prompt:\n\n",
           "| mode | template arguments | " + " | ".join(_label(*c) for c in cols) + " |\n",
           "|---" * (len(cols) + 2) + "|\n"]
    for m, v in modes["modes"].items():
        out.append(f"| {m} | `{json.dumps(v.get('chat_template_kwargs'))}` | "
                   + " | ".join(_fmt(by.get((m, *c, k, "all", "all"))) for c in cols) + " |\n")
    for m in modes["modes"]:
        out += [f"\n### {m}\n\n", matrix_tables([r for r in rows if r["mode"] == m], k)]
    return "".join(out)


def _num(x) -> str:
    return f"{x:.3f}" if isinstance(x, (int, float)) else "—"


def front_matter(base_model: str, datasets: list[str], tags: list[str]) -> str:
    import yaml

    meta = {"base_model": base_model, "library_name": "vllm", "pipeline_tag": "text-generation",
            "tags": tags, "datasets": datasets, "metrics": ["acceptance_length"]}
    return "---\n" + yaml.safe_dump(meta, sort_keys=False) + "---\n"


def vllm_snippet(base_model: str, drafter_dir: str, k: int, serving: dict, method: str = "eagle3",
                 extra: dict | None = None) -> str:
    s = serving or {}
    spec = speculative_config_text(method, "DRAFTER", k, extra)
    tp = int(s.get("tensor_parallel_size", schema.default("target.vllm.tensor_parallel_size")))
    return f'''```python
{SNIPPET_MARK}: the drafter served by vLLM's Python API
from vllm import LLM, SamplingParams

TARGET = "{base_model}"  # the target: its hub name or a local folder of the same checkpoint
DRAFTER = "{drafter_dir}"  # this folder

if __name__ == "__main__":  # vLLM starts worker processes that import this file again
    llm = LLM(model=TARGET, dtype="{s.get("dtype", "auto")}", max_model_len=2048,
              tensor_parallel_size={tp},
              enforce_eager=True,  # CPU: no graph capture; drop it on GPUs
              speculative_config={spec})
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=32))
    print(out[0].outputs[0].text)
```
'''


def speculative_config_text(method: str, model: str, k: int, extra: dict | None = None) -> str:
    """vLLM's speculative config as Python source, ``model`` a name in the snippet (extra: the kind's keys,
    P-EAGLE's ``parallel_drafting``)."""
    more = "".join(f", {json.dumps(key)}: {v!r}" for key, v in (extra or {}).items())
    return f'{{"method": "{method}", "model": {model}, "num_speculative_tokens": {k}{more}}}'


def speculative_config(drafter_dir: str, k: int, method: str = "eagle3", extra: dict | None = None) -> str:
    return json.dumps({"method": method, "model": drafter_dir, "num_speculative_tokens": k, **(extra or {})})


def vllm_serve_command(base_model: str, drafter_dir: str, k: int, method: str = "eagle3",
                       extra: dict | None = None) -> str:
    """vLLM's server with the drafter (README.md shows the same line: tests/report/test_card.py)."""
    return f"vllm serve {base_model} --speculative-config '{speculative_config(drafter_dir, k, method, extra)}'"


def sglang_command(base_model: str, drafter_dir: str, k: int) -> str:
    """SGLang's server with the drafter: k chained drafts, one per step (top-1), k + 1 tokens verified."""
    return (f"python -m sglang.launch_server --model-path {base_model} --speculative-algorithm EAGLE3 \\\n"
            f"    --speculative-draft-model-path {drafter_dir} --speculative-num-steps {k} \\\n"
            f"    --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}")


def card(drafter_dir: str | Path, identity: dict, evaluation: dict | None, train: dict, tokenize: dict,
         vocab: dict, prompts: dict, base_model: str | None = None, serving: dict | None = None,
         shown_dir: str | None = None) -> str:
    d = Path(drafter_dir)
    conf = read_json(d / "config.json")
    if is_dflash(conf) or conf.get("parallel_drafting") is True:  # DFlash, P-EAGLE
        return block_card(d, conf, identity, evaluation, train, tokenize, prompts, base_model, serving, shown_dir)
    contract = read_json(d / "contract.json")
    ref = read_json(d / "reference.json") if (d / "reference.json").exists() else {}
    base = base_model or identity.get("name")
    shown = shown_dir or str(d)
    ev = evaluation or {}
    h = ev.get("headline") or {}
    k = int(h.get("k") or conf.get("eaglet", {}).get("num_speculative_tokens") or 3)
    source = prompts.get("source")
    datasets = [DATASETS[source]] if source in DATASETS else []
    datasets += [EVAL_DATASETS[s] for s in ("mtbench", "humaneval") if any(
        str(r.get("set")) == s for r in ev.get("matrix") or [])]
    ids = conf.get("eagle_aux_hidden_state_layer_ids")
    best = train.get("best_val") or train.get("final_val") or {}
    checks = contract.get("checks") or []
    passed = sum(c.get("ok") is True for c in checks)
    acc = next((c for c in checks if c["name"] == "vllm.acceptance"), None)
    digests = contract.get(DIGESTS_KEY) or {}
    parts = [front_matter(base, datasets, ["speculative-decoding", "eagle3", "draft-model", "eaglet"]),
             f"\n# EAGLE-3 drafter for {base}\n\n",
             f"A one-layer EAGLE-3 draft model that proposes tokens for `{base}` to verify, k = {k} at a time "
             f"(speculative decoding in vLLM or SGLang: the output is the target's own, faster when enough "
             f"drafts are accepted). It reads the target's hidden states entering layers {ids} (vLLM's "
             f"convention), shares the target's token embedding, and drafts over a vocabulary of "
             f"{conf.get('draft_vocab_size')} of the target's {conf.get('vocab_size')} tokens "
             f"(`d2t` maps them back). Trained for the target whose weights digest is "
             f"`{identity.get('digest')}`; made by eaglet.\n\n",
             "## The data it saw\n\n",
             f"- prompts: {source} ({prompts.get('train')} training conversations, {prompts.get('heldout')} held out); "
             f"answers: {tokenize.get('samples_processed')} samples, {tokenize.get('total_tokens'):,} tokens, "
             f"{tokenize.get('total_assistant_tokens'):,} of them the assistant's (the loss is on these)\n",
             f"- draft vocabulary: {vocab.get('draft_vocab_size')} tokens covering "
             f"{100 * float(vocab.get('coverage') or 0):.2f} % of the assistant tokens\n",
             f"- training: {train.get('steps')} steps on {train.get('train_samples')} samples, kept step "
             f"{best.get('step')}; validation chain τ {_num(best.get(f'chain_tau_{k}', best.get('chain_tau')))} "
             f"at k = {k}\n\n",
             "## Results\n\n", matrix_tables(ev.get("matrix") or [], k),
             "\nEngines: the exact chain replays greedy drafting along the target's greedy text; the "
             "expected chain is each draft's acceptance probability along its sampled text, under each "
             "rule vLLM serves (greedy drafts: p(argmax q); sampled drafts: Σ min(p, q)); the HF loop "
             "(sampled drafts) and vLLM (each `draft_sample_method`) are measured runs.\n",
             serving_recommendation(ev.get("matrix") or [], k),
             verifier_fix_line(h.get("vllm_verifier_fix")),
             f"\n{h.get('recommendation') or ''}\n",
             modes_section(ev.get("modes"), ev.get("modes_matrix") or [], k),
             "\n## The export contract\n\n",
             f"{'Passed' if contract.get('ok') else 'FAILED'}: {passed} of {len(checks)} checks pass"
             + (f"; not run: {[r['name'] for r in contract.get('not_run') or []]}" if contract.get("not_run") else "")
             + ".",
             (f" vLLM's acceptance: τ {acc['details'].get('served_tau')} served vs "
              f"{acc['details'].get('simulated_tau')} simulated on the same text ({acc['status']})."
              if acc and acc["details"].get("served_tau") is not None else ""),
             "\n\n## Files\n\n| file | sha256 |\n|---|---|\n",
             "".join(f"| `{n}` | `{v}` |\n" for n, v in sorted(digests.items())),
             "\n`reference.json` holds every tensor's digest and eaglet's drafting on fixed prompts, so "
             "that the folder proves itself (below).\n\n",
             "## Serve it\n\nvLLM, Python:\n\n", vllm_snippet(base, shown, k, serving or {}),
             f"\nvLLM, server:\n\n```bash\n{vllm_serve_command(base, shown, k)}\n```\n",
             f"\nSGLang:\n\n```bash\n{sglang_command(base, shown, k)}\n```\n",
             "\n## Check a copy\n\n```bash\n"
             f"python -m eaglet.export.contract {shown} --identity <the target's identity.json> --vllm\n```\n\n"
             "Without the trainer's file it checks the tensors' digests and reruns the recorded drafting"
             + (f" ({ref['chain']['rounds']} rounds on {len(ref['chain']['prompt_token_ids'])} prompts)"
                if ref.get("chain") else "") + "; with `--vllm`, vLLM's acceptance against it.\n"]
    return "".join(parts)


def _contract_lines(contract: dict) -> str:
    checks = contract.get("checks") or []
    passed = sum(c.get("ok") is True for c in checks)
    return (f"{'Passed' if contract.get('ok') else 'FAILED'}: {passed} of {len(checks)} checks pass"
            + (f"; not run: {[r['name'] for r in contract.get('not_run') or []]}" if contract.get("not_run") else "")
            + ".")


def _not_conclusive(x: dict) -> str:
    return " (not conclusive" + (": " + x["note"] if x.get("note") else "") + ")"


def block_card(d: Path, conf: dict, identity: dict, evaluation: dict | None, train: dict, tokenize: dict,
               prompts: dict, base_model: str | None, serving: dict | None, shown_dir: str | None) -> str:
    """The card of a block-parallel drafter, DFlash or P-EAGLE (the module docstring)."""
    contract = read_json(d / "contract.json")
    base = base_model or identity.get("name")
    shown = shown_dir or str(d)
    ev = evaluation or {}
    h = ev.get("headline") or {}
    dflash = is_dflash(conf)
    if dflash:
        bs = int(conf["block_size"])
        k = bs - 1
        taps = [i + 1 for i in (conf.get("dflash_config") or {}).get("target_layer_ids") or []]
        name, tag, chain, val = "DFlash", "dflash", "block chain", ("val_block_tau", "block τ")
        extra: dict = {}
        what = (f"A {conf.get('num_hidden_layers')}-layer DFlash (block-parallel) draft model for `{base}`, block "
                f"size {bs}: one drafter forward proposes a whole block of k = block_size − 1 = {k} tokens after "
                f"the target's last token, which vLLM serves with `method: dflash` at `num_speculative_tokens` {k} "
                f"(the only k it takes). It reads the target's hidden states entering layers {taps} (vLLM's "
                f"convention; `dflash_config.target_layer_ids` holds DFlash's ids, one less), uses the target's "
                f"own embedding and head, and fills a block with mask token "
                f"{conf['dflash_config'].get('mask_token_id')}. Trained for the target whose weights digest is "
                f"`{identity.get('digest')}`; made by eaglet (drafter.kind dflash).\n\n")
        loop = "one block per round, drafts sampled from the block's q at T > 0"
        loop_note = ("A round of the HF loop drafts no further than max_new_tokens, where vLLM's drafts a whole "
                     "block, so on short texts its τ is a little below the exact chain's.\n\n")
    else:  # P-EAGLE: an EAGLE-3 folder served with parallel drafting (eaglet.export.p_eagle_format)
        k = int((conf.get("eaglet") or {}).get("num_speculative_tokens") or h.get("k") or 0)
        name, tag, chain, val = "P-EAGLE", "p-eagle", "parallel chain", ("val_parallel_tau", "parallel τ")
        extra = {"parallel_drafting": True}
        what = (f"A one-layer EAGLE-3 draft model for `{base}` trained for **parallel drafting** (P-EAGLE): one "
                f"drafter forward proposes all k = {k} tokens of a round (the first from the target's states, "
                f"the others from mask token {conf.get('mask_token_id')} with the trained `mask_hidden`), which "
                f"vLLM serves with `method: eagle3`, `parallel_drafting: true` at `num_speculative_tokens` {k} "
                f"(the k it was trained for). It reads the target's hidden states entering layers "
                f"{conf.get('eagle_aux_hidden_state_layer_ids')} (vLLM's convention), shares the target's token "
                f"embedding, and drafts over a vocabulary of {conf.get('draft_vocab_size')} of the target's "
                f"{conf.get('vocab_size')} tokens (`d2t` maps them back). Trained for the target whose weights "
                f"digest is `{identity.get('digest')}`; made by eaglet (drafter.kind p_eagle).\n\n")
        loop = "one drafter forward per round, each slot's draft sampled from its own q at T > 0"
        loop_note = ("A round of the HF loop drafts no further than max_new_tokens, where vLLM's drafts all k "
                     "slots, so on short texts its τ is a little below the exact chain's.\n\n")
    source = prompts.get("source")
    datasets = [DATASETS[source]] if source in DATASETS else []
    datasets += [EVAL_DATASETS[s] for s in ("mtbench", "humaneval") if any(
        str(r.get("set")) == s for r in ev.get("matrix") or [])]
    sel = train.get("selected") or {}
    secs = train.get("seconds_this_run")
    eq = (ev.get("served_vs_offline_chain") or {}).get("equal")
    digests = contract.get(DIGESTS_KEY) or {}
    hf = "".join(f"- HF loop (eaglet's timed loop on the HF target) paired speedup over plain decoding at T = "
                 f"{x['temperature']:g}{' (sampled drafts)' if x.get('rule') else ''}: {_num(x.get('estimate'))}"
                 f" [{_num(x.get('lo'))}, {_num(x.get('hi'))}]{'' if x.get('conclusive') else _not_conclusive(x)}\n"
                 for x in h.get("speedup_hf_loop_by_temperature") or [])
    if h.get("lossless_hf_loop") is not None:
        hf += (f"- lossless at T = 0 in the HF loop (k = {', '.join(map(str, h.get('hf_loop_k_values') or [k]))}): "
               f"{'yes' if h['lossless_hf_loop'] else 'NO'}; its rounds "
               f"{'equal' if h.get('offline_matches_real_loop') else 'DIFFER from'} eaglet's {chain}'s\n")
    speed = "".join(f"- vLLM paired speedup at T = {x['temperature']:g} ({x['rule']} drafts): {_num(x.get('estimate'))}"
                    f" [{_num(x.get('lo'))}, {_num(x.get('hi'))}]"
                    f"{'' if x.get('conclusive') else _not_conclusive(x)}\n"
                    for x in h.get("speedup_vllm_by_temperature") or [])
    method = "dflash" if dflash else "eagle3"
    parts = [front_matter(base, datasets, ["speculative-decoding", tag, "draft-model", "eaglet"]),
             f"\n# {name} drafter for {base}\n\n", what,
             "## The data it saw\n\n",
             f"- prompts: {source} ({prompts.get('train')} training conversations, {prompts.get('heldout')} held "
             f"out); answers: {tokenize.get('samples_processed')} samples, {tokenize.get('total_tokens'):,} tokens\n",
             f"- training: {train.get('steps')} steps on {train.get('train_samples')} samples"
             f"{f' in {secs / 60:.1f} min' if secs is not None else ''}, kept step {sel.get('step')}; validation "
             f"{val[1]} {_num(sel.get(val[0]))}\n\n",
             "## Results\n\n", matrix_tables(ev.get("matrix") or [], k),
             f"\nEngines: the exact chain is the {chain} vLLM's {name} proposer runs at T = 0 along the "
             "target's greedy text; the expected chain is each draft position's acceptance probability along "
             "the target's sampled text under each rule vLLM serves; "
             + f"the HF loop (eaglet's, {loop}) and vLLM are measured. " + loop_note,
             hf, speed,
             (f"- vLLM's counters at T = 0 {'equal' if eq else 'DIFFER from'} the offline {chain}'s\n"
              if eq is not None else ""),
             (f"- lossless at T = 0 in vLLM: {'yes' if h.get('lossless_vllm') else 'NO'}\n"
              if h.get("lossless_vllm") is not None else ""),
             (f"- at T > 0 vLLM's acceptance {'agrees' if h.get('vllm_t_gt0_agrees_with_rule') else 'DIFFERS'} "
              "with the rule it serves (expected along the target's text)"
              + ("" if h.get("vllm_t_gt0_agrees_with_rule") else
                 f": vLLM's {name} departs from its rule here, so the T > 0 figures describe vLLM as "
                 "served, not a decoder checked lossless in distribution") + "\n"
              if h.get("vllm_t_gt0_agrees_with_rule") is not None else ""),
             f"- not measured: {h.get('hf_loop_reason')}\n" if h.get("hf_loop") == "not run" else "",
             verifier_fix_line(h.get("vllm_verifier_fix")),
             "\n## The export contract\n\n", _contract_lines(contract),
             "\n\n## Files\n\n| file | sha256 |\n|---|---|\n",
             "".join(f"| `{n}` | `{v}` |\n" for n, v in sorted(digests.items())),
             "\n## Serve it\n\nvLLM, Python:\n\n", vllm_snippet(base, shown, k, serving or {}, method, extra),
             f"\nvLLM, server:\n\n```bash\n{vllm_serve_command(base, shown, k, method, extra)}\n```\n",
             f"\nSGLang: not checked by eaglet for a {name} folder.\n"]
    return "".join(parts)


def is_dflash(conf: dict) -> bool:
    """Whether a drafter's config.json names a DFlash architecture."""
    return any(str(a).startswith("DFlash") for a in conf.get("architectures") or [])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    for name in ("drafter-dir", "identity", "train", "tokenize", "vocab", "prompts"):
        p.add_argument(f"--{name}", required=True)
    p.add_argument("--evaluation", default=None, help="eval/summary.json (optional)")
    p.add_argument("--config", default=None, help="JSON: base_model, serving, shown_dir")
    p.add_argument("--log", default=None)
    a = p.parse_args(argv)
    setup_logging(a.log)
    o = parse_json_arg(a.config, {})
    text = card(a.drafter_dir, read_json(a.identity), read_json(a.evaluation) if a.evaluation else None,
                read_json(a.train), read_json(a.tokenize), read_json(a.vocab), read_json(a.prompts),
                base_model=o.get("base_model"), serving=o.get("serving"), shown_dir=o.get("shown_dir"))
    out = Path(a.drafter_dir) / "README.md"
    tmp = out.with_suffix(".md.tmp")
    tmp.write_text(text)
    tmp.replace(out)
    log.info("model card: %s (%d lines)", out, text.count("\n"))


if __name__ == "__main__":
    main()
