"""A step's rollouts replayed arm by arm: the rollout speedup measured, not modeled.

After the step, on an idle decoder (the evaluation's process, running the stand-in fleet's own
engine loop: `scheduler.schedule_round`), the step's requests are decoded again as a replica
decoded them: one replica's share of the step's rollouts (acceptance.replay_batch) submitted at
once, each ending at its rollout's length, each sampled at the rollouts' parameters from its own
seed, speculation round by round where it pays.
The same requests and seeds for every arm:

    none       no drafter: plain decoding, the baseline every speedup is over
    baseline   the first drafter, never retrained
    served     what the fleet ran when the step was published: what its rollouts got
    cotrained  the step's newest drafter

Each arm's wall time and tokens over the whole step (the full batch, shrinking as rollouts finish),
and over its tail: the `TAIL_BATCH` longest requests decoded on their own, as they are once the
others are done (the long rollouts that hold an RL step back, at small batch, where speculation
pays most), with the scheduler the arm's whole step left. The ledger's saving is the served arm's
seconds against none's: what the drafter saved on this step's rollouts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from transformers import LlamaForCausalLM

from pipeline.data.replay_record import ArmReplay, RolloutReplay
from pipeline.data.rollouts import Rollout
from pipeline.evaluation.rejection_sampler import RequestSampling
from pipeline.evaluation.scheduler import SpeculationThreshold, bucket, schedule_round
from pipeline.evaluation.speculative import DecodingBatch, Request, Sequence, clock
from pipeline.models.drafter import Proposer
from pipeline.sampling import DraftSampleMethod, SamplingParams

TAIL_BATCH = 4  # the tail: rounds with at most this many requests left
ARMS = ("none", "baseline", "served", "cotrained")


def step_requests(rollouts: list[Rollout], params: SamplingParams, seed: int, device: str) -> list[Request]:
    """The step's rollouts as requests: each rollout's prompt, decoded to its response's length, seeded."""
    import torch

    return [Request(torch.tensor(r.input_ids[: max(1, r.prompt_len)]), max(1, sum(r.loss_mask)),
                    RequestSampling.seeded(params, seed + i, device)) for i, r in enumerate(rollouts)]


@dataclass(frozen=True)
class Decoded:
    """One batch of requests decoded to their ends."""

    seconds: float
    tokens: int  # each request's first token (its prefill's) included
    speculative_rows: int  # rows of speculative rounds (a request in a round counts once)
    plain_rows: int
    accepted: int  # drafts kept, all speculative rows together
    by_batch: dict[int, tuple[float, int, int, int]]  # batch bucket -> seconds, tokens, rounds, speculative rounds


def decode(model: LlamaForCausalLM, new_proposer: Callable[[], Proposer] | None, requests: list[Request], k: int,
           draft_method: DraftSampleMethod, threshold: SpeculationThreshold) -> Decoded:
    """Every request submitted at once and decoded to its end, round by round as the fleet's engine schedules
    them (`threshold` decides and learns per round); the requests' generators are left where they were."""
    batch = DecodingBatch(model, new_proposer, k, draft_method)
    joining = [Sequence(Request(r.prompt, r.max_tokens, RequestSampling(r.sampling.params,
                                                                        _copy(r.sampling.generator))))
               for r in requests]
    tokens = speculative = plain = accepted = 0
    by_batch: dict[int, tuple[float, int, int, int]] = {}
    started = clock(model.device)
    while True:
        _, record = schedule_round(batch, threshold, joining)  # the prefill joins first, timed with the rest
        joining = []
        if record is None:
            break
        tokens += record.tokens
        seconds_at, tokens_at, rounds_at, speculative_at = by_batch.get(bucket(record.rows), (0.0, 0, 0, 0))
        by_batch[bucket(record.rows)] = (seconds_at + record.seconds, tokens_at + record.tokens, rounds_at + 1,
                                         speculative_at + record.speculative)
        if record.speculative:
            speculative += record.rows
            accepted += sum(record.accepted)
        else:
            plain += record.rows
    seconds = clock(model.device) - started
    return Decoded(seconds, tokens + len(requests), speculative, plain, accepted,
                   {b: (round(s, 4), t, n, m) for b, (s, t, n, m) in sorted(by_batch.items())})


