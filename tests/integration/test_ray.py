"""Model stages as Ray jobs (`launch.launcher: ray`) on a real Ray cluster on loopback: a head and two worker
nodes, one with the `drafter_slot` a trainer sharing the cluster would leave free, one with the trainer's own
`rl_trainer` resource. A whole RL step through Dagster with every stage a Ray job placed on the node with its slot;
a stage waiting, not preempting, while another job holds the slot, and the wait in its placement record; a stage
failing in its job; a training rank killed in its job; the job's log as the Pipes channel: a long message whole, a
lost end failing the step. The cluster is this user's alone: a job without its token is refused, from this user or
another, and its servers listen on loopback only."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import grpc
import psutil
import pytest
from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
from ray.exceptions import AuthenticationError
from ray.job_submission import JobStatus, JobSubmissionClient
from ray.util.state.common import ListApiOptions, StateResource

from assets.cotraining import drafter, hidden_states
from definitions import build_definitions
from ops.ray_cluster import RayCluster, RayNode, ray_cluster
from pipeline.accounting.cost import read_cost
from pipeline.config import PROJECT_ROOT, load_config
from pipeline.data.acceptance_record import read_acceptance
from pipeline.data.buffer import build_buffer
from pipeline.data.keys import placement_key
from pipeline.data.records import read_record
from pipeline.data.stage_placement import StagePlacement
from pipeline.data.store import open_store
from pipeline.data.training_record import read_training
from pipeline.registry import DrafterRegistry
from pipeline.sources import extract
from pipeline.sources.simulation import SimulatedRL
from pipeline.stages import EVALUATION, EXTRACTION, TRAINING
from resources import pipeline_resource
from resources.ray_jobs import PipesRayStageClient
from tests.support.config import write_config

STEP, KEY = 1, "step-000001"
SLOT = {"drafter_slot": 1.0}
ONE_CPU = {"cpu": "1", "memory": "256Mi"}  # what a loopback node has, not a GPU node's 8 CPUs and 64 GiB
WORKER_FAULTS = Path(__file__).resolve().parent.parent / "support" / "worker_faults"
NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3"  # another user runs it: the project's venv may lie where only its owner reads
LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    with ray_cluster(head_cpus=1, workers=(RayNode(1, {"rl_trainer": 1.0}), RayNode(1, SLOT))) as running:
        yield running


def _config(tmp_path: Path, cluster: RayCluster, training_ranks: int = 1) -> Path:
    """A tiny config whose stages are Ray jobs asking for the slot, and step 1's rollouts published."""
    path = write_config(tmp_path, {"launch": {"launcher": "ray", "ray": {"address": cluster.address,
                                                                         "token_file": str(cluster.token_file),
                                                                         "resources": SLOT},
                                              "extraction": ONE_CPU, "training": {**ONE_CPU, "nproc": training_ranks},
                                              "evaluation": ONE_CPU, "refresh": ONE_CPU}})
    cfg = load_config(path)
    SimulatedRL(cfg.simulation, open_store(cfg), cfg.run, cfg.data_path / "cache").run_step(STEP)
    return path


def _jobs_of(client: JobSubmissionClient, run_id: str) -> list:
    """The Ray jobs a Dagster run submitted (dagster-ray tags each with the run's id), oldest first."""
    jobs = [job for job in client.list_jobs() if run_id in (job.metadata or {}).values()]
    return sorted(jobs, key=lambda job: job.start_time)


def test_a_step_runs_its_stages_as_ray_jobs_on_the_node_with_their_slot(tmp_path: Path, cluster: RayCluster) -> None:
    """rl_step_job with every model stage a Ray job asking for `drafter_slot`, the training on two gloo ranks
    (torchrun in its job): the step's drafter trains and is measured as with any launcher, each stage's
    materialization (sent over the job's log) reaches Dagster, and every job ran on the one node that has the
    slot, never on the trainer's or the head."""
    path = _config(tmp_path, cluster, training_ranks=2)
    cfg = load_config(path)
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("rl_step", [KEY])
        result = build_definitions(str(path)).resolve_job_def("rl_step_job").execute_in_process(
            instance=instance, partition_key=KEY)
        assert result.success
        extracted = instance.get_latest_materialization_event(dg.AssetKey("hidden_states")).asset_materialization
        assert extracted.metadata["ran_in"].value == "ray"
        checks = [e for e in result.get_asset_check_evaluations() if e.asset_key == dg.AssetKey("acceptance")]
        assert checks
        assert all(c.passed for c in checks)
    store = open_store(cfg)
    assert read_acceptance(store, cfg.run, STEP).cotrained.version == "1"
    placements = [read_record(store, placement_key(cfg.run, STEP, s), StagePlacement)
                  for s in (EXTRACTION, TRAINING, EVALUATION)]
    assert [(p.where, p.ranks) for p in placements] == [("ray", 1), ("ray", 2), ("ray", 1)]
    assert all(p.waited_s > 0 for p in placements)  # submitted -> started: at least the cluster's start of it
    ledger = {p.stage: p for p in read_cost(store, cfg.run, STEP).placements}  # the step's row: its stages' waits
    assert [ledger[s] for s in (EXTRACTION, TRAINING)] == placements[:2]

    client = cluster.jobs()
    jobs = _jobs_of(client, result.run_id)
    assert [job.entrypoint.rsplit(" ", 1)[-1] for job in jobs] == [s.worker for s in (EXTRACTION, TRAINING,
                                                                                       EVALUATION)]
    assert "--nproc-per-node=2" in jobs[1].entrypoint
    assert all(job.status == JobStatus.SUCCEEDED for job in jobs)
    assert {job.driver_node_id for job in jobs} == {cluster.node_ids()["drafter_slot"]}


