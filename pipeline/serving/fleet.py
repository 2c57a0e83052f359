"""The serving fleet: replica drivers, deploy gates and the rolling update.

A redeploy updates one replica at a time, so the fleet keeps serving. With `fleet.update: hot`
(the default) a replica that runs the deploy's policy already gets the new drafter weights in
place, through vLLM's dev-mode weight-update routes (docs/operating.md names the version and
sources):

    POST /init_weight_transfer_engine {"init_info": {}}
    POST /pause?mode=keep                  in-flight requests are held, not dropped
    (a new policy first, when the replica serves another one and the policy is a local directory:)
    POST /start_weight_update              the update targets the policy (the target model)
    POST /update_weights {"update_info": {"path": POLICY_DIR}}
    POST /finish_weight_update {"weight_version": "policy-<dir name>"}
    POST /start_draft_weight_update        the update targets the speculative draft model
    POST /update_weights {"update_info": {"path": DIR}}     the `disk` backend loads DIR
    POST /finish_weight_update {"weight_version": "drafter-v<version>"}
    GET  /weight_info                      must now report "drafter-v<version>", still paused
    POST /resume

A replica without those routes (404/405: not in dev mode, an older vLLM), or on a policy that is
not a local directory, is restarted with the new `--speculative-config` instead (the one way that
works on every vLLM version), never more than one down. A hot update that fails once weights may have
changed never resumes on them: the previous drafter (and policy) go back in the same pause and the
replica resumes on those, or, failing that, it is restarted with them while still paused; then it
takes the restart path. A replica the driver knows runs that very drafter and policy
already (a rerun of a deploy stopped midway, the same version again) is not touched, only gated. A
replica passes when, in order: GET /health answers 200, GET /v1/models lists the served
model, a smoke completion returns tokens, and over a canary window of completions its
live mean acceptance length (from GET /metrics) reaches the configured minimum. A
replica that fails is restarted with the previous drafter and the deploy stops.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from pipeline.config import PROJECT_ROOT
from pipeline.data.records import DeployReport, ReplicaDeploy, UpdateKind
from pipeline.data.sampling import DraftSampleMethod
from pipeline.rendezvous import private_dir, private_file
from pipeline.serving import metrics as serving_metrics

UpdateMode = Literal["hot", "restart"]


@dataclass(frozen=True)
class ReplicaSpec:
    name: str
    host: str
    port: int
    served_model_name: str = "policy"
    api_key_env: str = ""  # the key itself only ever lives in the environment

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None


@dataclass(frozen=True)
class Speculation:
    """How replicas speculate, beyond the drafter: vLLM's `draft_sample_method`, and the largest batch whose rounds
    speculate (None: the stand-ins measure it, a vLLM replica speculates at every batch size)."""

    draft_sample_method: DraftSampleMethod = "greedy"
    max_batch: int | None = None


MAX_BATCH = 1 << 20  # the open end of a batch-size schedule


def speculative_config(method: str, drafter_dir: str, k: int, speculation: Speculation = Speculation()) -> str:
    """vLLM's --speculative-config for a drafter kind: P-EAGLE is an EAGLE-3 drafter served with parallel drafting.
    A batch threshold T goes as vLLM's batch-size schedule `num_speculative_tokens_per_batch_size`: k drafts up to
    T requests, none above (vllm/config/speculative.py; 0 drafts is a valid entry there)."""
    config: dict = {"method": "eagle3" if method == "peagle" else method, "model": drafter_dir,
                    "num_speculative_tokens": k}
    if method == "peagle":
        config["parallel_drafting"] = True
    if speculation.draft_sample_method != "greedy":
        config["draft_sample_method"] = speculation.draft_sample_method
    if speculation.max_batch is not None:
        T = speculation.max_batch
        config["num_speculative_tokens_per_batch_size"] = [[1, T, k], [T + 1, MAX_BATCH, 0]]
    return json.dumps(config)


DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"  # vLLM serves its weight-update routes only with this set


def vllm_argv(replica: ReplicaSpec, target: str, method: str, drafter_dir: str, k: int,
              weight_transfer_backend: str = "", speculation: Speculation = Speculation()) -> list[str]:
    """`vllm serve` for one replica. No API key here: argv ends up in process lists and logs, so
    the key goes to vLLM through its VLLM_API_KEY environment variable (`vllm_env`). A weight-transfer
    backend (`disk` for hot drafter updates) adds `--weight-transfer-config`."""
    argv = ["vllm", "serve", target, "--host", replica.host, "--port", str(replica.port),
            "--served-model-name", replica.served_model_name,
            "--speculative-config", speculative_config(method, drafter_dir, k, speculation)]
    if weight_transfer_backend:
        argv += ["--weight-transfer-config", json.dumps({"backend": weight_transfer_backend})]
    return argv


def vllm_env(replica: ReplicaSpec, dev_mode: bool = False) -> dict[str, str]:
    """The launching environment: the replica's key, if any, as VLLM_API_KEY; VLLM_SERVER_DEV_MODE=1 when
    the replica is to take hot weight updates."""
    env = dict(os.environ)
    if replica.api_key:
        env["VLLM_API_KEY"] = replica.api_key
    if dev_mode:
        env[DEV_MODE_ENV] = "1"
    return env


class ReplicaDriver(Protocol):
    def restart(self, replica: ReplicaSpec, target: str, drafter_dir: str) -> None: ...

    def stop(self, replica: ReplicaSpec) -> None: ...

    def alive(self, replica: ReplicaSpec) -> bool:
        """False once the driver knows the replica's process has exited (fail fast, not at the timeout)."""
        ...

    def serving(self, replica: ReplicaSpec) -> tuple[str, str] | None:
        """(target, drafter_dir) the replica's running process serves; None when not known."""
        ...

    def updated(self, replica: ReplicaSpec, drafter_dir: str, target: str | None = None) -> None:
        """The replica's drafter weights were replaced in place by those of `drafter_dir` (a hot update), and
        its policy by `target` when given."""
        ...


