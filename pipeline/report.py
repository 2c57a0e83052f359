"""Reports: per-step summary rows, a text table, JSON, the acceptance and loss plots (PNG)."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

from pipeline.data import buffer as buffer_lib
from pipeline.data import capture, shards
from pipeline.data import rollouts as rollouts_lib
from pipeline.data.keys import acceptance_key
from pipeline.data.store import ObjectStore
from pipeline.training.outcome import read_outcome

NO_DRAFTER_TAU = 1.0  # without a drafter every target forward yields one token


def step_row(store: ObjectStore, run: str, step: int) -> dict:
    """One line of the summary, read from what the step's assets stored."""
    record = store.read_json(acceptance_key(run, step))
    trained = read_outcome(store, run, step)
    plan = capture.read_plan(store, run, step)

    def tau(role: str) -> float:
        d = record["drafters"][role]
        return round(d["tau"], 4) if d else NO_DRAFTER_TAU

    return {
        "step": step,
        "samples": len(rollouts_lib.read_rollouts(store, run, step)),
        "buffer_samples": len(buffer_lib.read_buffer(store, run, step)),
        "captured": plan.captured if plan else None,  # rollouts whose hidden states the step stored
        "bytes_stored": shards.read_manifest(store, run, step).total_bytes,
        "trained": trained["trained"],
        "tau_cotrained": tau("cotrained"),
        "tau_baseline": tau("baseline"),
        "tau_served": tau("served"),
        "promoted": record["promoted"],
        "version_cotrained": (record["drafters"]["cotrained"] or {}).get("version"),
        "version_served": (record["drafters"]["served"] or {}).get("version"),
        "acceptance_rate_cotrained": round((record["drafters"]["cotrained"] or {}).get("acceptance_rate", 0.0), 4),
        # what the co-trained tau rests on, and its teacher-forced estimate from one pass over held-out rollouts
        "eval_prompts_cotrained": (record["drafters"]["cotrained"] or {}).get("prompts"),
        "eval_rounds_cotrained": (record["drafters"]["cotrained"] or {}).get("rounds"),
        "tau_estimate_cotrained": _estimate(record["drafters"]["cotrained"]),
    }


def _estimate(measured: dict | None) -> dict | None:
    estimate = (measured or {}).get("estimate")
    if not estimate:
        return None
    return {"tau": round(estimate["tau"], 4), "rollouts": estimate["sequences"], "positions": estimate["positions"]}


def format_table(rows: list[dict]) -> str:
    reward = any("trl_mean_reward" in r for r in rows)  # the RL trainer's own mean reward, when it reports one
    head = f"{'step':>4} {'samples':>7} {'buffer':>6} {'trained':>7} {'tau co-trained':>14} " \
           f"{'tau served':>10} {'tau baseline':>12} {'promoted':>8}" + (f" {'TRL reward':>10}" if reward else "")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['step']:>4} {r['samples']:>7} {r['buffer_samples']:>6} {'yes' if r['trained'] else 'no':>7} "
            f"{r['tau_cotrained']:>14.2f} {r['tau_served']:>10.2f} {r['tau_baseline']:>12.2f} "
            f"{'yes' if r['promoted'] else 'no':>8}" + (f" {r['trl_mean_reward']:>10.3f}" if reward else "")
        )
    return "\n".join(lines)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # headless: plots are files or bytes, never a window
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    _pyplot().close(fig)
    return buf.getvalue()


def acceptance_png(rows: list[dict], k: int, drafter_kind: str = "", dpi: int = 120) -> bytes:
    """tau per RL step of the co-trained, served and never-retrained drafters (rows: `step_row`s or
    `acceptance_rows`)."""
    plt = _pyplot()
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=dpi)
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
    return _png(fig)


def plot(rows: list[dict], k: int, path: Path, drafter_kind: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(acceptance_png(rows, k, drafter_kind))
    return path


def loss_png(loss_history: list[float], title: str, dpi: int = 100) -> bytes:
    """The training loss per iteration; log scale when it spans more than a decade (a fresh start)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3), dpi=dpi)
    ax.plot(range(1, len(loss_history) + 1), loss_history, lw=1.2)
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss")
    low, high = min(loss_history, default=1.0), max(loss_history, default=1.0)
    if low > 0 and high / low > 10:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _png(fig)


def acceptance_rows(store: ObjectStore, run: str, steps: list[int]) -> list[dict]:
    """tau of each drafter role for the `steps` that have an acceptance record (no other reads)."""
    rows = []
    for step in steps:
        key = acceptance_key(run, step)
        if not store.exists(key):
            continue
        drafters = store.read_json(key)["drafters"]
        rows.append({"step": step, **{f"tau_{role}": round(d["tau"], 4) if d else NO_DRAFTER_TAU
                                      for role, d in drafters.items()}})
    return rows


def png_markdown(png: bytes, alt: str) -> str:
    """Markdown that shows the image inline (Dagster's metadata renders data URIs)."""
    return f"![{alt}](data:image/png;base64,{base64.b64encode(png).decode()})"


def write_summary(rows: list[dict], wall_s: float, step_wall_s: list[float], path: Path, **extra) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"wall_s": round(wall_s, 2), "step_wall_s": [round(s, 2) for s in step_wall_s], "steps": rows, **extra}
    path.write_text(json.dumps(doc, indent=2))
    return path
