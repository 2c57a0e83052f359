"""A launched stage's ranks (pipeline/ranks.py): which units each rank does, how their results meet on rank 0,
alone and on two real gloo ranks on loopback, checked against what one process gets."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeline.ranks import SINGLE, Ranks, join, leave, ranks_from_env

UNITS = 7  # odd: rank 0 does one unit more than rank 1
WRITE_ID = "w-0123456789abcdef"


def _unit_result(unit: int) -> dict:
    """A unit's result, the same whoever computes it (a shard's rows and tokens)."""
    return {"unit": unit, "rows": unit + 1, "tokens": [unit * 10 + i for i in range(unit % 3 + 1)]}


def _stage(ranks: Ranks) -> dict:
    """A stage's work the way the workers do it: this rank's units, their counts summed, their results gathered
    on rank 0, rank 0's write id on every rank."""
    mine = ranks.mine(list(range(UNITS)))
    results = [_unit_result(u) for u in mine]
    counts = ranks.sum_counts([len(results), sum(r["rows"] for r in results),
                               sum(len(r["tokens"]) for r in results)])
    gathered = ranks.gather_json(results)
    ranks.barrier()
    return {
        "mine": mine,
        "owners": [ranks.owner(u) for u in mine],
        "counts": counts,
        "merged": sorted((r for part in gathered for r in part), key=lambda r: r["unit"]),
        "gathered_lengths": [len(part) for part in gathered],
        "write_id": ranks.broadcast_text(WRITE_ID if ranks.is_main else "", len(WRITE_ID)),
        # rank 1 sends the longer document: padding works whichever rank is shorter; non-ASCII survives the bytes
        "names": ranks.gather_json({"rank": ranks.rank, "name": "é" * (3 + 5 * ranks.rank)}),
        "largest": ranks.max_value(1.5 + 2.25 * ranks.rank),
        "empty_counts": ranks.sum_counts([]),
    }


def _rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    ranks = ranks_from_env()
    join(ranks, "cpu")
    try:
        result = {"ranks": [ranks.rank, ranks.world_size, ranks.local_rank], "backend": dist.get_backend(),
                  **_stage(ranks)}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        leave()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """What each of two gloo ranks on loopback got from `_stage`, in rank order."""
    from tests.support.config import free_port  # here: the spawned ranks import this module, not transformers

    out = tmp_path_factory.mktemp("ranks")
    mp.start_processes(_rank_main, args=(2, free_port(), str(out)), nprocs=2, start_method="spawn")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


# --- one rank --------------------------------------------------------------------------------------------------


def test_a_plain_run_is_rank_0_of_1(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert ranks_from_env() == SINGLE == Ranks(0, 1, 0)
    assert SINGLE.is_main
    assert not SINGLE.distributed


def test_torchrun_environment_gives_the_rank_its_place(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    ranks = ranks_from_env()
    assert ranks == Ranks(5, 8, 1)
    assert ranks.distributed
    assert not ranks.is_main


def test_one_rank_does_every_unit_and_its_results_pass_through_unchanged() -> None:
    units = ["a", "b", "c"]
    assert SINGLE.mine(units) == units
    assert SINGLE.mine(range(4)) == [0, 1, 2, 3]
    assert [SINGLE.owner(u) for u in range(4)] == [0, 0, 0, 0]
    counts = [3, 0, 2**40]
    summed = SINGLE.sum_counts(counts)
    assert summed == counts
    assert summed is not counts
    assert SINGLE.max_value(2.5) == 2.5
    assert SINGLE.gather_json({"rows": 3}) == [{"rows": 3}]
    assert SINGLE.broadcast_text("abc", 3) == "abc"
    SINGLE.barrier()


def test_one_rank_joins_no_process_group() -> None:
    join(SINGLE, "cpu")
    assert not dist.is_initialized()
    leave()  # nothing to leave


@pytest.mark.parametrize("world", [1, 2, 3, 4, 9])
def test_the_ranks_split_the_units_whole_each_once_in_their_order(world: int) -> None:
    units = [f"shard-{i}" for i in range(8)]
    shares = [Ranks(r, world).mine(units) for r in range(world)]
    assert sorted(u for share in shares for u in share) == sorted(units)
    for r, share in enumerate(shares):
        assert share == [u for i, u in enumerate(units) if i % world == r]  # every world-th, from the rank on
        assert all(Ranks(r, world).owner(units.index(u)) == r for u in share)
    if world > len(units):
        assert shares[-1] == []  # more ranks than units: the last ones idle


def test_cuda_is_the_first_gpu_of_the_ranks_own_block() -> None:
    assert Ranks(0, 2, 0).device("cuda") == "cuda:0"
    assert Ranks(3, 4, 1).device("cuda") == "cuda:1"
    assert Ranks(3, 4, 1).device("cuda", gpus_per_rank=2) == "cuda:2"  # a policy split over two GPUs per rank
    assert Ranks(1, 2, 1).device("cpu") == "cpu"
    assert Ranks(1, 2, 1).device("cuda:3") == "cuda:3"  # anything but `cuda` as given


# --- two gloo ranks --------------------------------------------------------------------------------------------


def test_two_ranks_join_one_gloo_group_from_torchruns_environment(two_ranks: list[dict]) -> None:
    assert [r["ranks"] for r in two_ranks] == [[0, 2, 0], [1, 2, 1]]
    assert {r["backend"] for r in two_ranks} == {"gloo"}


def test_two_ranks_take_alternate_units_that_together_are_one_processes(two_ranks: list[dict]) -> None:
    assert two_ranks[0]["mine"] == [0, 2, 4, 6]
    assert two_ranks[1]["mine"] == [1, 3, 5]
    assert [r["owners"] for r in two_ranks] == [[0] * 4, [1] * 3]
    assert sorted(two_ranks[0]["mine"] + two_ranks[1]["mine"]) == _stage(SINGLE)["mine"]


def test_two_ranks_counts_sum_to_one_processes_on_every_rank(two_ranks: list[dict]) -> None:
    single = _stage(SINGLE)["counts"]
    assert single == [UNITS, sum(u + 1 for u in range(UNITS)), sum(u % 3 + 1 for u in range(UNITS))]
    assert two_ranks[0]["counts"] == two_ranks[1]["counts"] == single


def test_two_ranks_results_meet_on_rank_0_exactly_as_one_process_computes_them(two_ranks: list[dict]) -> None:
    assert two_ranks[0]["gathered_lengths"] == [4, 3]  # in rank order
    assert two_ranks[0]["merged"] == _stage(SINGLE)["merged"] == [_unit_result(u) for u in range(UNITS)]
    assert two_ranks[1]["gathered_lengths"] == []
    assert two_ranks[1]["merged"] == []


def test_a_longer_document_from_a_later_rank_arrives_whole(two_ranks: list[dict]) -> None:
    assert two_ranks[0]["names"] == [{"rank": 0, "name": "ééé"}, {"rank": 1, "name": "é" * 8}]
    assert two_ranks[1]["names"] == []


def test_rank_0s_text_reaches_every_rank(two_ranks: list[dict]) -> None:
    assert [r["write_id"] for r in two_ranks] == [WRITE_ID, WRITE_ID]


def test_the_largest_value_of_the_ranks_is_on_every_rank(two_ranks: list[dict]) -> None:
    assert [r["largest"] for r in two_ranks] == [3.75, 3.75]


def test_no_counts_sum_to_none_on_two_ranks_as_on_one(two_ranks: list[dict]) -> None:
    assert [r["empty_counts"] for r in two_ranks] == [[], []] == [SINGLE.sum_counts([])] * 2
