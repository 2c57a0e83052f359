"""The co-training loop of one RL step as Dagster assets, partitioned by `rl_step`.

    rollouts -> hidden_states -> drafter_buffer -> drafter -> acceptance

Each asset coordinates and calls into `pipeline/`; the heavy data is written to the
object store by that code and the assets return metadata only (no pickling IO manager).
"""

import functools

import dagster as dg

from assets.partitions import BACKFILL_TAG, RETRAIN_TAG, rl_step, step_of
from pipeline.accounting import ledger as ledger_lib
from pipeline.accounting import plots, report
from pipeline.config import PipelineConfig
from pipeline.data import buffer as buffer_lib
from pipeline.data import rollouts as rollouts_lib
from pipeline.data import run_layout
from pipeline.data.acceptance_record import read_acceptance
from pipeline.data.held_out import held_out_rollouts
from pipeline.data.keys import acceptance_key, buffer_key, rollouts_key, rollouts_prefix
from pipeline.data.replay_record import read_replay
from pipeline.data.rollouts import committed_steps
from pipeline.data.store import ObjectStore
from pipeline.data.training_record import read_training
from pipeline.models.layers import stored_layer_ids
from pipeline.serving import deploy
from pipeline.stages import EVALUATION, EXTRACTION, TRAINING, Stage
from pipeline.training import outcome as outcome_lib
from pipeline.training import plan as plan_lib
from resources import PipelineResource

GROUP = "cotraining"
PLOT_STEPS = 50  # steps shown in the acceptance plot of a materialization


BUFFER_SCHEMA = dg.TableSchema(
    columns=[
        dg.TableColumn("rl_step", "int", description="RL step the samples come from"),
        dg.TableColumn("samples", "int", description="samples of that step in the buffer"),
    ]
)


@dg.asset(
    partitions_def=rl_step,
    group_name=GROUP,
    kinds={"parquet"},
    description="Rollouts of one RL step (token ids, loss mask, reward, policy version) and the pointer "
    "to the policy checkpoint, as the RL trainer (or the simulated source) committed them.",
)
def rollouts(
    context: dg.AssetExecutionContext, pipeline: PipelineResource) -> dg.MaterializeResult:
    """Validates the step's rollouts against the schema; everything downstream trusts them."""
    cfg, store, step = pipeline.config, pipeline.store(), step_of(context)
    rows = rollouts_lib.read_rollouts(store, cfg.run, step)
    pointer = rollouts_lib.read_policy_pointer(store, cfg.run, step)
    layout = run_layout.checkpoint_layout(store, pointer.checkpoint_uri,
                                          lambda n: stored_layer_ids(cfg.drafter, n) or [n])
    run_layout.check_step_layout(store, cfg.run, step, layout)  # a policy of another layout needs a new run
    held_out = held_out_rollouts(rows, cfg.eval.held_out_fraction)
    return dg.MaterializeResult(
        metadata={
            "samples": len(rows),
            "held_out_samples": len(held_out),
            "tokens": sum(len(r.input_ids) for r in rows),
            "response_tokens": sum(sum(r.loss_mask) for r in rows),
            "mean_reward": round(sum(r.reward for r in rows) / len(rows), 4),
            "policy_version": pointer.policy_version,
            "target_layout": str(layout),
            "policy_checkpoint": dg.MetadataValue.path(pointer.checkpoint_uri),
            "bytes": store.size(rollouts_key(cfg.run, step)),
            "uri": dg.MetadataValue.path(store.uri(rollouts_prefix(cfg.run, step))),
        }
    )


@dg.asset(
    partitions_def=rl_step,
    group_name=GROUP,
    deps=[rollouts],
    kinds={"pytorch", "arrow"},
    pool="gpu",
    description="The target's hidden states for the step's training rollouts: Arrow IPC shards (bf16, "
    "bit-exact, one column per layer, optionally split-zstd) plus a _manifest.json commit point in object storage.",
    check_specs=[
        dg.AssetCheckSpec(
            "shards_valid",
            asset="hidden_states",
            blocking=True,
            description="Hidden size, finite values, lengths agree with the tokens.",
        )
    ],
)
def hidden_states(
    context: dg.AssetExecutionContext, pipeline: PipelineResource) -> dg.MaterializeResult:
    """Source B (default): the step's policy runs forward over its rollouts; source A: vLLM's files. Either
    in the extraction worker's own process (`launch.extraction.nproc` ranks; a GPU pod in production), which reports
    the materialization, where it ran and the `shards_valid` check over Pipes."""
    launcher, step = pipeline.launcher(), step_of(context)
    return launcher.run_stage(context, launcher.stage_job(EXTRACTION, step)).get_materialize_result()


