"""The same-step refresh's decisions (pipeline/refresh/plan.py), against a real store on tmp_path, steps published
in parts through the trainer's client, and a real MLflow registry on SQLite: which of a step's first parts
qualify, the fine-tune's settings, the drafter it starts from, and when a refreshed drafter may (not) reach the
fleet, by the order the store saw the steps, never by their numbers."""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from pipeline.client import Rollout, publish_rollouts_part, publish_step
from pipeline.config import PipelineConfig, load_config
from pipeline.data import parts as parts_lib
from pipeline.data.fleet_state import FleetPolicy
from pipeline.data.held_out import held_out_rollouts
from pipeline.data.keys import (
    fleet_policy_key,
    fleet_prefix,
    part_manifest_key,
    parts_step_key,
    policy_pointer_key,
    step_key,
)
from pipeline.data.records import write_record
from pipeline.data.refresh_record import read_refresh
from pipeline.data.store import ObjectStore, open_store
from pipeline.refresh.plan import (
    REFRESH_WARMUP_STEPS,
    newer_live_refresh,
    part_rollouts,
    qualified_parts,
    record_skipped,
    refresh_config,
    seen_step,
    serving_policy,
    starting_version,
    superseded_by,
)
from pipeline.registry import DrafterRegistry
from pipeline.serving import deploy
from tests.support.config import write_config
from tests.support.contract_cases import LIMITS, ok

EXPECTED = 8  # rollouts a step is expected to hold; min_share 0.5 qualifies at 4


@dataclass(frozen=True)
class Trainer:
    """A run whose trainer publishes steps in parts through the client, and the store's clock set by hand."""

    cfg: PipelineConfig
    store: ObjectStore
    checkpoint: Path

    def part(self, step: int, part: int, rows: int, published_at: float, seen_at: float | None = None) -> None:
        """`rows` rollouts (2 response tokens each) as `part` of `step`, the store seeing its manifest at
        `published_at` and (the step's first part) the step at `seen_at`."""
        publish_rollouts_part(self.store, self.cfg.run, step, part, self.rollouts(step, part, rows), self.checkpoint,
                              policy_version=step, model_id="tiny", expected_rollouts=EXPECTED)
        self._touch(part_manifest_key(self.cfg.run, step, part), published_at)
        if seen_at is not None:
            self._touch(parts_step_key(self.cfg.run, step), seen_at)

    def whole(self, step: int, rows: int, committed_at: float) -> None:
        publish_step(self.store, self.cfg.run, step, self.rollouts(step, 0, rows), self.checkpoint,
                     policy_version=step, model_id="tiny")
        self._touch(policy_pointer_key(self.cfg.run, step), committed_at)

    @staticmethod
    def rollouts(step: int, part: int, rows: int) -> list[Rollout]:
        return [ok(f"s{step}-p{part}-{i}", input_ids=[1 + part, 2 + i % 5, 3]) for i in range(rows)]

    def _touch(self, key: str, at: float) -> None:
        os.utime(self.store.local_path(key), (at, at))


def _trainer(tmp_path: Path, refresh: dict | None = None) -> Trainer:
    path = write_config(tmp_path, {"refresh": {"min_share": 0.5, **(refresh or {})},
                                   "eval": {"held_out_fraction": 0.5, "num_prompts": 3}}, pretrained=False)
    checkpoint = tmp_path / "policy"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"vocab_size": LIMITS.vocab_size,
                                                        "max_position_embeddings": LIMITS.max_positions}))
    save_file({"w": np.zeros((2, 3), dtype=np.float32)}, str(checkpoint / "model.safetensors"))
    cfg = load_config(path)
    return Trainer(cfg, open_store(cfg), checkpoint)


@pytest.fixture
def trainer(tmp_path: Path) -> Trainer:
    return _trainer(tmp_path)


@pytest.fixture(scope="module")
def tracking_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One SQLite MLflow database for the file (its schema takes seconds to create); each test its own model."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture
def registry(tracking_uri: str, tmp_path: Path) -> DrafterRegistry:
    return DrafterRegistry(tracking_uri, "refresh-plan", f"drafter-{uuid.uuid4().hex[:12]}",
                          (tmp_path / "artifacts").as_uri())


def _version(registry: DrafterRegistry, alias: str | None = None, **tags: object) -> str:
    """A registered drafter version trained as `tags` say (rl_step, or refresh_step and refresh_part)."""
    version = str(registry.client.create_model_version(
        registry.model_name, f"file:///drafters/{uuid.uuid4().hex}", tags={k: str(v) for k, v in tags.items()}).version)
    if alias:
        registry.set_alias(alias, version)
    return version


