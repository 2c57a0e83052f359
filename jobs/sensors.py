"""Sensors: new RL steps in (one run per step), a step's first parts into a same-step refresh, a
promoted champion out to the fleet, and a retraining when the fleet's live acceptance falls below
its floor."""

import json

import dagster as dg

from assets.partitions import RETRAIN_TAG, rl_step
from jobs import deploy_job, refresh_job, rl_step_job
from pipeline.data import order
from pipeline.data.keys import is_step_key, malformed_step_names, parse_step_key, rollouts_root, step_key
from pipeline.data.rollouts import is_committed
from pipeline.refresh import plan as refresh_lib
from pipeline.serving import deploy, live_tau
from resources import PipelineResource

SENSOR_NAME = "rl_step_sensor"
DEPLOY_SENSOR_NAME = "champion_sensor"
LIVE_TAU_SENSOR_NAME = "live_tau_sensor"
REFRESH_SENSOR_NAME = "refresh_sensor"
IN_PROGRESS = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
               dg.DagsterRunStatus.STARTED]


@dg.sensor(
    name=SENSOR_NAME,
    job=rl_step_job,
    minimum_interval_seconds=30,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Adds an `rl_step` partition for every committed step under rollouts/<run>/ and requests "
    "one run of rl_step_job per step (run_key = the step, so a step is never run twice).",
)
def rl_step_sensor(context: dg.SensorEvaluationContext, pipeline: PipelineResource) -> dg.SensorResult | dg.SkipReason:
    cfg = pipeline.config
    seen, _ = _cursor_rank(context.cursor, "committed_at")
    # Every committed step whose partition is not added yet (a trainer that committed steps out of order, or
    # late), and those committed since the last tick, in the order the store saw their commits: never by the
    # step numbers, which the trainer chose. run_key = the step keeps any from being requested twice.
    known = set(context.instance.get_dynamic_partitions(rl_step.name))
    store = pipeline.store()
    committed = [(order.committed_at(store, cfg.run, s), s) for s in order.commit_order(store, cfg.run)]
    new = [s for at, s in committed if at > seen or step_key(s) not in known]
    malformed = malformed_step_names(store.list_dirs(rollouts_root(cfg.run)))
    ignored = (f"; ignored {len(malformed)} step director(ies) whose name is not 'step-' and the step in six "
               f"digits, up to int64 (e.g. step-000001): {', '.join(malformed[:10])}") if malformed else ""
    if ignored:
        context.log.warning(f"{rollouts_root(cfg.run)}/{ignored[1:]}")
    if not new:
        return dg.SkipReason(f"no RL step committed under {rollouts_root(cfg.run)}/ since the last one seen "
                             f"({step_key(committed[-1][1]) if committed else 'none'}){ignored}")
    keys = [step_key(s) for s in new]
    return dg.SensorResult(
        run_requests=[dg.RunRequest(partition_key=k, run_key=k) for k in keys],
        dynamic_partitions_requests=[rl_step.build_add_request(keys)],
        cursor=json.dumps({"committed_at": max(seen, committed[-1][0]), "step": committed[-1][1]}),
    )


def _cursor_rank(cursor: str | None, at: str) -> tuple[float, int]:
    """(store time, step) a sensor's cursor holds (`{at: seconds, "step": n}`); (0, -1) for none, or a cursor
    of another form (one written before the cursors held times: every step is considered again, and run keys
    drop repeats)."""
    try:
        doc = json.loads(cursor) if cursor else {}
        return float(doc[at]), int(doc.get("step", -1))
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError):
        return 0.0, -1


