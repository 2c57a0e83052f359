"""`make bench`'s sections at their smoke-run sizes: each section's entry point as `benchmarks.run` calls it, with
`tiny=True` (`python -m benchmarks.run --tiny`), its figures present and finite; and how `benchmarks.run` reports a
section that fails."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import run as bench
from benchmarks.run import SECTIONS, Section
from pipeline.sources import smollm2

ROOT = Path(__file__).resolve().parents[2]
# Sections whose smoke run starts several Python processes (ranks, launched stages, warm workers) or whole simulated
# steps through the stages: tens of seconds on 2 cores.
SLOW = {"training", "stage_launch", "schedule"}


@pytest.mark.parametrize("section", [pytest.param(s, id=s.name, marks=[pytest.mark.slow] if s.name in SLOW else [])
                                     for s in SECTIONS])
def test_each_section_measures_its_figures_at_tiny_sizes(section: Section, tmp_path: Path,
                                                         request: pytest.FixtureRequest,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # a section that reads the demo's state (demo_economics' replay of its last step) finds none of this machine's
    (tmp_path / "pipeline.yaml").write_text(f"data_dir: {tmp_path / 'data'}\n")
    monkeypatch.setenv("DRAFTER_PIPELINE_CONFIG", str(tmp_path / "pipeline.yaml"))
    if section.name == "real_model" and smollm2.gguf_path() is not None:
        # SmolLM2 as the run's other tests have it converted, not a conversion of its own in the project's .data
        monkeypatch.setattr(smollm2, "DEFAULT_DATA", request.getfixturevalue("smollm2_checkpoint").parents[1])
    result = section.run(tiny=True)
    json.dumps(result)  # what `make bench` writes
    for name in section.figures:
        assert isinstance(result[name], int | float), (name, result[name])
        assert math.isfinite(result[name]), (name, result[name])
    for name in section.optional:
        assert result[name] is None or math.isfinite(result[name]), (name, result[name])


def test_run_writes_the_json_and_prints_its_path_last(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "benchmarks.run", "--tiny", "--only", "target_load", "--out",
                          str(tmp_path)], cwd=ROOT, capture_output=True, text=True, check=True)
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("target_load: {'load_time_ratio': ")
    report = json.loads(Path(lines[-1]).read_text())
    assert Path(lines[-1]).parent == tmp_path
    assert report["tiny"] is True
    assert report["failed"] == []
    assert set(report) == {"machine", "tiny", "failed", "target_load"}
    assert report["target_load"]["wall_s"] > 0


def test_a_section_that_fails_is_named_and_the_others_still_run(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Stand-in sections: one whose child process fails as evaluation's did, one that measures."""
    def crashes(tiny: bool = False) -> dict:
        raise subprocess.CalledProcessError(1, [sys.executable, "-m", "benchmarks.evaluation"], stderr=(
            "Traceback (most recent call last):\n"
            "ValueError: expected sequence of length 45 at dim 1 (got 120)\n"))

    def measures(tiny: bool = False) -> dict:
        return {"ratio": 0.5, "nested": {"tiny": tiny}}

    monkeypatch.setattr(bench, "SECTIONS", (Section("crashes", crashes, ("ratio",)),
                                            Section("measures", measures, ("ratio",))))
    assert bench.main(["--out", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    path = Path(out.strip().splitlines()[-1])
    assert out.strip().splitlines()[:-1] == ["measures: {'ratio': 0.5}"]
    report = json.loads(path.read_text())
    assert report["failed"] == ["crashes"]
    assert report["crashes"]["error"].startswith("CalledProcessError: Command ")
    assert report["crashes"]["error"].endswith("ValueError: expected sequence of length 45 at dim 1 (got 120)")
    assert report["measures"] == {"ratio": 0.5, "nested": {"tiny": False}, "wall_s": report["measures"]["wall_s"]}
    assert "crashes: FAILED: CalledProcessError" in err
    assert "ValueError: expected sequence of length 45" in err
    assert "1 of 2 sections failed: crashes" in err
    assert list(tmp_path.iterdir()) == [path]  # the partial file replaced


def test_headline_shows_none_for_a_figure_that_is_not_a_number() -> None:
    section = Section("s", lambda tiny=False: {}, ("a", "b", "c"), ("d",))
    assert bench.headline(section, {"a": 1.23456, "b": float("nan"), "c": {"k": 1}, "d": None}) == {
        "a": 1.235, "b": None, "c": None, "d": None}
