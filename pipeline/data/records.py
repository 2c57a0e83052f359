"""A stored stage record: what one stage stores for the next, as a frozen record per JSON document.

    buffer/<run>/step-000123/_manifest.json   BufferRecord       (buffer_record.py) the drafter_buffer asset
                                                                 -> training
    drafter/<run>/step-000123.json            TrainingRecord     (training_record.py) the drafter asset
                                                                 -> acceptance, reports
    acceptance/<run>/step-000123.json         AcceptanceRecord   (acceptance_record.py) the acceptance asset
                                                                 -> reports, plots
    cost/<run>/step-000123.json               StepCost           (pipeline/accounting/cost.py) the acceptance asset
                                                                 -> schedules, the ledger
    replay/<run>/step-000123.json             RolloutReplay      (replay_record.py) the acceptance asset
                                                                 -> the ledger, reports, plots
    placement/<run>/step-000123/<stage>.json  StagePlacement     (stage_placement.py) a launched stage's worker
                                                                 -> its asset, the ledger
    fleet/<run>/state.json                    FleetState         (fleet_state.py) the fleet asset
                                                                 -> status, the demo, the ledger
    refresh/<run>/step-000123.json            RefreshRecord      (refresh_record.py) the refresh job
                                                                 -> tail tau, reports
    tail/<run>/step-000123.json               TailTau            (refresh_record.py) the acceptance asset
                                                                 -> reports, MLflow
    (not stored)                              DeployReport       (fleet_state.py) a rolling deploy -> the fleet asset

Each record writes `schema_version` into its JSON; a document without one is version 1 (what
was stored before records carried it). A document this code cannot read raises RecordError
naming its key. A record reads its fields with the readers here: a stored record is untrusted input.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from pipeline.data.rollouts import INT64_MAX, finite_number
from pipeline.data.store import ObjectStore

SCHEMA_VERSION = 1


class RecordError(ValueError):
    """A stored record that this code cannot read (another schema version, a missing or mistyped field)."""


class _Record(Protocol):
    def to_json(self) -> dict: ...

    @classmethod
    def from_json(cls, doc: dict) -> Any: ...


R = TypeVar("R", bound=_Record)
T = TypeVar("T")


def typed(value: Any, kind: type, field: str) -> Any:
    """`value` if it is a `kind` (a bool is no int here); TypeError naming the field otherwise: a stored record is
    read as untrusted input (parse_record names the key)."""
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TypeError(f"field {field} must be a {kind.__name__}, not {type(value).__name__}")
    return value


def number(value: Any, field: str) -> float:
    """A finite number as a float; ValueError naming the field for NaN, an infinity or an integer too large for a
    float (a stored number of hundreds of digits)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"field {field} must be a number, not {type(value).__name__}")
    finite = finite_number(value)
    if finite is None:
        raise ValueError(f"field {field} must be a finite number")
    return finite


def integer(value: Any, field: str, low: int = 0) -> int:
    """An integer in [low, 2**63 - 1] (what the pipeline stores as int64: steps, counts, sizes)."""
    typed(value, int, field)
    if not low <= value <= INT64_MAX:
        raise ValueError(f"field {field} must be an integer in [{low}, 2**63 - 1]")
    return value


def optional(value: Any, read: Callable[[Any, str], T], field: str) -> T | None:
    return None if value is None else read(value, field)


def text(value: Any, field: str) -> str:
    return typed(value, str, field)


def flag(value: Any, field: str) -> bool:
    return typed(value, bool, field)


def numbers(value: Any, field: str) -> tuple[float, ...]:
    return tuple(number(v, f"{field}[{i}]") for i, v in enumerate(typed(value, list, field)))


def integers(value: Any, field: str) -> tuple[int, ...]:
    return tuple(integer(v, f"{field}[{i}]") for i, v in enumerate(typed(value, list, field)))


def write_record(store: ObjectStore, key: str, record: _Record) -> None:
    store.write_json(key, {"schema_version": SCHEMA_VERSION, **record.to_json()})


def read_record(store: ObjectStore, key: str, kind: type[R]) -> R:
    """`kind` read from `key`; RecordError naming the key when the document is not one this code reads."""
    return parse_record(store.read_json(key), kind, key)


def parse_record(doc: object, kind: type[R], where: str) -> R:
    if not isinstance(doc, dict):
        raise RecordError(f"{where}: not a JSON object, cannot read it as a {kind.__name__}")
    version = doc.get("schema_version", 1)
    if version != SCHEMA_VERSION:
        raise RecordError(f"{where}: {kind.__name__} schema_version {version!r}; this code reads version "
                          f"{SCHEMA_VERSION}")
    try:
        return kind.from_json(doc)
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise RecordError(f"{where}: not a {kind.__name__} of schema_version {SCHEMA_VERSION} "
                          f"({type(exc).__name__}: {exc})") from None
