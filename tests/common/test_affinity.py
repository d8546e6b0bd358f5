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


def _cgroup(tmp_path, own: str, files: dict[str, str]):
    """A cgroup tree under tmp_path/fs and this process's /proc/self/cgroup as `own`."""
    root = tmp_path / "fs"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (tmp_path / "cgroup").write_text(own)
    return root, tmp_path / "cgroup"


@pytest.mark.parametrize(
    "own, files, quota",
    [
        # v2, a container's own cgroup (cgroupns): its cpu.max at the mount
        ("0::/\n", {"cpu.max": "250000 100000\n"}, 2.5),
        ("0::/\n", {"cpu.max": "max 100000\n"}, None),
        # v2 without a namespace: the pod's limit above the container's own "max"
        (
            "0::/kubepods/pod1/ctr\n",
            {"kubepods/pod1/cpu.max": "400000 100000", "kubepods/pod1/ctr/cpu.max": "max 100000"},
            4.0,
        ),
        # v1: cpu,cpuacct controller, read at the mount (a container sees its own there)
        (
            "2:cpu,cpuacct:/\n1:memory:/x\n",
            {"cpu,cpuacct/cpu.cfs_quota_us": "150000", "cpu,cpuacct/cpu.cfs_period_us": "100000"},
            1.5,
        ),
        ("1:cpu:/\n", {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, None),
        ("0::/\n", {}, None),  # no cpu controller files: no limit known
    ],
)
def test_cpu_quota_reads_the_cgroup_limit(tmp_path, own, files, quota):
    from services.common.affinity import cpu_quota

    root, proc = _cgroup(tmp_path, own, files)
    assert cpu_quota(root, proc) == quota


def test_cpu_quota_is_none_without_a_cgroup_file(tmp_path):
    from services.common.affinity import cpu_quota

    assert cpu_quota(tmp_path, tmp_path / "missing") is None


def test_worker_threads_take_a_quota_whole_and_share_the_cores_without_one():
    from services.common.affinity import worker_threads

    # a container with a CPU limit runs one worker: the limit is all its own, whole CPUs
    assert worker_threads(2, 4.0, 64) == 4
    assert worker_threads(2, 2.5, 64) == 2
    assert worker_threads(1, 0.5, 64) == 1
    assert worker_threads(1, 8.0, 4) == 4  # and no more than its cores
    # no quota: the host's cores (this process's affinity) over the pipeline's workers
    assert worker_threads(2, None, 8) == 4
    assert worker_threads(3, None, 2) == 1


def test_cpu_budget_is_the_affinity_within_the_quota():
    from services.common.affinity import cpu_budget, cpu_quota

    quota = cpu_quota()
    cores = len(available_cpus())
    assert cpu_budget() == (min(cores, max(1, int(quota))) if quota is not None else cores)
