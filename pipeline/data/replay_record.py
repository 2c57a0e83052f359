"""A step's rollouts replayed per drafter as the acceptance asset stores it: the rollout speedup measured."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from pipeline.data.keys import replay_key
from pipeline.data.records import integer, number, optional, read_record, text, typed
from pipeline.data.store import ObjectStore
from pipeline.sampling import DRAFT_SAMPLE_METHODS, DraftSampleMethod, SamplingParams


@dataclass(frozen=True)
class ArmReplay:
    """One arm of a step's replay (evaluation/replay.py): the step's requests decoded with one drafter, or none."""

    version: str | None  # the registered drafter; None: no speculation
    seconds: float  # wall time, from the first request's prefill to the last completion
    tokens: int  # tokens generated, all requests together
    speculative_rows: int  # rows of speculative rounds (a request in a round counts once)
    plain_rows: int  # rows of plain rounds
    tau: float  # tokens a row got from a speculative round (1.0: none ran)
    tail_seconds: float  # the record's tail_batch longest requests decoded on their own
    tail_tokens: int
    threshold: int  # the batch threshold the arm's scheduler ended with
    # batch bucket -> seconds, tokens, rounds, speculative rounds: every run's rounds together
    by_batch: dict[int, tuple[float, int, int, int]] = field(default_factory=dict)
    # Every run's seconds, in the order the arms took turns (the figures above are the fastest run's): the spread
    runs_s: tuple[float, ...] = ()
    tail_runs_s: tuple[float, ...] = ()

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def tail_tokens_per_s(self) -> float:
        return self.tail_tokens / self.tail_seconds if self.tail_seconds > 0 else 0.0

    def to_json(self) -> dict:
        return {**asdict(self), "by_batch": {str(b): list(v) for b, v in self.by_batch.items()},
                "runs_s": list(self.runs_s), "tail_runs_s": list(self.tail_runs_s)}

    @classmethod
    def from_json(cls, doc: dict) -> ArmReplay:
        by_batch = {}
        for bucket, figures in typed(doc.get("by_batch", {}), dict, "by_batch").items():
            where = f"by_batch.{bucket}"
            seconds, tokens, rounds, speculative = typed(figures, list, where)
            by_batch[integer(int(bucket), f"{where} (its key)")] = (number(seconds, f"{where}[0]"),
                                                                    integer(tokens, f"{where}[1]"),
                                                                    integer(rounds, f"{where}[2]"),
                                                                    integer(speculative, f"{where}[3]"))
        return cls(optional(doc["version"], text, "version"), number(doc["seconds"], "seconds"),
                   integer(doc["tokens"], "tokens"), integer(doc["speculative_rows"], "speculative_rows"),
                   integer(doc["plain_rows"], "plain_rows"), number(doc["tau"], "tau"),
                   number(doc["tail_seconds"], "tail_seconds"), integer(doc["tail_tokens"], "tail_tokens"),
                   integer(doc["threshold"], "threshold"), by_batch,
                   *(tuple(number(x, f"{name}[{i}]") for i, x in enumerate(typed(doc.get(name, []), list, name)))
                     for name in ("runs_s", "tail_runs_s")))


@dataclass(frozen=True)
class RolloutReplay:
    """A step's rollouts replayed after the step on an idle decoder, one arm per drafter role, on the same requests
    and seeds: the rollout speedup measured. Arms: none (no drafter), baseline, served, cotrained."""

    step: int
    requests: int
    tokens: int  # tokens each arm generates
    tail_batch: int
    sampling: SamplingParams
    draft_sample_method: DraftSampleMethod
    arms: dict[str, ArmReplay]

    def batch_speedups(self, arm: str, over: str = "none", speculated: bool = False) -> dict[int, float]:
        """Per batch bucket both arms ran rounds at (batch-size buckets, scheduler.bucket): tokens/s of `arm` over
        `over`'s there; with `speculated`, only the buckets where `arm`'s scheduler chose to speculate (most of its
        rounds there speculative: its exploring rounds of the other kind aside)."""
        a, b = self.arms.get(arm), self.arms.get(over)
        if a is None or b is None:
            return {}
        def rates(replay: ArmReplay, speculated: bool) -> dict[int, float]:
            return {batch: tokens / seconds for batch, (seconds, tokens, rounds, speculative) in replay.by_batch.items()
                    if seconds > 0 and (not speculated or 2 * speculative > rounds)}

        mine, theirs = rates(a, speculated), rates(b, False)
        return {batch: mine[batch] / theirs[batch] for batch in sorted(mine.keys() & theirs.keys()) if theirs[batch]}

    def speedup(self, arm: str, over: str = "none", tail: bool = False) -> float | None:
        """Tokens per second of `arm` over `over`'s, over the whole step or its tail; None when either did not run
        (no such drafter, or no round in the tail)."""
        a, b = self.arms.get(arm), self.arms.get(over)
        if a is None or b is None:
            return None
        mine, theirs = (a.tail_tokens_per_s, b.tail_tokens_per_s) if tail else (a.tokens_per_s, b.tokens_per_s)
        return mine / theirs if mine > 0 and theirs > 0 else None

    def speedup_range(self, arm: str, over: str = "none", tail: bool = False) -> tuple[float, float] | None:
        """The least and the greatest speedup of `arm` over `over` run by run (run i of each: they took turns, so
        a burst of other work on the machine meets both alike); None without both arms' runs. Each arm generates
        the same tokens in every run, so a run's speedup is `over`'s seconds over `arm`'s."""
        a, b = self.arms.get(arm), self.arms.get(over)
        if a is None or b is None:
            return None
        mine, theirs = (a.tail_runs_s, b.tail_runs_s) if tail else (a.runs_s, b.runs_s)
        ratios = [t / m for m, t in zip(mine, theirs, strict=False) if m > 0 and t > 0]
        return (min(ratios), max(ratios)) if ratios else None

    @property
    def saved_s(self) -> float | None:
        """Rollout seconds the served drafter saved on the step: no speculation's wall time less the served arm's."""
        served, none = self.arms.get("served"), self.arms.get("none")
        return None if served is None or none is None else round(none.seconds - served.seconds, 4)

    def to_json(self) -> dict:
        return {"step": self.step, "requests": self.requests, "tokens": self.tokens, "tail_batch": self.tail_batch,
                "sampling": self.sampling.to_json(), "draft_sample_method": self.draft_sample_method,
                "arms": {arm: a.to_json() for arm, a in self.arms.items()}}

    @classmethod
    def from_json(cls, doc: dict) -> RolloutReplay:
        method = doc["draft_sample_method"]
        if method not in DRAFT_SAMPLE_METHODS:
            raise ValueError(f"draft_sample_method {method!r} is not one of {', '.join(DRAFT_SAMPLE_METHODS)}")
        return cls(*(integer(doc[f], f) for f in ("step", "requests", "tokens", "tail_batch")),
                   SamplingParams.from_json(doc["sampling"], "field sampling"),
                   method, {str(arm): ArmReplay.from_json(typed(a, dict, f"arms.{arm}"))
                            for arm, a in typed(doc["arms"], dict, "arms").items()})


def read_replay(store: ObjectStore, run: str, step: int) -> RolloutReplay | None:
    key = replay_key(run, step)
    return read_record(store, key, RolloutReplay) if store.exists(key) else None
