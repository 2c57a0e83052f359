"""A step published in parts: groups of rollouts written as they finish, before the step's commit.

    <root>/rollouts/<run>/step-000123/
    ├── parts/
    │   ├── _step.json           written with the first part, before its manifest: the step's policy
    │   │                        pointer, the rollouts the trainer expects, the policy's limits
    │   ├── part-0000.parquet    a part's rollouts (the rollouts.parquet schema)
    │   ├── part-0000.json       the part's manifest, written after its rollouts: the part's commit point
    │   └── ...
    ├── rollouts.parquet         at the commit: every part's rollouts, in part order
    └── policy.json              the step's commit point, with "parts": the part numbers it consists of

A part is validated exactly like a whole step (`pipeline.data.rollouts`), and against the parts
before it: no sample id twice in the step. Publishing a part is idempotent: the same content again
is a no-op, other content under the same part number is refused by name, and so is any new part of
a committed step (the commit never changes). Parts may arrive in any order; the trainer numbers them
as its groups finish, so the highest numbers are the step's tail. A reader sees a part only through
its manifest, and a step's parts only until `commit_parts` writes the step the way `publish_step`
does, so everything downstream of the commit reads the step as it reads any other.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass, replace

import pyarrow.parquet as pq

from pipeline.data.keys import (
    part_manifest_key,
    part_rollouts_key,
    parts_prefix,
    parts_step_key,
    policy_pointer_key,
    rollouts_key,
    step_key,
)
from pipeline.data.rollouts import (
    INT64_MAX,
    SCHEMA_VERSION,
    PolicyPointer,
    Rollout,
    RolloutsError,
    TargetLimits,
    check_step,
    finite_number,
    is_committed,
    parse_rollouts,
    pointer_record,
    read_policy_pointer,
    rollouts_table,
    validate_pointer,
    validate_rollouts,
)
from pipeline.data.store import ObjectStore

MAX_PART = 9999  # four digits in the key: a step of more parts than this is published whole


@dataclass(frozen=True)
class StepParts:
    """What the first part of a step fixes for all of them."""

    step: int
    pointer: PolicyPointer
    expected_rollouts: int  # the step's batch: the share a refresh waits for is of this
    limits: TargetLimits
    started_at: float  # when the first part's step record was written (epoch seconds)

    def to_json(self) -> dict:
        return {"schema_version": SCHEMA_VERSION, "step": self.step, "pointer": pointer_record(self.pointer),
                "expected_rollouts": self.expected_rollouts, "vocab_size": self.limits.vocab_size,
                "max_positions": self.limits.max_positions, "started_at": self.started_at}

    @classmethod
    def from_json(cls, doc: object, where: str, step: int) -> StepParts:
        """The record of step `step` as the trainer's client wrote it; every field checked again here (a reader
        trusts nothing only the writer checked): RolloutsError naming the field."""
        if not isinstance(doc, dict) or doc.get("schema_version") != SCHEMA_VERSION:
            raise RolloutsError(where, f"not a step record of schema_version {SCHEMA_VERSION}")
        missing = [k for k in ("step", "pointer", "expected_rollouts", "vocab_size", "started_at") if k not in doc]
        if missing:
            raise RolloutsError(where, f"missing key(s) {', '.join(missing)}")
        _require(doc["step"] == step and _is_int(doc["step"]), where, "step", f"is not this step's ({step})")
        _require(_is_int(doc["expected_rollouts"]) and 1 <= doc["expected_rollouts"] <= INT64_MAX, where,
                 "expected_rollouts", "must be a positive integer")
        _require(_is_int(doc["vocab_size"]) and 1 <= doc["vocab_size"] <= INT64_MAX, where, "vocab_size",
                 "must be a positive integer")
        positions = doc.get("max_positions")
        _require(positions is None or (_is_int(positions) and 1 <= positions <= INT64_MAX), where, "max_positions",
                 "must be a positive integer or null")
        _require(_is_time(doc["started_at"]), where, "started_at", "must be a time in epoch seconds")
        return cls(step, validate_pointer(doc["pointer"], where), doc["expected_rollouts"],
                   TargetLimits(doc["vocab_size"], positions), float(doc["started_at"]))


@dataclass(frozen=True)
class PartManifest:
    """One published part: its rows, their response tokens, its content digest and when it was committed."""

    step: int
    part: int
    rows: int
    response_tokens: int
    digest: str  # sha256 of the rollouts' content (ids, masks, float32 rewards, versions), in order
    published_at: float  # read back: when the store saw the manifest (its modification time)

    def to_json(self) -> dict:
        return {"schema_version": SCHEMA_VERSION, "step": self.step, "part": self.part, "rows": self.rows,
                "response_tokens": self.response_tokens, "digest": self.digest, "published_at": self.published_at}

    @classmethod
    def from_json(cls, doc: object, where: str, step: int, part: int) -> PartManifest:
        """The manifest of (step, part) as the trainer's client wrote it, checked again: its step and part are
        the ones its name says, its counts are counts, its digest a digest (its rows and tokens against the
        rollouts themselves in `read_part`). RolloutsError naming the field."""
        if not isinstance(doc, dict) or doc.get("schema_version") != SCHEMA_VERSION:
            raise RolloutsError(where, f"not a part manifest of schema_version {SCHEMA_VERSION}")
        missing = [k for k in ("step", "part", "rows", "response_tokens", "digest", "published_at") if k not in doc]
        if missing:
            raise RolloutsError(where, f"missing key(s) {', '.join(missing)}")
        _require(_is_int(doc["step"]) and doc["step"] == step, where, "step", f"is not this step's ({step})")
        _require(_is_int(doc["part"]) and doc["part"] == part, where, "part", f"is not the part its name says ({part})")
        _require(_is_int(doc["rows"]) and 1 <= doc["rows"] <= INT64_MAX, where, "rows", "must be a positive integer")
        _require(_is_int(doc["response_tokens"]) and doc["rows"] <= doc["response_tokens"] <= INT64_MAX, where,
                 "response_tokens", "must be an integer of at least one per row")
        _require(isinstance(doc["digest"], str) and _DIGEST.fullmatch(doc["digest"]) is not None, where, "digest",
                 "must be a sha256 in hex")
        _require(_is_time(doc["published_at"]), where, "published_at", "must be a time in epoch seconds")
        return cls(step, part, doc["rows"], doc["response_tokens"], doc["digest"], float(doc["published_at"]))


@dataclass(frozen=True)
class PublishedPart:
    manifest: PartManifest
    written: bool  # False: the identical part was there already (a retried call)


def content_digest(rollouts: Sequence[Rollout]) -> str:
    """The rollouts' content as Parquet reads it back (rewards as float32), independent of the file's bytes."""
    h = hashlib.sha256()
    for r in rollouts:
        for value in (r.sample_id.encode(), struct.pack(f"<{len(r.input_ids)}q", *r.input_ids),
                      struct.pack(f"<{len(r.loss_mask)}b", *r.loss_mask), struct.pack("<f", r.reward),
                      struct.pack("<q", r.policy_version)):
            h.update(struct.pack("<q", len(value)))
            h.update(value)
    return h.hexdigest()


def _check_part(part: object, where: str) -> int:
    if not isinstance(part, int) or isinstance(part, bool) or not 0 <= part <= MAX_PART:
        raise RolloutsError(where, f"part must be an integer in [0, {MAX_PART}], got {part!r}"
                            if isinstance(part, (int, bool)) else f"part must be an integer, got a "
                            f"{type(part).__name__}", None, "part")
    return part


def read_step_parts(store: ObjectStore, run: str, step: int) -> StepParts | None:
    key = parts_step_key(run, step)
    return StepParts.from_json(_read_json(store, key), store.uri(key), step) if store.exists(key) else None


def read_part_manifest(store: ObjectStore, run: str, step: int, part: int) -> PartManifest | None:
    """The part's manifest, its `published_at` the time the store saw it written (the order parts qualify in is
    the store's, not a time the writer put in the file)."""
    key = part_manifest_key(run, step, part)
    if not store.exists(key):
        return None
    return replace(PartManifest.from_json(_read_json(store, key), store.uri(key), step, part),
                   published_at=store.modified(key))