class StandInDriver:
    """Supervises local stand-in replica processes (`pipeline.serving.standin_replica`), not vLLM.

    Each replica's pid is kept in `<state_dir>/<name>.pid`, so a later driver (the next Dagster
    run, another process) can replace a replica an earlier one started; after a hot update,
    `<name>.drafter` names the drafter it serves since. With `dev_mode` (as vLLM with
    VLLM_SERVER_DEV_MODE=1) the replicas serve the weight-update routes."""

    def __init__(self, k: int, state_dir: Path, dev_mode: bool = True, speculation: Speculation = Speculation()
                 ) -> None:
        self.k, self.state_dir, self.dev_mode, self.speculation = k, state_dir, dev_mode, speculation
        self.processes: dict[str, subprocess.Popen] = {}

    def argv(self, replica: ReplicaSpec, target: str, drafter_dir: str) -> list[str]:
        s = self.speculation
        argv = [sys.executable, "-m", "pipeline.serving.standin_replica", "--host", replica.host,
                "--port", str(replica.port), "--target", target, "--drafter", drafter_dir,
                "--num-speculative-tokens", str(self.k), "--served-model-name", replica.served_model_name,
                "--draft-sample-method", s.draft_sample_method,
                "--speculation-max-batch", "auto" if s.max_batch is None else str(s.max_batch)]
        return argv + (["--api-key-env", replica.api_key_env] if replica.api_key_env else [])

    def _pid_file(self, replica: ReplicaSpec) -> Path:
        return self.state_dir / f"{replica.name}.pid"

    def _drafter_file(self, replica: ReplicaSpec) -> Path:
        return self.state_dir / f"{replica.name}.drafter"

    def restart(self, replica: ReplicaSpec, target: str, drafter_dir: str) -> None:
        self.stop(replica)
        # Its pid file says which process `stop` signals: a folder of this user's alone (rendezvous.private_dir).
        log = private_file(private_dir(self.state_dir) / f"{replica.name}.log")
        env = {k: v for k, v in os.environ.items() if k != DEV_MODE_ENV}
        if self.dev_mode:
            env[DEV_MODE_ENV] = "1"
        process = subprocess.Popen(
            self.argv(replica, target, drafter_dir), stdout=log, stderr=subprocess.STDOUT,
            cwd=PROJECT_ROOT, start_new_session=True, env=env,  # where `-m pipeline...` imports from
        )
        self.processes[replica.name] = process
        self._pid_file(replica).write_text(str(process.pid))

    def stop(self, replica: ReplicaSpec) -> None:
        process = self.processes.pop(replica.name, None)
        pid_file = self._pid_file(replica)
        recorded = int(pid_file.read_text()) if pid_file.exists() else None
        if process is not None and process.pid != recorded:
            # Another process (a later deploy run) replaced the replica we started: the pid file
            # names the one serving now. Ours goes too, if it is still there.
            self._terminate(process.pid, process)
            process = None
        self._terminate(process.pid if process else recorded, process)
        pid_file.unlink(missing_ok=True)
        self._drafter_file(replica).unlink(missing_ok=True)

    @staticmethod
    def _terminate(pid: int | None, process: subprocess.Popen | None) -> None:
        if pid is not None and _running(pid):
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 15
            while _running(pid) and time.monotonic() < deadline:
                if process is not None:
                    process.poll()  # reap our own child so it does not linger as a zombie
                time.sleep(0.1)
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        if process is not None:
            process.wait()

    def alive(self, replica: ReplicaSpec) -> bool:
        process = self.processes.get(replica.name)
        if process is not None:
            return process.poll() is None
        pid_file = self._pid_file(replica)
        return pid_file.exists() and _running(int(pid_file.read_text()))

    def serving(self, replica: ReplicaSpec) -> tuple[str, str] | None:
        """Read from the command line of the process the pid file names (whichever driver started it), the
        drafter from `<name>.drafter` once a hot update replaced it."""
        pid_file = self._pid_file(replica)
        pid = int(pid_file.read_text()) if pid_file.exists() else None
        if pid is None or not _running(pid):
            return None
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            target, drafter_dir = argv[argv.index("--target") + 1], argv[argv.index("--drafter") + 1]
        except (OSError, ValueError, IndexError):
            return None
        with suppress(OSError, ValueError, json.JSONDecodeError, KeyError, TypeError):
            hot = json.loads(self._drafter_file(replica).read_text())
            if int(hot["pid"]) == pid:  # else written for a process since replaced
                return hot["target"] or target, hot["drafter"]
        return target, drafter_dir

    def updated(self, replica: ReplicaSpec, drafter_dir: str, target: str | None = None) -> None:
        pid_file = self._pid_file(replica)
        if pid_file.exists():
            known = self.serving(replica)
            target = target or (known[0] if known else None)
            self._drafter_file(replica).write_text(json.dumps(
                {"pid": int(pid_file.read_text().strip()), "target": target, "drafter": drafter_dir}))

    def stop_all(self, replicas: list[ReplicaSpec]) -> None:
        for replica in replicas:
            self.stop(replica)


