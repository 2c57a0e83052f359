"""RL step identifiers and every object-store key the pipeline reads or writes.

    rollouts/<run>/step-000123/rollouts.parquet   policy.json (commit point)
    rollouts/<run>/step-000123/parts/             a step published in parts before its commit (parts.py)
    policies/<run>/step-000123/                   the simulated trainer's policy checkpoints
    hidden_states/<run>/step-000123/              Arrow shards + _manifest.json (commit point)
    hidden_states/<run>/_target_layout.json       the run's target layout, recorded by its first step
    capture/<run>/step-000123.json                a step's capture plan (capture.py)
    buffer/<run>/step-000123/_manifest.json       the cross-step buffer of a step
    drafter/<run>/step-000123.json                a step's training outcome
    acceptance/<run>/step-000123.json             a step's acceptance record
    cost/<run>/step-000123.json                   a step's entry in the cost ledger
    replay/<run>/step-000123.json                 the step's rollouts replayed per drafter: the measured speedup
    placement/<run>/step-000123/<stage>.json      where a launched stage ran (process, pod or ray, ranks, memory, wait)
    training/<run>/<input id>/                    resumable checkpoints of one training, origin.json
    fleet/<run>/state.json                        which drafter version the fleet serves
    refresh/<run>/step-000123.json                a step's same-step refresh (refresh/plan.py)
    refresh_data/<run>/step-000123-part-0004/     the refresh's hidden states and buffer (its own writer)
    tail/<run>/step-000123.json                   tau of the step's tail (its last parts) per drafter
"""

from __future__ import annotations

import re

from pipeline.stages import Stage

_STEP_KEY = re.compile(r"step-([0-9]{6,})")
MAX_STEP = 2**63 - 1  # steps are int64 wherever they are stored (Parquet, Dagster, MLflow tags)

ROLLOUTS_FILE = "rollouts.parquet"
POLICY_FILE = "policy.json"
HIDDEN_STATES_MANIFEST = "_manifest.json"


def step_key(step: int) -> str:
    if step < 0:
        raise ValueError(f"RL step must be >= 0, got {step}")
    if step > MAX_STEP:
        raise ValueError(f"RL step {step} is too large for int64")
    return f"step-{step:06d}"


def parse_step_key(key: str) -> int:
    """`step-000123` -> 123; anything else is rejected with the offending key in the message."""
    match = _STEP_KEY.fullmatch(key)
    if match and _too_large(match.group(1)):
        raise ValueError(f"partition key {key!r}: step too large for int64")
    if not is_step_key(key):
        raise ValueError(f"partition key {key!r} is not 'step-' followed by the step zero-padded to six digits "
                         "(e.g. step-000001)")
    return int(match.group(1))


def _too_large(digits: str) -> bool:
    """Beyond int64, judged on the digits' length first: a name of thousands of digits is never converted."""
    digits = digits.lstrip("0") or "0"
    return len(digits) > len(str(MAX_STEP)) or int(digits) > MAX_STEP


def is_step_key(name: str) -> bool:
    """Whether `name` is the one key of a step (`step-` and the step zero-padded to six digits, within int64);
    never raises, whatever the name: directory names come from the RL trainer."""
    match = _STEP_KEY.fullmatch(name)
    if not match or _too_large(match.group(1)):
        return False
    return step_key(int(match.group(1).lstrip("0") or "0")) == name  # one key per step: no extra leading zeros


def rollouts_root(run: str) -> str:
    return f"rollouts/{run}"


def malformed_step_names(names: list[str]) -> list[str]:
    """The names among `names` meant as step directories (they start with 'step') that are not step keys
    (step-12, step-0000001, Step-000001, step-00001a, a step beyond int64): ignored, so the operator must be
    told."""
    return [n for n in names if n.lower().startswith("step") and not is_step_key(n)]


def rollouts_prefix(run: str, step: int) -> str:
    return f"{rollouts_root(run)}/{step_key(step)}"


def rollouts_key(run: str, step: int) -> str:
    return f"{rollouts_prefix(run, step)}/{ROLLOUTS_FILE}"


def policy_pointer_key(run: str, step: int) -> str:
    return f"{rollouts_prefix(run, step)}/{POLICY_FILE}"


def policy_prefix(run: str, step: int) -> str:
    return f"policies/{run}/{step_key(step)}"


