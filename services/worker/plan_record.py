"""The plans a stage received, recorded to be run again in process (`--record-plans`).

A running stack's step can take longer than the same step run alone (the control plane's
processes share the cores, docs/performance.md). `conveyor worker --record-plans FILE` writes
every plan its stage receives, and `python -m services.bench.replay_plans FILE` runs them
again through the stage's own `StageRunner`, alone, beside the stack's timeline.

The file: a line naming the format, then records of a 4-byte little-endian length and that
many bytes. The first record is the stage's configuration (JSON: what rebuilds its runner);
each later record is one `conveyor.v1.StepPlan` (plans joined in one message are recorded one
by one), or an empty record where a scheduler session started (the stage forgets its
requests there).
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Iterator
from pathlib import Path

from services.common.errors import ConfigError
from services.common.proto.conveyor.v1 import worker_pb2

MAGIC = b"conveyor plans 1\n"
_LENGTH = struct.Struct("<I")

# The WorkerConfig fields that rebuild the stage's runner (no addresses, no secrets).
RUNNER_FIELDS = (
    "model_dir",
    "stage_index",
    "num_stages",
    "tp_rank",
    "tensor_parallel_size",
    "layer_split",
    "block_size",
    "kv_cache_memory",
    "max_model_len",
    "dtype",
    "attention_backend",
    "device",
    "num_threads",
    "quantization",
    "quantization_ignore",
    "linear_backend",
    "seed",
)

SESSION_START = None
"""What `read_plans` yields where a scheduler session started."""


class PlanRecorder:
    """Appends a stage's plans to `path` (truncated when the worker starts), flushed per plan
    so that a worker killed mid-run leaves every plan it ran."""

    def __init__(self, path: str | Path, config) -> None:
        header = {name: getattr(config, name) for name in RUNNER_FIELDS}
        try:
            self._file = open(path, "wb")  # noqa: SIM115 - open for the worker's lifetime
        except OSError as exc:
            raise ConfigError(f"--record-plans {path}: cannot write there: {exc}") from None
        self._file.write(MAGIC)
        self._write(json.dumps(header).encode())

    def session_started(self) -> None:
        self._write(b"")

    def plan(self, msg: worker_pb2.StepPlan) -> None:
        if msg.following:  # joined plans are recorded one by one
            msg = worker_pb2.StepPlan.FromString(msg.SerializeToString())
            msg.ClearField("following")
        self._write(msg.SerializeToString())

    def close(self) -> None:
        self._file.close()

    def _write(self, data: bytes) -> None:
        self._file.write(_LENGTH.pack(len(data)) + data)
        self._file.flush()


def read_header(path: str | Path) -> dict:
    """The recorded stage's configuration (the WorkerConfig fields of RUNNER_FIELDS)."""
    with open(path, "rb") as file:
        _check_magic(file, path)
        header = _read_record(file, path)
    if header is None:
        raise ConfigError(f"{path} ends before its header: the worker wrote no plan")
    return json.loads(header)


def read_plans(path: str | Path) -> Iterator[worker_pb2.StepPlan | None]:
    """The recorded plans in order, with SESSION_START (None) where a session started."""
    with open(path, "rb") as file:
        _check_magic(file, path)
        _read_record(file, path)  # the header
        while (data := _read_record(file, path)) is not None:
            yield worker_pb2.StepPlan.FromString(data) if data else SESSION_START


def runner_config(header: dict):
    """A WorkerConfig that builds the recorded stage's runner."""
    from services.worker.config import WorkerConfig

    known = {f.name for f in dataclasses.fields(WorkerConfig)}
    values = {k: v for k, v in header.items() if k in known}
    if values.get("quantization_ignore") is not None:
        values["quantization_ignore"] = tuple(values["quantization_ignore"])
    return WorkerConfig(**values)


def _check_magic(file, path) -> None:
    if file.read(len(MAGIC)) != MAGIC:
        raise ConfigError(f"{path} is not a plan recording (conveyor worker --record-plans)")


def _read_record(file, path) -> bytes | None:
    head = file.read(_LENGTH.size)
    if not head:
        return None
    if len(head) < _LENGTH.size:
        return None  # cut short while the worker wrote it: the plans before it stand
    (length,) = _LENGTH.unpack(head)
    data = file.read(length)
    return data if len(data) == length else None
