"""What stage 0 tells the scheduler's window of its wait for a plan (engine.py
`_reported_wait`): pure logic on a step's record."""

from __future__ import annotations

import pytest

from services.worker.engine import StageEngine, StepRecord, _Session

STEP_NS = 2_000_000


def _reported(plan_wait_ns: int, token_wait_ns: int) -> int:
    session = _Session(plans=None, on_outcome=None, epoch=0, last_step_ns=STEP_NS)
    record = StepRecord(7, 4, 4, 0, STEP_NS, token_wait_ns, plan_wait_ns=plan_wait_ns)
    return StageEngine._reported_wait(session, record)


def test_a_plan_that_came_late_with_the_tokens_there_is_reported():
    assert _reported(STEP_NS // 4, token_wait_ns=1_000) == STEP_NS // 4


@pytest.mark.parametrize("plan_wait_ns", [0, STEP_NS // 100])
def test_a_sliver_of_a_step_is_not(plan_wait_ns):
    assert _reported(plan_wait_ns, token_wait_ns=0) == 0


def test_a_plan_that_came_before_the_tokens_cost_nothing():
    """The step then waited for the last stage's tokens: with its plan there sooner, it
    could not have started sooner, and more lead would buy nothing."""
    assert _reported(STEP_NS // 4, token_wait_ns=STEP_NS // 4) == 0
