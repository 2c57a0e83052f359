"""The fleet as the rollout engine: each step's policy reaches every replica (stand-in processes, not vLLM)
through the weight-update routes before the step's first rollout request, and a rollout decoded by any other
policy is an error, not a statistic."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from pipeline.data.fleet_state import read_fleet_policy
from pipeline.data.rollout_engine import RolloutRequest
from pipeline.data.store import ObjectStore
from pipeline.evaluation import speculative
from pipeline.models import target as target_lib
from pipeline.sampling import GREEDY, SamplingParams
from pipeline.serving.drivers import ReplicaSpec, StandInDriver, call
from pipeline.serving.hot_update import send_policy
from pipeline.serving.metrics import SpecCounters
from pipeline.serving.rollouts import FleetRollouts, StalePolicyError, _reset
from tests.unit.serving.conftest import free_port


def _requests(n: int) -> list[RolloutRequest]:
    params = [GREEDY, SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=6)]
    return [RolloutRequest([1 + i % 7, 2, 3], 6 + i % 5, params[i % 3], seed=100 + i) for i in range(n)]


@pytest.fixture
def fleet(models: dict[str, str], driver: StandInDriver, store: ObjectStore, tmp_path: Path) -> FleetRollouts:
    """Two stand-ins not started yet; steps 1 and 2's policies in the store."""
    for step, name in ((1, "target"), (2, "target2")):
        shutil.copytree(models[name][len("file://"):], tmp_path / "store" / "policies" / f"step-00000{step}")
    replicas = [ReplicaSpec(f"r{i}", "127.0.0.1", free_port()) for i in range(2)]
    return FleetRollouts(replicas, driver, store, "run", ready_timeout_s=90)


def test_each_steps_policy_reaches_every_replica_before_its_first_rollout(
    fleet: FleetRollouts, driver: StandInDriver, models: dict[str, str]
) -> None:
    fleet.push_policy(1, "policies/step-000001")  # no replica runs yet: they start on it, without a drafter
    assert [driver.serving(r)[1] for r in fleet.replicas] == ["", ""]
    first = dict(fleet.generate(_requests(12)))
    assert sorted(first) == list(range(12))
    assert fleet.windows[1].rollouts == 12
    assert fleet.windows[1].counters.drafts == 0  # plain decoding until a drafter is deployed

    fleet.push_policy(2, "policies/step-000002")
    for replica in fleet.replicas:  # every replica, in place (same process), before any request of step 2
        assert call(replica, "/weight_info") == b'{"weight_version": "policy-step-000002"}'
        assert driver.serving(replica)[0] == fleet.store.resolve("policies/step-000002")
    assert read_fleet_policy(fleet.store, "run").step == 2
    requests = _requests(12)
    second = dict(fleet.generate(requests))
    target2 = target_lib.load_checkpoint(fleet.store.resolve("policies/step-000002"))
    for i in (0, 3, 6):  # the greedy ones are step 2's policy's greedy decoding
        expected = speculative.greedy_generate(target2, torch.tensor(requests[i].prompt), requests[i].max_tokens)
        assert second[i].token_ids == expected
    assert all(len(second[i].logprobs) == len(second[i].token_ids) == r.max_tokens for i, r in enumerate(requests))
    again = dict(fleet.generate(requests))  # on whichever replica: a request's seed decides its tokens
    assert [again[i].token_ids for i in range(12)] == [second[i].token_ids for i in range(12)]


def test_a_replica_left_on_the_previous_policy_fails_the_step(fleet: FleetRollouts, reliability) -> None:
    reliability.fault("a replica serving the previous step's policy when the step's rollouts are requested")
    fleet.push_policy(1, "policies/step-000001")
    fleet.push_policy(2, "policies/step-000002")
    stale = fleet.replicas[1]
    send_policy(stale, fleet.store.resolve("policies/step-000001")[len("file://"):])  # as a stray update would
    with pytest.raises(StalePolicyError, match=r"replica r1: rollout \d+ was decoded by 'policy-step-000001', not "
                                               r"the step's policy 'policy-step-000002'"):
        dict(fleet.generate(_requests(6)))


def test_trl_completions_come_from_the_fleet(fleet: FleetRollouts, tmp_path: Path) -> None:
    """TRL's GRPO with the fleet as its rollout function: the weights TRL holds go to the replicas as the step's
    policy, and the published step's completions are the fleet's, each from its seed (asked again, the same)."""
    from pipeline.data.rollout_engine import request_seed
    from pipeline.data.rollouts import read_rollouts
    from pipeline.sources import trl as trl_source

    settings = trl_source.GRPODemoSettings(prompts_per_step=2, num_generations=4, max_completion_length=8,
                                           parts_per_step=1)
    fleet.replicas = fleet.replicas[:1]
    demo = trl_source.GRPODemo(fleet.store, "run", 1, tmp_path / "trl", settings, engine=fleet.engine())
    published = demo.run_step(1)
    demo.finish()
    assert read_fleet_policy(fleet.store, "run").label == "policy-step-000001"
    rollouts = read_rollouts(fleet.store, "run", 1)
    assert fleet.windows[1].rollouts == len(rollouts) == 8
    assert fleet.windows[1].tokens == sum(sum(r.loss_mask) for r in rollouts)
    eos = demo.tokenizer.eos_token_id
    by_id = {r.sample_id: r for r in rollouts}
    for i, rollout in enumerate(published.rollouts):  # TRL's order: prompt-major, one completion per generation
        stored = by_id[rollout.sample_id]
        prompt = stored.input_ids[: stored.loss_mask.index(1)]
        completion = stored.input_ids[len(prompt):]
        assert completion[-1] == eos or len(completion) == settings.max_completion_length
        [(_, again)] = fleet.generate([RolloutRequest(prompt, settings.max_completion_length,
                                                      SamplingParams(temperature=settings.temperature),
                                                      request_seed(settings.seed, 1, i), (eos,))])
        assert again.token_ids == completion


def test_a_replica_restarted_between_scrapes_counts_its_window_from_zero() -> None:
    """A replica that served step 1 without a drafter (no drafts) and was restarted with one: its drafts did not go
    down, its plain rounds did, so the window is its counters since the restart, never a negative count."""
    none = SpecCounters(0, 0, 0)
    assert _reset(none, {"plain": 300, "speculative": 0}, none, {"plain": 5, "speculative": 39})
    assert _reset(SpecCounters(10, 40, 20), {}, SpecCounters(3, 12, 5), {})
    assert not _reset(SpecCounters(10, 40, 20), {"plain": 3}, SpecCounters(12, 48, 26), {"plain": 3, "speculative": 2})