def hidden_states_root(run: str) -> str:
    return f"hidden_states/{run}"


def hidden_states_prefix(run: str, step: int) -> str:
    return f"{hidden_states_root(run)}/{step_key(step)}"


def hidden_states_manifest_key(run: str, step: int) -> str:
    return f"{hidden_states_prefix(run, step)}/{HIDDEN_STATES_MANIFEST}"


def hidden_states_shard_key(run: str, step: int, shard: str) -> str:
    return f"{hidden_states_prefix(run, step)}/{shard}"


def layout_key(run: str) -> str:
    """The target layout the run's first step recorded: every later step must match it."""
    return f"{hidden_states_root(run)}/_target_layout.json"


def capture_plan_key(run: str, step: int) -> str:
    return f"capture/{run}/{step_key(step)}.json"


def buffer_root(run: str) -> str:
    return f"buffer/{run}"


def buffer_key(run: str, step: int) -> str:
    return f"{buffer_root(run)}/{step_key(step)}/_manifest.json"


def acceptance_key(run: str, step: int) -> str:
    return f"acceptance/{run}/{step_key(step)}.json"


def cost_key(run: str, step: int) -> str:
    return f"cost/{run}/{step_key(step)}.json"


def replay_key(run: str, step: int) -> str:
    return f"replay/{run}/{step_key(step)}.json"


def placement_key(run: str, step: int, stage: Stage) -> str:
    return f"placement/{run}/{step_key(step)}/{stage.name}.json"


def drafter_key(run: str, step: int) -> str:
    return f"drafter/{run}/{step_key(step)}.json"


def training_prefix(run: str, input_id: str) -> str:
    """The checkpoints of one training, named by its input identity."""
    return f"training/{run}/{input_id}"


def training_origin_key(run: str, input_id: str) -> str:
    """The warm start a training began with: a resumed attempt keeps it."""
    return f"{training_prefix(run, input_id)}/origin.json"


def fleet_state_key(run: str) -> str:
    return f"{fleet_prefix(run)}/state.json"


def fleet_policy_key(run: str) -> str:
    """The policy the fleet was last pushed to generate a step's rollouts with."""
    return f"{fleet_prefix(run)}/policy.json"


def parts_prefix(run: str, step: int) -> str:
    return f"{rollouts_prefix(run, step)}/parts"


def part_key(part: int) -> str:
    if part < 0 or part > MAX_STEP:
        raise ValueError(f"part must be in [0, 2**63 - 1], got {part}")
    return f"part-{part:04d}"


def part_rollouts_key(run: str, step: int, part: int) -> str:
    return f"{parts_prefix(run, step)}/{part_key(part)}.parquet"


def part_manifest_key(run: str, step: int, part: int) -> str:
    """A part's manifest: written after its rollouts, it is the part's commit point."""
    return f"{parts_prefix(run, step)}/{part_key(part)}.json"


def parts_step_key(run: str, step: int) -> str:
    """The step's policy pointer and expected rollouts, written with its first part."""
    return f"{parts_prefix(run, step)}/_step.json"


def refresh_key(run: str, step: int) -> str:
    return f"refresh/{run}/{step_key(step)}.json"


def refresh_data_run(run: str, step: int, part: int) -> str:
    """The namespace of one refresh's hidden states and buffer: apart from the step's own, so the step's
    extraction (its lease, its sweep of files it did not commit) never meets the refresh's writer."""
    return f"{refresh_data_root(run)}/{step_key(step)}-{part_key(part)}"


def refresh_data_root(run: str) -> str:
    """Where every refresh namespace of a run lives (`refresh_data_run`), as a run name."""
    return f"{run}/refresh"


def refresh_lock_prefix(run: str) -> str:
    """The lease one refresh at a time of a run holds."""
    return f"refresh/{run}/_running"


def parse_refresh_data_name(name: str) -> int | None:
    """The step of a refresh namespace's last path element (`step-000123-part-0004`); None for anything else."""
    head, sep, tail = name.rpartition("-part-")
    if not sep or not tail.isdigit() or not is_step_key(head):
        return None
    return parse_step_key(head)


def tail_key(run: str, step: int) -> str:
    return f"tail/{run}/{step_key(step)}.json"


def fleet_prefix(run: str) -> str:
    return f"fleet/{run}"