# --- which parts qualify ---------------------------------------------------------------------------------------


def test_no_part_qualifies_a_step_before_its_parts_reach_the_share(trainer: Trainer) -> None:
    assert qualified_parts(trainer.store, trainer.cfg, 3) is None  # nothing published
    trainer.part(3, 2, rows=3, published_at=1000.0)
    assert qualified_parts(trainer.store, trainer.cfg, 3) is None  # 3 of the 4 the share asks for


def test_the_parts_qualify_in_publication_order_up_to_the_first_reaching_the_share(trainer: Trainer) -> None:
    trainer.part(3, 2, rows=3, published_at=1000.0)  # groups finish in any order: part 2 first
    trainer.part(3, 0, rows=1, published_at=1001.0)
    q = qualified_parts(trainer.store, trainer.cfg, 3)
    assert (q.step, q.part, q.parts, q.rows, q.response_tokens) == (3, 0, (2, 0), 4, 8)
    assert q.qualified_at == 1001.0  # when the store saw the qualifying part
    assert q.step_parts.expected_rollouts == EXPECTED
    assert q.pointer.policy_version == 3
    trainer.part(3, 1, rows=4, published_at=1002.0)  # the tail changes nothing: the same answer on every read
    assert qualified_parts(trainer.store, trainer.cfg, 3) == q


def test_enough_response_tokens_qualify_before_the_share(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, {"min_share": 1.0, "min_tokens": 6})
    trainer.part(3, 0, rows=2, published_at=1000.0)  # 4 tokens
    assert qualified_parts(trainer.store, trainer.cfg, 3) is None
    trainer.part(3, 1, rows=1, published_at=1001.0)  # 6 tokens, 3 of 8 rollouts
    assert qualified_parts(trainer.store, trainer.cfg, 3).parts == (0, 1)


def test_a_step_published_whole_has_no_parts_to_refresh_on(trainer: Trainer) -> None:
    trainer.whole(3, rows=EXPECTED, committed_at=1000.0)
    assert qualified_parts(trainer.store, trainer.cfg, 3) is None


def test_the_refresh_reads_its_parts_rollouts_in_part_order(trainer: Trainer) -> None:
    trainer.part(3, 2, rows=3, published_at=1000.0)
    trainer.part(3, 0, rows=2, published_at=1001.0)
    q = qualified_parts(trainer.store, trainer.cfg, 3)
    got = part_rollouts(trainer.store, trainer.cfg.run, 3, q.parts, q.step_parts)
    assert got == [*Trainer.rollouts(3, 0, 2), *Trainer.rollouts(3, 2, 3)]


# --- the fine-tune ---------------------------------------------------------------------------------------------


def test_a_refresh_fine_tunes_at_its_own_budget_and_rate_without_checkpoints(trainer: Trainer) -> None:
    cfg = trainer.cfg
    before = cfg.model_copy(deep=True)
    tuned = refresh_config(cfg)
    assert tuned.train.max_tokens == cfg.refresh.max_tokens
    assert tuned.train.optim.lr == cfg.refresh.lr
    assert tuned.train.optim.lr_warmup_steps == REFRESH_WARMUP_STEPS
    assert (tuned.train.checkpoint_every, tuned.train.min_samples) == (0, 1)
    assert tuned.train.epochs == cfg.train.epochs  # the rest is the step's own training
    assert tuned.refresh == cfg.refresh
    assert cfg == before  # the step's own settings stay


def test_a_fresh_drafter_trains_at_the_steps_own_budget(trainer: Trainer) -> None:
    cfg = trainer.cfg
    fresh = refresh_config(cfg, fresh=True)
    assert fresh.train.max_tokens == cfg.train.max_tokens
    assert fresh.train.optim == cfg.train.optim
    assert (fresh.train.checkpoint_every, fresh.train.min_samples) == (0, 1)


def test_a_refresh_starts_from_the_champion_else_the_live_drafter_else_fresh(registry: DrafterRegistry) -> None:
    assert starting_version(registry) is None
    live = _version(registry, "live", refresh_step=1, refresh_part=0)
    assert starting_version(registry) == live
    champion = _version(registry, "champion", rl_step=1)
    assert starting_version(registry) == champion


