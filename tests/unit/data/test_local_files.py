"""Local paths another party writes (pipeline.data.local_files), and the file:// store's keys: a symlink
leads no read or write out of the store root."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline.data.keys import policy_pointer_key, rollouts_prefix
from pipeline.data.local_files import LocalPathError, check_inside, open_regular, resolves_inside
from pipeline.data.rollouts import read_policy_pointer
from pipeline.data.store import ObjectStore


@pytest.fixture
def store(tmp_path: Path) -> ObjectStore:
    (tmp_path / "store").mkdir()
    (tmp_path / "outside").mkdir()
    return ObjectStore((tmp_path / "store").as_uri())


def test_resolves_inside_follows_every_link(tmp_path: Path) -> None:
    (tmp_path / "root" / "a").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "root" / "in").symlink_to(tmp_path / "root" / "a")
    (tmp_path / "root" / "out").symlink_to(tmp_path / "elsewhere")
    assert resolves_inside(tmp_path / "root" / "in" / "file", [tmp_path / "root"])
    assert not resolves_inside(tmp_path / "root" / "out" / "file", [tmp_path / "root"])
    with pytest.raises(LocalPathError, match="the key: .*out/file leads out of .*root through a symlink"):
        check_inside(tmp_path / "root" / "out" / "file", [tmp_path / "root"], "the key")


def test_open_regular_refuses_links_and_fifos(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"data")
    (tmp_path / "link").symlink_to(tmp_path / "file")
    os.mkfifo(tmp_path / "fifo")
    with open_regular(tmp_path / "file", "f") as f:
        assert f.read() == b"data"
    with pytest.raises(LocalPathError, match="^link: cannot be opened as a regular file: a symlink"):
        open_regular(tmp_path / "link", "link")
    with pytest.raises(LocalPathError, match="^fifo: not a regular file"):
        open_regular(tmp_path / "fifo", "fifo")


@pytest.mark.reliability("security", "a step directory symlinked out of a file:// store: its files are not read, "
                                     "nothing is written through it")
def test_store_keys_do_not_lead_out_of_the_root_through_a_symlink(store: ObjectStore, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (outside / "policy.json").write_text('{"secret": "Hunter2-store"}')
    (tmp_path / "store" / "rollouts" / "r").mkdir(parents=True)
    (tmp_path / "store" / rollouts_prefix("r", 1)).symlink_to(outside)
    with pytest.raises(LocalPathError, match=f"store key {policy_pointer_key('r', 1)}: .* leads out of") as failure:
        read_policy_pointer(store, "r", 1)
    assert "Hunter2" not in str(failure.value)
    for read in (lambda k: store.read_bytes(k), lambda k: store.read_ranges(k, [(0, 1)])):
        with pytest.raises(LocalPathError, match="leads out of"):
            read(policy_pointer_key("r", 1))
    with pytest.raises(LocalPathError, match="leads out of"), store.open_ranges(policy_pointer_key("r", 1)):
        pass
    (tmp_path / "store" / "hidden_states").symlink_to(outside)
    with pytest.raises(LocalPathError, match="store key hidden_states/r/step-000001/_manifest.json: .*leads out of"):
        store.write_json("hidden_states/r/step-000001/_manifest.json", {})
    assert sorted(p.name for p in outside.iterdir()) == ["policy.json"]  # no directory made, nothing written

    (tmp_path / "store" / "policies").mkdir()
    (tmp_path / "store" / "policies" / "a.json").write_text("{}")
    (tmp_path / "store" / "policies" / "b.json").symlink_to(tmp_path / "store" / "policies" / "a.json")
    assert store.read_json("policies/b.json") == {}  # a link that stays inside the root is the operator's own


@pytest.mark.reliability("security", "deleting a step (retention) through a directory symlinked out of a file:// "
                                     "store: refused, nothing outside deleted")
def test_deletes_do_not_follow_a_symlink_out_of_the_root(store: ObjectStore, tmp_path: Path) -> None:
    victim = tmp_path / "outside" / "step-000001"
    victim.mkdir()
    (victim / "keep.txt").write_text("not the pipeline's")
    (tmp_path / "store" / "hidden_states").mkdir()
    (tmp_path / "store" / "hidden_states" / "r").symlink_to(tmp_path / "outside")
    with pytest.raises(LocalPathError, match="store key hidden_states/r/step-000001: .*leads out of"):
        store.delete_prefix("hidden_states/r/step-000001")
    assert (victim / "keep.txt").exists()
