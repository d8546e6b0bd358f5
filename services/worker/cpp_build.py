"""Building the workers' C++ CPU kernels with `torch.utils.cpp_extension`: where, and under
which lock. Shared by the attention kernel (`attention/cpu_backend.py`) and the matmul and
fused kernels (`model/cpu_ops.py`)."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import time
from pathlib import Path

import torch

from services.common.errors import ConfigError

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def build_lock(path: Path):
    """Held while the kernel in `path` is built or loaded. An flock dies with its process, so
    a build killed half-way never blocks the next one; torch's own `lock` file does not (torch
    waits on it forever), and under this flock one left there is stale by definition: removed."""
    with open(path / ".conveyor-build.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = path / "lock"
            if stale.exists():
                logger.warning("removing a build lock left by a killed build: %s", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def source_copy(source: Path, directory: Path) -> Path:
    """`source`, copied into its build directory when it differs: ninja rebuilds whenever a
    source path changes, so compiling the checkout's own file made every other checkout of the
    same code (a worktree, a CI clone) rebuild the shared cache, ~100 s."""
    copy = directory / source.name
    if not copy.exists() or copy.read_bytes() != source.read_bytes():
        shutil.copyfile(source, copy)
    return copy


@contextlib.contextmanager
def _our_ninja():
    """torch runs the `ninja` first on PATH; this puts the one the package depends on (pip's
    `ninja`) first while it builds. Ninja versions keep their logs differently, so a build
    left by another version is rebuilt in full: with a venv activated (its 1.13 first on
    PATH) and not (the system's 1.11), every switch recompiled both kernels, ~70 s."""
    try:
        import ninja

        bin_dir = ninja.BIN_DIR
    except (ImportError, AttributeError):  # not installed as a package: PATH decides
        yield
        return
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([bin_dir, path]) if path else bin_dir
    try:
        yield
    finally:
        os.environ["PATH"] = path


def build_directory(name: str) -> Path:
    """Where `name` is built: per torch version, since the module links against torch."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    path = Path(root) / f"conveyor-torch{torch.__version__}" / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def build_extension(name: str, source: Path, arch_flags: list[str], what: str, hint: str = ""):
    """The extension `name` compiled from `source` (built on first use, under the lock);
    ConfigError naming `what` did not build and how to fix it (`hint` adds a way around)."""
    from torch.utils.cpp_extension import load

    if not source.is_file():  # not a missing compiler: the package lacks its data files
        raise ConfigError(
            f"the {what} cannot build: its source {source} is missing, so this installation "
            f"of Conveyor is incomplete (its package data, csrc/*.cpp, was not installed); "
            f"reinstall it from a complete checkout or wheel{hint}"
        )
    start = time.monotonic()
    directory = build_directory(name)
    try:
        with build_lock(directory), _our_ninja():
            module = load(
                name=name,
                sources=[str(source_copy(source, directory))],
                # -fopenmp: at::parallel_for is inline, and runs as a plain loop in code
                # compiled without OpenMP (one thread, whatever torch.set_num_threads says)
                extra_cflags=["-O3", "-ffast-math", "-fopenmp", *arch_flags],
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
                verbose=False,
            )
    except Exception as exc:  # compiler, headers or ninja missing: say what to do
        first_line = (str(exc).strip().splitlines() or [""])[0][:300]
        raise ConfigError(
            f"the {what} did not build ({type(exc).__name__}: {first_line}); install a C++ "
            f"compiler and ninja (apt-get install g++ ninja-build){hint}"
        ) from exc
    logger.info("%s %s ready in %.1f s", what, name, time.monotonic() - start)
    return module
