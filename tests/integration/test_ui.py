"""The operator's path through the real UIs, in headless Chromium (Debian's `chromium`, driven by Playwright).

`dagster-webserver` and `dagster-daemon` run from the project's workspace.yaml and dagster.yaml on a
temporary instance; two simulated RL steps are committed and registered as `rl_step` partitions (what
the sensor does); then, in the browser: turn the sensor off, open the asset graph, launch a backfill of
the two partitions, watch it finish, read the plots in the materialization metadata, and find the
registered drafter with its alias in the MLflow UI of a real `mlflow server`.

Screenshots: $UI_SCREENSHOTS or .data/test-ui/screenshots (`make test-ui` prints the folder last).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import pytest
from mlflow.tracking import MlflowClient
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from ops.instance import prepare_instance
from pipeline.config import PipelineConfig, load_config
from pipeline.data.keys import step_key
from pipeline.data.store import open_store
from pipeline.sources.simulation import SimulatedRL
from tests.support.config import free_port, write_config
from tests.support.registered import register_champion

pytestmark = [pytest.mark.ui, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
SCREENSHOTS = Path(os.environ.get("UI_SCREENSHOTS", ROOT / ".data" / "test-ui" / "screenshots"))
LOCATION = "drafter_cotraining"
STEPS = [1, 2]  # with a buffer of one step, the second step's buffer has evicted the first's samples
KEYS = [step_key(s) for s in STEPS]
ASSETS = ["rollouts", "hidden_states", "drafter_buffer", "drafter", "acceptance"]
MODEL = "ui-drafter"
BACKFILL_TIMEOUT_S = 900  # a loaded 2-core CI machine; about 90 s when idle
DEQUEUE_EVERY_SECOND = "run_queue:\n  dequeue_interval_seconds: 1\n"


@dataclass
class Stack:
    web: str
    mlflow: str
    home: Path
    procs: list[subprocess.Popen]
    logs: Path
    cfg: PipelineConfig

    def instance(self) -> dg.DagsterInstance:
        return dg.DagsterInstance.from_config(str(self.home))


def _wait_http(url: str, proc: subprocess.Popen, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not come up; log:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)


def _graphql(web: str, query: str) -> dict:
    request = urllib.request.Request(f"{web}/graphql", data=json.dumps({"query": query}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())["data"]


LOCATION_QUERY = """{ workspaceOrError { ... on Workspace { locationEntries { name loadStatus
  locationOrLoadError { __typename ... on PythonError { message } } } } } }"""


def _wait_for_location(web: str, timeout_s: float) -> None:
    """The code location loaded in the webserver; on a loaded machine its first load can time out,
    and then it is reloaded, as a person would press "Reload definitions"."""
    deadline, error = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        entries = _graphql(web, LOCATION_QUERY)["workspaceOrError"]["locationEntries"]
        entry = next(e for e in entries if e["name"] == LOCATION)
        loaded = entry["locationOrLoadError"] or {}
        if entry["loadStatus"] == "LOADED" and loaded.get("__typename") == "RepositoryLocation":
            return
        if entry["loadStatus"] == "LOADED" and loaded.get("__typename") == "PythonError":
            error = loaded["message"]
            _graphql(web, f'mutation {{ reloadRepositoryLocation(repositoryLocationName: "{LOCATION}") '
                          '{ __typename } }')
        time.sleep(2)
    raise RuntimeError(f"code location {LOCATION} did not load: {error}")


def _processes_of(home: Path) -> list[int]:
    """Every process started for this instance (webserver, daemon, their code servers, run workers)."""
    marker = f"DAGSTER_HOME={home}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _stop(stack: Stack) -> None:
    for proc in stack.procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in stack.procs:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    for pid in _processes_of(stack.home):  # a code server or run worker that left its process group
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, mlflow_server: str) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("ui")
    config_path = write_config(tmp, {
        "fleet": {"driver": "none"},  # no deploys: champion_sensor and live_tau_sensor skip
        "train": {"buffer_steps": 1},
        "mlflow": {"tracking_uri": mlflow_server, "experiment": "ui-test", "model_name": MODEL},
    })
    home = tmp / "dagster"
    home.mkdir()
    shutil.copyfile(ROOT / "dagster.yaml", home / "dagster.yaml")
    with (home / "dagster.yaml").open("a") as f:  # the run queue looked at every second (Dagster's default: 5 s)
        f.write(DEQUEUE_EVERY_SECOND)
    with dg.DagsterInstance.from_config(str(home)) as instance:
        prepare_instance(instance)  # before the webserver and the daemon race to create it
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DAGSTER_", "MLFLOW_UI"))}
    env.update(DAGSTER_HOME=str(home), DRAFTER_PIPELINE_CONFIG=str(config_path), PYTHONPATH=str(ROOT),
               HF_HUB_OFFLINE="1", MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR="false",
               # Importing torch, transformers and MLflow can take over a minute on a loaded 2-core machine.
               DAGSTER_GRPC_TIMEOUT_SECONDS="180")
    bin_dir = Path(sys.executable).parent
    port = free_port()
    commands = {
        "webserver": [str(bin_dir / "dagster-webserver"), "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(port)],
        "daemon": [str(bin_dir / "dagster-daemon"), "run", "-w", "workspace.yaml"],
    }
    procs = [
        subprocess.Popen(argv, cwd=ROOT, env=env, stdout=(tmp / f"{name}.log").open("w"), stderr=subprocess.STDOUT,
                         start_new_session=True)
        for name, argv in commands.items()
    ]
    s = Stack(f"http://127.0.0.1:{port}", mlflow_server, home, procs, tmp, load_config(config_path))
    try:
        # The tiny target is pre-trained (and cached) while both processes load the code location.
        SimulatedRL(s.cfg.simulation, open_store(s.cfg), s.cfg.run, s.cfg.data_path / "cache").pretrained()
        _wait_http(f"{s.web}/server_info", procs[0], 300, tmp / "webserver.log")
        _wait_for_location(s.web, 600)
        yield s
    finally:
        _stop(s)


@pytest.fixture(scope="module")
def page(stack: Stack):
    with browser_page() as page:
        yield page


@contextlib.contextmanager
def browser_page():
    """A page of headless Chromium (Debian's), screenshot as it is when the block ends."""
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: `make browser` installs Debian's chromium (make test does it first)")
    from playwright.sync_api import sync_playwright

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        context = browser.new_context(viewport={"width": 1400, "height": 900})
        # Dagster's first-visit "join the community" dialog would cover the page; a person dismisses it once.
        context.add_init_script("window.localStorage.setItem('communityNux', '\"1\"')")
        context.set_default_timeout(60_000)
        page = context.new_page()
        try:
            yield page
        finally:
            _shot(page, "zz-last-page")  # where a failed test stopped
            browser.close()


def _shot(page, name: str) -> Path:
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path))
    return path