@dg.asset(
    partitions_def=rl_step,
    group_name=GROUP,
    deps=[hidden_states],
    kinds={"json"},
    description="The rolling cross-step buffer: a manifest pointing at the samples of the last "
    "`train.buffer_steps` steps (at most `train.data_buffer_max_size`, oldest evicted first).",
    check_specs=[
        dg.AssetCheckSpec(
            "buffer_within_limits",
            asset="drafter_buffer",
            description="At most train.data_buffer_max_size samples, all from the last train.buffer_steps steps.",
        )
    ],
)
def drafter_buffer(
    context: dg.AssetExecutionContext, pipeline: PipelineResource) -> dg.MaterializeResult:
    """A manifest, not a copy: buffers of consecutive steps share their shards."""
    cfg, store, step = pipeline.config, pipeline.store(), step_of(context)
    built = buffer_lib.build_buffer(store, cfg.run, step, cfg.train.buffer_steps, cfg.train.data_buffer_max_size)
    by_step = built.composition
    oldest_allowed = step - cfg.train.buffer_steps + 1
    return dg.MaterializeResult(
        metadata={
            "samples": built.num_samples,
            "tokens": built.num_tokens,
            "steps": str(sorted(by_step)),
            "composition": dg.MetadataValue.table(
                records=[dg.TableRecord({"rl_step": s, "samples": n}) for s, n in sorted(by_step.items())],
                schema=BUFFER_SCHEMA,
            ),
            "uri": dg.MetadataValue.path(store.uri(buffer_key(cfg.run, step))),
        },
        check_results=[
            dg.AssetCheckResult(
                check_name="buffer_within_limits",
                passed=built.num_samples <= cfg.train.data_buffer_max_size
                and all(oldest_allowed <= s <= step for s in by_step),
                metadata={"max_samples": cfg.train.data_buffer_max_size, "oldest_step_allowed": oldest_allowed},
            )
        ],
    )


@dg.asset(
    partitions_def=rl_step,
    group_name=GROUP,
    deps=[drafter_buffer],
    kinds={"pytorch", "mlflow"},
    pool="gpu",
    description="A drafter training run warm-started from the champion, tracked in MLflow and registered "
    "as a model version (alias `challenger`). Skipped, with the reason, when FastRL's trigger says so.",
)
def drafter(context: dg.AssetExecutionContext, pipeline: PipelineResource) -> dg.MaterializeResult:
    """Trains every `train.training_interval_steps` once the buffer holds `train.min_samples` (or when
    live_tau_sensor asks for a retraining), in its own process (torchrun, or a GPU pod) that resumes
    from its last checkpoint when a rerun finds one."""
    cfg, store, registry, step = pipeline.config, pipeline.store(), pipeline.registry(), step_of(context)
    requested_by = context.run.tags.get(RETRAIN_TAG)
    # A run the sensor asked for trains on the newest buffer; a backfill trains every step, in order. The
    # `acceptance` and `cost` schedules read the champion's live tau from the fleet's replicas.
    plan = plan_lib.plan_training(store, cfg, step, registry, requested_by, BACKFILL_TAG not in context.run.tags,
                                  functools.partial(deploy.live_tau, cfg, store))
    tags = {"dagster_run_id": context.run.run_id, "dagster_asset": "drafter", "rl_step": context.partition_key,
            "pipeline_run": cfg.run}
    planned = plan_lib.settle_plan(plan, cfg, registry, tags)
    if isinstance(planned, outcome_lib.TrainOutcome):  # skipped, or a version trained on identical inputs exists
        outcome_lib.write_outcome(store, cfg.run, step, planned)
        return dg.MaterializeResult(metadata=outcome_lib.outcome_metadata(planned))
    context.log.info(f"launching training ({cfg.launch.launcher}, {cfg.launch.training.nproc} process(es) per node)"
                     + (f", continuing MLflow run {planned.run_id}" if planned.run_id else "")
                     + (f", requested: {requested_by}" if requested_by else ""))
    # Rank 0 of the training process reports the materialization (and writes the step's outcome).
    return pipeline.launcher().train(context, planned).get_materialize_result()


