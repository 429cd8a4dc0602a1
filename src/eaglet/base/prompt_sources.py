"""What the prompts stage reads, by content: the key the workflow's parse puts in the prompts rule's
params (its cache key and rerun trigger) and the job checks again before reading, so that the same
name with new content reruns prompts and everything after it, and a renamed copy of the same data
keys the same.

- a local file or folder (``prompts.source: file``, or ``datasets`` with a local path that is no
  saved data set): its content digest, ``sha256:...`` (eaglet.base.content_digests);
- a data set saved with ``datasets``' ``save_to_disk`` (a folder with ``state.json``, or a
  ``DatasetDict``'s ``dataset_dict.json`` and one folder per split): the fingerprint ``datasets``
  recorded for it (of the split ``prompts.split``), ``datasets:<fingerprint>``;
- a ``datasets`` name (a data set in the ``datasets`` cache, loaded as ``HF_DATASETS_OFFLINE`` /
  ``HF_HUB_OFFLINE`` say): the fingerprint of the split ``datasets`` loads, which it derives from
  the data files it resolved (the hub commit), ``datasets:<fingerprint>``.

    key = source_key("datasets", "data/my_saved_set", "train")   # 'datasets:e07c7c702e59d9d6'
    check_source("datasets", "data/my_saved_set", "train", key, "prompts.path")   # the job, before reading
"""

from __future__ import annotations

import json
from pathlib import Path

from eaglet.base.artifacts import ArtifactError
from eaglet.base.content_digests import DigestCache, content_digest, verify_content

FINGERPRINT = "datasets:"


def saved_split(folder: str | Path, split: str) -> Path | None:
    """The folder of ``split`` when ``folder`` is a data set ``save_to_disk`` wrote (a Dataset: the
    folder itself; a DatasetDict: its split's folder), else None. A DatasetDict without that split is
    refused, naming the splits it has."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    if (folder / "dataset_dict.json").is_file():
        splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        if split not in splits:
            raise ValueError(f"prompts.split: {split!r} is not a split of the saved data set {folder} (it has "
                             f"{', '.join(map(str, splits)) or 'none'})")
        return folder / split
    return folder if (folder / "state.json").is_file() else None


def saved_fingerprint(split_folder: Path) -> str:
    """The fingerprint ``datasets`` recorded in a saved split's state.json (content-derived: the same
    rows saved twice give the same one)."""
    try:
        return str(json.loads((split_folder / "state.json").read_text())["_fingerprint"])
    except (OSError, ValueError, KeyError) as e:
        raise ArtifactError(f"{split_folder}/state.json: no fingerprint of a saved data set ({e})") from None


def load_named(name: str, split: str):
    """The split of a ``datasets`` name as ``datasets.load_dataset`` gives it (from its cache when
    offline), memory-mapped: iterating it holds one batch at a time."""
    try:
        import datasets
    except ImportError:
        raise RuntimeError("prompts.source 'datasets' needs the `datasets` package") from None
    try:
        return datasets.load_dataset(name, split=split)
    except Exception as e:  # the library's errors (offline, unknown name or split) are many kinds
        raise ValueError(f"prompts.path: the data set {name!r} (split {split!r}) cannot be loaded: "
                         f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def source_key(source: str, path: str | None, split: str, cache: DigestCache | None = None,
               base: str | Path = ".") -> str:
    """The key of what prompts reads (see the module docstring); "" for the packaged ShareGPT (the
    rule keys it by the package's recorded digest) and for a ``file`` source without a path (the
    parse refuses it). A relative local path is read from ``base``, the workflow folder."""
    if source == "sharegpt" or not path:
        return ""
    local = Path(base) / path
    if local.exists():
        saved = saved_split(local, split) if source == "datasets" else None
        if saved is not None:
            return FINGERPRINT + saved_fingerprint(saved)
        return content_digest(local, cache if cache is not None else DigestCache())
    if source == "datasets":
        return FINGERPRINT + str(load_named(path, split)._fingerprint)
    return ""


def check_source(source: str, path: str, split: str, want: str, key: str, cache: DigestCache | None = None) -> None:
    """Refuse a source that no longer has the key the parse recorded (``want``; ``key`` names the
    config key): read under the old content's cache key otherwise."""
    if not want:
        return
    if want.startswith("sha256:"):
        verify_content(path, want, key, cache)
        return
    have = source_key(source, path, split, cache)
    if have != want:
        raise ArtifactError(f"{key}: {path} (split {split!r}) changed after the workflow was parsed: its "
                            f"fingerprint is {have or 'none'}, the parse recorded {want}. Run snakemake again: "
                            "the stages that read it then rerun on what it holds now")