def _wait_for_backfill(instance: dg.DagsterInstance, timeout_s: float) -> dg.PartitionBackfill:
    """The backfill once each of its partitions' runs has finished, or once it ended otherwise (failed,
    canceled). The backfill daemon marks a finished backfill only on its next pass (every 30 s): its runs say
    sooner."""
    from dagster._core.execution.backfill import BulkActionStatus

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        backfills = instance.get_backfills()
        if backfills:
            runs = instance.get_runs(dg.RunsFilter(tags={"dagster/backfill": backfills[0].backfill_id}))
            if backfills[0].status != BulkActionStatus.REQUESTED or (
                    len(runs) == len(KEYS) and all(r.is_finished for r in runs)):
                return backfills[0]
        time.sleep(1)
    raise AssertionError(f"backfill not finished after {timeout_s}s: {instance.get_backfills()}")


def test_backfill_rl_steps_from_the_asset_graph(stack: Stack, page) -> None:
    s = stack
    # 1. Automatic processing off (the sensor would otherwise run new steps itself) ...
    page.goto(f"{s.web}/locations/{LOCATION}/sensors/rl_step_sensor")
    toggle = page.locator("input[type=checkbox]")  # the "Running" switch (the input itself is hidden)
    toggle.wait_for(state="attached")
    if toggle.is_checked():
        page.locator("label", has=toggle).click()
    page.wait_for_function("() => !document.querySelector('input[type=checkbox]').checked")
    _shot(page, "01-sensor-stopped")
    # ... then the RL source commits two steps (the external trainer's layout), and they are registered
    # as `rl_step` partitions, as the sensor's dynamic_partitions_request does.
    simulator = SimulatedRL(s.cfg.simulation, open_store(s.cfg), s.cfg.run, s.cfg.data_path / "cache")
    for step in STEPS:
        simulator.run_step(step)
    instance = s.instance()
    instance.add_dynamic_partitions("rl_step", KEYS)

    # 2. The asset graph of the loop.
    page.goto(f"{s.web}/locations/{LOCATION}/asset-groups/cotraining/lineage")
    for asset in ASSETS:
        page.get_by_text(asset, exact=True).filter(visible=True).first.wait_for()
    _shot(page, "02-asset-graph")

    # 3. Materialize all -> two RL-step partitions -> Launch backfill.
    page.get_by_role("button", name="Materialize all…").click()
    dialog = page.get_by_role("dialog")
    picker, first = dialog.get_by_text("Select a partition or create one"), page.get_by_text(KEYS[0], exact=True)
    for _ in range(10):  # the picker opens empty while the dialog still loads the partitions: open it again
        picker.click()
        try:
            first.filter(visible=True).first.wait_for(timeout=5_000)
            break
        except PlaywrightTimeout:
            dialog.get_by_text("Launch runs to materialize").click()
    for key in KEYS:
        page.get_by_text(key, exact=True).filter(visible=True).first.click()
    dialog.get_by_text("Launch runs to materialize").click()  # closes the partition picker
    dialog.get_by_text(f"{len(KEYS)} partitions", exact=True).wait_for()
    _shot(page, "03-launch-backfill")
    dialog.get_by_role("button", name="Launch backfill").click()
    page.get_by_text("Created backfill").wait_for()

    # 4. The daemon executes it; the result is checked in the instance.
    backfill = _wait_for_backfill(instance, BACKFILL_TIMEOUT_S)
    runs = sorted(instance.get_runs(dg.RunsFilter(tags={"dagster/backfill": backfill.backfill_id})),
                  key=lambda r: r.tags["dagster/partition"])
    assert [r.status for r in runs] == [dg.DagsterRunStatus.SUCCESS] * len(KEYS), \
        (s.logs / "daemon.log").read_text()[-3000:]
    assert [r.tags["dagster/partition"] for r in runs] == KEYS
    for asset in ASSETS:
        assert instance.get_materialized_partitions(dg.AssetKey(asset)) == set(KEYS), asset
    # One step at a time, in order (dagster.yaml's run queue), as the sensor's runs would go: step N's
    # buffer holds step N-1's samples and its drafter warm-starts from the champion N-1 promoted.
    stats = [instance.get_run_stats(r.run_id) for r in runs]
    for earlier, later in zip(stats, stats[1:], strict=False):
        assert earlier.end_time <= later.start_time
    last_buffer = instance.get_latest_materialization_event(dg.AssetKey("drafter_buffer"))
    composition = last_buffer.asset_materialization.metadata["composition"].value
    assert [r.data["rl_step"] for r in composition.records] == [2]
    drafter = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey("drafter"), asset_partitions=[KEYS[-1]]), limit=1
    ).records[0].asset_materialization.metadata
    assert drafter["warm_start_version"].value == "1"  # the first step's champion, never fresh
    assert drafter["trained_on_steps"].value == "[2]"
    assert drafter["mlflow_run"].value.startswith(s.mlflow)

    # 5. The graph now shows every asset materialized for the partition ...
    page.goto(f"{s.web}/locations/{LOCATION}/asset-groups/cotraining/lineage")
    page.get_by_text("acceptance", exact=True).filter(visible=True).first.wait_for()
    page.wait_for_load_state("networkidle")  # the nodes' status arrives after the graph
    _shot(page, "04-asset-graph-materialized")
    # ... and operators read the plots in the metadata of the last step.
    _open_plot(page, f"{s.web}/assets/acceptance?partition={KEYS[-1]}", "tau_by_step", "tau per RL step",
               "05-acceptance-metadata", "06-acceptance-plot")
    _open_plot(page, f"{s.web}/assets/drafter?partition={KEYS[-1]}", "loss_curve", "training loss",
               "07-drafter-metadata", "08-loss-plot")


