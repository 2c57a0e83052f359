"""A model stage as a Ray job (`launch.launcher: ray`): its entrypoint and what it asks the cluster for.

The entrypoint is the stage's command on one machine (`pipeline.launch.process.stage_command`: the worker itself,
torchrun for several ranks). The job asks for the stage's CPUs and memory (`launch.<stage>`), a GPU per rank on
device cuda (a split policy's `target.split_devices` per rank) and the custom resources of `launch.ray.resources`;
Ray starts the entrypoint on one node once they are free there, so a job waits (PENDING) while another job, or an
RL trainer's placement groups, hold them: it never preempts. Ray's scheduler holds the entrypoint's resources for
the job's life, so a stage's ranks get the node's devices Ray assigned (CUDA_VISIBLE_DEVICES). Its environment is
the node's, with `launch.ray.env_vars` over it. A training on several nodes is one job whose driver reserves a
placement group of a bundle per node and runs a torchrun agent in each (`pipeline.launch.raygroup`).

Who may submit: a job runs its entrypoint as the nodes' user, with their environment (the stages' secrets), so a
cluster that takes jobs without a token runs anyone's code. The launcher sends the cluster's token (Ray's token
authentication, `RAY_AUTH_MODE=token`) on every request, read from `launch.ray.token_file` or where Ray's own
clients look, and refuses to submit without one, or from a token file that others can read or that is not this
user's.

Where the code is: with `launch.ray.working_dir` empty the cluster shares this machine's filesystem (a cluster on
this machine, or nodes that mount the project at the same path): the entrypoint runs this process's Python in the
project directory. Otherwise it is the job's runtime_env `working_dir` (a folder Ray uploads, or a zip's URI), run
by the nodes' `python`, whose environment has this project's dependencies.
"""

from __future__ import annotations

import os
import re
import shlex
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.config import PipelineConfig, RayConfig
from pipeline.launch.process import stage_command, stage_ranks
from pipeline.launch.raygroup import NodeGroup
from pipeline.stages import TRAINING, Stage

