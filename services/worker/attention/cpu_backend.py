"""Attention backend for CPUs: the torch backend, with decode rows and chunks on C++.

For a decode row (one query token) the torch backend copies the sequence's whole context
out of the paged cache into a dense tensor, for every layer and step, then runs SDPA,
whose tiling is made for long queries. `csrc/paged_decode.cpp` reads the context in place
and handles the query heads of a KV head together: about 3x faster per layer at 32
sequences of 256 tokens (`python -m services.bench.worker_step`), close to the memory read the
work needs. Short chunks (2 to 32 rows: a speculative step verifies k + 1 positions per
request) take its second kernel, which reads each context once for all the chunk's rows
and scores them a tile of keys at a time: 16 requests x 5 rows went from 2.8 to 1.6 ms
per layer against padded SDPA (`python -m services.bench.spec_step`,
docs/speculative-decoding.md). Since 2026-12-07 it takes prefill chunks too (contexts up to
MAX_CHUNK_CONTEXT, float32 and bfloat16 caches, skipping the masked key tiles): SDPA's
per-call cost dominated a burst's short prompts (a 4 x 128 bf16 prefill step 0.85x the
time; but for bf16 on CPUs with AMX-BF16, whose SDPA runs on AMX tiles).

The kernels are compiled once per machine with `torch.utils.cpp_extension` (g++ and ninja,
about 20 s) into $TORCH_EXTENSIONS_DIR/conveyor-<torch version>/ (default
~/.cache/torch_extensions); later loads take milliseconds. Float32 and bfloat16 caches (the
decode fallback float32 only); other dtypes take the torch reference. Decode rows over
float32 and bfloat16 caches run on the twin
kernel in model/cpu_ops.py where that builds (AVX-512 register blocking, the context read
a block at a time with the next block prefetched); this module's decode kernel is its
fallback.
"""

from __future__ import annotations

import functools
import logging
import platform
from pathlib import Path

import torch

from services.common.errors import ConfigError
from services.kernels.metadata import AttentionMetadata
from services.worker.attention import torch_backend
from services.worker.cpp_build import build_extension, source_copy

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"


def _source_in(directory: Path) -> Path:
    return source_copy(SOURCE, directory)


def _arch() -> tuple[str, list[str]]:
    """(name, vector flags) for this CPU: AVX-512 where torch itself runs AVX-512 kernels
    (the chunk kernel's scores and sums are compute bound: a zmm accumulator per query),
    else AVX2 on any x86 CPU torch runs with AVX2; not -march=native, so a build cached on
    a shared disk never meets a CPU without its instructions."""
    is_x86 = platform.machine().lower() in ("x86_64", "amd64")
    capability = torch.backends.cpu.get_cpu_capability()
    if is_x86 and capability.startswith("AVX512"):
        return "avx512", ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"]
    if is_x86 and capability.startswith("AVX2"):
        return "avx2", ["-mavx2", "-mfma"]
    return "generic", []


@functools.cache
def load_kernels():
    """The compiled extension module (built on first use); ConfigError if it cannot build."""
    arch, arch_flags = _arch()
    return build_extension(
        f"conveyor_cpu_attention_{arch}",
        SOURCE,
        arch_flags,
        "CPU attention kernel",
        " or run the workers with --attention-backend torch",
    )


def available() -> bool:
    """Whether the kernel builds (or is already built) here."""
    try:
        load_kernels()
    except ConfigError as exc:
        logger.warning("%s", exc)
        return False
    return True


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """torch_backend.decode_attention on a C++ kernel: model/cpu_ops.py's for float32 and
    bfloat16 caches where that builds, else this module's for float32 caches; other caches
    take the torch path."""
    if k_cache.dtype in (torch.float32, torch.bfloat16) and k_cache.device.type == "cpu":
        from services.worker.model import cpu_ops  # imports this module: not at the top

        if cpu_ops.available():
            return cpu_ops.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
    if k_cache.dtype != torch.float32 or k_cache.device.type != "cpu":
        return torch_backend.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
    out = load_kernels().paged_decode_attention(
        q.to(torch.float32).contiguous(),
        k_cache,
        v_cache,
        block_tables.to(torch.int32).contiguous(),
        seq_lens.to(torch.int32).contiguous(),
        scale,
    )
    return out.to(q.dtype)


def kernel_chunk_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Chunks on the C++ kernel (a speculative step's k + 1 positions, and the prefill
    chunks `takes_chunk` picks): q [T, Hq, D] -> [T, Hq, D], causal within each chunk
    (float32 or bfloat16 caches and head_dim a multiple of 16, the kernel's tile; others
    take the torch path)."""
    if not _kernel_reads(k_cache):
        return torch_backend.chunk_attention(q, k_cache, v_cache, meta, scale)
    dtype = q.dtype  # the kernel reads and writes float32 and bfloat16 rows as they are
    if dtype not in (torch.float32, torch.bfloat16):
        q = q.to(torch.float32)
    out = load_kernels().paged_chunk_attention(
        q.contiguous(),
        k_cache,
        v_cache,
        meta.block_tables.to(torch.int32).contiguous(),
        meta.seq_lens.to(torch.int32).contiguous(),
        meta.query_start_loc.to(torch.int32).contiguous(),
        scale,
    )
    return out.to(dtype)


def paged_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Same contract as torch_backend.paged_attention_forward."""
    torch_backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    return attend_cached(q, k_cache, v_cache, meta, scale)


def attend_cached(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Same contract as torch_backend.attend_cached (K/V rows already written)."""
    return torch_backend.attend_cached(
        q,
        k_cache,
        v_cache,
        meta,
        scale,
        decode_attention,
        kernel_chunk_attention,
        takes_chunk(k_cache),
    )


MAX_CHUNK_CONTEXT = 2048
"""A prefill chunk goes to the C++ kernel when its context is at most this many tokens
(a work item then holds ~1.8 MiB of scores and K/V copies); longer ones keep SDPA, which
ties the kernel from ~1,024 tokens on (both skip the masked tiles) and keeps any length in
cache. Below that SDPA's per-call cost dominates: a 4 x 128 bf16 prefill step 0.85x the
time on the kernel, a 512-token prompt 0.78x (Zen 5, 2 threads)."""


def takes_chunk(k_cache: torch.Tensor) -> torch_backend.TakesChunkFn:
    """The chunks the C++ kernel takes: short ones always; prefill chunks of contexts up to
    MAX_CHUNK_CONTEXT, except over a bfloat16 cache on a CPU with AMX-BF16, where SDPA's
    tiles run on AMX. Each sequence by its own lengths (results never depend on the batch)."""
    long_too = _kernel_reads(k_cache) and not (k_cache.dtype == torch.bfloat16 and _has_amx_bf16())

    def takes(query_lens: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        short = query_lens <= torch_backend.MAX_SHORT_QUERY_LEN
        if not long_too:
            return short
        return short | (seq_lens <= MAX_CHUNK_CONTEXT)

    return takes


def _kernel_reads(k_cache: torch.Tensor) -> bool:
    """Whether the chunk kernel reads this cache: float32 or bfloat16 on the CPU, head_dim
    a multiple of its 16-key tile."""
    return (
        k_cache.dtype in (torch.float32, torch.bfloat16)
        and k_cache.device.type == "cpu"
        and k_cache.shape[3] % 16 == 0
    )


@functools.cache
def _has_amx_bf16() -> bool:
    """Whether this CPU has AMX-BF16 tiles (Linux: a flag of /proc/cpuinfo)."""
    try:
        return " amx_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