def _running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


class CommandDriver:
    """Restarts a real vLLM replica with a configured command template, e.g. a supervisor or
    `kubectl rollout restart`; `{argv}` is the shell-quoted `vllm serve ...` line. With a weight-transfer
    backend the replica starts in dev mode with it, ready for hot drafter updates."""

    def __init__(self, template: str, method: str, k: int, weight_transfer_backend: str = "",
                 speculation: Speculation = Speculation()) -> None:
        self.template, self.method, self.k = template, method, k
        self.weight_transfer_backend, self.speculation = weight_transfer_backend, speculation

    def command(self, replica: ReplicaSpec, target: str, drafter_dir: str) -> str:
        argv = vllm_argv(replica, target, self.method, drafter_dir, self.k, self.weight_transfer_backend,
                         self.speculation)
        return self.template.format(argv=shlex.join(argv), name=replica.name, drafter=drafter_dir)

    def restart(self, replica: ReplicaSpec, target: str, drafter_dir: str) -> None:
        subprocess.run(self.command(replica, target, drafter_dir), shell=True, check=True,
                       env=vllm_env(replica, dev_mode=bool(self.weight_transfer_backend)))

    def stop(self, replica: ReplicaSpec) -> None:
        pass

    def alive(self, replica: ReplicaSpec) -> bool:
        return True  # not ours to watch: the health gate's timeout decides

    def serving(self, replica: ReplicaSpec) -> tuple[str, str] | None:
        return None  # not observable here: the deploy goes by the fleet's recorded state

    def updated(self, replica: ReplicaSpec, drafter_dir: str, target: str | None = None) -> None:
        pass  # the fleet's recorded state says what each replica serves


