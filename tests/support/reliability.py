"""The reliability report: tests record each fault they inject and each bad input they try, and the
session regenerates `docs/reliability.md` from what ran.

Recording is one line, either a marker (also on one `pytest.param`) or the fixture:

    @pytest.mark.reliability("fault", "SIGKILL during a shard write")
    def test_...(...): ...

    def test_...(reliability):
        reliability.bad_input("loss mask all zero")

The row's outcome is the test's: `survived` (fault) or `rejected` (bad input) when it passes,
`FAILED` when it fails. A row named by several tests (or parameters) fails if any of them fails.

The file is rewritten only when some test recorded a row, and then only the rows of test files
that ran in full change; rows of files that did not run (or ran in part: `-k`, `-x`, node ids)
are kept as they were, so running one unrelated test file never wipes the report.
"""

from __future__ import annotations

import fcntl
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

REPORT = Path(__file__).resolve().parents[2] / "docs" / "reliability.md"
OUTCOMES = {"fault": "survived", "bad_input": "rejected", "security": "held"}
LABELS = {"fault": "fault", "bad_input": "bad input", "security": "security"}
_ROWS = pytest.StashKey[dict]()
_RAN = pytest.StashKey[set]()
_DESELECTED = pytest.StashKey[set]()
_PENDING = pytest.StashKey[list]()


@dataclass(frozen=True)
class Row:
    kind: str  # fault | bad_input
    name: str
    outcome: str  # survived | rejected | FAILED | skipped
    test: str  # the test file, relative to the repository

    def line(self) -> str:
        return f"| {LABELS[self.kind]} | {self.name.replace('|', '/')} | {self.outcome} | `{self.test}` |"


class Recorder:
    """What one test injects or tries; the outcome comes from the test's result."""

    def __init__(self, pending: list[tuple[str, str]]) -> None:
        self._pending = pending

    def fault(self, name: str) -> None:
        self._pending.append(("fault", name))

    def bad_input(self, name: str) -> None:
        self._pending.append(("bad_input", name))

    def security(self, name: str) -> None:
        self._pending.append(("security", name))


@pytest.fixture
def reliability(request: pytest.FixtureRequest) -> Recorder:
    """Record a fault injected (`reliability.fault(name)`) or a bad input tried (`.bad_input(name)`)."""
    return Recorder(request.node.stash.setdefault(_PENDING, []))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "reliability(kind, name): a row of docs/reliability.md (fault|bad_input)")
    config.stash[_ROWS] = {}
    config.stash[_RAN] = set()
    config.stash[_DESELECTED] = set()


def pytest_deselected(items: list[pytest.Item]) -> None:
    if items:
        items[0].config.stash[_DESELECTED].update(_test_file(i) for i in items)


