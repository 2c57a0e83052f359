"""Same-step refresh through Dagster: a step's first parts reach the refresh sensor, the refresh job fine-tunes
the champion on them and the fleet's drafter changes while the step's tail is still being published; the
step's own training then supersedes it. The replicas are stand-in processes (not vLLM)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import numpy as np
import pytest
from safetensors.numpy import save_file

from definitions import build_definitions
from demo.daemon import SensorTicks, pipeline_tick
from jobs.sensors import REFRESH_SENSOR_NAME, refresh_sensor
from pipeline.client import publish_rollouts_part
from pipeline.config import PipelineConfig, load_config
from pipeline.data import parts as parts_lib
from pipeline.data.acceptance_record import read_acceptance
from pipeline.data.fleet_state import read_fleet_state
from pipeline.data.keys import part_manifest_key, parts_prefix, parts_step_key, step_key
from pipeline.data.refresh_record import read_refresh, read_tail
from pipeline.data.rollouts import is_committed
from pipeline.data.store import ObjectStore, open_store
from pipeline.registry import DrafterRegistry, open_registry
from pipeline.serving import deploy
from pipeline.serving.drivers import StandInDriver
from pipeline.sources.simulation import SimulatedRL
from tests.support.config import write_config
from tests.support.contract_cases import ok

REFRESH = {"simulation": {"parts_per_step": 4, "response_len_sigma": 0.5, "drift": 0.6, "rollouts_per_step": 32},
           "eval": {"held_out_fraction": 0.4, "num_prompts": 4, "max_new_tokens": 8},
           "refresh": {"enabled": True, "min_share": 0.5, "max_tokens": 3000, "margin": 0.0}}


@dataclass(frozen=True)
class Refreshing:
    """A run with `REFRESH`'s settings: its store, registry, simulated source and definitions, and the driver of
    the stand-in replicas its deploys start."""

    cfg: PipelineConfig
    store: ObjectStore
    registry: DrafterRegistry
    source: SimulatedRL
    defs: dg.Definitions
    driver: StandInDriver


@pytest.fixture
def refreshing(tmp_path: Path) -> Iterator[Refreshing]:
    path = write_config(tmp_path, REFRESH)
    cfg = load_config(path)
    store = open_store(cfg)
    driver = StandInDriver(cfg.eval.num_speculative_tokens, cfg.data_path / "fleet" / "replicas")
    try:
        yield Refreshing(cfg, store, open_registry(cfg), SimulatedRL(cfg.simulation, store, cfg.run,
                                                                     cfg.data_path / "cache"),
                         build_definitions(str(path)), driver)
    finally:
        driver.stop_all(deploy.replicas(cfg))


def _refresh_tick(defs: dg.Definitions, instance: dg.DagsterInstance, cursor: str | None):
    return refresh_sensor(dg.build_sensor_context(instance=instance, cursor=cursor, sensor_name=REFRESH_SENSOR_NAME,
                                                  definitions=defs, resources=defs.resources))


@pytest.mark.slow
def test_a_refresh_changes_the_fleets_drafter_mid_step(refreshing: Refreshing) -> None:
    r = refreshing
    cfg, store, registry, source, defs, driver = r.cfg, r.store, r.registry, r.source, r.defs, r.driver
    with dg.instance_for_test() as instance:
        ticks = SensorTicks(instance, defs)
        source.run_step(1)  # in parts, committed: the step's own run trains v1, which is deployed
        assert parts_lib.committed_part_numbers(store, cfg.run, 1)
        assert pipeline_tick(ticks, True, lambda _: None)
        assert read_fleet_state(store, cfg.run).version == "1"

        # Step 2 is generating: its first parts are out, its tail is not.
        generated = source.generate_step(2)
        order = sorted(parts_lib.published_parts(store, cfg.run, 1), key=lambda m: m.part)
        assert order  # step 1 went out in parts
        slices = [p for p, rows in enumerate(parts_lib_finish(generated, cfg.simulation.parts_per_step)) if rows]
        head, tail = _split_at_share(generated, slices, cfg.refresh.min_share, cfg.simulation.parts_per_step)
        assert _refresh_tick(defs, instance, None).skip_message.startswith("no step to refresh")
        source.publish_parts(generated, only=set(head))
        assert not is_committed(store, cfg.run, 2)

        tick = _refresh_tick(defs, instance, None)
        [request] = tick.run_requests
        assert request.run_key == "refresh:step-000002"
        assert defs.resolve_job_def("refresh_job").execute_in_process(
            instance=instance, run_config=request.run_config, tags=request.tags).success
        assert isinstance(_refresh_tick(defs, instance, tick.cursor), dg.SkipReason)  # once per step

        record = read_refresh(store, cfg.run, 2)
        assert record.part == head[-1]
        assert record.parts == tuple(head)
        assert record.warm_start_version == "1"
        assert registry.version_tags(record.version)["refresh_step"] == "2"
        assert registry.version_tags(record.version)["refresh_part"] == str(head[-1])
        assert record.deployed, record.decision
        # The fleet's drafter changed mid-step: its state and each replica's running drafter say so.
        state = read_fleet_state(store, cfg.run)
        assert state.version == record.version
        assert {r.version for r in state.replicas} == {record.version}
        for replica in deploy.replicas(cfg):
            assert f"v{record.version}" in driver.serving(replica)[1]
        assert record.latency_s is not None
        assert record.latency_s >= 0
        assert registry.alias_version("champion") == "1"  # the refresh moves no alias but `live`
        assert registry.alias_version("challenger") == "1"

        # The tail, the commit, and the step's own run: it supersedes the refresh.
        source.publish_parts(generated, only=set(tail))
        parts_lib.commit_parts(store, cfg.run, 2)
        assert pipeline_tick(ticks, True, lambda _: None)
        step_version = registry.alias_version("challenger")
        assert step_version not in ("1", record.version)
        tail_tau = read_tail(store, cfg.run, 2)
        assert tail_tau.tail_parts == tuple(tail)
        assert tail_tau.versions == {"start": "1", "refreshed": record.version, "whole_step": step_version}
        assert all(1.0 <= t <= cfg.eval.num_speculative_tokens + 1 for t in tail_tau.taus.values())
        assert tail_tau.refresh_latency_s == record.latency_s
        if registry.alias_version("champion") == step_version:  # promoted: it replaces the refresh
            assert read_fleet_state(store, cfg.run).version == step_version


@pytest.mark.slow
def test_the_first_steps_refresh_trains_a_fresh_drafter_until_the_steps_own_replaces_it(refreshing: Refreshing) -> None:
    """No champion yet: step 1's head trains a fresh drafter at the step's own budget (not the fine-tune's), the
    replicas start with it and serve it; step 1's own training replaces it where it measures higher."""
    r = refreshing
    cfg, store, registry, source, defs = r.cfg, r.store, r.registry, r.source, r.defs
    with dg.instance_for_test() as instance:
        generated = source.generate_step(1)
        slices = [p for p, rows in enumerate(parts_lib_finish(generated, cfg.simulation.parts_per_step)) if rows]
        head, tail = _split_at_share(generated, slices, cfg.refresh.min_share, cfg.simulation.parts_per_step)
        source.publish_parts(generated, only=set(head))
        [request] = _refresh_tick(defs, instance, None).run_requests
        assert request.run_key == "refresh:step-000001"
        assert defs.resolve_job_def("refresh_job").execute_in_process(
            instance=instance, run_config=request.run_config, tags=request.tags).success

        record = read_refresh(store, cfg.run, 1)
        assert record.warm_start_version is None
        assert record.tau_champion is None
        assert record.decision.startswith("started fresh; refreshed tau"), record.decision
        assert record.deployed, record.decision
        params = registry.client.get_run(
            registry.client.get_model_version(cfg.mlflow.model_name, record.version).run_id).data.params
        assert (params["warm_start_version"], params["epochs"], params["max_tokens"], params["optim.lr"]) == (
            "none", str(cfg.train.epochs), str(cfg.train.max_tokens), str(cfg.train.optim.lr))
        state = read_fleet_state(store, cfg.run)
        assert {(r.version, r.update) for r in state.replicas} == {(record.version, "restart")}
        assert registry.alias_version("champion") is None  # the refresh moves no alias but `live`
        assert registry.alias_version("live") == record.version

        source.publish_parts(generated, only=set(tail))
        parts_lib.commit_parts(store, cfg.run, 1)
        assert pipeline_tick(SensorTicks(instance, defs), True, lambda _: None)
        # The step's own drafter must beat what the fleet runs, the refresh, on the step's held-out prompts: promoted
        # and deployed when it measures higher, else the refresh keeps serving.
        acceptance = read_acceptance(store, cfg.run, 1)
        own = acceptance.cotrained
        assert own.version != record.version
        assert acceptance.incumbent.version == record.version
        assert registry.version_tags(own.version)["warm_start_version"] == "none"  # the step's own starts fresh too
        beats = own.tau > acceptance.incumbent.tau + cfg.promotion.margin
        assert acceptance.promoted == beats, acceptance.decision
        assert registry.alias_version("champion") == (own.version if beats else None)
        assert read_fleet_state(store, cfg.run).version == (own.version if beats else record.version)


def parts_lib_finish(generated, parts: int):
    from pipeline.sources.simulation import finish_parts

    return finish_parts(generated.rollouts, parts)


def _split_at_share(generated, slices: list[int], share: float, parts: int) -> tuple[list[int], list[int]]:
    """The parts up to the first that brings the step to `share`, and the rest (its tail)."""
    from pipeline.sources.simulation import finish_parts

    sizes = [len(rows) for rows in finish_parts(generated.rollouts, parts)]
    total = 0
    for i, part in enumerate(slices):
        total += sizes[part]
        if total >= share * len(generated.rollouts):
            return slices[: i + 1], slices[i + 1 :]
    raise AssertionError("the parts never reach the share")


@dataclass(frozen=True)
class OpenSteps:
    """A run with a champion whose trainer publishes the first half of steps (`first_half`), then stops."""

    cfg: PipelineConfig
    store: ObjectStore
    defs: dg.Definitions
    checkpoint: Path

    def first_half(self, step: int, seen_at: float | None = None) -> None:
        """Half of the step's rollouts in one part, the store seeing its first part at `seen_at` when given."""
        publish_rollouts_part(self.store, self.cfg.run, step, 0, [ok(f"s{step}-{i}") for i in range(4)],
                              self.checkpoint, policy_version=step % 1000, model_id="tiny", expected_rollouts=8)
        if seen_at is not None:
            os.utime(self.store.local_path(parts_step_key(self.cfg.run, step)), (seen_at, seen_at))


def _open_steps(tmp_path: Path) -> OpenSteps:
    path = write_config(tmp_path, {"refresh": {"enabled": True, "min_share": 0.5}}, pretrained=False)
    cfg = load_config(path)
    store, registry = open_store(cfg), open_registry(cfg)
    champion = registry.client.create_model_version(cfg.mlflow.model_name, (tmp_path / "drafter").as_uri())
    registry.set_alias("champion", str(champion.version))  # the sensor's one question to the registry
    checkpoint = tmp_path / "policy"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"vocab_size": 50, "max_position_embeddings": 8}))
    save_file({"w": np.zeros((2, 3), dtype=np.float32)}, str(checkpoint / "model.safetensors"))
    return OpenSteps(cfg, store, build_definitions(str(path)), checkpoint)


