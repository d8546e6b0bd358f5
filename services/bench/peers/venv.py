"""A peer's virtualenv, built on first use under the peers cache directory.

    ~/.cache/conveyor/peers/<peer>/        the virtualenv (bin/python, bin/vllm, ...)
    ~/.cache/conveyor/peers/<peer>.log     pip's output while building it
    ~/.cache/conveyor/peers/<peer>/.conveyor-peer.json   what it was built with

The peers pin the same CPU torch as Conveyor (`TORCH_VERSION`, as scripts/install.sh): an
unpinned torch pulls a multi-GB CUDA build. PyPI's torchvision / torchaudio / torchcodec
wheels that the peers depend on are built against a different torch and crash at import
beside the CPU one, and neither peer needs them for text models, so they are uninstalled.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

ENV_PEERS_DIR = "CONVEYOR_PEERS_DIR"
STAMP = ".conveyor-peer.json"
# Imported by torch-based peers' optional vision/audio paths only; crash beside the CPU torch.
UNUSABLE = ("torchvision", "torchaudio", "torchcodec")


def peers_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """Where peer virtualenvs live: $CONVEYOR_PEERS_DIR, else ~/.cache/conveyor/peers."""
    configured = environ.get(ENV_PEERS_DIR)
    return Path(configured) if configured else Path.home() / ".cache" / "conveyor" / "peers"


@dataclass(frozen=True, slots=True)
class PeerSpec:
    """What a peer's virtualenv holds."""

    name: str
    requirements: tuple[str, ...]
    """pip requirements, installed in one resolve beside the pinned torch."""


@dataclass(frozen=True, slots=True)
class PeerVenv:
    spec: PeerSpec
    root: Path
    torch_version: str = "2.13.0"

    @classmethod
    def for_spec(cls, spec: PeerSpec, base: Path, environ: Mapping[str, str] = os.environ):
        return cls(spec, base / spec.name, environ.get("TORCH_VERSION", "2.13.0"))

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    @property
    def log_path(self) -> Path:
        return self.root.parent / f"{self.spec.name}.log"

    def bin(self, name: str) -> Path:
        return self.root / "bin" / name

    def wanted(self) -> dict:
        return {"requirements": [f"torch=={self.torch_version}", *self.spec.requirements]}

    def ready(self) -> bool:
        """Built, and with the requirements asked for now."""
        stamp = self.root / STAMP
        try:
            return json.loads(stamp.read_text()) == self.wanted()
        except (OSError, ValueError):
            return False

    def build_commands(self) -> list[list[str]]:
        """The commands that build it, in order (pure: for the tests and the log)."""
        pip = [str(self.python), "-m", "pip"]
        return [
            [sys.executable, "-m", "venv", "--clear", str(self.root)],
            [*pip, "install", "-q", "--upgrade", "pip"],
            [*pip, "install", *self.wanted()["requirements"]],
            [*pip, "uninstall", "-y", *UNUSABLE],
        ]

    def ensure(self) -> PeerVenv:
        """Builds the virtualenv unless it is ready; pip's output goes to `log_path`."""
        if self.ready():
            return self
        self.root.parent.mkdir(parents=True, exist_ok=True)
        print(
            f"--- building the {self.spec.name} peer in {self.root} (minutes; log: "
            f"{self.log_path})",
            flush=True,
        )
        with self.log_path.open("a") as log:
            for argv in self.build_commands():
                log.write(f"$ {' '.join(argv)}\n")
                log.flush()
                done = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, check=False)
                if done.returncode != 0:
                    raise RuntimeError(
                        f"building the {self.spec.name} peer failed ({' '.join(argv[:5])} ...: "
                        f"exit {done.returncode}); see {self.log_path}"
                    )
        (self.root / STAMP).write_text(json.dumps(self.wanted()) + "\n")
        return self
