"""The paced source publishes every step on its own schedule and never waits for a reader."""

import time

import pytest

from pipeline.sources.pacing import PacedSource


def test_steps_are_published_in_order_and_at_most_one_per_period():
    source = PacedSource(lambda step: step * 10, steps=3, period_s=0.2).start()
    while not source.done:
        time.sleep(0.01)
    published = source.published()
    assert [p.step for p in published] == [1, 2, 3]
    assert [p.result for p in published] == [10, 20, 30]
    gaps = [b.at - a.at for a, b in zip(published, published[1:], strict=False)]
    assert min(gaps) >= 0.19


def test_every_step_is_published_with_nobody_reading():
    """Nothing consumes the steps while the source runs (the pipeline is busy): it publishes them all."""
    source = PacedSource(lambda step: step, steps=4).start()
    source.stop(timeout=5)
    assert [p.step for p in source.published()] == [1, 2, 3, 4]


def test_a_failing_step_is_raised_to_the_caller_with_what_was_published():
    def run_step(step: int) -> int:
        if step == 2:
            raise OSError("disk full")
        return step

    source = PacedSource(run_step, steps=3).start()
    source.stop(timeout=5)
    with pytest.raises(RuntimeError, match="failed after 1 step") as failure:
        source.raise_if_failed()
    assert isinstance(failure.value.__cause__, OSError)


def test_stop_ends_the_source_between_steps():
    source = PacedSource(lambda step: step, steps=100, period_s=0.5).start()
    time.sleep(0.1)
    source.stop(timeout=5)
    assert source.done
    assert len(source.published()) == 1
