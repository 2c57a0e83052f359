"""The cross-step buffer's record: the samples a step's drafter trains on, as pointers into the steps' shards
(stored as buffer/<run>/step-N/_manifest.json; buffer.py selects and reads them)."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

from pipeline.data.records import integer, text, typed


@dataclass(frozen=True)
class BufferEntry:
    """One sample in the buffer, addressed by (step, sample_id) and found at (shard, row)."""

    step: int
    sample_id: str
    shard: str
    row: int
    tokens: int

    @classmethod
    def from_json(cls, doc: Any, field: str) -> BufferEntry:
        doc = typed(doc, dict, field)
        return cls(integer(doc["step"], f"{field}.step"), text(doc["sample_id"], f"{field}.sample_id"),
                   text(doc["shard"], f"{field}.shard"), integer(doc["row"], f"{field}.row"),
                   integer(doc["tokens"], f"{field}.tokens"))


def composition(entries: tuple[BufferEntry, ...] | list[BufferEntry]) -> dict[int, int]:
    """Samples per RL step, oldest step first."""
    return dict(sorted(Counter(e.step for e in entries).items()))


@dataclass(frozen=True)
class BufferRecord:
    """The samples a step's drafter trains on: pointers into the steps' shards, never a copy."""

    step: int
    entries: tuple[BufferEntry, ...]

    @property
    def num_samples(self) -> int:
        return len(self.entries)

    @property
    def num_tokens(self) -> int:
        return sum(e.tokens for e in self.entries)

    @property
    def composition(self) -> dict[int, int]:
        return composition(self.entries)

    def to_json(self) -> dict:
        return {"step": self.step, "num_samples": self.num_samples, "num_tokens": self.num_tokens,
                "composition": {str(k): v for k, v in self.composition.items()},
                "entries": [asdict(e) for e in self.entries]}

    @classmethod
    def from_json(cls, doc: dict) -> BufferRecord:
        return cls(integer(doc["step"], "step"), tuple(BufferEntry.from_json(e, f"entries[{i}]")
                                                   for i, e in enumerate(typed(doc["entries"], list, "entries"))))