def tail_requests(requests: list[Request]) -> list[Request]:
    """The step's tail: its `TAIL_BATCH` longest requests, the last to finish."""
    return sorted(requests, key=lambda r: r.max_tokens)[-TAIL_BATCH:]


def replay_arm(model: LlamaForCausalLM, new_proposer: Callable[[], Proposer] | None, requests: list[Request], k: int,
               draft_method: DraftSampleMethod, threshold: SpeculationThreshold, version: str | None) -> ArmReplay:
    """The whole step, then its tail on its own, one scheduler learning through both."""
    whole = decode(model, new_proposer, requests, k, draft_method, threshold)
    tail = decode(model, new_proposer, tail_requests(requests), k, draft_method, threshold)
    return ArmReplay(version, round(whole.seconds, 4), whole.tokens, whole.speculative_rows, whole.plain_rows,
                     round(1 + whole.accepted / whole.speculative_rows, 4) if whole.speculative_rows else 1.0,
                     round(tail.seconds, 4), tail.tokens, threshold.threshold, whole.by_batch)


def _copy(generator):  # noqa: ANN001, ANN202 - a torch.Generator at the same point of its stream
    import torch

    copy = torch.Generator(device=generator.device)
    copy.set_state(generator.get_state())
    return copy


def replay_step(model: LlamaForCausalLM, arms: dict[str, tuple[str | None, Callable[[], Proposer] | None]],
                requests: list[Request], k: int, draft_method: DraftSampleMethod,
                new_threshold: Callable[[], SpeculationThreshold], step: int, params: SamplingParams,
                runs_per_arm: int) -> RolloutReplay:
    """Each arm (role -> its version and proposer factory; None: no drafter) replayed on the same requests; an arm
    whose version another arm has is measured once. The arms take turns, `runs_per_arm` times, and each keeps its
    fastest run: a burst of other work on a shared machine slows the run it lands in, not the arm. No speculation
    goes first: its plain rounds' seconds per batch size are what a replica serving for a while knows already, so a
    drafter's arm starts with them (it measures its own speculative rounds as it goes), not from nothing. Every run's
    seconds stay on the record (`runs_s`): the speedup's spread, run by run. The rounds per batch size are every
    run's together (`pooled`): a bucket holds a few sub-second rounds a run, too few to compare on one run alone."""
    factories = {None: None, **{version: new_proposer for version, new_proposer in arms.values()}}
    runs: dict[str | None, list[ArmReplay]] = {version: [] for version in factories}
    for _ in range(runs_per_arm):
        for version, new_proposer in factories.items():
            threshold = new_threshold()
            if version is not None:
                threshold.know_plain(_plain_seconds(_fastest(runs[None])))
            runs[version].append(replay_arm(model, new_proposer, requests, k, draft_method, threshold, version))
    fastest = {version: replace(_fastest(measured), by_batch=pooled([r.by_batch for r in measured]),
                                runs_s=tuple(r.seconds for r in measured),
                                tail_runs_s=tuple(r.tail_seconds for r in measured))
               for version, measured in runs.items()}
    out = {role: fastest[version] for role, (version, _) in arms.items()}
    return RolloutReplay(step, len(requests), sum(r.max_tokens for r in requests), TAIL_BATCH, params, draft_method,
                         out)


def _fastest(runs: list[ArmReplay]) -> ArmReplay:
    """The fastest whole step, with the fastest tail."""
    tail = min(runs, key=lambda run: run.tail_seconds)
    return replace(min(runs, key=lambda run: run.seconds), tail_seconds=tail.tail_seconds)


def pooled(runs: list[dict[int, tuple[float, int, int, int]]]) -> dict[int, tuple[float, int, int, int]]:
    """Runs' rounds per batch-size bucket, summed bucket by bucket."""
    out: dict[int, tuple[float, int, int, int]] = {}
    for by_batch in runs:
        for b, figures in by_batch.items():
            out[b] = tuple(round(x + y, 4) for x, y in zip(out.get(b, (0.0, 0, 0, 0)), figures, strict=True))
    return dict(sorted(out.items()))


def _plain_seconds(plain: ArmReplay) -> dict[int, float]:
    """A plain arm's seconds per round at each batch-size bucket."""
    return {b: seconds / rounds for b, (seconds, _, rounds, _) in plain.by_batch.items() if rounds}