def _open_plot(page, url: str, label: str, alt: str, shot_page: str, shot_plot: str) -> None:
    """A plot in the materialization metadata: the row's [Show Markdown] opens it in a dialog."""
    page.goto(url)
    row = page.locator("tr", has_text=label).filter(visible=True).first
    row.wait_for()
    _shot(page, shot_page)
    row.get_by_text("[Show Markdown]").click()
    image = page.get_by_role("dialog").locator(f"img[alt^='{alt}']")
    image.wait_for()
    assert image.evaluate("img => img.complete && img.naturalWidth") > 100, f"{label} did not render"
    _shot(page, shot_plot)
    page.keyboard.press("Escape")


def test_registered_drafter_and_alias_in_the_mlflow_ui(stack: Stack, page) -> None:
    """On a drafter this test registers itself, in an experiment of its own: it passes alone too."""
    register_champion(stack.mlflow, "ui-registry", f"{MODEL}-registered", 3)
    check_mlflow_ui(page, stack.mlflow, "ui-registry", f"{MODEL}-registered", [3])


def check_mlflow_ui(page, mlflow: str, experiment_name: str, model: str, steps: list[int], shots: str = "") -> None:
    """The runs of `steps` in the experiment, the registered `model` with its champion alias and tags, in the
    MLflow UI at `mlflow`; screenshots named with the prefix `shots`."""
    client = MlflowClient(tracking_uri=mlflow)
    champion = client.get_model_version_by_alias(model, "champion")
    assert champion.tags["rl_step"] in {str(x) for x in steps}
    assert "tau" in champion.tags
    assert "trained_on_steps" in champion.tags

    # Runs named by RL step, in the training experiment.
    experiment = client.get_experiment_by_name(experiment_name)
    # (the runs tab: MLflow 3 opens an experiment on its GenAI traces overview)
    page.goto(f"{mlflow}/#/experiments/{experiment.experiment_id}/runs")
    for step in steps:
        page.get_by_text(f"drafter-step-{step:06d}").first.wait_for()
    _shot(page, f"{shots}09-mlflow-runs")

    page.goto(f"{mlflow}/#/models/{model}")
    page.get_by_text(model).first.wait_for()
    page.get_by_text("champion").first.wait_for()
    _shot(page, f"{shots}10-mlflow-model")
    page.goto(f"{mlflow}/#/models/{model}/versions/{champion.version}")
    page.get_by_text("@champion", exact=False).or_(page.get_by_text("champion")).first.wait_for()
    for tag in ("rl_step", "tau", "trained_on_steps", "train_samples"):
        page.get_by_text(tag, exact=True).first.wait_for()
    _shot(page, f"{shots}11-mlflow-champion-version")
