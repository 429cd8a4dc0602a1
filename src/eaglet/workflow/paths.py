"""Where a run writes (``Paths``): its results and logs folders and the target's folder and identity,
from the config's ``run`` and ``target.name`` alone. The rule files bind them from the resolved config
(``R.paths``); the stage table (eaglet.workflow.stages) renders the same paths with placeholders.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Paths:
    """Where a run writes: its results and logs, and the target's folder and identity."""

    run: str  # results/<run>
    logs: str  # logs/<run>
    target_dir: str  # resources/targets/<target.name>
    target_id: str  # its identity.json (written once by target_model)

    @classmethod
    def of(cls, config: dict) -> Paths:
        target_dir = f"resources/targets/{config['target']['name']}"
        return cls(run=f"results/{config['run']}", logs=f"logs/{config['run']}", target_dir=target_dir,
                   target_id=f"{target_dir}/identity.json")
