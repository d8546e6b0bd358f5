"""How the simulated device waits: a plain sleep (no busy loop), corrected for oversleeping.

`time.sleep` wakes late by the kernel's timer slack and scheduling (about 50-100 us on
Linux), which would lengthen every modeled step; the sleeper learns its average lateness
and sleeps that much less.
"""

from __future__ import annotations

import time

_GAIN = 0.2
_MAX_CORRECTION_S = 300e-6
"""The most a sleep is shortened: timer slack, not a stall (a thread that waited for the GIL
or a core woke late for a reason a shorter sleep would not fix)."""
_MAX_SAMPLE_S = 500e-6


class Sleeper:
    """Sleeps until a deadline, learning how late `time.sleep` wakes (one per thread)."""

    def __init__(self) -> None:
        self.correction_s = 0.0
        """The running estimate of how late a sleep wakes."""
        self.slept_s = 0.0
        """Total seconds asked for (the modeled time this sleeper stood for)."""

    def sleep_for(self, seconds: float) -> None:
        """Returns about `seconds` from now (at once when `seconds` <= 0)."""
        if seconds <= 0:
            return
        self.slept_s += seconds
        deadline = time.perf_counter() + seconds
        ahead = seconds - self.correction_s
        if ahead > 0:
            time.sleep(ahead)
        late = min(max(time.perf_counter() - deadline, -_MAX_SAMPLE_S), _MAX_SAMPLE_S)
        self.correction_s = min(max(self.correction_s + _GAIN * late, 0.0), _MAX_CORRECTION_S)