def test_one_refresh_at_a_time_for_the_newest_qualifying_step(tmp_path: Path) -> None:
    """Steps 3 and 4 qualify at once (an asynchronous trainer): only 4 is refreshed, 3 is recorded as skipped;
    while a refresh run is in progress the sensor waits, then requests the newest step qualifying by then."""
    steps = _open_steps(tmp_path)
    cfg, store, defs, first_half = steps.cfg, steps.store, steps.defs, steps.first_half
    first_half(3, 1000.0)
    first_half(4, 2000.0)
    with dg.instance_for_test() as instance:
        tick = _refresh_tick(defs, instance, None)
        [request] = tick.run_requests
        assert (request.run_key, json.loads(tick.cursor)["step"]) == ("refresh:step-000004", 4)
        skipped = read_refresh(store, cfg.run, 3)
        assert (skipped.version, skipped.deployed, skipped.part) == (None, False, 0)
        assert skipped.decision == "skipped: step-000004 qualified as well; one refresh at a time, the newest " \
                                   "open step's"

        running = instance.create_run_for_job(defs.resolve_job_def("refresh_job"), run_config=request.run_config,
                                              tags=request.tags, status=dg.DagsterRunStatus.STARTED)
        first_half(5)
        waiting = _refresh_tick(defs, instance, tick.cursor)
        assert isinstance(waiting, dg.SkipReason)
        assert waiting.skip_message.startswith("a refresh run is in progress (step-000004, run ")
        instance.report_run_canceled(running)
        [after] = _refresh_tick(defs, instance, tick.cursor).run_requests
        assert after.run_key == "refresh:step-000005"
        assert read_refresh(store, cfg.run, 5) is None  # requested, not skipped


