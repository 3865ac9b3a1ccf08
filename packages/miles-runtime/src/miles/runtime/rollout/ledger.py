"""The sample ledger: every sample id is handed out here and ends in exactly one place.

Ids are unique over the run (and checkpointed). When a step is taken, each of its samples is
written to `samples.jsonl` with its fate: trained, filtered, or stale (dropped for being too old),
its status and, for a failed sample, the error.
The running counts become the `samples/*` metrics.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from miles.core.contracts.protocols import PromptGroup
from miles.core.contracts.types import Sample

Fate = Literal["trained", "filtered", "stale"]


class SampleLedger:
    def __init__(self, path: Path | None) -> None:
        self.path = path  # None: keep counts, write nothing
        self.next_sample_id = 0
        self.next_group_id = 0
        self.counts = {"created": 0, "trained": 0, "filtered": 0, "stale": 0}

    def new_groups(
        self, rows: list[dict[str, Any]], prompts: list[list[int]], samples_per_prompt: int
    ) -> list[PromptGroup]:
        """One group per row, with fresh group and sample ids."""
        groups = []
        for row, ids in zip(rows, prompts, strict=True):
            first = self.next_sample_id
            self.next_sample_id += samples_per_prompt
            groups.append(
                PromptGroup(
                    group_id=self.next_group_id,
                    prompt_ids=ids,
                    row=row,
                    sample_ids=list(range(first, self.next_sample_id)),
                )
            )
            self.next_group_id += 1
        self.counts["created"] += len(groups) * samples_per_prompt
        return groups

    def record(self, samples: list[Sample], step: int, fate: Fate) -> None:
        """One line per sample in samples.jsonl: where each id ended."""
        self.counts[fate] += len(samples)
        if self.path is None or not samples:
            return
        with self.path.open("a") as f:
            for s in samples:
                versions = (
                    s.weight_version if isinstance(s.weight_version, list) else [s.weight_version]
                )
                row = {
                    "sample_id": s.sample_id,
                    "group_id": s.group_id,
                    "step": step + 1,  # numbered from 1, as metrics.jsonl
                    "fate": fate,
                    "reward": s.reward,
                    "weight_versions": [min(versions, default=0), max(versions, default=0)],
                    "status": s.status.value,
                }
                if s.error:  # why it failed (an agent's refused call names its reason)
                    row["error"] = s.error
                f.write(json.dumps(row) + "\n")

    def metrics(self) -> dict[str, float]:
        return {f"samples/{k}": float(v) for k, v in self.counts.items()}

    def get_state(self) -> dict[str, Any]:
        return {
            "next_sample_id": self.next_sample_id,
            "next_group_id": self.next_group_id,
            "counts": dict(self.counts),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        self.next_sample_id = int(state["next_sample_id"])
        self.next_group_id = int(state["next_group_id"])
        self.counts.update(state.get("counts", {}))
