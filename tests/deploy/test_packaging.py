"""The installed package holds every file the services read at run time, as the Dockerfile
installs it (`pip install .` from pyproject.toml, README.md and services/): the CPU kernels'
C++ sources (without them a worker serves on the slow torch fallbacks) and the simulated
device's profiles and model configs."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from services.worker.attention import cpu_backend
from services.worker.model import cpu_ops

REPO = Path(__file__).resolve().parents[2]
CODE = {".py", ".pyi", ".pyc"}


def _data_files() -> set[str]:
    """Every file under services/ that is not Python code: what the code opens by path."""
    return {
        path.relative_to(REPO).as_posix()
        for path in (REPO / "services").rglob("*")
        if path.is_file() and path.suffix not in CODE and "__pycache__" not in path.parts
    }


def test_the_wheel_holds_every_data_file_the_services_read(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "services", source / "services", ignore=shutil.ignore_patterns("*.pyc"))
    argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run([*argv, "-w", str(tmp_path / "dist"), str(source)], check=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("conveyor-*.whl")
    packaged = set(zipfile.ZipFile(wheel).namelist())
    kernels = {p.relative_to(REPO).as_posix() for p in (cpu_backend.SOURCE, cpu_ops.SOURCE)}
    assert kernels <= _data_files()
    missing = sorted(_data_files() - packaged)
    assert not missing, f"not in the wheel (add to [tool.setuptools.package-data]): {missing}"
