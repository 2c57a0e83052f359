"""Where a launched stage ran (pipeline/launch/placement.py): the StagePlacement its worker measures (alone and on
two gloo ranks, the largest rank's peak), its JSON round trip through a real store, and a stored one that does
not hold refused with its key named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from pipeline.data.keys import placement_key
from pipeline.data.records import RecordError, read_record, write_record
from pipeline.data.stage_placement import StagePlacement, read_placements
from pipeline.data.store import ObjectStore
from pipeline.launch.placement import (
    SUBMITTED_AT_ENV,
    device_name,
    measure_placement,
    peak_memory_bytes,
    process_started_at,
    waited_s,
)
from pipeline.ranks import SINGLE, join, leave, ranks_from_env
from pipeline.stages import DEPLOYMENT, EVALUATION, EXTRACTION, REFRESH, TRAINING

RUN, STEP = "run-a", 3
HELD_BY_RANK_1 = 512 * 2**20  # rank 1 holds this much more than rank 0


def _status_kib(field: str) -> int:
    """A figure of /proc/self/status (VmRSS: resident now, VmHWM: its peak), in KiB."""
    line = next(li for li in Path("/proc/self/status").read_text().splitlines() if li.startswith(f"{field}:"))
    return int(line.split()[1])


def _placement(stage=EXTRACTION, **changes) -> StagePlacement:
    fields = {"where": "ray", "ranks": 2, "device": "cuda:0 (NVIDIA H100 80GB HBM3)",
              "peak_memory_bytes": 41_234_567_890, "seconds": 12.345, "waited_s": 3.5, **changes}
    return StagePlacement(stage, **fields)


# --- what a worker measures ------------------------------------------------------------------------------------


def test_the_peak_on_cpu_is_the_processes_peak_resident_set_in_bytes() -> None:
    held = bytearray(64 * 2**20)  # touched: resident
    resident = _status_kib("VmRSS") * 1024
    peak = peak_memory_bytes("cpu")
    assert peak >= max(resident, len(held))
    assert peak <= _status_kib("VmHWM") * 1024 < 2 * peak  # bytes, not KiB
    del held


def test_a_launched_processes_peak_is_its_own_not_its_launchers() -> None:
    """Linux carries a process's peak resident set across fork and exec into getrusage's ru_maxrss: a worker
    that a large process launches (the Dagster run) would record that process's peak as its own."""
    held = bytearray(768 * 2**20)  # the launcher holds more than the child ever does while it starts it
    code = "from pipeline.launch.placement import peak_memory_bytes; print(peak_memory_bytes('cpu'))"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           cwd=Path(__file__).resolve().parents[3])
    assert 0 < int(child.stdout) < len(held)
    del held


def test_a_cpu_device_is_named_as_given() -> None:
    assert device_name("cpu") == "cpu"


def test_the_process_started_before_now_and_after_the_boot() -> None:
    started = process_started_at()
    assert started <= time.time()
    assert started >= time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)


def test_a_process_its_launcher_started_itself_waited_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SUBMITTED_AT_ENV, raising=False)
    assert waited_s() == 0.0


def test_a_queued_process_waited_from_its_submission_to_its_start(monkeypatch: pytest.MonkeyPatch) -> None:
    tick = 1 / os.sysconf("SC_CLK_TCK")
    monkeypatch.setenv(SUBMITTED_AT_ENV, repr(process_started_at() - 7.0))
    assert waited_s() == pytest.approx(7.0, abs=2 * tick)
    # a launcher's clock ahead of this machine's: no negative wait
    monkeypatch.setenv(SUBMITTED_AT_ENV, repr(time.time() + 60.0))
    assert waited_s() == 0.0


def test_a_submission_time_that_is_not_epoch_seconds_is_refused_naming_the_variable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SUBMITTED_AT_ENV, "yesterday")
    with pytest.raises(ValueError, match=f"{SUBMITTED_AT_ENV} is 'yesterday', not epoch seconds"):
        waited_s()


def test_one_rank_measures_where_it_ran_what_it_held_and_how_long(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SUBMITTED_AT_ENV, repr(process_started_at() - 4.0))
    started = time.perf_counter() - 1.25  # the stage's work began 1.25 s ago
    before = peak_memory_bytes("cpu")
    placement = measure_placement(TRAINING, "process", SINGLE, "cpu", started)
    assert (placement.stage, placement.where, placement.ranks, placement.device) == (TRAINING, "process", 1, "cpu")
    assert before <= placement.peak_memory_bytes <= peak_memory_bytes("cpu")
    assert 1.25 <= placement.seconds < 1.25 + 5.0
    assert placement.seconds == round(placement.seconds, 3)
    assert placement.waited_s == pytest.approx(4.0, abs=0.1)