@pytest.mark.reliability("fault", "a stage's Ray job submitted while another job holds its slot: it waits (PENDING), "
                                  "never preempts, runs once the slot is free, and records the wait")
def test_a_stage_waits_for_its_slot_while_another_job_holds_it(tmp_path: Path, cluster: RayCluster) -> None:
    """The slot held by another job (an RL trainer's work, say) for a few seconds: the extraction's job queues
    (PENDING), starts once the holder ends and succeeds; its placement record holds the wait, at least the
    time from its submission to the holder's end."""
    path = _config(tmp_path, cluster)
    cfg = load_config(path)
    client = cluster.jobs()
    holder = client.submit_job(entrypoint="python -c 'import time; time.sleep(8)'", entrypoint_num_cpus=0,
                               entrypoint_resources=SLOT)
    while client.get_job_status(holder) != JobStatus.RUNNING:
        time.sleep(0.1)
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("rl_step", [KEY])
        result = dg.materialize([hidden_states], partition_key=KEY, instance=instance,
                                resources={"pipeline": pipeline_resource(str(path))})
        assert result.success
        metadata = result.asset_materializations_for_node("hidden_states")[0].metadata
    held = client.get_job_info(holder)
    (stage,) = _jobs_of(client, result.run_id)
    assert held.status == JobStatus.SUCCEEDED
    queued_s = (held.end_time - stage.start_time) / 1000  # Ray's clock: the stage's submission -> the slot freed
    assert queued_s > 1.0, "the holder ended before the stage was submitted: nothing to wait for"
    placement = read_record(open_store(cfg), placement_key(cfg.run, STEP, EXTRACTION), StagePlacement)
    assert placement.waited_s >= queued_s
    assert metadata["waited_seconds"].value == round(placement.waited_s, 2)


@pytest.mark.reliability("fault", "a stage's worker failing in its Ray job: the step fails with the worker's error "
                                  "from the job's log")
def test_a_stage_failing_in_its_ray_job_fails_its_step_with_the_workers_error(tmp_path: Path,
                                                                            cluster: RayCluster) -> None:
    """The extraction of a step the source never published: the worker exits with its error, the job FAILED, and
    the step fails with Ray's message, which carries the end of the job's log (the worker's traceback)."""
    path = _config(tmp_path, cluster)
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("rl_step", ["step-000002"])
        result = dg.materialize([hidden_states], partition_key="step-000002", instance=instance,
                                resources={"pipeline": pipeline_resource(str(path))}, raise_on_error=False)
    assert not result.success
    (failure,) = [e for e in result.all_events if e.is_step_failure]
    error = failure.step_failure_data.error.to_string()
    assert "failed with status FAILED" in error
    assert "RolloutsError" in error  # the worker's own error, from the end of the job's log
    assert "step-000002/policy.json: not found" in error
    (job,) = _jobs_of(cluster.jobs(), result.run_id)
    assert job.status == JobStatus.FAILED


@pytest.mark.reliability("fault", "a training spread over two nodes of a Ray placement group, rank 1 SIGKILLed "
                                  "mid-training: the attempt fails with nothing registered, Dagster's retry registers")
