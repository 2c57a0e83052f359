"""Same-step refresh: the champion fine-tuned on a step's first parts serves the step's tail.

A reasoning RL step's rollouts finish unevenly: most groups early, a long tail of long responses
last. Once a step's published parts (`pipeline/data/parts.py`) hold `refresh.min_share` of its
expected rollouts (or `refresh.min_tokens` response tokens), a refresh:

    qualify   the parts in publication order, up to the first that reaches the share
    extract   their captured rollouts' hidden states (the capture plan applies), into the
              refresh's own namespace (keys.refresh_data_run): the step's own extraction, its
              writer lease and its sweep never meet the refresh's files
    train     the champion, warm-started, for `refresh.max_tokens` positions through the same
              training launcher and worker as any training (plan.TrainJob with a RefreshSpec)
    check     tau of the refreshed drafter and of the champion on the parts' held-out rollouts,
              against the step's policy
    deploy    when it beats the champion by `refresh.margin`, through the fleet's deploy path,
              fenced: under the fleet's lease, and only while the fleet runs nothing that has seen
              the step already (the step's own training, once promoted, supersedes the refresh)

    refresh/<run>/step-000123.json    the RefreshRecord (records.py)

The refresh registers an MLflow version tagged `refresh_step` and `refresh_part`, and moves no
alias but `live` (through the deploy): the step's own training is decided, trained, promoted and
deployed as if no refresh had run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.config import PipelineConfig
from pipeline.data import capture, shards
from pipeline.data import parts as parts_lib
from pipeline.data.buffer import select_buffer, write_buffer
from pipeline.data.held_out import held_out_rollouts
from pipeline.data.keys import refresh_data_run, refresh_key
from pipeline.data.parts import Qualified, StepParts, qualify
from pipeline.data.records import RefreshRecord, read_fleet_state, write_record
from pipeline.data.rollouts import Rollout
from pipeline.data.run_layout import TargetLayout
from pipeline.data.store import ObjectStore
from pipeline.evaluation import tail as tail_lib
from pipeline.models import target as target_lib
from pipeline.models.drafter import stored_layer_ids
from pipeline.registry import DrafterRegistry
from pipeline.serving import deploy
from pipeline.sources.extract import iter_hidden_states
from pipeline.training.plan import RefreshSpec, TrainJob, input_identity

REFRESH_WARMUP_STEPS = 2  # a refresh is a few dozen iterations: most of them at the full rate


def qualified_parts(store: ObjectStore, cfg: PipelineConfig, step: int) -> Qualified | None:
    """The step's qualifying parts as its stored manifests say (manifests never change: the same answer on
    every read); None before the share is reached or for a step published whole."""
    step_parts = parts_lib.read_step_parts(store, cfg.run, step)
    if step_parts is None:
        return None
    return qualify(parts_lib.published_parts(store, cfg.run, step), step_parts, cfg.refresh.min_share,
                   cfg.refresh.min_tokens)


def part_rollouts(store: ObjectStore, run: str, step: int, parts: tuple[int, ...],
                  step_parts: StepParts) -> list[Rollout]:
    manifests = {m.part: m for m in parts_lib.published_parts(store, run, step)}
    return [r for p in sorted(parts) for r in parts_lib.read_part(store, run, step, manifests[p], step_parts.limits)]


def extract(store: ObjectStore, cfg: PipelineConfig, q: Qualified) -> int:
    """The hidden states of the qualifying parts' captured rollouts and their buffer, in the refresh's
    namespace; returns the buffer's samples."""
    data_run = refresh_data_run(cfg.run, q.step, q.part)
    model = target_lib.load_policy(store, q.pointer.checkpoint_uri, cfg.device, target_lib.load_settings(cfg))
    rollouts = part_rollouts(store, cfg.run, q.step, q.parts, q.step_parts)
    plan = capture.plan_capture(rollouts, q.step, held_out_fraction=cfg.eval.held_out_fraction,
                                window_tokens=cfg.train.window_tokens, max_samples=cfg.capture.max_samples,
                                max_tokens=cfg.capture.max_tokens)
    windows = plan.bounds()
    num_layers = model.config.num_hidden_layers
    layer_ids = stored_layer_ids(cfg.drafter, num_layers)
    samples = iter_hidden_states(model, [r for r in rollouts if r.sample_id in windows], q.step,
                                 tokens_per_batch=cfg.hidden_states.tokens_per_batch, device=cfg.device,
                                 layer_ids=layer_ids, windows=windows)
    manifest = shards.write_hidden_states(
        store, data_run, q.step, samples, hidden_size=model.config.hidden_size, layer_ids=layer_ids or [num_layers],
        compression=cfg.shard_compression,
        target={"model_id": q.pointer.model_id, "policy_version": str(q.pointer.policy_version),
                "checkpoint_uri": q.pointer.checkpoint_uri, "source": "forward",
                "final_norm": "applied" if layer_ids is None else "not applied"},
        layout=TargetLayout.from_config(model.config.to_dict(), layer_ids or [num_layers]),
        lease_s=cfg.storage.step_lease_s, lease_wait_s=cfg.storage.step_lease_wait_s)
    entries = select_buffer([manifest], q.step, 1, cfg.train.data_buffer_max_size)
    return write_buffer(store, data_run, q.step, entries).num_samples


