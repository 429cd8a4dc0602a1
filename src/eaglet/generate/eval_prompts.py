"""The prompts the target regenerates for the evaluation: the evaluation and validation sets (MT-Bench's
questions, this run's held-out prompts, ...) once per evaluation temperature, as a conversation Parquet
that eaglet.generate.generate answers through the live server like the training prompts
(workflow/rules/generate.smk, rule ``generate_eval``). The drafter is then scored along the target's
own answers (eaglet.eval.regenerated): the text it faces when served.

    python -m eaglet.generate.eval_prompts --sets '["mtbench", "results/RUN/prompts/heldout.parquet"]' \
        --num-prompts '{"mtbench": null, "heldout": null}' --temperatures '[0.0, 1.0]' \
        --out results/RUN/generate_eval/prompts.parquet [--log LOG]

Each row: ``id`` = ``<set>|<T>|<the set's id>`` (eaglet.base.datasets.row_id; row_key reads it
back), ``source`` = the domain (MT-Bench's category, else the set), ``messages`` = the prompt up
to its last user turn, and ``temperature``: the backends ask for that row at its own
temperature (seeded per row above 0).
"""

from __future__ import annotations

import argparse
import logging

from eaglet.base import datasets
from eaglet.base.files import write_parquet
from eaglet.base.logs import setup_logging
from eaglet.base.settings_files import parse_json_arg

log = logging.getLogger("eaglet.generate.eval_prompts")


def build(sets: list[str], num_prompts, temperatures: list[float], digests=()) -> list[dict]:
    """``digests``: ``(path, content digest)`` pairs of the user's .parquet sets, checked before reading."""
    if not temperatures:
        raise ValueError("eval_prompts: no temperatures")
    rows, want = [], dict(digests or ())
    for spec in sets:
        name = datasets.set_name(spec)
        for r in datasets.load_set(spec, datasets.count_for(num_prompts, name), want.get(spec, "")):
            for t in temperatures:
                rows.append({"id": datasets.row_id(name, t, r["id"]), "source": datasets.domain(name, r),
                             "messages": r["messages"], "temperature": float(t)})
    if not rows:
        raise ValueError(f"eval_prompts: no prompts from sets {sets}")
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sets", required=True, help="JSON list: mtbench, humaneval, math, *.parquet")
    p.add_argument("--set-digests", default="[]",
                   help="JSON list of [path, content digest]: the user's .parquet sets as the parse hashed them")
    p.add_argument("--num-prompts", default="null", help="JSON: prompts per set (null = all), or set -> count")
    p.add_argument("--temperatures", required=True, help="JSON list of temperatures")
    p.add_argument("--out", required=True)
    p.add_argument("--log", default=None)
    a = p.parse_args(argv)
    setup_logging(a.log)
    rows = build(parse_json_arg(a.sets), parse_json_arg(a.num_prompts), parse_json_arg(a.temperatures),
                 parse_json_arg(a.set_digests))
    import pandas as pd

    write_parquet(a.out, pd.DataFrame(rows))
    log.info("eval_prompts: %d rows (%d prompts x %d temperatures) -> %s", len(rows),
             len(rows) // len(parse_json_arg(a.temperatures)), len(parse_json_arg(a.temperatures)), a.out)


if __name__ == "__main__":
    main()