def test_a_version_has_seen_its_refresh_part_or_its_whole_step(registry: DrafterRegistry) -> None:
    assert seen_step(registry, _version(registry, refresh_step=4, refresh_part=2)) == (4, 2)
    assert seen_step(registry, _version(registry, rl_step=4)) == (4, parts_lib.MAX_PART + 1)
    assert seen_step(registry, _version(registry)) == (-1, parts_lib.MAX_PART + 1)


# --- when a refreshed drafter may reach the fleet --------------------------------------------------------------


def test_a_refresh_goes_when_the_fleet_has_seen_less_of_the_step(trainer: Trainer, registry: DrafterRegistry) -> None:
    store, run = trainer.store, trainer.cfg.run
    trainer.part(7, 0, rows=4, published_at=1000.0, seen_at=1000.0)
    assert superseded_by(store, run, registry, 7, 1) is None  # no drafter at all
    _version(registry, "live", refresh_step=7, refresh_part=0)
    assert superseded_by(store, run, registry, 7, 1) is None  # the live drafter saw part 0 only


def test_a_refresh_is_superseded_by_a_live_drafter_that_saw_as_much_of_the_step(
        trainer: Trainer, registry: DrafterRegistry) -> None:
    store, run = trainer.store, trainer.cfg.run
    trainer.part(7, 0, rows=4, published_at=1000.0, seen_at=1000.0)
    live = _version(registry, "live", refresh_step=7, refresh_part=1)
    assert superseded_by(store, run, registry, 7, 1) == (
        f"the live drafter (version {live}) has seen step 7 up to part 1 or newer data")


def test_a_refresh_is_superseded_by_a_champion_trained_on_the_whole_step(
        trainer: Trainer, registry: DrafterRegistry) -> None:
    store, run = trainer.store, trainer.cfg.run
    trainer.part(7, 0, rows=4, published_at=1000.0, seen_at=1000.0)
    champion = _version(registry, "champion", rl_step=7)
    assert superseded_by(store, run, registry, 7, parts_lib.MAX_PART).startswith(
        f"the champion drafter (version {champion}) has seen step 7")


def test_steps_are_newer_in_the_order_the_store_saw_them_not_by_their_numbers(
        trainer: Trainer, registry: DrafterRegistry) -> None:
    """Step 10**12 committed first, step 3 seen after it: a champion of step 10**12 is older than step 3's
    refresh, and a champion of step 3 is newer than a refresh of step 10**12."""
    store, run = trainer.store, trainer.cfg.run
    big = 10**12
    trainer.whole(big, rows=EXPECTED, committed_at=1000.0)
    trainer.part(3, 0, rows=4, published_at=2000.0, seen_at=2000.0)
    _version(registry, "champion", rl_step=big)
    assert superseded_by(store, run, registry, 3, 0) is None
    _version(registry, "champion", rl_step=3)
    assert superseded_by(store, run, registry, big, 0) is not None


def test_the_champion_waits_while_the_fleet_runs_a_refresh_of_a_later_step(
        trainer: Trainer, registry: DrafterRegistry) -> None:
    store, run = trainer.store, trainer.cfg.run
    trainer.whole(9, rows=EXPECTED, committed_at=1000.0)  # seen first, numbered higher
    trainer.part(4, 0, rows=4, published_at=2000.0, seen_at=2000.0)
    champion = _version(registry, "champion", rl_step=9)
    assert newer_live_refresh(store, run, registry, champion) is None  # no live drafter
    live = _version(registry, "live", refresh_step=4, refresh_part=0)
    assert newer_live_refresh(store, run, registry, champion) == (
        f"the fleet runs refreshed version {live} (step 4 up to part 0), newer than version {champion} "
        "(trained at step 9)")


def test_the_champion_goes_over_a_refresh_of_an_earlier_step_or_an_ordinary_live_drafter(
        trainer: Trainer, registry: DrafterRegistry) -> None:
    store, run = trainer.store, trainer.cfg.run
    trainer.part(4, 0, rows=4, published_at=1000.0, seen_at=1000.0)
    trainer.whole(9, rows=EXPECTED, committed_at=2000.0)
    champion = _version(registry, "champion", rl_step=9)
    _version(registry, "live", refresh_step=4, refresh_part=0)
    assert newer_live_refresh(store, run, registry, champion) is None  # the refresh saw an earlier step
    _version(registry, "live", rl_step=4)
    assert newer_live_refresh(store, run, registry, champion) is None  # live is no refresh
    registry.set_alias("live", champion)
    assert newer_live_refresh(store, run, registry, champion) is None  # the fleet runs the champion


