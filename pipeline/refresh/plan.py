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

    refresh/<run>/step-000123.json    the RefreshRecord (data/refresh_record.py)

Before the first champion, a refresh starts from the drafter the fleet runs (an earlier refresh's),
and with none a fresh drafter trains at the step's own budget (`train.epochs` at `train.optim.lr`,
within `train.max_tokens`: a fine-tune's few thousand positions leave a fresh drafter untrained).
That is the first step's: an asynchronous trainer starts the second step as the first ends, and the
first step's own training and deploy outlast a step, so without it the fleet would serve no drafter
through the second step; a refresh trained on the first step's head serves it. Its check compares
with the drafter it started from, or decides on its own tau when it started fresh.

The refresh registers an MLflow version tagged `refresh_step` and `refresh_part`, and moves no
alias but `live` (through the deploy): the step's own training is decided, trained, promoted and
deployed as if no refresh had run.
"""

from __future__ import annotations

import time
from dataclasses import replace

from pipeline.config import PipelineConfig
from pipeline.data import order, run_layout
from pipeline.data import parts as parts_lib
from pipeline.data.fleet_state import read_fleet_state
from pipeline.data.held_out import held_out_rollouts
from pipeline.data.keys import refresh_data_run, refresh_key
from pipeline.data.parts import Qualified, StepParts, qualify
from pipeline.data.records import write_record
from pipeline.data.refresh_record import RefreshRecord
from pipeline.data.rollouts import Rollout
from pipeline.data.store import ObjectStore
from pipeline.registry import DrafterRegistry
from pipeline.serving import deploy
from pipeline.training.plan import RefreshSpec, TrainJob, input_identity

REFRESH_WARMUP_STEPS = 2  # a refresh is a few dozen iterations: most of them at the full rate


def qualified_parts(store: ObjectStore, cfg: PipelineConfig, step: int) -> Qualified | None:
    """The step's qualifying parts as its stored manifests say (manifests never change: the same answer on
    every read), each then checked against its rollouts (digest, rows, response tokens) under the limits of the
    policy the step names (its config.json, not the limits the step's record claims); None before the share is
    reached or for a step published whole. RolloutsError or LayoutError naming the file that does not hold."""
    step_parts = parts_lib.read_step_parts(store, cfg.run, step)
    if step_parts is None:
        return None
    step_parts = replace(step_parts, limits=run_layout.checkpoint_limits(store, step_parts.pointer.checkpoint_uri))
    manifests = parts_lib.published_parts(store, cfg.run, step)
    q = qualify(manifests, step_parts, cfg.refresh.min_share, cfg.refresh.min_tokens)
    if q is not None:
        by_part = {m.part: m for m in manifests}
        for part in q.parts:
            parts_lib.read_part(store, cfg.run, step, by_part[part], step_parts.limits)
    return q


def part_rollouts(store: ObjectStore, run: str, step: int, parts: tuple[int, ...],
                  step_parts: StepParts) -> list[Rollout]:
    manifests = {m.part: m for m in parts_lib.published_parts(store, run, step)}
    return [r for p in sorted(parts) for r in parts_lib.read_part(store, run, step, manifests[p], step_parts.limits)]


def refresh_config(cfg: PipelineConfig, fresh: bool = False) -> PipelineConfig:
    """The step's training settings with the refresh's budget: `refresh.max_tokens` positions at `refresh.lr`
    (`fresh`: the step's own budget, for a drafter that starts from nothing), no resumable checkpoints (a
    refresh lasts seconds; a killed one is simply not deployed)."""
    update: dict = {"checkpoint_every": 0, "min_samples": 1}
    if not fresh:
        update.update(max_tokens=cfg.refresh.max_tokens, optim=cfg.train.optim.model_copy(
            update={"lr": cfg.refresh.lr, "lr_warmup_steps": REFRESH_WARMUP_STEPS}))
    return cfg.model_copy(update={"train": cfg.train.model_copy(update=update)})


def starting_version(registry: DrafterRegistry) -> str | None:
    """The drafter a refresh fine-tunes: the champion, else the one the fleet runs (an earlier refresh's);
    None: a fresh drafter."""
    return registry.alias_version("champion") or registry.alias_version("live")


def training_job(store: ObjectStore, cfg: PipelineConfig, q: Qualified, registry: DrafterRegistry,
                 tags: dict[str, str]) -> TrainJob:
    """The training process's job: the champion (`starting_version`) fine-tuned on the refresh's buffer."""
    from pipeline.data.buffer import read_buffer

    data_run = refresh_data_run(cfg.run, q.step, q.part)
    start = starting_version(registry)
    tuned = refresh_config(cfg, fresh=start is None)
    entries = list(read_buffer(store, data_run, q.step).entries)
    identity = input_identity(tuned, entries, q.pointer.checkpoint_uri, f"refresh of part {q.part}")
    spec = RefreshSpec(q.part, data_run, q.pointer.checkpoint_uri, q.pointer.policy_version, q.pointer.model_id)
    return TrainJob(q.step, tuned.model_dump(mode="json"), registry.unfinished_run({"input_id": identity}), identity,
                    f"refresh on {q.rows} rollouts of parts {list(q.parts)}", start, tags, None, spec)


def seen_step(registry: DrafterRegistry, version: str) -> tuple[int, int]:
    """(step, part) of the newest data a registered version trained on; a step's own training has seen the
    whole step (a part above any)."""
    tags = registry.version_tags(version)
    if "refresh_step" in tags:
        return int(tags["refresh_step"]), int(tags["refresh_part"])
    return int(tags.get("rl_step", -1)), parts_lib.MAX_PART + 1


def _seen_rank(store: ObjectStore, run: str, seen: tuple[int, int]) -> tuple[tuple[float, int], int]:
    """A (step, part) in the order the store saw the steps (order.seen_rank), never by the step's number."""
    step, part = seen
    return (order.seen_rank(store, run, step) if step >= 0 else (float("-inf"), step)), part


def superseded_by(store: ObjectStore, run: str, registry: DrafterRegistry, step: int, part: int) -> str | None:
    """Why a refresh of (step, part) must not reach the fleet: the live drafter, or the champion, has seen as
    much of the step or more, or a step the store saw later. None: it may go."""
    for alias in ("live", "champion"):
        version = registry.alias_version(alias)
        if version and _seen_rank(store, run, seen_step(registry, version)) >= _seen_rank(store, run, (step, part)):
            return f"the {alias} drafter (version {version}) has seen step {step} up to part {part} or newer data"
    return None


def newer_live_refresh(store: ObjectStore, run: str, registry: DrafterRegistry, version: str) -> str | None:
    """Why a deploy of `version` (the champion) must wait: the fleet runs a refreshed drafter that has seen a
    step the store saw after the one `version` trained at. None: it may go."""
    live = registry.alias_version("live")
    if not live or live == version or "refresh_step" not in registry.version_tags(live):
        return None
    live_seen, seen = seen_step(registry, live), seen_step(registry, version)
    if _seen_rank(store, run, live_seen) > _seen_rank(store, run, seen):
        return (f"the fleet runs refreshed version {live} (step {live_seen[0]} up to part {live_seen[1]}), newer "
                f"than version {version} (trained at step {seen[0]})")
    return None


def serving_policy(store: ObjectStore, cfg: PipelineConfig, q: Qualified) -> deploy.ServedPolicy:
    """The policy a refresh's drafter serves with: the step's own (its tail is generated by it; the first part
    names it), with the parts' held-out prompts as canaries; the newest committed one once a later step has
    committed (the fleet never goes back to an older policy)."""
    newest = order.newest_committed(store, cfg.run)
    if newest is not None and order.seen_rank(store, cfg.run, newest) > order.seen_rank(store, cfg.run, q.step):
        return deploy.served_policy(store, cfg)
    held = held_out_rollouts(part_rollouts(store, cfg.run, q.step, q.parts, q.step_parts), cfg.eval.held_out_fraction)
    prompts = [list(r.input_ids[: max(1, r.prompt_len)]) for r in held[: cfg.eval.num_prompts]]
    if not prompts:
        return deploy.served_policy(store, cfg)
    return deploy.ServedPolicy(q.step, store.resolve(q.pointer.checkpoint_uri), prompts)


def record_skipped(store: ObjectStore, cfg: PipelineConfig, q: Qualified, reason: str) -> RefreshRecord | None:
    """A qualifying step not refreshed (a newer one is): its record says why. None when it has a record already
    (a refresh ran, or the skip was recorded)."""
    key = refresh_key(cfg.run, q.step)
    if store.exists(key):
        return None
    record = RefreshRecord(q.step, q.part, q.parts, q.rows, q.qualified_at, None, None, None, None, False, reason)
    write_record(store, key, record)
    return record


def deploy_refreshed(store: ObjectStore, cfg: PipelineConfig, registry: DrafterRegistry,
                     record: RefreshRecord, q: Qualified | None = None) -> RefreshRecord:
    """The checked refresh to the fleet when it beats the champion, fenced (`superseded_by`), on the step's own
    policy (`serving_policy`, when `q` is given); its record and the version's MLflow run say whether it went,
    its latency and where the latency went."""
    if not record.beats_champion or record.version is None:
        write_record(store, refresh_key(cfg.run, record.step), record)
        return record
    deploy_started_at = time.time()
    if record.times is not None:
        record = replace(record, times=replace(record.times, deploy_started_at=deploy_started_at))
    try:
        deploy.deploy(cfg, store, registry, record.version,
                      fence=lambda: superseded_by(store, cfg.run, registry, record.step, record.part),
                      serving=(lambda: serving_policy(store, cfg, q)) if q is not None else None)
    except deploy.DeploySuperseded as exc:
        record = replace(record, decision=f"{record.decision}; not deployed, superseded: {exc}")
    else:
        history = read_fleet_state(store, cfg.run).history
        live_at = next((d.live_at for d in reversed(history) if d.version == record.version), None)
        record = replace(record, deployed=True, live_at=live_at,
                         times=replace(record.times, live_at=live_at) if record.times else None)
        registry.set_version_tags(record.version, {"refresh_deployed": "true"})
        if record.latency_s is not None:
            run_id = registry.client.get_model_version(registry.model_name, record.version).run_id
            registry.log_metrics(run_id, {"refresh_latency_s": record.latency_s}, step=record.step)
    write_record(store, refresh_key(cfg.run, record.step), record)
    return record