@dg.asset(
    partitions_def=rl_step,
    group_name=GROUP,
    deps=[drafter],
    kinds={"pytorch"},
    pool="gpu",
    description="Acceptance (tau, acceptance rate, per position) of the new drafter, the serving champion "
    "and the never-retrained baseline on held-out prompts of this step's policy; the promotion decision.",
    check_specs=[
        dg.AssetCheckSpec(
            "tau_in_range", asset="acceptance", description="1 <= tau <= k + 1 for every drafter measured."
        )
    ],
)
def acceptance(context: dg.AssetExecutionContext, pipeline: PipelineResource) -> dg.MaterializeResult:
    """Real speculative decoding with greedy verification against the step's target, in the evaluation
    worker's own process (`launch.evaluation.nproc` ranks; a GPU pod in production), which measures every drafter of the
    step, decides the promotion and reports tau, where it ran and the `tau_in_range` check over Pipes; the
    plots and the ledger are added here from the records it wrote."""
    cfg, store, launcher, step = pipeline.config, pipeline.store(), pipeline.launcher(), step_of(context)
    training = read_training(store, cfg.run, step)
    spent = _stage_seconds(context, {EXTRACTION: cfg.launch.extraction.nproc,
                                     TRAINING: cfg.launch.training.nproc if training.figures else 0})
    job = launcher.stage_job(EVALUATION, step, new_version=training.version, spent_s=spent)
    measured = launcher.run_stage(context, job).get_materialize_result()
    record = read_acceptance(store, cfg.run, step)
    metadata = dict(measured.metadata or {})
    metadata["uri"] = dg.MetadataValue.path(store.uri(acceptance_key(cfg.run, step)))
    if record.champion_after:
        metadata["mlflow_champion"] = dg.MetadataValue.url(
            pipeline.registry().version_url(record.champion_after, pipeline.mlflow_ui_url))
    metadata["tau_by_step"] = _tau_plot(store, cfg, step)
    shown = [s for s in committed_steps(store, cfg.run) if s <= step][-PLOT_STEPS:]
    ledger = ledger_lib.read_ledger(store, cfg.run, shown)
    metadata.update(_ledger_metadata(ledger))
    metadata.update(_replay_metadata(store, cfg.run, step))
    ledger_lib.log_served(pipeline.registry(), ledger)
    return dg.MaterializeResult(metadata=metadata, check_results=measured.check_results)


def _stage_seconds(context: dg.AssetExecutionContext, devices: dict[Stage, int]) -> dict[Stage, float]:
    """Device-seconds of this run's extraction and training steps, from Dagster's own step timings: a
    step's wall time counts once per rank it launched (`devices`; 0 when it launched none)."""
    seconds = {}
    for stats in context.instance.get_run_step_stats(context.run_id):
        stage = next((s for s in devices if s.asset == stats.step_key), None)
        if stage and stats.start_time and stats.end_time:
            seconds[stage] = (stats.end_time - stats.start_time) * devices[stage]
    return seconds


def _ledger_metadata(ledger: ledger_lib.Ledger) -> dict:
    """This step's lag and cost (numbers Dagster plots over partitions), and the run's ledger up to it."""
    cost, lag = ledger.costs[-1], ledger.lags[-1]
    return {
        "served_version": cost.served_version or "none",
        "lag_steps": lag.lag_steps if lag.lag_steps is not None else -1,  # -1: no drafter served the rollouts
        "spent_s": round(sum(cost.seconds.values()), 2),
        "saved_s": round(cost.saved_s, 3),
        "ledger": dg.MetadataValue.md(plots.png_markdown(
            report.ledger_png(ledger, dpi=90), "the served drafter's lag, and device-seconds spent against saved")),
    }


def _replay_metadata(store: ObjectStore, run: str, step: int) -> dict:
    """The step's measured rollout speedups (numbers Dagster plots over partitions), where a replay ran."""
    replay = read_replay(store, run, step)
    if replay is None:
        return {}
    speedups = {"speedup_served": replay.speedup("served"), "speedup_served_tail": replay.speedup("served", tail=True),
                "speedup_served_over_baseline": replay.speedup("served", over="baseline"),
                "speedup_cotrained": replay.speedup("cotrained"),
                "speedup_cotrained_tail": replay.speedup("cotrained", tail=True)}
    return {name: round(value, 3) for name, value in speedups.items() if value is not None}


def _tau_plot(store: ObjectStore, cfg: PipelineConfig, step: int) -> dg.MetadataValue:
    """The picture an operator looks for: tau per step over the last PLOT_STEPS steps, up to this one."""
    earlier = [s for s in committed_steps(store, cfg.run) if s <= step][-PLOT_STEPS:]
    rows = report.acceptance_rows(store, cfg.run, earlier)
    return dg.MetadataValue.md(plots.png_markdown(
        report.acceptance_png(rows, cfg.eval.num_speculative_tokens, cfg.drafter.kind, dpi=90),
        "tau per RL step: co-trained, served (champion), never retrained (baseline)"))
