"""`conveyor stats`' window row (services/common/stats_cli.py): pure formatting."""

from __future__ import annotations

import pytest

from services.common.proto.conveyor.v1 import scheduler_pb2
from services.common.stats_cli import format_table, stats_to_dict


def _window_row(**fields) -> str:
    table = format_table(stats_to_dict(scheduler_pb2.SchedulerStats(**fields), top=0))
    return next(line for line in table.splitlines() if line.strip().startswith("window"))


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_a_scheduler_still_starting_shows_no_window(scheduling):
    """No pipeline yet: no window to tell of, and no --max-inflight that set one."""
    row = _window_row(scheduling=scheduling, num_stages=4)
    assert "n/a" in row and "--max-inflight" not in row


def test_the_window_says_what_sized_it():
    assert "(P + 2: the lead adapts" in _window_row(
        scheduling="async", max_inflight=6, async_lead=2, async_lead_changes=1
    )
    assert "6 steps in flight at most (--max-inflight)" in _window_row(
        scheduling="async", max_inflight=6
    )
    assert _window_row(scheduling="sync", max_inflight=4).endswith("4 steps in flight at most")
