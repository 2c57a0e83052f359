"""The demo's outputs: per-step summary rows, a text table, JSON and a PNG plot."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline import buffer as buffer_lib
from pipeline import cotrain
from pipeline import rollouts as rollouts_lib
from pipeline.steps import acceptance_key
from pipeline.store import ObjectStore

NO_DRAFTER_TAU = 1.0  # without a drafter every target forward yields one token


def step_row(store: ObjectStore, run: str, step: int) -> dict:
    """One line of the summary, read from what the step's assets stored."""
    record = store.read_json(acceptance_key(run, step))
    trained = cotrain.read_outcome(store, run, step)

    def tau(role: str) -> float:
        d = record["drafters"][role]
        return round(d["tau"], 4) if d else NO_DRAFTER_TAU

    return {
        "step": step,
        "samples": len(rollouts_lib.read_rollouts(store, run, step)),
        "buffer_samples": len(buffer_lib.read_buffer(store, run, step)),
        "trained": trained["trained"],
        "tau_cotrained": tau("cotrained"),
        "tau_baseline": tau("baseline"),
        "tau_served": tau("served"),
        "promoted": record["promoted"],
        "version_cotrained": (record["drafters"]["cotrained"] or {}).get("version"),
        "version_served": (record["drafters"]["served"] or {}).get("version"),
        "acceptance_rate_cotrained": round((record["drafters"]["cotrained"] or {}).get("acceptance_rate", 0.0), 4),
    }


def format_table(rows: list[dict]) -> str:
    head = f"{'step':>4} {'samples':>7} {'buffer':>6} {'trained':>7} {'tau co-trained':>14} " \
           f"{'tau served':>10} {'tau baseline':>12} {'promoted':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['step']:>4} {r['samples']:>7} {r['buffer_samples']:>6} {'yes' if r['trained'] else 'no':>7} "
            f"{r['tau_cotrained']:>14.2f} {r['tau_served']:>10.2f} {r['tau_baseline']:>12.2f} "
            f"{'yes' if r['promoted'] else 'no':>8}"
        )
    return "\n".join(lines)


def plot(rows: list[dict], k: int, path: Path, drafter_kind: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")  # headless: the plot is a file, never a window
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(steps, [r["tau_cotrained"] for r in rows], "o-", label="co-trained (new drafter)")
    ax.plot(steps, [r["tau_served"] for r in rows], "s--", label="served (champion during the step)")
    ax.plot(steps, [r["tau_baseline"] for r in rows], "^:", label="never retrained (baseline)")
    ax.axhline(k + 1, color="grey", lw=0.8)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.text(steps[0], k + 1 - 0.15, f"ceiling k+1 = {k + 1}", fontsize=8, color="grey", va="top")
    ax.set_xlabel("RL step")
    ax.set_ylabel("mean acceptance length tau")
    ax.set_title(f"{drafter_kind.upper() + ' d' if drafter_kind else 'D'}rafter acceptance against each step's policy")
    ax.set_xticks(steps)
    ax.set_ylim(0.8, k + 1.3)
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def write_summary(rows: list[dict], wall_s: float, step_wall_s: list[float], path: Path, **extra) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"wall_s": round(wall_s, 2), "step_wall_s": [round(s, 2) for s in step_wall_s], "steps": rows, **extra}
    path.write_text(json.dumps(doc, indent=2))
    return path