class GateError(RuntimeError):
    """A replica failed a deploy gate; the message names the replica and the gate. A stopped deploy says
    what each replica it reached runs now (`replicas`), the one that failed as rolled back."""

    def __init__(self, message: str, replicas: tuple[ReplicaDeploy, ...] = ()) -> None:
        super().__init__(message)
        self.replicas = replicas


@dataclass(frozen=True)
class GateConfig:
    """The deploy gates of a replica; the values come from `fleet.*` of the pipeline config (one default each)."""

    ready_timeout_s: float
    canary_requests: int
    canary_tokens: int
    min_live_tau: float


def _request(replica: ReplicaSpec, path: str, body: dict | None = None, timeout: float = 60.0) -> bytes:
    request = urllib.request.Request(replica.url + path, method="POST" if body is not None else "GET",
                                     data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Content-Type": "application/json"})
    if replica.api_key:
        request.add_header("Authorization", f"Bearer {replica.api_key}")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read()


def scrape(replica: ReplicaSpec, timeout: float = 10.0) -> serving_metrics.SpecCounters:
    """The replica's speculative-decoding counters now."""
    return serving_metrics.parse(_request(replica, "/metrics", timeout=timeout).decode())


def wait_healthy(replica: ReplicaSpec, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            _request(replica, "/health", timeout=5)
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            if not alive():
                raise GateError(f"replica {replica.name}: its process exited before /health answered") from None
            if time.monotonic() > deadline:
                raise GateError(f"replica {replica.name}: /health not ready after {timeout_s:.0f}s ({exc})") from None
            time.sleep(0.5)


def check_replica(
    replica: ReplicaSpec, gates: GateConfig, canary_prompts: list[list[int]], alive: Callable[[], bool] = lambda: True
) -> float:
    """All gates in order; returns the live mean acceptance length over the canary window."""
    wait_healthy(replica, gates.ready_timeout_s, alive)
    try:
        models = [m["id"] for m in json.loads(_request(replica, "/v1/models"))["data"]]
        if replica.served_model_name not in models:
            raise GateError(f"replica {replica.name}: /v1/models lists {models}, not {replica.served_model_name!r}")
        # Canaries decode greedily (temperature 0): the same window measures the same drafter alike.
        smoke = json.loads(_request(replica, "/v1/completions", {
            "model": replica.served_model_name, "prompt": canary_prompts[0], "max_tokens": 4, "temperature": 0}))
        if not smoke["choices"] or not smoke["choices"][0].get("text"):
            raise GateError(f"replica {replica.name}: the smoke completion returned no text")
        before = scrape(replica)
        for i in range(gates.canary_requests):
            _request(replica, "/v1/completions", {"model": replica.served_model_name,
                                                  "prompt": canary_prompts[i % len(canary_prompts)],
                                                  "max_tokens": gates.canary_tokens, "temperature": 0})
        window = scrape(replica) - before
    except (urllib.error.URLError, KeyError, json.JSONDecodeError) as exc:
        raise GateError(f"replica {replica.name}: {exc}") from None
    tau = window.mean_acceptance_length
    if tau is None or tau < gates.min_live_tau:
        raise GateError(f"replica {replica.name}: live tau {tau} below the gate {gates.min_live_tau}")
    return tau


@dataclass(frozen=True)
class StagedDrafter:
    """A drafter version's checkpoint directory, as replicas read it."""

    version: str
    directory: str


# --- the hot update ----------------------------------------------------------------------------------------


class HotUpdateUnsupported(RuntimeError):
    """The replica took no update and is unchanged: it has no weight-update routes (404/405), or refused to
    begin one (/init_weight_transfer_engine or /pause failed, e.g. vLLM without a weight-transfer backend)."""


class HotUpdateFailed(RuntimeError):
    """A weight-update call failed after the replica was paused: its weights may have changed. The replica was
    not resumed on them: `rolled_back` when the weights it had are back in place and it serves again, else it is
    still paused, for its caller to restart."""

    def __init__(self, message: str, rolled_back: bool = False) -> None:
        super().__init__(message)
        self.rolled_back = rolled_back


class _Unchanged(RuntimeError):
    """Inside a paused update: refused before any weight was sent."""


@dataclass(frozen=True)
class Weights:
    """What a paused session sends: a drafter version's checkpoint, after the policy in `policy_dir` if given."""

    drafter_dir: str
    version: str
    policy_dir: str | None = None


def weight_version(version: str) -> str:
    """What the fleet commits as vLLM's `weight_version` for a drafter version, and reads back from /weight_info."""
    return f"drafter-v{version}"


def _dev_call(replica: ReplicaSpec, path: str, body: dict | None = None, timeout: float = 300.0) -> dict:
    """A dev-mode route; HotUpdateUnsupported when the server does not have it, HotUpdateFailed on any other
    error (the server's own message kept)."""
    try:
        raw = _request(replica, path, body, timeout)
    except urllib.error.HTTPError as exc:
        if exc.code in (404, 405):
            raise HotUpdateUnsupported(f"{path} answered HTTP {exc.code}") from None
        detail = exc.read().decode(errors="replace")[:300]
        raise HotUpdateFailed(f"{path} answered HTTP {exc.code}: {detail}") from None
    except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
        raise HotUpdateFailed(f"{path}: {exc}") from None
    try:
        return json.loads(raw) if raw else {}
    except json.JSONDecodeError:
        raise HotUpdateFailed(f"{path} answered with no JSON object") from None


def _send_drafter(replica: ReplicaSpec, drafter_dir: str, label: str, start: str = "/start_draft_weight_update"
                  ) -> None:
    """One weight-update session on a paused replica: start (the draft model's, or with
    `/start_weight_update` the policy's), the checkpoint, finish under `label`."""
    _dev_call(replica, start, {})
    _dev_call(replica, "/update_weights", {"update_info": {"path": str(Path(drafter_dir).resolve())}})
    _dev_call(replica, "/finish_weight_update", {"weight_version": label})


def local_directory(target: str) -> str | None:
    """The local directory of a policy checkpoint URI (`file://` or a path), as the `disk` backend reads it;
    None for a remote one (s3://), which only a restart loads."""
    if target.startswith("file://"):
        return urllib.request.url2pathname(target[len("file://"):])
    return target if target.startswith("/") else None


def policy_version(policy_dir: str) -> str:
    """The `weight_version` a policy sent in place is committed under."""
    return f"policy-{Path(policy_dir).name}"


def _send_paused(replica: ReplicaSpec, weights: Weights) -> None:
    """`weights` to a paused replica, then its /weight_info checked, still paused: the replica is resumed only on
    weights it reports. _Unchanged when it has no route for a policy update (nothing sent), HotUpdateFailed when
    anything failed once a weight may have been sent."""
    try:
        if weights.policy_dir is not None:
            try:
                _dev_call(replica, "/start_weight_update", {})
            except HotUpdateUnsupported as exc:  # nothing sent yet: unchanged, it takes the restart
                raise _Unchanged(f"{exc}: the policy cannot be sent in place") from None
            _dev_call(replica, "/update_weights", {"update_info": {"path": str(Path(weights.policy_dir).resolve())}})
            _dev_call(replica, "/finish_weight_update", {"weight_version": policy_version(weights.policy_dir)})
        _send_drafter(replica, weights.drafter_dir, weight_version(weights.version))
        reported = _dev_call(replica, "/weight_info").get("weight_version")
    except HotUpdateUnsupported as exc:
        raise HotUpdateFailed(f"{exc} after /pause succeeded") from None
    if reported != weight_version(weights.version):
        raise HotUpdateFailed(f"/weight_info reports {reported!r} after the update, not "
                              f"{weight_version(weights.version)!r}")


def hot_update(replica: ReplicaSpec, drafter_dir: str, version: str, policy_dir: str | None = None,
               restore: Weights | None = None) -> float:
    """Pause the replica (requests held, not dropped), send it the policy in `policy_dir` (when given) and the
    drafter in `drafter_dir`, check it reports `version`, resume; returns the seconds its requests were held.

    A held request never decodes on a failed update: once a weight may have been sent, a failure puts `restore`
    (the weights the replica had) back while it is still paused and resumes it on them (HotUpdateFailed with
    `rolled_back`); with no `restore`, or when that fails too, the replica stays paused (HotUpdateFailed) for the
    caller to restart. HotUpdateUnsupported when it refused before anything changed (resumed, unchanged)."""
    try:
        _dev_call(replica, "/init_weight_transfer_engine", {"init_info": {}})
        _dev_call(replica, "/pause?mode=keep", {})
    except HotUpdateFailed as exc:
        raise HotUpdateUnsupported(str(exc)) from None
    paused = time.monotonic()
    try:
        _send_paused(replica, Weights(drafter_dir, version, policy_dir))
    except _Unchanged as exc:
        _resume(replica, str(exc))
        raise HotUpdateUnsupported(str(exc)) from None
    except HotUpdateFailed as exc:
        if restore is None:
            raise HotUpdateFailed(f"{exc}; the replica stays paused") from None
        try:
            _send_paused(replica, restore)
        except (HotUpdateFailed, _Unchanged) as again:
            raise HotUpdateFailed(f"{exc}; putting version {restore.version} back failed too ({again}): the replica "
                                  "stays paused") from None
        _resume(replica, str(exc))
        raise HotUpdateFailed(f"{exc}; version {restore.version} put back before the replica resumed",
                              rolled_back=True) from None
    _resume(replica)
    return time.monotonic() - paused


def _resume(replica: ReplicaSpec, failure: str = "") -> None:
    try:
        _dev_call(replica, "/resume", {})
    except (HotUpdateFailed, HotUpdateUnsupported) as exc:
        raise HotUpdateFailed(f"{f'{failure}; ' if failure else ''}/resume failed, the replica may hold its "
                              f"requests: {exc}") from None


def send_policy(replica: ReplicaSpec, policy_dir: str) -> float:
    """The policy in `policy_dir` in place on a running replica, alone (its drafter stays): paused (requests held),
    sent, resumed; /weight_info must then report the policy's label. Returns the seconds requests were held.
    HotUpdateUnsupported when it refused before anything changed; HotUpdateFailed otherwise."""
    try:
        _dev_call(replica, "/init_weight_transfer_engine", {"init_info": {}})
        _dev_call(replica, "/pause?mode=keep", {})
    except HotUpdateFailed as exc:
        raise HotUpdateUnsupported(str(exc)) from None
    paused = time.monotonic()
    try:
        _send_drafter(replica, policy_dir, policy_version(policy_dir), start="/start_weight_update")
    finally:
        _dev_call(replica, "/resume", {})
    held = time.monotonic() - paused
    reported = _dev_call(replica, "/weight_info").get("weight_version")
    if reported != policy_version(policy_dir):
        raise HotUpdateFailed(f"/weight_info reports {reported!r} after the policy update, not "
                              f"{policy_version(policy_dir)!r}")
    return held


def roll_back(replica: ReplicaSpec, driver: ReplicaDriver, target: str, previous: StagedDrafter,
              gates: GateConfig, alive: Callable[[], bool], policy_dir: str | None = None) -> str:
    """The previous drafter again (on the policy in `policy_dir`, the one `target` names, when the update sent a
    policy too), hot if the replica takes it, else by a restart on `target` (a replica left paused included).
    Returns how ("hot" or "restart")."""
    try:
        hot_update(replica, previous.directory, previous.version, policy_dir)
        driver.updated(replica, previous.directory, target if policy_dir else None)
        return "hot"
    except (HotUpdateFailed, HotUpdateUnsupported):
        driver.restart(replica, target, previous.directory)
        wait_healthy(replica, gates.ready_timeout_s, alive)
        return "restart"


@dataclass
class _Attempt:
    """How one replica's update went so far (becomes its ReplicaDeploy)."""

    update: UpdateKind = "restart"
    note: str = ""
    paused_s: float = 0.0


def _try_hot(replica: ReplicaSpec, driver: ReplicaDriver, target: str, version: str, drafter_dir: str,
             previous: StagedDrafter, gates: GateConfig, canary_prompts: list[list[int]],
             alive: Callable[[], bool], attempt: _Attempt, served: str) -> float | None:
    """The hot update and its gates; the live tau, or None when the replica is to be restarted instead (with
    `attempt.note` saying why, and the previous drafter back on it when the update may have changed it).
    `served`: the policy the replica runs; when it is not `target`, the new policy goes first, in place."""
    new_policy = local_directory(target) if served != target else None
    old_policy = local_directory(served) if new_policy else None
    try:
        attempt.paused_s = hot_update(replica, drafter_dir, version, new_policy,
                                      Weights(previous.directory, previous.version, old_policy))
    except HotUpdateUnsupported as exc:
        attempt.note = f"no hot update ({exc}); restarted"
        return None
    except HotUpdateFailed as exc:
        how = "hot"
        if exc.rolled_back:
            driver.updated(replica, previous.directory, served if old_policy else None)
        else:  # still paused on weights it may have half: restarted on what it had
            driver.restart(replica, served, previous.directory)
            wait_healthy(replica, gates.ready_timeout_s, alive)
            how = "restart"
        attempt.note = f"hot update failed ({exc}); rolled back to version {previous.version} by {how}; restarted"
        return None
    driver.updated(replica, drafter_dir, target if new_policy else None)
    try:
        tau = check_replica(replica, gates, canary_prompts, alive)
    except GateError as exc:
        how = roll_back(replica, driver, served, previous, gates, alive, old_policy)
        attempt.note = f"hot-updated replica failed a gate ({exc}); rolled back to version {previous.version} " \
                       f"by {how}; restarted"
        return None
    attempt.update = "hot"
    if new_policy:
        attempt.note = "the new policy and the drafter sent in place"
    return tau


def rolling_deploy(
    replicas: list[ReplicaSpec],
    driver: ReplicaDriver,
    target: str,
    version: str,
    drafter_dir: str,
    previous: StagedDrafter | None,
    gates: GateConfig,
    canary_prompts: list[list[int]],
    update: UpdateMode = "hot",
    recorded: dict[str, ReplicaDeploy] | None = None,
) -> DeployReport:
    """Update replicas one at a time; on a failed gate restore `previous` there and stop.

    A replica already running `drafter_dir` on `target` keeps running: it only passes the gates (and is
    updated like the others if it fails them). With `update="hot"` and a `previous` to roll back to, a replica
    whose policy is known (from the driver, else from `recorded`, the fleet's recorded state) is hot-updated:
    the drafter alone when it serves `target`, `target` first when it serves another policy and both are local
    directories. Any other, and one whose hot update fails (rolled back to `previous` first, on the policy it
    served), is restarted."""
    recorded = recorded or {}
    done: list[ReplicaDeploy] = []
    for i, replica in enumerate(replicas):
        start = time.monotonic()
        alive = functools.partial(driver.alive, replica)
        attempt, tau = _Attempt(), None
        serving = driver.serving(replica)
        if serving == (target, drafter_dir):
            with suppress(GateError):  # failing while already serving it: updated like the others
                tau = check_replica(replica, gates, canary_prompts, alive)
                attempt.update = "none"
        # The policy it serves: what the driver sees, else what the fleet's state recorded.
        policy = serving[0] if serving else (recorded[replica.name].target if replica.name in recorded else "")
        try:
            if tau is None and update == "hot":
                if not policy:
                    attempt.note = "the policy it serves is not known: restarted"
                elif policy != target and (local_directory(target) is None or local_directory(policy) is None):
                    attempt.note = "it serves another policy, not both on local disk: restarted"
                elif previous is None:
                    attempt.note = "no previous version to roll back to: restarted"
                else:
                    tau = _try_hot(replica, driver, target, version, drafter_dir, previous, gates, canary_prompts,
                                   alive, attempt, policy)
            if tau is None:
                driver.restart(replica, target, drafter_dir)
                tau = check_replica(replica, gates, canary_prompts, alive)
        except GateError as exc:
            rolled_back = ()
            if previous is not None:
                driver.restart(replica, target, previous.directory)
                wait_healthy(replica, gates.ready_timeout_s, alive)
                earlier = recorded.get(replica.name)
                rolled_back = (ReplicaDeploy(replica.name, previous.version, earlier.live_tau if earlier else 0.0,
                                             time.monotonic() - start, True, "rolled back",
                                             f"{attempt.note + '; ' if attempt.note else ''}{exc}", attempt.paused_s,
                                             target),)
            untouched = tuple(recorded[r.name] for r in replicas[i + 1:] if r.name in recorded)
            raise GateError(
                f"{exc}; rolled back to version {previous.version if previous else 'none'}; deploy of "
                f"version {version} stopped after {len(done)} of {len(replicas)} replicas",
                (*done, *rolled_back, *untouched),
            ) from None
        done.append(ReplicaDeploy(replica.name, version, tau, time.monotonic() - start,
                                  attempt.update == "restart", attempt.update, attempt.note, attempt.paused_s,
                                  target))
    return DeployReport(version, tuple(done))