def published_parts(store: ObjectStore, run: str, step: int) -> list[PartManifest]:
    """The step's parts whose manifest is written, by part number: only manifests under a part's one name
    (`part-0001.json`; `part-1.json`, `part-01.json` or `part-².json` name no part and are not read, so no part
    counts twice); of a committed step, only the parts its commit lists (a manifest written after the commit
    is not one of the step's parts)."""
    numbers = sorted({int(m[1]) for name, _, _ in store.list_files(parts_prefix(run, step))
                      if (m := _PART_MANIFEST.fullmatch(name.rsplit("/", 1)[-1]))})
    if is_committed(store, run, step):
        listed = set(committed_part_numbers(store, run, step))
        numbers = [n for n in numbers if n in listed]
    return [m for n in numbers if (m := read_part_manifest(store, run, step, n)) is not None]


def read_part(store: ObjectStore, run: str, step: int, manifest: PartManifest,
              limits: TargetLimits | None = None) -> list[Rollout]:
    """A part's rollouts, validated, and checked against its manifest: the digest, the rows and the response
    tokens it claims (what qualifies a step for a refresh)."""
    key = part_rollouts_key(run, step, manifest.part)
    where = store.uri(key)
    rollouts = parse_rollouts(store.read_bytes(key), where, limits)
    if content_digest(rollouts) != manifest.digest:
        raise RolloutsError(where, "its rollouts do not match the digest of its manifest", None, "digest")
    tokens = sum(sum(r.loss_mask) for r in rollouts)
    if (len(rollouts), tokens) != (manifest.rows, manifest.response_tokens):
        raise RolloutsError(where, f"holds {len(rollouts)} rollouts of {tokens} response tokens; its manifest claims "
                                   f"{manifest.rows} of {manifest.response_tokens}", None, "rows")
    return rollouts