@dg.sensor(
    name=DEPLOY_SENSOR_NAME,
    job=deploy_job,
    minimum_interval_seconds=30,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Watches the `champion` alias of the registered drafter (moved by policy or by a person in the "
    "MLflow UI) and requests one deploy per version: run_key = <model>:<version>.",
)
def champion_sensor(context: dg.SensorEvaluationContext, pipeline: PipelineResource) -> dg.SensorResult | dg.SkipReason:
    cfg = pipeline.config
    if cfg.fleet.driver == "none":
        return dg.SkipReason("fleet.driver is none: no fleet to deploy to")
    registry = pipeline.registry()
    champion = registry.alias_version("champion")
    if champion is None:
        return dg.SkipReason(f"{registry.model_name} has no `champion` alias yet")
    if champion == context.cursor:
        return dg.SkipReason(f"champion {registry.model_name} version {champion} already requested")
    # The cursor stays: a later champion goes.
    if newer := refresh_lib.newer_live_refresh(pipeline.store(), cfg.run, registry, champion):
        return dg.SkipReason(f"champion version {champion} waits: {newer}")
    return dg.SensorResult(
        run_requests=[
            dg.RunRequest(
                run_key=f"{registry.model_name}:{champion}",
                run_config={"ops": {"fleet": {"config": {"version": champion}}}},
                tags={"drafter_version": champion},
            )
        ],
        cursor=champion,
    )


@dg.sensor(
    name=REFRESH_SENSOR_NAME,
    job=refresh_job,
    minimum_interval_seconds=2,  # its wait is part of the refresh's latency
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Watches the parts of steps not yet committed and, once a step's parts hold refresh.min_share of "
    "its expected rollouts (or refresh.min_tokens), requests one refresh run per step (run_key = refresh:<step>): "
    "one at a time per run, the newest qualifying step's (an older one is recorded as skipped).",
)
def refresh_sensor(context: dg.SensorEvaluationContext, pipeline: PipelineResource) -> dg.SensorResult | dg.SkipReason:
    cfg = pipeline.config
    if not cfg.refresh.enabled:
        return dg.SkipReason("refresh.enabled is false")
    if cfg.fleet.driver == "none" or not cfg.train.enable_drafter_training:
        return dg.SkipReason("refresh.enabled, but there is no fleet to refresh (fleet.driver none) or drafter "
                             "training is off (train.enable_drafter_training false)")
    seen = _cursor_rank(context.cursor, "first_seen_at")
    # One refresh at a time per run: while one is queued or running, the next waits for it (its request comes
    # on a later tick, for the newest step that qualifies by then).
    running = context.instance.get_runs(dg.RunsFilter(job_name=refresh_job.name, statuses=IN_PROGRESS), limit=1)
    if running:
        return dg.SkipReason(f"a refresh run is in progress ({running[0].tags.get('refresh_step', '?')}, run "
                             f"{running[0].run_id[:8]}): one refresh at a time; the newest qualifying step goes next")
    store = pipeline.store()
    # Only steps still generating (once committed, the step's own run trains on all of it), first seen by the
    # store after the step refreshed last, oldest first: the store's order, never the steps' numbers.
    open_steps = []
    for step in (parse_step_key(n) for n in store.list_dirs(rollouts_root(cfg.run)) if is_step_key(n)):
        first_seen = order.first_seen_at(store, cfg.run, step)
        if first_seen is not None and (first_seen, step) > seen and not is_committed(store, cfg.run, step):
            open_steps.append((first_seen, step))
    qualified, passed = [], []
    for first_seen, step in sorted(open_steps):
        try:
            q = refresh_lib.qualified_parts(store, cfg, step)
        except (ValueError, OSError) as exc:  # one step's bad files (RolloutsError, LayoutError) stop no other step
            context.log.warning(f"{step_key(step)} is not refreshed: {exc}")
            passed.append(f"{step_key(step)} refused ({exc.__class__.__name__})")
            continue
        if q is None:
            passed.append(f"{step_key(step)} below refresh.min_share")
        else:
            qualified.append((first_seen, q))
    if not qualified:
        return dg.SkipReason(f"no step to refresh first seen since the last refreshed one: "
                             f"{', '.join(passed) or 'no open step'}")
    # Only the newest: an older open step's tail is out before a refresh of it could serve it.
    first_seen, q = qualified[-1]
    for _, older in qualified[:-1]:
        refresh_lib.record_skipped(store, cfg, older, f"skipped: {step_key(q.step)} qualified as well; one refresh "
                                   f"at a time, the newest open step's")
    return dg.SensorResult(run_requests=[dg.RunRequest(
        run_key=f"refresh:{step_key(q.step)}", tags={"refresh_step": step_key(q.step), "refresh_part": str(q.part)},
        run_config={"ops": {"refreshed_drafter": {"config": {"step": q.step, "part": q.part}}}})],
        cursor=json.dumps({"first_seen_at": first_seen, "step": q.step}))


@dg.sensor(
    name=LIVE_TAU_SENSOR_NAME,
    job=rl_step_job,
    minimum_interval_seconds=60,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Scrapes each replica's /metrics, records the live tau since the last tick as an observation "
    "of `fleet`, and below fleet.live_tau_floor requests retraining on the newest step.",
)
def live_tau_sensor(context: dg.SensorEvaluationContext, pipeline: PipelineResource) -> dg.SensorResult | dg.SkipReason:
    cfg = pipeline.config
    if cfg.fleet.driver == "none" or not cfg.fleet.replicas:
        return dg.SkipReason("no fleet configured")
    fleet = deploy.replicas(cfg)
    reading = live_tau.read_counters(fleet)
    by_replica = live_tau.since_last(reading, json.loads(context.cursor) if context.cursor else {})
    taus = list(by_replica.values())
    metadata = {}  # live tau, or why a replica was not read
    for replica in fleet:
        if replica.name in reading.unreachable:
            metadata[f"{replica.name}_status"] = f"unreachable: {reading.unreachable[replica.name]}"
        elif replica.name in by_replica:
            metadata[f"{replica.name}_live_tau"] = by_replica[replica.name]
    events = [dg.AssetObservation(asset_key="fleet", metadata=metadata)] if metadata else []
    requests = []
    floor = cfg.fleet.live_tau_floor
    newest = order.newest_committed(pipeline.store(), cfg.run) if taus and floor and sum(taus) / len(taus) < floor \
        else None
    if newest is not None:
        requests.append(dg.RunRequest(
            # One retraining per step: the daemon drops repeats of a run_key. The reason tag makes the
            # drafter asset train (it is part of the training's input identity) and says why.
            partition_key=step_key(newest),
            run_key=f"retrain:{step_key(newest)}",
            asset_selection=[dg.AssetKey("drafter"), dg.AssetKey("acceptance")],
            tags={RETRAIN_TAG: f"live tau {sum(taus) / len(taus):.2f} < fleet.live_tau_floor {floor}"},
        ))
    return dg.SensorResult(asset_events=events, run_requests=requests, cursor=json.dumps(reading.to_json()))

