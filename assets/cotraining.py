"""The co-training loop of one RL step as Dagster assets, partitioned by `rl_step`.

    rollouts -> hidden_states -> drafter_buffer -> drafter -> acceptance

Each asset coordinates and calls into `pipeline/`; the heavy data is written to the
object store by that code and the assets return metadata only (no pickling IO manager).
"""

import dagster as dg

from assets.partitions import BACKFILL_TAG, RETRAIN_TAG, rl_step, step_of
from pipeline import ledger as ledger_lib
from pipeline import report
from pipeline.config import PipelineConfig
from pipeline.data import buffer as buffer_lib
from pipeline.data import capture, run_layout
from pipeline.data import rollouts as rollouts_lib
from pipeline.data import shard_checks as checks
from pipeline.data.held_out import held_out_rollouts
from pipeline.data.keys import acceptance_key, buffer_key, hidden_states_prefix, rollouts_key, rollouts_prefix
from pipeline.data.records import AcceptanceRecord, TailTau, read_training
from pipeline.data.rollouts import committed_steps
from pipeline.data.store import ObjectStore
from pipeline.evaluation import acceptance as acceptance_lib
from pipeline.evaluation import tail as tail_lib
from pipeline.models.drafter import stored_layer_ids
from pipeline.sources import extract
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
    """Source B (default): the step's policy runs forward over its rollouts; source A: vLLM's files."""
    cfg, store, step = pipeline.config, pipeline.store(), step_of(context)
    manifest = extract.extract_hidden_states(store, cfg, step)
    plan = capture.read_plan(store, cfg.run, step)
    problems = checks.check_shards(store, cfg.run, step)
    return dg.MaterializeResult(
        metadata={
            "samples": manifest.num_samples,
            "tokens": manifest.num_tokens,
            "bytes": manifest.total_bytes,
            **(plan.summary() if plan else {}),  # rollouts captured of published, tokens stored of forwarded
            "shards": len(manifest.shards),
            "hidden_size": manifest.hidden_size,
            "layer_ids": str(manifest.layer_ids),
            "compression": manifest.compression,
            "target": manifest.target["model_id"],
            **manifest.ingest,  # vLLM connector files: read, unmatched, refused; rollouts without a file
            "uri": dg.MetadataValue.path(store.uri(hidden_states_prefix(cfg.run, step))),
        },
        check_results=[
            dg.AssetCheckResult(
                check_name="shards_valid",
                passed=not problems,
                metadata={"problems": dg.MetadataValue.md("\n".join(f"* {p}" for p in problems) or "none")},
            )
        ],
    )


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
    # A run the sensor asked for trains on the newest buffer; a backfill trains every step, in order.
    plan = plan_lib.plan_training(store, cfg, step, registry, requested_by, BACKFILL_TAG not in context.run.tags)
    tags = {"dagster_run_id": context.run.run_id, "dagster_asset": "drafter", "rl_step": context.partition_key,
            "pipeline_run": cfg.run}
    planned = plan_lib.settle_plan(plan, cfg, registry, tags)
    if isinstance(planned, outcome_lib.TrainOutcome):  # skipped, or a version trained on identical inputs exists
        outcome_lib.write_outcome(store, cfg.run, step, planned)
        return dg.MaterializeResult(metadata=outcome_lib.outcome_metadata(planned))
    context.log.info(f"launching training ({cfg.train.launcher}, {cfg.train.nproc_per_node} process(es) per node)"
                     + (f", continuing MLflow run {planned.run_id}" if planned.run_id else "")
                     + (f", requested: {requested_by}" if requested_by else ""))
    # Rank 0 of the training process reports the materialization (and writes the step's outcome).
    return pipeline.launcher().launch(context, planned).get_materialize_result()


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
    """Real speculative decoding with greedy verification against the step's target."""
    cfg, store, registry, step = pipeline.config, pipeline.store(), pipeline.registry(), step_of(context)
    training = read_training(store, cfg.run, step)
    spent = _stage_seconds(context, cfg.train.nproc_per_node if training.figures else 0)
    record = acceptance_lib.evaluate_step(store, cfg, step, registry, training.version, spent)
    ceiling = cfg.eval.num_speculative_tokens + 1
    measured = record.measured()
    metadata = _acceptance_metadata(record)
    metadata["uri"] = dg.MetadataValue.path(store.uri(acceptance_key(cfg.run, step)))
    if record.champion_after:
        metadata["mlflow_champion"] = dg.MetadataValue.url(
            registry.version_url(record.champion_after, pipeline.mlflow_ui_url))
    metadata["tau_by_step"] = _tau_plot(store, cfg, step)
    shown = [s for s in committed_steps(store, cfg.run) if s <= step][-PLOT_STEPS:]
    ledger = ledger_lib.read_ledger(store, cfg.run, shown)
    metadata.update(_ledger_metadata(ledger))
    ledger_lib.log_served(registry, ledger)
    tail = tail_lib.measure_tail(store, cfg, step, registry)  # a step published in parts: tau on its tail
    if tail:
        metadata.update(_tail_metadata(tail))
        tail_lib.log_tail(registry, tail)
    return dg.MaterializeResult(
        metadata=metadata,
        check_results=[
            dg.AssetCheckResult(
                check_name="tau_in_range",
                passed=all(1.0 <= d.tau <= ceiling for d in measured.values()),
                metadata={"ceiling": ceiling},
            )
        ],
    )


