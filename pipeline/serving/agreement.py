"""The live tau's agreement gate: what a vLLM replica counts over its canary window against what the product
counts on the same tokens.

The canaries decode greedily, so their answers fix every round vLLM ran; the product counts those rounds with
the drafter and policy the replica was given (`pipeline.evaluation.greedy_rounds`, in a process of its own: the
deploy runs no model code). Two readings of one drafter that disagree mean the replica does not run the drafter
the product trained and measured (a layout vLLM reads otherwise, weights that did not arrive, a sampler bug), and
every figure built on the live tau would be wrong: the deploy refuses such a replica.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, dataclass

from pipeline.config import PROJECT_ROOT


@dataclass(frozen=True)
class Canary:
    """One canary completion: the prompt's token ids and the answer's, as the replica returned them."""

    prompt: list[int]
    completion: list[int]


class AgreementUnmeasured(RuntimeError):
    """The product's count could not be made (its process failed); the message holds its error output."""


def counted_tau(policy_dir: str, drafter_dir: str, canaries: list[Canary], k: int, timeout_s: float = 600.0) -> float:
    """The mean acceptance length the product counts along the canaries' tokens."""
    request = {"policy": policy_dir, "drafter": drafter_dir, "k": k, "canaries": [asdict(c) for c in canaries]}
    done = subprocess.run([sys.executable, "-m", "pipeline.evaluation.greedy_rounds"], input=json.dumps(request),
                          capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=timeout_s)
    if done.returncode != 0:
        raise AgreementUnmeasured(f"the count of the canaries' rounds exited with {done.returncode}: "
                                  f"{done.stderr.strip()[-2000:]}")
    count = json.loads(done.stdout.strip().splitlines()[-1])
    if not count["rounds"]:
        raise AgreementUnmeasured("the canaries' answers left no speculative round to count")
    return 1 + count["accepted"] / count["rounds"]


def disagreement(live: float, counted: float, tolerance: float) -> str | None:
    """Why the two readings disagree beyond `tolerance` (a share of the product's), or None."""
    if abs(live - counted) <= tolerance * counted:
        return None
    return (f"live tau {live:.3f} (vLLM's counters) and {counted:.3f} (the product's count of the same tokens) "
            f"differ by {abs(live - counted) / counted:.1%}, beyond {tolerance:.0%}")
