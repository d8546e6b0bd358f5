"""`Lead`: how many steps async mode plans beyond the P a pipeline of P stages holds.

Async keeps P + lead steps in flight: when step s reports, step s + P + lead is planned, so
each plan reaches stage 0 `lead` stage steps before it is due. One step of lead hides the
control plane's round trip (last stage → scheduler → plan → stage 0) wherever that is
shorter than a stage step; each step more makes a request that arrives while the pipeline
is busy wait one stage step longer (docs/performance.md#steps-in-flight). So the lead
starts at 1 and follows what stage 0 measures:

* **grow** when, over a period of reports, stage 0 waited for plans that the window held
  back for more than `grow_share` of the period's wall time: one more step of lead would
  have sent them sooner. A plan is held back for as long as the scheduler sat idle with a
  full window before planning it (the service's `planned(step, held_ns)`): with one more
  slot it would have planned it that much earlier, so of stage 0's wait for it only that
  much counts. Waits the window did not cause (a scheduler behind its reports, stalled by
  its store or a draft model, a pipeline with nothing to do) count for nothing.
* **shrink** after `quiet_steps` reports without any such wait, to give TTFT back. A shrink
  that the waits undo within a quiet stretch doubles the stretch (up to
  `max_quiet_steps`), so a lead that is needed is probed rarely; a shrink that holds for a
  whole stretch sets it back to `quiet_steps`. At `max_lead` the lead stays while the waits
  go on: with 2P in flight every plan is already a whole pass early.

Pure logic: the scheduler tells it what it planned and what came back (`planned`,
`waited`, `reported`), with its own clock.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

GROW_SHARE = 0.02
"""Stage 0's wait for held-back plans, as a share of a period's wall time, that grows the
lead (the issue's bubble target is 5 %: this leaves the rest for the stages)."""
QUIET_STEPS = 512
MAX_QUIET_STEPS = 16_384
MIN_PERIOD = 32
"""Reports per decision at least (a period is 4 windows: a stall of one step is a blip)."""


class Lead:
    """The async window's lead over the pipeline's P steps (1 to `max_lead`)."""

    def __init__(
        self,
        num_stages: int,
        *,
        max_lead: int | None = None,
        grow_share: float = GROW_SHARE,
        quiet_steps: int = QUIET_STEPS,
        max_quiet_steps: int = MAX_QUIET_STEPS,
    ) -> None:
        self.num_stages = num_stages
        self.lead = 1
        self.max_lead = max(1, max_lead if max_lead is not None else num_stages)
        """P by default: 2P steps in flight already send every plan a whole pass early."""
        self.grow_share = grow_share
        self.base_quiet_steps = quiet_steps
        self.quiet_steps = quiet_steps
        self.max_quiet_steps = max_quiet_steps
        self.num_changes = 0
        self._held: dict[int, int] = {}
        """Steps the window held back → for how long (the most of their wait it caused)."""
        self._waited_ns = 0
        self._period_reports = 0
        self._period_start_ns: int | None = None
        self._quiet = 0
        self._reports = 0
        self._shrunk_at: int | None = None
        """`_reports` at the last shrink (None: none since the last grow)."""

    @property
    def window(self) -> int:
        """Steps in flight: P + lead."""
        return self.num_stages + self.lead

    @property
    def period(self) -> int:
        return max(MIN_PERIOD, 4 * self.window)

    def planned(self, step_id: int, held_ns: int) -> None:
        """Step `step_id` was planned after the scheduler sat idle with a full window for
        `held_ns` (0: the window did not hold it back)."""
        if held_ns > 0:
            self._held[step_id] = held_ns

    def waited(self, step_id: int, wait_ns: int) -> None:
        """Stage 0 waited `wait_ns` for step `step_id`'s plan (after its previous step)."""
        saved = self._held.get(step_id)
        if saved is not None:
            self._waited_ns += min(wait_ns, saved)

    def reported(self, step_id: int, now_ns: int) -> bool:
        """Step `step_id` reported at `now_ns`; True when the lead changed."""
        self._held.pop(step_id, None)
        self._reports += 1
        if self._shrunk_at is not None and self._reports - self._shrunk_at >= self.quiet_steps:
            self.quiet_steps, self._shrunk_at = self.base_quiet_steps, None  # the shrink held
        if self._period_start_ns is None:
            self._period_start_ns = now_ns
            return False
        self._period_reports += 1
        if self._period_reports < self.period:
            return False
        share = self._waited_ns / max(1, now_ns - self._period_start_ns)
        waited = self._waited_ns > 0
        self._period_start_ns, self._period_reports, self._waited_ns = now_ns, 0, 0
        if share > self.grow_share:
            self._quiet = 0
            return self._grow(share)
        if waited:  # short waits: the lead is about right
            self._quiet = 0
            return False
        self._quiet += self.period
        if self._quiet < self.quiet_steps or self.lead <= 1:
            return False
        self._quiet = 0
        self.lead -= 1
        self.num_changes += 1
        self._shrunk_at = self._reports
        logger.info(
            "async lead %d -> %d steps (%d in flight): stage 0 waited for no plan in %d steps",
            self.lead + 1,
            self.lead,
            self.window,
            self.quiet_steps,
        )
        return True

    def _grow(self, share: float) -> bool:
        if self._shrunk_at is not None:  # undone within the stretch: probe more rarely
            self.quiet_steps = min(2 * self.quiet_steps, self.max_quiet_steps)
            self._shrunk_at = None
        if self.lead >= self.max_lead:
            return False
        self.lead += 1
        self.num_changes += 1
        logger.info(
            "async lead %d -> %d steps (%d in flight): stage 0 waited %.1f%% of the last "
            "%d steps for plans the window held back",
            self.lead - 1,
            self.lead,
            self.window,
            100 * share,
            self.period,
        )
        return True

    def reset(self) -> None:
        """A new pipeline session: no step is in flight; the lead learned stays."""
        self._held.clear()
        self._waited_ns, self._period_reports, self._period_start_ns = 0, 0, None