def test_a_training_spread_over_two_nodes_survives_a_killed_rank_through_dagsters_retry(
        tmp_path: Path, cluster: RayCluster) -> None:
    """The drafter on two nodes of one rank each (a placement group, STRICT_SPREAD: one bundle per node), rank 1
    SIGKILLed as it applies its second optimizer step in the first attempt only (the fault hook's variables reach
    the job as `launch.ray.env_vars`): that attempt's job FAILED, a node's agent failing it, and Dagster's retry
    (`launch.retries`) trains again on two distinct nodes and registers the only model version."""
    path = write_config(tmp_path, {"launch": {
        "launcher": "ray", "retries": 1, "retry_delay_s": 0.0,
        "ray": {"address": cluster.address, "token_file": str(cluster.token_file),
                "placement_strategy": "STRICT_SPREAD",
                "env_vars": {"PYTHONPATH": f"{WORKER_FAULTS}:{PROJECT_ROOT}", "DRAFTER_TEST_KILL_TRAINING_RANK": "1",
                             "DRAFTER_TEST_FAULT_ONCE": str(tmp_path / "killed-once")}},
        "training": {**ONE_CPU, "nproc": 1, "nnodes": 2}}})
    cfg = load_config(path)
    store = open_store(cfg)
    SimulatedRL(cfg.simulation, store, cfg.run, cfg.data_path / "cache").run_step(STEP)
    extract.extract_hidden_states(store, cfg, STEP)  # the drafter's inputs, by the pipeline's own code
    build_buffer(store, cfg.run, STEP, cfg.train.buffer_steps, cfg.train.data_buffer_max_size)
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("rl_step", [KEY])
        result = dg.materialize([drafter], partition_key=KEY, instance=instance,
                                resources={"pipeline": pipeline_resource(str(path))})
        assert result.success
        assert result.asset_materializations_for_node("drafter")[0].metadata["model_version"].value == "1"
    assert len([e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_UP_FOR_RETRY]) == 1
    assert (tmp_path / "killed-once").exists()  # the kill fired, in the first attempt: the only difference
    client = cluster.jobs()
    killed, retried = _jobs_of(client, result.run_id)
    assert (killed.status, retried.status) == (JobStatus.FAILED, JobStatus.SUCCEEDED)
    assert "torchrun exited with" in client.get_job_logs(killed.submission_id)  # a node's agent failed the job
    assert "pipeline.launch.raygroup" in retried.entrypoint
    tasks = cluster.state().list(StateResource.TASKS, options=ListApiOptions(
        filters=[("job_id", "=", retried.job_id)], detail=True), raise_on_missing_output=True)
    agents = [t for t in tasks if t.name.startswith("training-node-")]
    assert len(agents) == 2
    assert len({t.node_id for t in agents}) == 2  # a node each
    registry = DrafterRegistry(cfg.tracking_uri, cfg.mlflow.experiment, cfg.mlflow.model_name)
    assert [str(v.version) for v in registry.client.search_model_versions(f"name = '{cfg.mlflow.model_name}'")] == ["1"]
    assert read_record(store, placement_key(cfg.run, STEP, TRAINING), StagePlacement).ranks == 2
    figures = read_training(store, cfg.run, STEP).figures
    assert len(figures.loss_history) == figures.iterations > 1


def _cluster_processes(cluster: RayCluster) -> list[psutil.Process]:
    """This cluster's processes (its nodes' and theirs: each inherits the node's token file variable)."""
    found = []
    for process in psutil.Process().children(recursive=True):
        try:
            if process.environ().get("RAY_AUTH_TOKEN_PATH") == str(cluster.token_file):
                found.append(process)
        except psutil.Error:  # gone since the listing
            pass
    return found


