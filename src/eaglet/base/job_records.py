"""Snakemake's own records of the jobs of a run (library): when each ran, read from
``.snakemake/metadata``. Provenance writes them into provenance.json; the learning curve prices more
data with them."""

from __future__ import annotations

import base64
import json
from pathlib import Path


def stage_times(run_dir: Path, workdir: Path = Path(".")) -> list[dict]:
    """Wall time per job from Snakemake's own metadata (.snakemake/metadata holds one record per
    output file, named by the base64 of its path)."""
    meta_dir = workdir / ".snakemake" / "metadata"
    seen: dict[tuple, dict] = {}
    if not meta_dir.is_dir():
        return []
    for f in meta_dir.iterdir():
        try:
            path = base64.b64decode(f.name.replace("@", "/") + "==", altchars=b"+/").decode()
            rec = json.loads(f.read_text())
        except (ValueError, UnicodeDecodeError, OSError):
            continue
        if not path.startswith(str(run_dir)) and not path.startswith("resources/"):
            continue
        start, end = rec.get("starttime"), rec.get("endtime")
        key = (rec.get("rule"), int(start or 0), int(end or 0))  # one job, several outputs
        if rec.get("rule") and start and end and key not in seen:
            seen[key] = {"rule": rec["rule"], "seconds": round(end - start, 1), "output": path,
                         "start": round(start, 1), "end": round(end, 1)}
    return sorted(seen.values(), key=lambda r: r["output"])
