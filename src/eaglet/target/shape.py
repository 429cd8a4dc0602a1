"""The target's layer count before anything is built, and the run's aux layer ids resolved from it:
read by the workflow alone at parse time (eaglet.workflow.resolve), so that the layer ids are a
plain param (compared by Snakemake's rerun trigger, in the cache key) and an id >= N stops
`snakemake -n` for every kind of target. No stage imports this module: the tiny families' specs it
reads are no code input of the stages.
"""

from __future__ import annotations

from eaglet.target.check import check_layer_ids, read_config, text_config


def num_layers(target: dict) -> int:
    """The target's layer count from what its config names, before anything is built: a tiny
    target's spec, a local folder's config.json, or a packaged GGUF's header. The workflow resolves
    the aux layer ids from it at parse time, so they are a plain param (compared by Snakemake's
    rerun trigger and in the cache key) and an id >= N stops `snakemake -n`."""
    from eaglet.target.load import DEFAULT_GGUF, gguf_num_layers, package_file

    if target.get("tiny") is not None:
        from eaglet.target.families import tiny_num_layers

        n = tiny_num_layers(target["tiny"])
        where = "target.tiny"
    elif target.get("path"):
        n = text_config(read_config(target["path"])).get("num_hidden_layers")
        where = f"target.path: {target['path']}/config.json"
    else:
        gguf = package_file(target.get("gguf_package") or DEFAULT_GGUF[0], target.get("gguf_file") or DEFAULT_GGUF[1])
        n = gguf_num_layers(gguf)
        where = f"target.gguf_file: {gguf}"
    if not isinstance(n, int) or n < 4:
        raise ValueError(f"{where}: num_hidden_layers {n!r} (an EAGLE-3 target needs at least 4 layers)")
    return n


def layer_ids(config: dict) -> list[int]:
    """The run's aux layer ids, resolved now: ``extract.layer_ids``, or vLLM's default for the
    target; a ValueError names extract.layer_ids when one is out of range."""
    return check_layer_ids(config.get("extract", {}).get("layer_ids"), num_layers(config["target"]))
