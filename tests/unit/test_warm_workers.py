"""A warm stage worker's rendezvous and requests: it meets only this user's launchers in a folder of this user's,
runs only the job it is given, and no client holds it up or brings it down (`pipeline.launch.warm`,
`resources.warm`, `pipeline.launch.rendezvous`)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from dagster_pipes import PipesContext, PipesMappingParamsLoader, open_dagster_pipes

from pipeline.config import PROJECT_ROOT, ConfigError, load_config
from pipeline.launch import warm
from pipeline.launch.process import JobError, StageJob
from pipeline.launch.rendezvous import RendezvousError, private_dir, unix_address
from pipeline.launch.warm import WarmWorker, WarmWorkerError, server_files
from pipeline.serving.drivers import running
from pipeline.stages import EVALUATION, EXTRACTION
from tests.support.processes import wait_until

NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3"  # another user runs it: the project's venv may lie where only its owner reads
as_root = pytest.mark.skipif(os.geteuid() != 0 or not Path(SYSTEM_PYTHON).exists(),
                             reason="acts as another local user (needs root to switch users, and a system Python)")


def _answer(line: bytes) -> warm.Answer:
    """`line` through the worker's request handling, with jobs that record whether one ran."""
    ran: list[object] = []
    jobs = SimpleNamespace(run=ran.append, reset=lambda: None)
    ours, theirs = socket.socketpair()
    try:
        answer = warm.run_job(jobs, ours, line, 3)
    finally:
        ours.close()
        theirs.close()
    assert ran == [], "the stage body ran on a request that carried no job"
    return answer


@pytest.mark.parametrize(("line", "why", "label"), [
    (b'{"pipes": {}}\n', "DAGSTER_PIPES_CONTEXT, DAGSTER_PIPES_MESSAGES", "Pipes parameters empty"),
    (b'{"pipes": {"DAGSTER_PIPES_CONTEXT": "e30="}}\n', "leave out DAGSTER_PIPES_MESSAGES", "no message channel"),
    (b'{"job": 1}\n', "no Pipes bootstrap parameters", "no `pipes`"),
    (b"GET / HTTP/1.0\n", "not a JSON line", "not JSON"),
    (b"\xff\xfe\n", "not a JSON line", "not UTF-8"),
])
def test_a_request_without_its_job_runs_nothing(line: bytes, why: str, label: str, reliability) -> None:
    """A careless or stale client's request without a job is answered as a failure and runs nothing: it never
    becomes a job on the configuration the worker's working directory implies (the checkout's own demo)."""
    reliability.bad_input(f"a warm worker's request without its job ({label}): answered failed, nothing run")
    answer = _answer(line)
    assert not answer.ok
    assert why in answer.error
    assert answer.jobs == 3  # no job counted


@pytest.mark.filterwarnings("ignore:This process was not launched by a Dagster orchestration process")
def test_a_stage_body_refuses_a_channel_without_a_job(reliability) -> None:
    """Every stage body reads its job through `pipeline.launch.worker`: a Pipes channel opened without bootstrap
    parameters (dagster_pipes then hands back a stand-in that accepts everything) has no job, and is refused
    before anything is read or written."""
    reliability.bad_input("a stage body run on a Pipes channel without its job: refused before any work")
    from pipeline.evaluation import worker as evaluation
    from pipeline.refresh import worker as refresh
    from pipeline.sources import worker as extraction
    from pipeline.training import worker as training

    for module in (extraction, training, evaluation, refresh):
        pipes = open_dagster_pipes(params_loader=PipesMappingParamsLoader({}))
        try:
            with pytest.raises(JobError, match="no Dagster Pipes context"):
                module.run_pipes(pipes)
        finally:
            PipesContext._instance = None  # noqa: SLF001


def test_a_stage_job_leaving_out_a_field_or_a_key_is_refused(reliability) -> None:
    reliability.bad_input("a stage job leaving out a field, or its config leaving out a key: refused, no default")
    full = StageJob(EVALUATION, 4, load_config().model_dump(mode="json"), "process").to_dict()
    job = StageJob.from_dict(full, EVALUATION)
    assert job.pipeline_config == load_config()
    assert job.pipeline_config is job.pipeline_config  # parsed once, at its first use
    for name in full:
        with pytest.raises(JobError, match=f"leaves out {name}"):
            StageJob.from_dict({k: v for k, v in full.items() if k != name})
    with pytest.raises(JobError, match="it is a evaluation job, sent to extraction"):
        StageJob.from_dict(full, EXTRACTION)
    with pytest.raises(JobError, match="step must be an integer"):
        StageJob.from_dict({**full, "step": "4"})
    for seconds in (10**400, float("nan"), -1.0):  # float() raised OverflowError on the first
        with pytest.raises(JobError, match="spent_s must map stages to seconds"):
            StageJob.from_dict({**full, "spent_s": {"extraction": seconds}})
    with pytest.raises(JobError, match="no job"):
        StageJob.from_dict(None)
    config = {k: v for k, v in full["config"].items() if k != "data_dir"}
    config["mlflow"] = {k: v for k, v in config["mlflow"].items() if k != "tracking_uri"}
    with pytest.raises(ConfigError, match="leaves out data_dir, mlflow.tracking_uri"):
        _ = StageJob.from_dict({**full, "config": config}).pipeline_config
    with pytest.raises(ConfigError, match="no configuration"):
        _ = StageJob.from_dict({**full, "config": {}}).pipeline_config


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of a warm evaluation worker whose socket path is too long for a Unix socket's address."""
    folder = tmp_path_factory.mktemp("warm") / ("a-long-data-directory-name-" * 4) / "stages"
    WarmWorker(EVALUATION, folder, PROJECT_ROOT, 300.0).prestart()
    yield folder
    files = server_files(folder, EVALUATION, PROJECT_ROOT)
    pid = _worker_pid(files.log)
    if pid:
        os.kill(pid, 9)


