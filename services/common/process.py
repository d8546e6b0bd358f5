"""Child processes that die with their parent (`conveyor up`, the benchmark, the tests)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


PARENT_ENV = "CONVEYOR_DIE_WITH_PARENT"


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a child that must not outlive this process (see `die_with_parent`).

    No preexec_fn: running Python between fork and exec is unsafe in a process whose gRPC
    threads are live (it aborted children here)."""
    env = dict(os.environ if env is None else env)
    env[PARENT_ENV] = str(os.getpid())
    return env


def die_with_parent() -> None:
    """Called first thing in a child started with `child_env`: SIGTERM when the parent dies
    (Linux PR_SET_PDEATHSIG), or exit now if it is already gone."""
    parent = os.environ.get(PARENT_ENV)
    if not parent:
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(parent):
        sys.exit(f"parent process {parent} is gone")


def bound_to_parent(argv: list[str]) -> list[str]:
    """`argv` run through this module (`main`): the program it names dies with the process
    that starts it. Start it with `env=child_env(...)`."""
    return [sys.executable, "-m", "services.common.process", *argv]


def main(argv: list[str] | None = None) -> None:
    """`python -m services.common.process PROGRAM [ARGS...]`, started with `child_env()`:
    becomes PROGRAM (exec, same pid) bound to die with the process that started it. For
    children that cannot call `die_with_parent` themselves (a peer engine's server)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        sys.exit("usage: python -m services.common.process PROGRAM [ARGS...]")
    die_with_parent()  # the death signal survives exec
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main()