STAGE_OF_STEP = {"hidden_states": "extraction", "drafter": "training"}


def _stage_seconds(context: dg.AssetExecutionContext, training_devices: int) -> dict[str, float]:
    """Device-seconds of this run's extraction and training steps, from Dagster's own step timings: the
    training step's wall time counts once per process it launched (0 when it launched none)."""
    seconds = {}
    for stats in context.instance.get_run_step_stats(context.run_id):
        stage = STAGE_OF_STEP.get(stats.step_key)
        if stage and stats.start_time and stats.end_time:
            devices = training_devices if stage == "training" else 1
            seconds[stage] = (stats.end_time - stats.start_time) * devices
    return seconds


def _acceptance_metadata(record: AcceptanceRecord) -> dict:
    """Tau and version per drafter role, and the promotion decision."""
    measured = record.measured()
    metadata: dict = {f"tau_{role}": round(d.tau, 3) for role, d in measured.items()}
    metadata.update({f"version_{role}": d.version for role, d in measured.items()})
    metadata.update({"promoted": record.promoted, "decision": record.decision,
                     "champion_after": record.champion_after or "none"})
    if cotrained := measured.get("cotrained"):
        metadata["acceptance_rate_cotrained"] = round(cotrained.acceptance_rate, 3)
        metadata["per_position_cotrained"] = str([round(p, 3) for p in cotrained.per_position])
    return metadata


def _tail_metadata(tail: TailTau) -> dict:
    """Tau on the step's tail per drafter and the refresh's latency (numbers Dagster plots; -1: none)."""
    metadata: dict = {f"tail_tau_{role}": round(tau, 3) if tau is not None else -1.0 for role, tau in tail.taus.items()}
    metadata.update({"tail_parts": str(list(tail.tail_parts)), "tail_prompts": tail.prompts,
                     "refresh_latency_s": tail.refresh_latency_s if tail.refresh_latency_s is not None else -1.0,
                     "refresh_latency_share": tail.latency_share if tail.latency_share is not None else -1.0})
    return metadata


def _ledger_metadata(ledger: ledger_lib.Ledger) -> dict:
    """This step's lag and cost (numbers Dagster plots over partitions), and the run's ledger up to it."""
    cost, lag = ledger.costs[-1], ledger.lags[-1]
    return {
        "served_version": cost.served_version or "none",
        "lag_steps": lag.lag_steps if lag.lag_steps is not None else -1,  # -1: no drafter served the rollouts
        "spent_s": round(sum(cost.seconds.values()), 2),
        "saved_s": round(cost.saved_s, 3),
        "ledger": dg.MetadataValue.md(report.png_markdown(
            report.ledger_png(ledger, dpi=90), "the served drafter's lag, and device-seconds spent against saved")),
    }


def _tau_plot(store: ObjectStore, cfg: PipelineConfig, step: int) -> dg.MetadataValue:
    """The picture an operator looks for: tau per step over the last PLOT_STEPS steps, up to this one."""
    earlier = [s for s in committed_steps(store, cfg.run) if s <= step][-PLOT_STEPS:]
    rows = report.acceptance_rows(store, cfg.run, earlier)
    return dg.MetadataValue.md(report.png_markdown(
        report.acceptance_png(rows, cfg.eval.num_speculative_tokens, cfg.drafter.kind, dpi=90),
        "tau per RL step: co-trained, served (champion), never retrained (baseline)"))
