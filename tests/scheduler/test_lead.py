"""The async window's lead (services/scheduler/lead.py), driven step by step with its own
clock: pure logic, no stack."""

from __future__ import annotations

from services.scheduler.lead import MIN_PERIOD, Lead

STEP_NS = 2_000_000  # a report every 2 ms


class Driver:
    """Plans and reports steps in order against a `Lead`, as the service does: a step is
    planned after the scheduler sat idle with a full window for `held_ns` (0: not held
    back), and reported."""

    def __init__(self, lead: Lead) -> None:
        self.lead = lead
        self.next_step = 0
        self.now_ns = 0

    def run(self, num_steps: int, wait_ns: int = 0, held_ns: int = STEP_NS) -> list[int]:
        """`num_steps` steps; stage 0 waits `wait_ns` for each plan. Returns the lead after
        each report."""
        leads = []
        for _ in range(num_steps):
            step = self.next_step
            self.next_step += 1
            self.lead.planned(step, held_ns)
            if wait_ns:
                self.lead.waited(step, wait_ns)
            self.now_ns += STEP_NS
            self.lead.reported(step, self.now_ns)
            leads.append(self.lead.lead)
        return leads


def test_the_lead_starts_at_one_step_beyond_the_pipeline():
    lead = Lead(4)
    assert (lead.lead, lead.window) == (1, 5)


def test_waits_for_held_plans_grow_the_lead_up_to_p():
    lead = Lead(4)
    leads = Driver(lead).run(40 * MIN_PERIOD, wait_ns=STEP_NS // 10)  # 10 % of the time
    assert leads[0] == 1
    assert sorted(leads) == leads, "it only grows while the waits go on"
    assert lead.lead == lead.max_lead == 4
    assert lead.window == 8
    assert lead.num_changes == 3


def test_one_period_of_waits_grows_the_lead_by_one_step():
    lead = Lead(2)
    driver = Driver(lead)
    driver.run(1)  # the first report starts the clock
    leads = driver.run(lead.period, wait_ns=STEP_NS // 10)
    assert leads[-2:] == [1, 2]


def test_waits_for_plans_the_window_did_not_hold_back_change_nothing():
    """A scheduler that cannot plan fast enough, or a pipeline that ran dry: more lead
    would not have sent those plans earlier."""
    lead = Lead(4)
    Driver(lead).run(20 * MIN_PERIOD, wait_ns=STEP_NS // 2, held_ns=0)
    assert (lead.lead, lead.num_changes) == (1, 0)


def test_of_a_wait_only_what_the_window_held_the_plan_back_counts():
    """A scheduler that sat idle on its full window for a sliver, then took long to plan
    (a draft model's timeout, a GC pause): one more step of lead would have started that
    plan only the sliver earlier."""
    lead = Lead(4)
    driver = Driver(lead)
    driver.run(20 * MIN_PERIOD, wait_ns=STEP_NS // 2, held_ns=STEP_NS // 100)
    assert (lead.lead, lead.num_changes) == (1, 0)
    driver.run(4 * MIN_PERIOD, wait_ns=STEP_NS // 2, held_ns=STEP_NS // 10)
    assert lead.lead > 1


def test_waits_below_the_share_keep_the_lead():
    lead = Lead(4)
    driver = Driver(lead)
    driver.run(4 * MIN_PERIOD, wait_ns=STEP_NS // 2)
    grown = lead.lead
    assert grown > 1
    # 1 % of the time waiting: not enough to grow, too much to shrink
    driver.run(20 * lead.quiet_steps, wait_ns=STEP_NS // 100)
    assert lead.lead == grown


def test_a_quiet_stretch_shrinks_the_lead_back_to_one():
    lead = Lead(4, quiet_steps=128)
    driver = Driver(lead)
    driver.run(20 * MIN_PERIOD, wait_ns=STEP_NS // 10)
    assert lead.lead == 4
    leads = driver.run(4 * 128 + 8 * lead.period)
    assert leads[-1] == 1
    assert sorted(leads, reverse=True) == leads, "one step at a time, never up"


def test_a_shrink_the_waits_undo_doubles_the_quiet_stretch_and_one_that_holds_resets_it():
    lead = Lead(2, quiet_steps=64, max_quiet_steps=256)
    driver = Driver(lead)

    def until(predicate, wait_ns: int, limit: int = 10_000) -> None:
        for _ in range(limit):
            driver.run(1, wait_ns)
            if predicate():
                return
        raise AssertionError("the lead never got there")

    until(lambda: lead.lead == 2, STEP_NS // 10)
    until(lambda: lead.lead == 1, 0)  # quiet: probe one step less
    until(lambda: lead.lead == 2, STEP_NS // 10)  # at once needed again
    assert lead.quiet_steps == 128
    until(lambda: lead.lead == 1, 0)
    until(lambda: lead.lead == 2, STEP_NS // 10)
    assert lead.quiet_steps == 256
    until(lambda: lead.lead == 1, 0)
    until(lambda: lead.lead == 2, STEP_NS // 10)
    assert lead.quiet_steps == 256, "capped"
    until(lambda: lead.lead == 1, 0)
    driver.run(256)  # the shrink held a whole stretch
    assert lead.quiet_steps == 64
    until(lambda: lead.lead == 2, STEP_NS // 10)
    assert lead.quiet_steps == 64


def test_a_wait_for_a_step_already_reported_is_ignored():
    lead = Lead(2)
    driver = Driver(lead)
    driver.run(3)
    lead.waited(1, 10**9)  # late news of a step that reported
    driver.run(lead.period)
    assert lead.lead == 1


def test_a_new_session_forgets_the_steps_in_flight_but_keeps_the_lead():
    lead = Lead(4)
    driver = Driver(lead)
    driver.run(8 * MIN_PERIOD, wait_ns=STEP_NS // 10)
    grown = lead.lead
    lead.planned(driver.next_step, STEP_NS)
    lead.reset()
    lead.waited(driver.next_step, 10**9)  # the old session's step: not this one's
    assert lead.lead == grown
    driver.next_step += 1
    driver.run(lead.period + 1)
    assert lead.lead == grown