def refresh_config(cfg: PipelineConfig) -> PipelineConfig:
    """The step's training settings with the refresh's budget: `refresh.max_tokens` positions at `refresh.lr`,
    no resumable checkpoints (a refresh lasts seconds; a killed one is simply not deployed)."""
    train = cfg.train.model_copy(update={
        "max_tokens": cfg.refresh.max_tokens, "checkpoint_every": 0, "min_samples": 1,
        "optim": cfg.train.optim.model_copy(update={"lr": cfg.refresh.lr, "lr_warmup_steps": REFRESH_WARMUP_STEPS}),
    })
    return cfg.model_copy(update={"train": train})


def training_job(store: ObjectStore, cfg: PipelineConfig, q: Qualified, registry: DrafterRegistry,
                 tags: dict[str, str]) -> TrainJob:
    """The training process's job: the champion fine-tuned on the refresh's buffer."""
    from pipeline.data.buffer import read_buffer

    data_run = refresh_data_run(cfg.run, q.step, q.part)
    tuned = refresh_config(cfg)
    entries = list(read_buffer(store, data_run, q.step).entries)
    identity = input_identity(tuned, entries, q.pointer.checkpoint_uri, f"refresh of part {q.part}")
    spec = RefreshSpec(q.part, data_run, q.pointer.checkpoint_uri, q.pointer.policy_version, q.pointer.model_id)
    return TrainJob(q.step, tuned.model_dump(mode="json"), registry.unfinished_run({"input_id": identity}), identity,
                    f"refresh on {q.rows} rollouts of parts {list(q.parts)}", registry.alias_version("champion"),
                    tags, None, spec)


@dataclass(frozen=True)
class RefreshCheck:
    tau_refreshed: float
    tau_champion: float | None
    prompts: int
    deploy: bool
    reason: str


def check(store: ObjectStore, cfg: PipelineConfig, q: Qualified, registry: DrafterRegistry, version: str,
          champion: str | None) -> RefreshCheck:
    """Tau of the refreshed drafter and of the champion on the held-out rollouts of the qualifying parts."""
    rollouts = held_out_rollouts(part_rollouts(store, cfg.run, q.step, q.parts, q.step_parts),
                                 cfg.eval.held_out_fraction)[: cfg.eval.num_prompts]
    if not rollouts:
        return RefreshCheck(0.0, None, 0, False, "no held-out rollout in the qualifying parts")
    prompts = [torch.tensor(r.input_ids[: max(1, r.prompt_len)]) for r in rollouts]
    taus = tail_lib.measure_taus(store, cfg, q.pointer.checkpoint_uri, registry, [version, champion], prompts)
    new, old = taus[version], taus.get(champion) if champion else None
    margin = cfg.refresh.margin
    if old is None:
        return RefreshCheck(new, None, len(prompts), True, f"no champion; refreshed tau {new:.3f}")
    if new > old + margin:
        return RefreshCheck(new, old, len(prompts), True,
                            f"refreshed tau {new:.3f} > champion tau {old:.3f} + refresh.margin {margin}")
    return RefreshCheck(new, old, len(prompts), False,
                        f"refreshed tau {new:.3f} <= champion tau {old:.3f} + refresh.margin {margin}")