@pytest.mark.reliability("bad_input", "a step numbered 10**12 refreshed first: later open steps are still refreshed "
                                      "(the sensor follows the order the store saw steps in)")
def test_a_refresh_of_a_step_numbered_ten_to_the_twelve_holds_no_later_step_back(tmp_path: Path) -> None:
    steps = _open_steps(tmp_path)
    steps.first_half(10**12, 1000.0)
    with dg.instance_for_test() as instance:
        tick = _refresh_tick(steps.defs, instance, None)
        assert [r.run_key for r in tick.run_requests] == [f"refresh:{step_key(10**12)}"]
        steps.first_half(3, 2000.0)  # the trainer's next step, numbered as usual
        [later] = _refresh_tick(steps.defs, instance, tick.cursor).run_requests
        assert later.run_key == "refresh:step-000003"
        steps.first_half(2, 500.0)  # seen before the step refreshed last: its tail is out already
        assert isinstance(_refresh_tick(steps.defs, instance, json.dumps(
            {"first_seen_at": 2000.0, "step": 3})), dg.SkipReason)


@pytest.mark.reliability("bad_input", "an open step whose part manifest lies (1,000 rows over 4) and a file named "
                                      "part-².json: the refresh sensor refreshes the other steps, never raises")
def test_one_steps_bad_part_files_hold_no_other_refresh_back(tmp_path: Path) -> None:
    steps = _open_steps(tmp_path)
    store, run = steps.store, steps.cfg.run
    steps.first_half(3, 1000.0)
    store.write_bytes(f"{parts_prefix(run, 3)}/part-².json", b"{}")
    publish_rollouts_part(store, run, 4, 0, [ok("s4-0")], steps.checkpoint, policy_version=4, model_id="tiny",
                          expected_rollouts=8)
    manifest = part_manifest_key(run, 4, 0)
    store.write_json(manifest, {**store.read_json(manifest), "rows": 1000, "response_tokens": 2000})
    os.utime(store.local_path(parts_step_key(run, 4)), (2000.0, 2000.0))
    with dg.instance_for_test() as instance:
        tick = _refresh_tick(steps.defs, instance, None)
        assert [r.run_key for r in tick.run_requests] == ["refresh:step-000003"]
    assert read_refresh(store, run, 3) is None  # requested, not recorded as skipped behind step 4
