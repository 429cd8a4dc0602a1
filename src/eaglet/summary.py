"""Print the headline figures of a finished run (what `make run` ends with).

    python -m eaglet.summary results/smollm2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def lines(run_dir: Path) -> list[str]:
    out = [f"eaglet run {run_dir.name}:"]

    def load(rel):
        p = run_dir / rel
        return json.loads(p.read_text()) if p.exists() else None

    if (m := load("tokenize/metadata.json")):
        out.append(f"  tokenize   {m['samples_processed']} samples ({m['samples_skipped']} skipped), "
                   f"{m['total_tokens']:,} tokens, {m['total_assistant_tokens']:,} assistant tokens")
    if (v := load("vocab_map/vocab.json")):
        out.append(f"  vocab_map  coverage {100 * v['coverage']:.2f}% at draft vocab {v['draft_vocab_size']:,}"
                   f" of {v['vocab_size']:,} ({len(v['pinned'])} pinned tokens)")
    if (t := load("train/train_summary.json")):
        out.append("  train      " + ", ".join(f"{k} {t[k]}" for k in ("steps", "final_loss", "val_tau")
                                               if k in t))
    if (e := load("eval/summary.json")):
        out.append("  evaluate   " + json.dumps(e.get("headline", e))[:300])
    report = run_dir / "report.html"
    if report.exists():
        out.append(f"  report     {report}")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    a = p.parse_args(argv)
    print("\n".join(lines(Path(a.run_dir))))


if __name__ == "__main__":
    main()