def seen_step(registry: DrafterRegistry, version: str) -> tuple[int, int]:
    """(step, part) of the newest data a registered version trained on; a step's own training has seen the
    whole step (a part above any)."""
    tags = registry.version_tags(version)
    if "refresh_step" in tags:
        return int(tags["refresh_step"]), int(tags["refresh_part"])
    return int(tags.get("rl_step", -1)), parts_lib.MAX_PART + 1


def superseded_by(registry: DrafterRegistry, step: int, part: int) -> str | None:
    """Why a refresh of (step, part) must not reach the fleet: the live drafter, or the champion, has seen as
    much of the step or more. None: it may go."""
    for alias in ("live", "champion"):
        version = registry.alias_version(alias)
        if version and seen_step(registry, version) >= (step, part):
            return f"the {alias} drafter (version {version}) has seen step {step} up to part {part} or more"
    return None


def newer_live_refresh(registry: DrafterRegistry, version: str) -> str | None:
    """Why a deploy of `version` (the champion) must wait: the fleet runs a refreshed drafter that has seen a
    newer step than `version`. None: it may go."""
    live = registry.alias_version("live")
    if not live or live == version or "refresh_step" not in registry.version_tags(live):
        return None
    if seen_step(registry, live) > seen_step(registry, version):
        step, part = seen_step(registry, live)
        return (f"the fleet runs refreshed version {live} (step {step} up to part {part}), newer than version "
                f"{version} (trained at step {seen_step(registry, version)[0]})")
    return None


def finish(store: ObjectStore, cfg: PipelineConfig, registry: DrafterRegistry, q: Qualified, job: TrainJob,
           train_s: float) -> RefreshRecord:
    """After the refresh's training: check it against the champion it started from, deploy it when it wins
    (fenced), and record it (the store, the version's MLflow run)."""
    version = registry.find_version({"input_id": job.input_id})
    if version is None:
        raise RuntimeError(f"the refresh of step {q.step} part {q.part} registered no version")
    checked = check(store, cfg, q, registry, version, job.warm_start_version)
    deployed, decision, live_at = False, checked.reason, None
    if checked.deploy:
        try:
            deploy.deploy(cfg, store, registry, version, fence=lambda: superseded_by(registry, q.step, q.part))
        except deploy.DeploySuperseded as exc:
            decision = f"{checked.reason}; not deployed, superseded: {exc}"
        else:
            deployed = True
            history = read_fleet_state(store, cfg.run).history
            live_at = next((d.live_at for d in reversed(history) if d.version == version), None)
    record = RefreshRecord(q.step, q.part, q.parts, q.rows, q.qualified_at, version, job.warm_start_version,
                           checked.tau_refreshed, checked.tau_champion, deployed, decision, live_at, round(train_s, 3))
    write_record(store, refresh_key(cfg.run, q.step), record)
    run_id = registry.client.get_model_version(registry.model_name, version).run_id
    registry.log_metrics(run_id, {"refresh_tau": checked.tau_refreshed, **(
        {"refresh_champion_tau": checked.tau_champion} if checked.tau_champion is not None else {}), **(
        {"refresh_latency_s": record.latency_s} if record.latency_s is not None else {})}, step=q.step)
    registry.set_version_tags(version, {"refresh_tau": f"{checked.tau_refreshed:.4f}",
                                        "refresh_deployed": str(deployed).lower()})
    return record
