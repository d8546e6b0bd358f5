"""The weight-transfer protocol between a trainer and the stage workers (torch.distributed).

One process group per deployment: the trainer is rank 0 and hosts the rendezvous (a
`TCPStore` at master_addr:master_port); stage s is rank 1 + s. The trainer never learns the
stage layout: it broadcasts every tensor, and each stage keeps the ones it owns.

One update, all broadcasts from rank 0, in this order:

    header    int64 [2]          (PROTOCOL_VERSION, manifest length in bytes)
    manifest  uint8 [length]     JSON: {"tensors": [{"name", "dtype", "shape"}, ...]}
    tensors   one broadcast per manifest entry, in manifest order, of that dtype and shape

The manifest is JSON (never pickle): a stage checks every entry against `MAX_*` before it
allocates anything. A stage receives tensors it does not own into a reused scratch buffer.
gloo on CPU; a CUDA deployment would build the group with NCCL the same way.
"""

from __future__ import annotations

import datetime
import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from services.common.errors import InvalidRequest

PROTOCOL_VERSION = 1
MAX_MANIFEST_BYTES = 64 << 20
MAX_TENSORS = 1_000_000
MAX_NAME_CHARS = 512
MAX_TENSOR_ELEMENTS = 1 << 36
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class TransferError(InvalidRequest):
    """The other side broke the protocol (a bad header or manifest)."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One manifest entry."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def join_group(
    master_addr: str, master_port: int, rank: int, world_size: int, timeout_s: float
) -> dist.ProcessGroup:
    """Joins the transfer group (rank 0 hosts the store); blocks until every rank has."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        master_addr,
        master_port,
        world_size,
        is_master=rank == 0,
        timeout=timeout,
        wait_for_workers=False,
    )
    prefix = dist.PrefixStore("conveyor-weights", store)
    return dist.ProcessGroupGloo(prefix, rank, world_size, timeout)


def encode_manifest(specs: Iterable[TensorSpec]) -> bytes:
    entries = [
        {"name": s.name, "dtype": DTYPE_NAMES[s.dtype], "shape": list(s.shape)} for s in specs
    ]
    return json.dumps({"tensors": entries}).encode()


def decode_manifest(raw: bytes) -> list[TensorSpec]:
    """The manifest's entries; `TransferError` naming the first bad one."""
    try:
        entries = json.loads(raw.decode())["tensors"]
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise TransferError(f"the weight manifest is not valid JSON with `tensors`: {exc}") from exc
    if not isinstance(entries, list) or len(entries) > MAX_TENSORS:
        raise TransferError(f"the weight manifest must list at most {MAX_TENSORS} tensors")
    specs = []
    for entry in entries:
        name, dtype, shape = (
            entry.get(k) if isinstance(entry, dict) else None for k in ("name", "dtype", "shape")
        )
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
            raise TransferError(
                f"manifest entry {entry!r:.80}: name must be 1-{MAX_NAME_CHARS} chars"
            )
        if dtype not in DTYPES:
            raise TransferError(f"tensor {name!r}: dtype {dtype!r} is not one of {sorted(DTYPES)}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise TransferError(f"tensor {name!r}: shape {shape!r} is not a list of sizes >= 0")
        if math.prod(shape) > MAX_TENSOR_ELEMENTS:
            raise TransferError(f"tensor {name!r}: {math.prod(shape)} elements is too many")
        specs.append(TensorSpec(name, DTYPES[dtype], tuple(shape)))
    return specs


def broadcast_state_dict(group: dist.ProcessGroup, tensors: dict[str, torch.Tensor]) -> int:
    """Rank 0 (the trainer): sends `tensors` (name -> CPU tensor); returns the bytes sent."""
    prepared = {name: _sendable(name, t) for name, t in tensors.items()}
    manifest = encode_manifest(TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in prepared.items())
    header = torch.tensor([PROTOCOL_VERSION, len(manifest)], dtype=torch.int64)
    group.broadcast(header, 0).wait()
    group.broadcast(torch.frombuffer(bytearray(manifest), dtype=torch.uint8), 0).wait()
    num_bytes = 0
    for tensor in prepared.values():
        group.broadcast(tensor, 0).wait()
        num_bytes += tensor.numel() * tensor.element_size()
    return num_bytes


def _sendable(name: str, tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype not in DTYPE_NAMES:
        raise TransferError(
            f"tensor {name!r} has dtype {tensor.dtype}: send one of {sorted(DTYPES)}"
        )
    return tensor.detach().to("cpu").contiguous()


def receive_state_dict(
    group: dist.ProcessGroup, wants: Callable[[str], bool]
) -> dict[str, torch.Tensor]:
    """A stage (rank > 0): receives one update; returns the tensors `wants` keeps."""
    header = torch.empty(2, dtype=torch.int64)
    group.broadcast(header, 0).wait()
    version, length = header.tolist()
    if version != PROTOCOL_VERSION or not 0 < length <= MAX_MANIFEST_BYTES:
        raise TransferError(
            f"the trainer speaks weight-transfer protocol {version} with a {length}-byte "
            f"manifest; this worker speaks {PROTOCOL_VERSION} (manifests up to "
            f"{MAX_MANIFEST_BYTES} bytes): use the same Conveyor version on both sides"
        )
    raw = torch.empty(length, dtype=torch.uint8)
    group.broadcast(raw, 0).wait()
    kept: dict[str, torch.Tensor] = {}
    scratch: dict[torch.dtype, torch.Tensor] = {}
    for spec in decode_manifest(raw.numpy().tobytes()):
        if wants(spec.name):
            buf = torch.empty(spec.shape, dtype=spec.dtype)
            kept[spec.name] = buf
        else:  # received and dropped: one buffer per dtype, grown as needed
            numel = math.prod(spec.shape)
            if scratch.get(spec.dtype) is None or scratch[spec.dtype].numel() < numel:
                scratch[spec.dtype] = torch.empty(numel, dtype=spec.dtype)
            buf = scratch[spec.dtype][:numel].view(spec.shape)
        group.broadcast(buf, 0).wait()
    return kept
