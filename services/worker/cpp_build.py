"""Building the workers' C++ CPU kernels with `torch.utils.cpp_extension`: where, and under
which lock. Shared by the attention kernel (`attention/cpu_backend.py`) and the matmul and
fused kernels (`model/cpu_ops.py`)."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
from pathlib import Path

import torch

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


def build_directory(name: str) -> Path:
    """Where `name` is built: per torch version, since the module links against torch."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    path = Path(root) / f"conveyor-torch{torch.__version__}" / name
    path.mkdir(parents=True, exist_ok=True)
    return path