def _as_another_user(cluster: RayCluster, marker: Path) -> dict:
    """What a local user other than this one gets (uid 65534, the system's Python, no Ray): the token file read,
    and a job submitted to the job API without it."""
    script = f"""
import json, urllib.error, urllib.request
seen = {{}}
try:
    open({str(cluster.token_file)!r}).read()
    seen["token"] = "read"
except OSError as error:
    seen["token"] = type(error).__name__
job = json.dumps({{"entrypoint": "touch {marker}"}}).encode()
request = urllib.request.Request({cluster.address!r} + "/api/jobs/", data=job, method="POST",
                                 headers={{"Content-Type": "application/json"}})
try:
    seen["submit"] = urllib.request.urlopen(request, timeout=120).status  # the dashboard answers slowly under load
except urllib.error.HTTPError as error:
    seen["submit"] = error.code
print(json.dumps(seen))
"""
    done = subprocess.run([SYSTEM_PYTHON, "-c", script], user=NOBODY, capture_output=True, text=True, cwd="/",
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.mark.reliability("security", "a job submitted to the loopback Ray cluster without its token (another local "
                                     "user, or this one without it; or with a wrong token): refused, nothing runs; "
                                     "the token file is this user's alone, every server listens on loopback only")
def test_the_cluster_runs_no_job_without_its_token_and_listens_on_loopback_only(tmp_path: Path,
                                                                                cluster: RayCluster) -> None:
    """Whoever submits a job runs code as the pipeline's user with its environment: the cluster's job API refuses a
    request without the token (401) or with another (403), the GCS a client without it, the token lies in
    a file of mode 0600 in a folder of mode 0700, both this user's, and no process of the cluster listens beyond
    loopback. Another local user can neither read the token nor submit without it."""
    marker = tmp_path / "ran"
    folder, token = cluster.token_file.parent.stat(), cluster.token_file.stat()
    assert (folder.st_uid, token.st_uid) == (os.getuid(), os.getuid())
    assert (folder.st_mode & 0o777, token.st_mode & 0o777) == (0o700, 0o600)

    with pytest.raises(AuthenticationError, match="Authentication required"):
        JobSubmissionClient(cluster.address).submit_job(entrypoint=f"touch {marker}")
    with pytest.raises(AuthenticationError, match="Authentication failed"):
        JobSubmissionClient(cluster.address, headers={"Authorization": "Bearer not-the-token"}).submit_job(
            entrypoint=f"touch {marker}")
    with grpc.insecure_channel(cluster.gcs_address) as channel:  # what `ray.init` and a node's `ray start` call
        nodes = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            nodes.GetAllNodeInfo(gcs_service_pb2.GetAllNodeInfoRequest(), timeout=30)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        token = [("authorization", cluster.headers()["Authorization"])]
        assert nodes.GetAllNodeInfo(gcs_service_pb2.GetAllNodeInfoRequest(), timeout=30, metadata=token).node_info_list
    if os.geteuid() == 0 and Path(SYSTEM_PYTHON).exists():  # another user, where this test may become one
        assert _as_another_user(cluster, marker) == {"token": "PermissionError", "submit": 401}
    assert not any(str(marker) in job.entrypoint for job in cluster.jobs().list_jobs())
    assert not marker.exists()

    processes = _cluster_processes(cluster)
    assert len(processes) > 2 * (1 + len(cluster.workers))  # each node's `ray start`, raylet and agents at least
    listening = {(p.name(), c.laddr.ip, c.laddr.port) for p in processes
                 for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
    assert listening
    assert {ip for _, ip, _ in listening} <= LOOPBACK, sorted(listening)


def _pipes_job(script: str) -> dict:
    """A Ray job running `script` in this environment's Python, as the Ray stage client submits it."""
    return {"entrypoint": f"{sys.executable} -c {shlex.quote(script)}", "entrypoint_num_cpus": 0,
            "runtime_env": {"env_vars": {}}}


CURVE = 40_000  # a 230 kB materialization: many writes of the job's stdout, more than one chunk of Ray's tail


def test_a_long_message_from_a_ray_job_reaches_dagster_whole(cluster: RayCluster) -> None:
    """A worker's materialization with a loss curve of 230 kB in its metadata, sent over the job's log: it
    reaches Dagster whole, however Ray's log tail cut it."""
    script = ("from dagster_pipes import open_dagster_pipes\n"
              "with open_dagster_pipes() as pipes:\n"
              f"    pipes.report_asset_materialization(metadata={{'curve': {{'raw_value': list(range({CURVE})), "
              "'type': 'json'}})\n")

    @dg.asset
    def curve(context):  # annotations would be strings, which Dagster does not resolve
        return PipesRayStageClient(cluster.address, cluster.token_file.read_text()).run(
            context=context, submit_job_params=_pipes_job(script)).get_materialize_result()

    result = dg.materialize([curve])
    assert result.success
    assert result.asset_materializations_for_node("curve")[0].metadata["curve"].value == list(range(CURVE))


@pytest.mark.reliability("fault", "a stage's Ray job that exits without its Pipes `closed` message: the step fails "
                                  "naming what arrived last, never passes without its reports")
def test_a_ray_job_that_loses_its_end_fails_the_step(cluster: RayCluster) -> None:
    script = ("import os\nfrom dagster_pipes import open_dagster_pipes\n"
              "pipes = open_dagster_pipes()\npipes.log.info('started')\nos._exit(0)\n")

    @dg.asset
    def cut_short(context):  # as `curve`
        return PipesRayStageClient(cluster.address, cluster.token_file.read_text()).run(
            context=context, submit_job_params=_pipes_job(script)).get_materialize_result()

    result = dg.materialize([cut_short], raise_on_error=False)
    assert not result.success
    (failure,) = [e for e in result.all_events if e.is_step_failure]
    assert "did not all reach Dagster: 2 arrived (the last: log)" in failure.step_failure_data.error.to_string()