# --- records and the served policy -----------------------------------------------------------------------------


def test_a_skipped_step_is_recorded_once_with_its_reason(trainer: Trainer) -> None:
    trainer.part(3, 0, rows=4, published_at=1000.0)
    q = qualified_parts(trainer.store, trainer.cfg, 3)
    record = record_skipped(trainer.store, trainer.cfg, q, "skipped: step-000004 qualified as well")
    assert read_refresh(trainer.store, trainer.cfg.run, 3) == record
    assert (record.step, record.part, record.parts, record.rollouts, record.qualified_at) == (3, 0, (0,), 4, 1000.0)
    assert (record.version, record.deployed, record.decision) == (None, False, "skipped: step-000004 qualified as well")
    assert record_skipped(trainer.store, trainer.cfg, q, "another reason") is None
    assert read_refresh(trainer.store, trainer.cfg.run, 3) == record  # the first record stays


def test_a_refresh_serves_its_steps_policy_with_the_parts_held_out_prompts(trainer: Trainer) -> None:
    store, cfg = trainer.store, trainer.cfg
    trainer.part(3, 0, rows=6, published_at=1000.0, seen_at=1000.0)
    q = qualified_parts(store, cfg, 3)
    served = serving_policy(store, cfg, q)
    held = held_out_rollouts(Trainer.rollouts(3, 0, 6), cfg.eval.held_out_fraction)
    assert held  # the sample ids hold some out at this fraction
    assert served.step == 3
    assert served.target == store.resolve(q.pointer.checkpoint_uri)
    assert served.canary_prompts == [list(r.input_ids[: max(1, r.prompt_len)]) for r in held][: cfg.eval.num_prompts]


def test_a_refresh_serves_the_newest_committed_policy_once_a_later_step_committed(trainer: Trainer) -> None:
    store, cfg = trainer.store, trainer.cfg
    trainer.part(3, 0, rows=6, published_at=1000.0, seen_at=1000.0)
    q = qualified_parts(store, cfg, 3)
    trainer.whole(2, rows=EXPECTED, committed_at=2000.0)  # numbered lower, committed later: newer
    served = serving_policy(store, cfg, q)
    assert served.step == 2
    assert served == deploy.served_policy(store, cfg)


def _pushed(trainer: Trainer, step: int, at: float) -> str:
    """Step `step`'s policy pushed to the fleet for its rollouts, as a source on the fleet writes it (its own copy
    under the run's fleet prefix, not the step's published checkpoint), the store seeing the push at `at`."""
    store, run = trainer.store, trainer.cfg.run
    key = f"{fleet_prefix(run)}/policies/{step_key(step)}"
    store.write_bytes(f"{key}/config.json", (trainer.checkpoint / "config.json").read_bytes())
    target = store.resolve(key)
    write_record(store, fleet_policy_key(run), FleetPolicy(step, target, f"policy-{step_key(step)}", at))
    trainer._touch(fleet_policy_key(run), at)
    return target


@pytest.mark.reliability("fault", "a refresh deploying while its step is still open (no policy.json yet), the "
                                  "fleet pushed another copy of a policy for rollouts: the deploy serves the newer of "
                                  "the two by when the store saw them")
def test_a_refresh_of_an_open_step_deploys_beside_a_pushed_policy(trainer: Trainer) -> None:
    """`make demo SOURCE=trl`: the fleet's rollouts push each step's policy (a copy under fleet/<run>/policies/), and
    the refresh of the open step compared the push with the step's commit, which does not exist yet."""
    store, cfg = trainer.store, trainer.cfg
    trainer.whole(2, rows=EXPECTED, committed_at=500.0)
    _pushed(trainer, 3, at=900.0)  # step 3's rollouts start on the fleet
    trainer.part(3, 0, rows=6, published_at=1000.0, seen_at=1000.0)
    served = serving_policy(store, cfg, qualified_parts(store, cfg, 3))
    assert not store.exists(policy_pointer_key(cfg.run, 3))  # the step is open
    assert deploy.newest_policy(store, cfg, served) == served  # the step's own policy: the store saw it after the push

    newer = _pushed(trainer, 4, at=1100.0)  # the next step's policy pushed while step 3 is still open
    assert deploy.newest_policy(store, cfg, served) == replace(served, step=4, target=newer)