def _worker_pid(log: Path) -> int | None:
    for line in log.read_text().splitlines():
        if line.startswith("stage server evaluation pid "):
            return int(line.split()[4])
    return None


def _connect(path: Path) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with unix_address(path) as address:
        conn.connect(address)
    return conn


@pytest.mark.reliability("security", "a warm worker's socket, lock and log stay in the run's stages folder (mode "
                                     "0700, files 0600), however long its path: no rendezvous in /tmp")
def test_the_worker_meets_in_a_folder_of_this_users_alone(worker: Path) -> None:
    files = server_files(worker, EVALUATION, PROJECT_ROOT)
    assert len(os.fsencode(files.socket)) > 108  # beyond sun_path: reached through the folder's descriptor
    assert files.socket.parent == worker
    assert stat.S_ISSOCK(files.socket.stat().st_mode)
    assert stat.S_IMODE(worker.stat().st_mode) == 0o700
    assert stat.S_IMODE(files.log.stat().st_mode) == 0o600
    assert stat.S_IMODE(files.lock.stat().st_mode) == 0o600


@pytest.mark.reliability("fault", "an idle client on a warm worker's socket and a request that is not JSON: later "
                                  "requests are answered, the worker stays up")
def test_an_idle_client_and_a_line_that_is_not_json_hold_up_no_later_request(worker: Path) -> None:
    files = server_files(worker, EVALUATION, PROJECT_ROOT)
    idle = _connect(files.socket)  # connects, never sends its request
    try:
        answers = []
        for line in (b"not json\n", b'{"pipes": {}}\n'):
            with _connect(files.socket) as conn:
                conn.settimeout(warm.REQUEST_TIMEOUT_S / 2)
                conn.sendall(line)
                answers.append(json.loads(conn.makefile("rb").readline()))
    finally:
        idle.close()
    assert [a["ok"] for a in answers] == [False, False]
    assert "not a JSON line" in answers[0]["error"]
    assert "leave out DAGSTER_PIPES_CONTEXT" in answers[1]["error"]
    assert _worker_pid(files.log) == answers[1]["pid"]
    os.kill(answers[1]["pid"], 0)  # still up


def test_a_worker_whose_folder_is_removed_leaves_before_its_idle_time(tmp_path: Path) -> None:
    """Its data dir removed (a test process's at exit, a run's cleaned up), nobody can reach the worker again: it
    leaves within a few seconds, not after its idle time."""
    folder = tmp_path / "stages"
    WarmWorker(EVALUATION, folder, PROJECT_ROOT, 3600.0).prestart()
    pid = _worker_pid(server_files(folder, EVALUATION, PROJECT_ROOT).log)
    shutil.rmtree(folder)
    wait_until(lambda: not running(pid), 4 * warm.GONE_CHECK_S, "the worker's exit")


@as_root
@pytest.mark.reliability("security", "another local user listening at a warm worker's socket: the launcher hands "
                                     "it no job (peer credentials)")
def test_the_launcher_hands_no_job_to_another_users_listener(tmp_path: Path) -> None:
    """A listener of another user at the worker's address (bound there, then listening as uid 65534): the
    launcher's connection reaches it, its credentials are checked, and the job is not sent."""
    client = WarmWorker(EVALUATION, tmp_path / "data" / "stages", PROJECT_ROOT, 60.0)
    private_dir(client.files.socket.parent)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with unix_address(client.files.socket) as address:  # a long tmp path (as in CI) goes through the folder
        listener.bind(address)
    script = (f"import socket, time; s = socket.socket(fileno={listener.fileno()}); s.listen(); "
              "print('up', flush=True); c, _ = s.accept(); print(repr(c.recv(4096)), flush=True); time.sleep(5)")
    theirs = subprocess.Popen([SYSTEM_PYTHON, "-c", script], pass_fds=(listener.fileno(),), user=NOBODY,
                              stdout=subprocess.PIPE, text=True, cwd="/")
    try:
        assert theirs.stdout.readline() == "up\n"
        with client.connect() as conn, pytest.raises(WarmWorkerError,
                                                     match=f"runs as uid {NOBODY}, not as this user"):
            client.check_peer(conn)
        assert theirs.stdout.readline() == "b''\n"  # it got a connection, closed, and not a byte of the job
    finally:
        theirs.kill()
        theirs.wait()
        listener.close()


@as_root
@pytest.mark.reliability("security", "a stages folder another local user owns (or a symlink in its place): refused "
                                     "by name, nothing started or sent there")
def test_a_stages_folder_of_another_user_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "data" / "stages"
    theirs.mkdir(parents=True)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(RendezvousError, match=f"belongs to uid {NOBODY}, not to this user"):
        WarmWorker(EVALUATION, theirs, PROJECT_ROOT, 60.0).prestart()
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "stages").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(RendezvousError, match="not a directory of its own"):
        WarmWorker(EVALUATION, linked / "stages", PROJECT_ROOT, 60.0).prestart()
    assert not (tmp_path / "elsewhere").exists()


def test_a_folder_of_ours_left_open_is_closed_to_others(tmp_path: Path) -> None:
    folder = tmp_path / "stages"
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)
    assert private_dir(folder) == folder
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
