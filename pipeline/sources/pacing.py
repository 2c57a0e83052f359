"""An RL source at its own pace: steps published in a background thread that never waits for the
pipeline, as a real trainer publishes step s+1 as soon as step s's update is done.

    period_s = 0   each step as soon as the previous one is written (as fast as the source runs)
    period_s > 0   one step every period_s seconds at most (a trainer's RL step time)

The pipeline learns about each step the way it learns about an external trainer's: from the
committed files, through the sensor. What the thread records (when each step was published) is
for progress output only; lag and cost figures are read from the pipeline's own records.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Published:
    step: int
    at: float  # time.time() once the step's commit was written
    result: object  # what the source's run_step returned


class PacedSource:
    """Runs `run_step(1..steps)` in a daemon thread, one step per `period_s` at most."""

    def __init__(self, run_step: Callable[[int], object], steps: int, period_s: float = 0.0) -> None:
        if steps < 1 or period_s < 0:
            raise ValueError(f"a paced source needs steps >= 1 and period_s >= 0, got {steps}, {period_s}")
        self._run_step, self.steps, self.period_s = run_step, steps, period_s
        self._published: list[Published] = []
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._publish_all, name="rl-source", daemon=True)

    def start(self) -> PacedSource:
        self._thread.start()
        return self

    def _publish_all(self) -> None:
        try:
            for step in range(1, self.steps + 1):
                started = time.monotonic()
                result = self._run_step(step)
                with self._lock:
                    self._published.append(Published(step, time.time(), result))
                if self._stop.wait(max(0.0, self.period_s - (time.monotonic() - started))):
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the caller by `raise_if_failed`
            self._error = exc

    def published(self) -> list[Published]:
        with self._lock:
            return list(self._published)

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the RL source failed after {len(self.published())} step(s)") from self._error

    def stop(self, timeout: float | None = None) -> None:
        """No further step after the one in progress; waits for it."""
        self._stop.set()
        self._thread.join(timeout)
