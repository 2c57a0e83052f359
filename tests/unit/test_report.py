"""Reports read what the step's assets stored: the summary rows, the table, the JSON summary, the plots."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from pipeline.accounting import plots, report
from pipeline.accounting.cost import StepCost
from pipeline.accounting.ledger import Ledger
from pipeline.data.acceptance_record import AcceptanceRecord, DrafterTau, TauEstimate
from pipeline.data.buffer import write_buffer
from pipeline.data.buffer_record import BufferEntry
from pipeline.data.keys import acceptance_key, drafter_key, replay_key
from pipeline.data.records import read_record, write_record
from pipeline.data.replay_record import ArmReplay, RolloutReplay
from pipeline.data.rollouts import Rollout, write_rollouts_file
from pipeline.data.store import ObjectStore
from pipeline.data.training_record import TrainingRecord
from pipeline.sampling import SamplingParams
from pipeline.stages import EVALUATION, EXTRACTION, TRAINING

RUN = "r"
PNG = b"\x89PNG\r\n\x1a\n"


def _tau(version: str, tau: float, estimate: TauEstimate | None = None) -> DrafterTau:
    return DrafterTau(version, tau, (tau - 1) / 4, (0.9, 0.7, 0.4, 0.1), 20, 80, int(20 * (tau - 1)), 6, estimate)


def _store_step(store: ObjectStore, step: int, drafters: dict[str, DrafterTau | None], trained: bool,
                promoted: bool) -> None:
    write_rollouts_file(store, RUN, step, [Rollout(f"s{step}-{i}", [1, 2, 3], [0, 1, 1], 0.0, step) for i in range(5)])
    write_buffer(store, RUN, step, [BufferEntry(step, f"s{step}-{i}", "part-00000.arrow", i, 3) for i in range(4)])
    write_record(store, drafter_key(RUN, step), TrainingRecord(step, trained, "why", 4))
    write_record(store, acceptance_key(RUN, step), AcceptanceRecord(
        step, step, 6, 4, 32, drafters["cotrained"], drafters["served"], drafters["baseline"], None, promoted,
        "decided", "1"))


@pytest.fixture
def store(tmp_path: Path) -> ObjectStore:
    store = ObjectStore(tmp_path.as_uri())
    _store_step(store, 1, {"cotrained": _tau("1", 2.123456, TauEstimate(2.0, (0.5,), 3, 40)), "served": None,
                           "baseline": _tau("1", 2.123456)}, trained=True, promoted=True)
    _store_step(store, 2, {"cotrained": None, "served": _tau("1", 1.8), "baseline": _tau("1", 1.8)},
                trained=False, promoted=False)
    return store


def test_step_row_reads_every_stage_of_the_step(store: ObjectStore) -> None:
    assert report.step_row(store, RUN, 1).to_json() == {
        "step": 1, "samples": 5, "buffer_samples": 4, "captured": None, "bytes_stored": None, "trained": True,
        "train_reason": "why",
        "tau_cotrained": 2.1235, "tau_baseline": 2.1235, "tau_served": report.NO_DRAFTER_TAU,
        "promoted": True, "version_cotrained": "1", "version_served": None,
        "acceptance_rate_cotrained": round((2.123456 - 1) / 4, 4),
        "eval_prompts_cotrained": 6, "eval_rounds_cotrained": 20,
        "tau_estimate_cotrained": {"tau": 2.0, "rollouts": 3, "positions": 40},
        "tau_greedy_cotrained": 2.1235, "tau_greedy_served": report.NO_DRAFTER_TAU, "tau_greedy_baseline": 2.1235,
        "sampling": "greedy", "draft_sample_method": "greedy",
        **report.replay_fields(store, RUN, 3),  # no replay: every figure None
        **dict.fromkeys(report.TAIL_FIELDS),  # a step published whole: no tail, no refresh
    }
    assert report.replay_fields(store, RUN, 3)["speedup_served"] is None


def test_a_replay_gives_each_arms_seconds_and_the_measured_speedups(store: ObjectStore) -> None:
    """Served 8 s against no drafter's 10 s: 1.25x; in the tail 2 s against 4 s: 2x; the never-retrained drafter
    took as long as no drafter."""
    none = ArmReplay(None, 10.0, 1000, 0, 900, 1.0, 4.0, 200, 0, runs_s=(10.0, 12.0, 11.0),
                     tail_runs_s=(4.0, 4.5, 6.0))
    served = ArmReplay("1", 8.0, 1000, 300, 100, 2.5, 2.0, 200, 8, runs_s=(8.0, 8.0, 11.0),
                       tail_runs_s=(2.0, 3.0, 2.5))
    write_record(store, replay_key(RUN, 1), RolloutReplay(1, 5, 1000, 4, SamplingParams(temperature=1.0), "greedy",
                                                          {"none": none, "baseline": none, "served": served}))
    fields = report.replay_fields(store, RUN, 1)
    assert (fields["rollout_s_none"], fields["rollout_s_served"], fields["rollout_s_cotrained"]) == (10.0, 8.0, None)
    assert (fields["speedup_served"], fields["speedup_served_tail"]) == (1.25, 2.0)
    assert (fields["speedup_baseline"], fields["speedup_served_over_baseline"]) == (1.0, 1.25)
    assert fields["speedup_cotrained"] is None
    # run by run (the arms took turns): whole step 10/8, 12/8, 11/11; tail 4/2, 4.5/3, 6/2.5
    assert fields["replay_runs"] == 3
    assert (fields["speedup_served_runs"], fields["speedup_served_tail_runs"]) == ([1.0, 1.5], [1.5, 2.4])
    assert read_record(store, replay_key(RUN, 1), RolloutReplay).arms["served"].tail_runs_s == (2.0, 3.0, 2.5)
    table = report.format_replay([report.StepRow(1, **fields)]).splitlines()
    assert table[2].split() == ["1", "10.00", "10.00", "8.00", "-", "1.25x", "2.00x", "1.50-2.40x", "1.25x", "-x",
                                "-x"]
    assert report.replay_png([report.StepRow(1, **fields)]).startswith(b"\x89PNG")


def test_tail_goals_average_the_ratios_over_steps_from_two() -> None:
    rows = [report.StepRow(1, tail_tau_start=1.0, tail_tau_refreshed=2.0, tail_tau_whole_step=2.0,
                           refresh_latency_s=9.0, refresh_latency_share=0.15),
            report.StepRow(2, tail_tau_start=2.0, tail_tau_refreshed=2.7, tail_tau_whole_step=3.0,
                           refresh_latency_s=12.0, refresh_latency_share=0.2),
            report.StepRow(3, tail_tau_start=2.0, tail_tau_refreshed=2.9, tail_tau_whole_step=None,
                           refresh_latency_s=18.0, refresh_latency_share=0.3),
            report.StepRow(4, tail_tau_start=2.0, tail_tau_refreshed=None, tail_tau_whole_step=3.0)]
    assert report.tail_goals(rows) == {"steps": [2, 3], "refreshed_over_whole_step": 0.9,
                                       "refreshed_over_start": 1.4, "latency_share": 0.25, "latency_s": 15.0}
    assert report.tail_goals(rows[3:]) is None
    table = report.format_tail(rows).splitlines()
    assert table[0].split() == ["step", "tail", "start", "refreshed", "whole", "step", "refresh", "v", "latency", "s",
                                "of", "period"]
    assert table[5].split() == ["4", "2.00", "-", "3.00", "-", "-", "-"]


def test_a_step_without_a_new_drafter_reports_no_cotrained_figures(store: ObjectStore) -> None:
    row = report.step_row(store, RUN, 2)
    assert (row.trained, row.tau_cotrained, row.tau_served) == (False, report.NO_DRAFTER_TAU, 1.8)
    assert (row.version_cotrained, row.version_served) == (None, "1")
    assert (row.acceptance_rate_cotrained, row.eval_prompts_cotrained, row.tau_estimate_cotrained) == (0.0, None, None)


def test_acceptance_rows_skip_steps_without_a_record(store: ObjectStore) -> None:
    assert report.acceptance_rows(store, RUN, [1, 2, 3]) == [
        report.StepRow(1, tau_cotrained=2.1235, tau_served=1.0, tau_baseline=2.1235),
        report.StepRow(2, tau_cotrained=1.0, tau_served=1.8, tau_baseline=1.8),
    ]


def test_format_table(store: ObjectStore) -> None:
    rows = [report.step_row(store, RUN, s) for s in (1, 2)]
    assert report.format_table(rows).splitlines() == [
        "step samples buffer trained tau co-trained tau served tau baseline greedy co-tr promoted",
        "-" * 88,
        "   1       5      4     yes           2.12       1.00         2.12         2.12      yes",
        "   2       5      4      no           1.00       1.80         1.80         1.00       no",
        "(tau at the rollouts' sampling, greedy, greedy drafting, as vLLM verifies drafts; greedy co-tr: the "
        "co-trained drafter at temperature 0)",
    ]
    with_reward = report.format_table([replace(rows[0], trl_mean_reward=0.25)])
    assert with_reward.splitlines()[0].endswith("TRL reward")
    assert with_reward.splitlines()[2].endswith("0.250")


def test_summary_json_and_plots(store: ObjectStore, tmp_path: Path) -> None:
    rows = [report.step_row(store, RUN, s) for s in (1, 2)]
    path = report.write_summary(rows, 12.345, [6.0, 6.3449], tmp_path / "out" / "summary.json", drafter_kind="eagle3")
    doc = json.loads(path.read_text())
    assert (doc["wall_s"], doc["step_wall_s"], doc["drafter_kind"]) == (12.35, [6.0, 6.34], "eagle3")
    assert doc["steps"] == [r.to_json() for r in rows]
    assert "trl_mean_reward" not in doc["steps"][0]  # what only a GRPO demo reports
    assert report.plot(rows, 4, tmp_path / "out" / "acceptance.png", "eagle3").read_bytes().startswith(PNG)
    assert plots.loss_png([4.0, 2.0, 0.1], "loss").startswith(PNG)
    markdown = plots.png_markdown(PNG, "tau")
    assert markdown.startswith("![tau](data:image/png;base64,")


def _schedule_step(step: int, trained: bool, tau: float, decoding, reason: str = "why") -> report.ScheduleStep:
    saved = decoding.saved_seconds(tau, 1000) if decoding else 0.0
    return report.ScheduleStep(step, trained, reason, 10.0 if trained else 0.0, 0.0, tau, saved, 0.0, 1000, decoding)


def test_schedules_side_by_side_are_priced_alike() -> None:
    """Two runs timed t at 1 and 3 ms per token (a loaded machine in the second): side by side, both are priced at
    the median of their timings, so the same served tau saves the same seconds in either, and the table says why
    `cost` skipped."""
    from pipeline.accounting.cost import DecodingCost

    fast, slow = DecodingCost(1e-3, 0.1, 4), DecodingCost(3e-3, 0.1, 4)
    runs = {"interval": [_schedule_step(1, True, 1.0, None), _schedule_step(2, True, 2.8, fast),
                         _schedule_step(3, True, 2.8, fast)],
            "cost": [_schedule_step(1, True, 1.0, None), _schedule_step(2, True, 2.8, slow),
                     _schedule_step(3, False, 2.8, slow, "keeping champion v2 loses 0.1 s <= 5.0 s per chance")]}
    price = report.common_price(runs)
    assert price == DecodingCost(2e-3, 0.1, 4)
    priced = {kind: report.at_price(rows, price) for kind, rows in runs.items()}
    per_step = 1000 * 2e-3 * (1 - 1.4 / 2.8)  # 1.0 s at the common price
    for rows in priced.values():
        assert [r.saved_s for r in rows] == pytest.approx([0.0, per_step, per_step])
        assert rows[-1].cumulative_saved_s == pytest.approx(2 * per_step)
    assert report.schedule_totals(priced["cost"]) == report.ScheduleTotals(20.0, 0.0, 2.0, (1, 2))
    table = report.format_schedules(priced)
    assert "   3   yes    10.0  2.80      2.00 |    no     0.0  2.80      2.00" in table
    assert "cost: trained steps [1, 2], training 20.0 s (refresh 0.0 s), saved 2.00 s of rollout time" in table
    assert "   3 skipped: keeping champion v2 loses 0.1 s <= 5.0 s per chance" in table
    assert report.common_price({"interval": runs["interval"][:1]}) is None


def test_speedup_goals_summarise_the_served_drafter_from_step_three() -> None:
    rows = [report.StepRow(2, speedup_served=0.5, speedup_served_tail=0.5, speedup_served_min_batch=0.5,
                           speedup_served_over_baseline=0.5),
            report.StepRow(3, speedup_served=1.2, speedup_served_tail=1.6, speedup_served_min_batch=0.98,
                           speedup_served_over_baseline=1.1),
            report.StepRow(4, speedup_served=1.4, speedup_served_tail=2.0, speedup_served_min_batch=1.0),
            report.StepRow(5)]
    assert report.speedup_goals(rows) == {
        "steps": [3, 4], "served_tail": {"min": 1.6, "mean": 1.8}, "served_whole": {"min": 1.2, "mean": 1.3},
        "served_worst_batch": {"min": 0.98, "mean": 0.99}, "served_over_baseline": {"min": 1.1, "mean": 1.1}}
    assert report.speedup_goals(rows[:1]) is None


def test_the_step_by_phase_puts_the_ledgers_stage_seconds_beside_the_trainers() -> None:
    """The trainer's phases from the row, the pipeline's device-seconds from the step's cost (keyed by stage)."""
    phases = {"generation_s": 9.2, "update_s": 37.6, "weight_push_s": 3.0, "publish_s": 1.5}
    cost = StepCost(1, {EXTRACTION: 3.9, TRAINING: 9.4, EVALUATION: 25.3}, 800, "1", 2.1, None)
    table = report.format_phases([report.StepRow(1, phases=phases)], Ledger([], [cost])).splitlines()
    assert table[2].split() == ["1", "9.2", "37.6", "3.0", "1.5", "3.9", "9.4", "25.3", "0.0"]