_PART_MANIFEST = re.compile(r"part-([0-9]{4})\.json")  # part_key's one spelling, ASCII digits only
_DIGEST = re.compile(r"[0-9a-f]{64}")


def _require(ok: bool, where: str, field: str, problem: str) -> None:
    if not ok:
        raise RolloutsError(where, problem, None, field)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_time(value: object) -> bool:
    seconds = finite_number(value)
    return seconds is not None and seconds >= 0


def _read_json(store: ObjectStore, key: str) -> object:
    """A trainer's JSON file; RolloutsError naming it when it is not JSON."""
    try:
        return json.loads(store.read_bytes(key))
    except (UnicodeDecodeError, ValueError):
        raise RolloutsError(store.uri(key), "not JSON this pipeline reads") from None


def write_part(
    store: ObjectStore, run: str, step: int, part: int, rollouts: Sequence[Rollout], pointer: PolicyPointer,
    expected_rollouts: int, limits: TargetLimits, now: float,
) -> PublishedPart:
    """Validate and write one part: its step record first (first part only), its rollouts, its manifest last.
    Checks the whole step publication would make, plus the parts before it (pointer, sample ids)."""
    check_step(step, store.uri(f"rollouts/{run}/step-?"))
    where = store.uri(part_rollouts_key(run, step, _check_part(part, store.uri(parts_prefix(run, step)))))
    if not isinstance(expected_rollouts, int) or isinstance(expected_rollouts, bool) or expected_rollouts < 1:
        raise RolloutsError(where, f"expected_rollouts must be a positive integer, got {expected_rollouts!r}", None,
                            "expected_rollouts")
    rollouts = list(rollouts)
    validate_rollouts(rollouts, where, limits)
    validate_pointer(pointer_record(pointer), where)
    digest = content_digest(rollouts)
    committed = is_committed(store, run, step)
    existing = read_part_manifest(store, run, step, part)
    if existing is not None:
        if existing.digest != digest:
            raise RolloutsError(where, f"part {part} of {step_key(step)} was published already with other content",
                                None, "part")
        if committed and part not in committed_part_numbers(store, run, step):
            raise _after_commit(where, step, part)
        _check_same_step(read_step_parts(store, run, step), pointer, expected_rollouts, where)
        return PublishedPart(existing, written=False)
    if committed:
        raise _after_commit(where, step, part)
    earlier = published_parts(store, run, step)
    step_parts = read_step_parts(store, run, step)
    if step_parts is None:
        step_parts = StepParts(step, pointer, expected_rollouts, limits, now)
        store.write_json(parts_step_key(run, step), step_parts.to_json())
    _check_same_step(step_parts, pointer, expected_rollouts, where)
    seen = {r.sample_id: m.part for m in earlier for r in read_part(store, run, step, m)}
    for r in rollouts:
        if r.sample_id in seen:
            raise RolloutsError(where, f"already published in part {seen[r.sample_id]} of the step", r.sample_id,
                                "sample_id")
    with store.open_write(part_rollouts_key(run, step, part)) as f:
        pq.write_table(rollouts_table(rollouts), f)
    manifest = PartManifest(step, part, len(rollouts), sum(sum(r.loss_mask) for r in rollouts), digest, now)
    store.write_json(part_manifest_key(run, step, part), manifest.to_json())
    return PublishedPart(read_part_manifest(store, run, step, part) or manifest, written=True)