def _rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    os.environ.pop(SUBMITTED_AT_ENV, None)
    ranks = ranks_from_env()
    join(ranks, "cpu")
    try:
        held = bytearray(HELD_BY_RANK_1 if rank == 1 else 0)  # touched (zeroed): resident
        own_before = peak_memory_bytes("cpu")
        placement = measure_placement(EVALUATION, "pod", ranks, "cpu", time.perf_counter())
        own_after = peak_memory_bytes("cpu")
        del held
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(
            {"placement": placement.to_json(), "own_before": own_before, "own_after": own_after}))
    finally:
        leave()


def test_two_ranks_record_the_largest_ranks_peak(tmp_path: Path) -> None:
    from tests.support.config import free_port  # here: the spawned ranks import this module, not transformers

    mp.start_processes(_rank_main, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    placements = [StagePlacement.from_json(g["placement"]) for g in got]
    assert placements[0].peak_memory_bytes == placements[1].peak_memory_bytes  # reduced on every rank
    assert (placements[0].stage, placements[0].where, placements[0].ranks) == (EVALUATION, "pod", 2)
    # rank 1's peak, larger than anything rank 0 held, is the record's
    assert got[0]["own_after"] + HELD_BY_RANK_1 // 2 < got[1]["own_before"]
    assert got[1]["own_before"] <= placements[0].peak_memory_bytes <= got[1]["own_after"]


# --- the stored record -----------------------------------------------------------------------------------------


def test_a_placement_reads_back_from_the_store_as_written(store: ObjectStore) -> None:
    key = placement_key(RUN, STEP, EXTRACTION)
    assert key == f"placement/{RUN}/step-{STEP:06d}/extraction.json"
    placement = _placement()
    write_record(store, key, placement)
    assert store.read_json(key)["schema_version"] == 1
    assert store.read_json(key)["stage"] == "extraction"  # a stage is stored by its name
    assert read_record(store, key, StagePlacement) == placement


def test_a_placement_without_a_wait_never_queued() -> None:
    doc = _placement().to_json()
    del doc["waited_s"]
    assert StagePlacement.from_json(doc).waited_s == 0.0


def test_a_placements_figures_are_shown_rounded_for_its_materialization() -> None:
    assert _placement().metadata() == {"ran_in": "ray", "ranks": 2, "device": "cuda:0 (NVIDIA H100 80GB HBM3)",
                                       "peak_memory_gb": 41.235, "stage_seconds": 12.35, "waited_seconds": 3.5}


def test_a_steps_placements_are_read_in_stage_order_skipping_stages_that_recorded_none(store: ObjectStore) -> None:
    evaluation, extraction = _placement(EVALUATION, where="process", ranks=1), _placement(EXTRACTION)
    write_record(store, placement_key(RUN, STEP, EVALUATION), evaluation)
    write_record(store, placement_key(RUN, STEP, EXTRACTION), extraction)
    write_record(store, placement_key(RUN, STEP + 1, TRAINING), _placement(TRAINING))  # another step's
    assert read_placements(store, RUN, STEP) == (extraction, evaluation)
    assert read_placements(store, RUN, STEP + 2) == ()


def test_a_refresh_placement_is_not_one_of_the_steps_own(store: ObjectStore) -> None:
    write_record(store, placement_key(RUN, STEP, REFRESH), _placement(REFRESH))
    assert read_placements(store, RUN, STEP) == ()


def _without(field: str) -> dict:
    doc = _placement().to_json()
    del doc[field]
    return doc


@pytest.mark.parametrize(("doc", "says"), [
    pytest.param(["extraction"], "not a JSON object", id="not-an-object"),
    pytest.param({**_placement().to_json(), "schema_version": 2}, "schema_version 2", id="another-version"),
    pytest.param({**_placement().to_json(), "stage": "sampling"}, "stage 'sampling' is not one of", id="no-stage"),
    pytest.param({**_placement().to_json(), "stage": DEPLOYMENT.name, "ranks": "two"}, "field ranks must be a int",
                 id="ranks-not-a-number"),
    pytest.param({**_placement().to_json(), "ranks": "2"}, "field ranks must be a int", id="ranks-a-string"),
    pytest.param({**_placement().to_json(), "ranks": True}, "field ranks must be a int", id="ranks-a-bool"),
    pytest.param({**_placement().to_json(), "device": None}, "field device must be a str", id="device-null"),
    pytest.param(_without("peak_memory_bytes"), "KeyError: 'peak_memory_bytes'", id="missing-field"),
    pytest.param({**_placement().to_json(), "seconds": None}, "field seconds must be a number", id="seconds-null"),
])
def test_a_stored_placement_that_does_not_hold_is_refused_naming_its_key(store: ObjectStore, doc: object,
                                                                         says: str) -> None:
    key = placement_key(RUN, STEP, EVALUATION)
    store.write_json(key, doc)
    with pytest.raises(RecordError, match=rf"^{key}: .*StagePlacement.*") as refused:
        read_placements(store, RUN, STEP)
    assert says in str(refused.value)
    assert store.read_json(key) == doc  # the stored document stays as it was