def _test_file(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    config = item.config
    if report.when == "call" or report.failed or report.skipped:
        config.stash[_RAN].add(item.nodeid)
    if not (report.when == "call" or (report.when == "setup" and (report.failed or report.skipped))):
        return
    wanted = [(m.args[0], m.args[1]) for m in item.iter_markers("reliability")]
    wanted += item.stash.get(_PENDING, [])
    for kind, name in wanted:
        if kind not in OUTCOMES:
            raise ValueError(f"{item.nodeid}: reliability kind {kind!r} is not one of {sorted(OUTCOMES)}")
        result = OUTCOMES[kind] if report.passed else "skipped" if report.skipped else "FAILED"
        rows: dict = config.stash[_ROWS]
        earlier = rows.get((kind, name))
        if earlier is not None and (earlier.outcome == "FAILED" or result == "skipped"):
            continue
        rows[(kind, name)] = Row(kind, name, result, _test_file(item))


def _read_rows(path: Path) -> list[Row]:
    if not path.exists():
        return []
    kinds = {label: kind for kind, label in LABELS.items()}
    rows = []
    for line in path.read_text().splitlines():
        m = re.fullmatch(r"\| (fault|bad input|security) \| (.+) \| (\w+) \| `(.+)` \|", line)
        if m:
            rows.append(Row(kinds[m[1]], m[2], m[3], m[4]))
    return rows


# The trust boundary with the RL trainer: each class of bad input it can hand over, and the tests that try it.
TRUST_CLASSES = [
    ("1. checkpoint_uri leaves the store (by name or through a symlink) / carries credentials",
     "tests/unit/data/test_uris.py, tests/unit/data/test_local_files.py, tests/unit/models/test_target.py, "
     "tests/integration/test_untrusted_trainer.py (run database), tests/integration/test_reliability.py"),
    ("2. policy checkpoint contents", "tests/unit/models/, tests/integration/test_reliability.py"),
    ("3. a step whose target layout differs from the run's", "tests/unit/data/test_run_layout.py, "
     "tests/integration/test_untrusted_trainer.py"),
    ("4. rollouts.parquet / policy.json fields; malformed step directories", "tests/unit/data/test_rollouts.py, "
     "tests/integration/test_untrusted_trainer.py (sensor)"),
    ("5. vLLM connector directory", "tests/unit/sources/test_vllm_connector.py"),
    ("6. two writers of one step", "tests/integration/test_writers.py"),
    ("7. corrupt shards during training", "tests/unit/training/test_dataset.py, "
     "tests/integration/test_untrusted_trainer.py"),
    ("8. a step published in parts (part manifests, _step.json) written past the client: read again by the readers",
     "tests/unit/data/test_parts.py, tests/integration/test_refresh.py (sensor)"),
    ("9. step numbers: newer is when the store saw a commit, never the number the trainer chose",
     "tests/unit/training/test_plan.py, tests/integration/test_dagster.py, tests/integration/test_refresh.py"),
    ("10. a step republished after its hidden states were extracted", "tests/unit/sources/test_extract.py"),
    ("11. numbers: an integer of hundreds of digits, NaN, or a value that is 0 in the float32 sampler (top_p 1e-300)",
     "tests/unit/data/test_records.py, tests/unit/data/test_parts.py, tests/unit/data/test_rollouts.py, "
     "tests/unit/evaluation/test_rejection_sampler.py, tests/unit/serving/test_fleet.py"),
    ("12. records the pipeline stored, read back as trainer input (stage records, fleet/<run>/policy.json, "
     "hidden-states manifests, the run's layout, training checkpoints)",
     "tests/unit/data/test_records.py, tests/unit/serving/test_fleet.py, tests/unit/data/test_run_layout.py, "
     "tests/unit/training/test_state.py"),
]


def render(rows: list[Row]) -> str:
    faults = [r for r in rows if r.kind == "fault" and r.outcome != "skipped"]
    bad = [r for r in rows if r.kind == "bad_input" and r.outcome != "skipped"]
    totals = (f"faults: {len(faults)} injected, {sum(r.outcome == 'survived' for r in faults)} survived; "
              f"bad inputs: {len(bad)} tried, {sum(r.outcome == 'rejected' for r in bad)} rejected")
    security = [r for r in rows if r.kind == "security" and r.outcome != "skipped"]
    totals += f"; security checks: {len(security)} run, {sum(r.outcome == 'held' for r in security)} held"
    ordered = sorted(rows, key=lambda r: (list(OUTCOMES).index(r.kind), r.test, r.name))
    return "\n".join([
        "# Reliability report",
        "",
        "Generated by the test suite (`tests/support/reliability.py`); do not edit by hand. Each row is a fault a test",
        "injects, a bad input it tries or a security property it checks, then checks the stored state:",
        "`survived` / `rejected` / `held` when the test passed, `FAILED` when it did not.",
        "",
        totals,
        "",
        "| kind | fault or bad input | outcome | test |",
        "|---|---|---|---|",
        *(r.line() for r in ordered),
        "",
        "## The RL trainer's inputs, by class",
        "",
        "| class | tests |",
        "|---|---|",
        *(f"| {name} | {tests} |" for name, tests in TRUST_CLASSES),
        "",
    ])


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Merge this process's rows into the report. Under pytest-xdist every worker collects all tests
    and merges the rows of the files it ran (`--dist loadfile`: each file runs whole on one worker),
    one worker at a time (a lock on the report)."""
    config = session.config
    recorded: dict = config.stash.get(_ROWS, {})
    if not recorded:
        return
    node_args = any("::" in str(a) for a in config.args)
    ran, deselected = config.stash[_RAN], config.stash[_DESELECTED]
    files = {_test_file(i) for i in session.items}
    complete = set() if node_args else {
        f for f in files if f not in deselected and all(i.nodeid in ran for i in session.items if _test_file(i) == f)
    }
    REPORT.parent.mkdir(exist_ok=True)
    with REPORT.open("a") as lock:  # the report itself is the lock (created empty when missing)
        fcntl.flock(lock, fcntl.LOCK_EX)
        keep = {(r.kind, r.name): r for r in _read_rows(REPORT) if r.test not in complete}
        merged = {**keep, **recorded}
        if hasattr(config, "workerinput"):
            # A row several files name, written by another worker first: a failure wins, else the file a
            # serial run would run last (as there, the last file's result names the row).
            for key in keep.keys() & recorded.keys():
                merged[key] = max(keep[key], recorded[key], key=lambda r: (r.outcome == "FAILED", r.test))
        rows = list(merged.values())
        text = render(rows)
        if REPORT.read_text() != text:
            REPORT.write_text(text)