_QUANTITY = re.compile(r"([0-9]+(?:\.[0-9]+)?)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?")
_SCALE = {None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


def quantity(value: str) -> float:
    """A Kubernetes quantity (`launch.<stage>.cpu` / `.memory`, validated at load) as a number: 500m -> 0.5."""
    match = _QUANTITY.fullmatch(value)
    if not match:
        raise ValueError(f"{value!r} is not a Kubernetes quantity (e.g. 8, 500m, 64Gi)")
    return float(match.group(1)) * _SCALE[match.group(2)]


@dataclass(frozen=True)
class RayStageJob:
    """One stage's Ray job, as `JobSubmissionClient.submit_job` takes it (dagster-ray's `SubmitJobParams`)."""

    entrypoint: str
    num_cpus: float
    num_gpus: float
    memory: int  # bytes
    resources: dict[str, float] = field(default_factory=dict)  # custom resources
    runtime_env: dict = field(default_factory=dict)

    def submit_params(self) -> dict:
        """The keyword arguments of `submit_job` (each call its own copies: the Pipes client adds to them)."""
        params = {"entrypoint": self.entrypoint, "entrypoint_num_cpus": self.num_cpus,
                  "entrypoint_num_gpus": self.num_gpus, "entrypoint_memory": self.memory,
                  "runtime_env": {**self.runtime_env, "env_vars": dict(self.runtime_env.get("env_vars", {}))}}
        if self.resources:
            params["entrypoint_resources"] = dict(self.resources)
        return params


def ray_stage_job(cfg: PipelineConfig, stage: Stage, project_dir: Path, python: str = sys.executable) -> RayStageJob:
    """The stage's Ray job: its command in the project directory (`launch.ray.working_dir` empty) or in its
    runtime_env working_dir, with the stage's resources; a training on several nodes: the driver of their
    placement group (`pipeline.launch.raygroup`), which asks for nothing itself and reserves a node's resources
    per bundle."""
    settings, ray = cfg.launch.of(stage), cfg.launch.ray
    ranks = stage_ranks(cfg, stage)
    per_rank = cfg.target.gpus_per_process if stage.policy_per_rank else 1
    gpus = ranks * per_rank if cfg.device.startswith("cuda") else 0
    python = "python" if ray.working_dir else python
    if stage == TRAINING and cfg.launch.training.nnodes > 1:
        bundle = {"CPU": quantity(settings.cpu), "memory": quantity(settings.memory), **({"GPU": gpus} if gpus else {}),
                  **ray.resources}
        group = NodeGroup(cfg.launch.training.nnodes, ranks, bundle, ray.placement_strategy)
        command = group.driver_command(python, "" if ray.working_dir else str(project_dir))
        cpus, gpus, memory, resources = 0.0, 0, 0, {}
    else:
        command = stage_command(cfg, stage, python)
        cpus, memory, resources = quantity(settings.cpu), int(quantity(settings.memory)), dict(ray.resources)
    if ray.working_dir:
        entrypoint = shlex.join(command)
        runtime_env = {"working_dir": ray.working_dir}
    else:
        entrypoint = f"cd {shlex.quote(str(project_dir))} && exec {shlex.join(command)}"
        runtime_env = {}
    if ray.env_vars:
        runtime_env["env_vars"] = dict(ray.env_vars)
    return RayStageJob(entrypoint, cpus, float(gpus), memory, resources, runtime_env)


TOKEN_ENV, TOKEN_PATH_ENV = "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"  # where Ray's clients look, before ~/.ray
DEFAULT_TOKEN_FILE = Path("~/.ray/auth_token")


class RayAuthError(PermissionError):
    """No token for the cluster, or one that is not this user's alone: the message names the file, never the token."""


def cluster_token(ray: RayConfig) -> str:
    """The token every request to the cluster's job API carries: from `launch.ray.token_file`, else where Ray's
    own clients look (RAY_AUTH_TOKEN, the file RAY_AUTH_TOKEN_PATH names, ~/.ray/auth_token)."""
    if not ray.token_file and os.environ.get(TOKEN_ENV, "").strip():
        return os.environ[TOKEN_ENV].strip()
    path = Path(ray.token_file or os.environ.get(TOKEN_PATH_ENV) or DEFAULT_TOKEN_FILE).expanduser()
    where = "launch.ray.token_file" if ray.token_file else TOKEN_PATH_ENV if os.environ.get(TOKEN_PATH_ENV) \
        else "Ray's default token file"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise RayAuthError(f"no token for the Ray cluster's job API: {path} ({where}) does not exist. Start the "
                           f"cluster with RAY_AUTH_MODE=token and give its token to launch.ray.token_file, "
                           f"{TOKEN_ENV} or {TOKEN_PATH_ENV}: a cluster that takes jobs without one runs anyone's "
                           "code as its nodes' user") from None
    except OSError as error:  # a symlink (ELOOP), a folder on the way that is not ours to enter
        raise RayAuthError(f"{path} ({where}): cannot open it as the cluster's token file ({error.strerror}); "
                           "a token file is a plain file, never a symlink") from None
    with os.fdopen(fd) as file:
        found = os.fstat(file.fileno())
        if not stat.S_ISREG(found.st_mode) or found.st_uid != os.getuid() or stat.S_IMODE(found.st_mode) & 0o077:
            raise RayAuthError(f"{path} ({where}) must be a plain file of this user's (uid {os.getuid()}) that only "
                               f"it can read (mode 0600), not uid {found.st_uid} mode "
                               f"{stat.S_IMODE(found.st_mode):04o}: a token others can read or write is theirs too")
        token = file.read().strip()
    if not token:
        raise RayAuthError(f"{path} ({where}) is empty: no token for the Ray cluster's job API")
    return token
