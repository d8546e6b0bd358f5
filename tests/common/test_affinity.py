"""CPU pinning of stage workers: the core lists, the split over stages, the pin itself."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from services.common.affinity import available_cpus, parse_cpu_list, pin_process, stage_cpus
from services.common.errors import ConfigError


def test_parse_cpu_list_reads_ids_and_ranges():
    assert parse_cpu_list("0") == [0]
    assert parse_cpu_list("0-3,8") == [0, 1, 2, 3, 8]
    assert parse_cpu_list(" 2, 1-2 ") == [1, 2]


@pytest.mark.parametrize("text", ["", "a", "3-1", "-1", "0,,1"])
def test_parse_cpu_list_rejects_malformed_lists(text):
    with pytest.raises(ConfigError, match="malformed"):
        parse_cpu_list(text)


def test_stage_cpus_gives_each_stage_its_own_cores_or_none():
    assert stage_cpus(2, 1, [0, 1]) == [[0], [1]]
    assert stage_cpus(2, 2, [0, 1, 2, 3, 4]) == [[0, 1], [2, 3]]
    assert stage_cpus(3, 1, [4, 6, 7]) == [[4], [6], [7]]
    assert stage_cpus(3, 1, [0, 1]) is None  # does not fit: nothing pinned
    assert stage_cpus(1, 2, [0, 1]) is None  # one stage has nobody to trade cores with


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_pin_process_pins_existing_and_later_threads():
    cpu = available_cpus()[-1]
    code = (
        "import os, threading\n"
        "from services.common.affinity import pin_process\n"
        "seen = []\n"
        "early = threading.Thread(target=lambda: (threading.Event().wait(0.5),"
        " seen.append(os.sched_getaffinity(0))))\n"
        "early.start()\n"
        f"pin_process([{cpu}])\n"
        "late = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))\n"
        "late.start(); late.join(); early.join()\n"
        "print(sorted(os.sched_getaffinity(0)), [sorted(s) for s in seen])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout.strip()
    assert out == f"[{cpu}] [[{cpu}], [{cpu}]]"


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_pin_process_refuses_cores_it_may_not_use():
    with pytest.raises(ConfigError, match="outside the cores"):
        pin_process([max(available_cpus()) + 1000])