def _after_commit(where: str, step: int, part: int) -> RolloutsError:
    return RolloutsError(where, f"{step_key(step)} is committed: a part published after the commit (part {part}) "
                                "would change it, and a committed step never changes", None, "part")


def _check_same_step(step_parts: StepParts | None, pointer: PolicyPointer, expected: int, where: str) -> None:
    if step_parts is None:
        return
    if step_parts.pointer != pointer:
        differs = [f for f in ("policy_version", "checkpoint_uri", "model_id")
                   if getattr(step_parts.pointer, f) != getattr(pointer, f)]
        raise RolloutsError(where, "the step's first part named another policy pointer", None, ", ".join(differs))
    if step_parts.expected_rollouts != expected:
        raise RolloutsError(where, f"the step's first part expected {step_parts.expected_rollouts} rollouts, this "
                                   f"part {expected}", None, "expected_rollouts")


def commit_parts(store: ObjectStore, run: str, step: int) -> list[int]:
    """Commit a step published in parts: rollouts.parquet from every part (in part order), then policy.json
    listing the parts. Committing again is a no-op; returns the parts the step consists of."""
    where = store.uri(parts_prefix(run, step))
    if is_committed(store, run, step):
        return committed_part_numbers(store, run, step)
    step_parts = read_step_parts(store, run, step)
    manifests = published_parts(store, run, step)
    if step_parts is None or not manifests:
        raise RolloutsError(where, "no part published: nothing to commit")
    rollouts = [r for m in manifests for r in read_part(store, run, step, m, step_parts.limits)]
    validate_rollouts(rollouts, store.uri(rollouts_key(run, step)), step_parts.limits)  # ids unique across parts
    with store.open_write(rollouts_key(run, step)) as f:
        pq.write_table(rollouts_table(rollouts), f)
    parts = [m.part for m in manifests]
    store.write_json(policy_pointer_key(run, step), {**pointer_record(step_parts.pointer), "parts": parts})
    return parts


def committed_part_numbers(store: ObjectStore, run: str, step: int) -> list[int]:
    """The parts a committed step lists in its policy.json; [] for a step published whole."""
    read_policy_pointer(store, run, step)  # validated as any commit is
    parts = store.read_json(policy_pointer_key(run, step)).get("parts", [])
    if not isinstance(parts, list) or not all(_is_int(p) and 0 <= p <= MAX_PART for p in parts):
        raise RolloutsError(store.uri(policy_pointer_key(run, step)), "must list part numbers", None, "parts")
    return parts


def step_progress(manifests: Sequence[PartManifest], expected_rollouts: int) -> float:
    """The share of the step's expected rollouts its parts hold."""
    return sum(m.rows for m in manifests) / expected_rollouts


@dataclass(frozen=True)
class Qualified:
    """The parts a refresh of `step` trains on: in publication order, up to the first reaching the share."""

    step: int
    part: int  # the qualifying part
    parts: tuple[int, ...]
    rows: int
    response_tokens: int
    qualified_at: float  # the qualifying part's publication (epoch seconds)
    step_parts: StepParts

    @property
    def pointer(self) -> PolicyPointer:
        return self.step_parts.pointer


def qualify(manifests: list[PartManifest], step_parts: StepParts, min_share: float,
            min_tokens: int = 0) -> Qualified | None:
    """The parts, in publication order, up to the first with which they hold `min_share` of the expected
    rollouts or `min_tokens` response tokens; None while they do not."""
    rows = tokens = 0
    taken = []
    for m in sorted(manifests, key=lambda m: (m.published_at, m.part)):
        rows, tokens = rows + m.rows, tokens + m.response_tokens
        taken.append(m.part)
        if rows >= min_share * step_parts.expected_rollouts or (min_tokens and tokens >= min_tokens):
            return Qualified(step_parts.step, m.part, tuple(taken), rows, tokens, m.published_at, step_parts)
    return None
