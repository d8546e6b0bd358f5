"""The CPU backend's C++ kernels against the torch reference: decode rows (decode_attention)
and chunks (chunk_attention): a speculative step's k + 1 positions, and prefill chunks."""

from __future__ import annotations

import random

import pytest
import torch

from services.kernels.metadata import AttentionMetadata
from services.worker import cpp_build
from services.worker.attention import cpu_backend, torch_backend
from services.worker.model import cpu_ops

# The decode kernels: model/cpu_ops.py's (what cpu_backend.decode_attention runs where it
# builds) and this backend's own, its fallback.
DECODE_KERNELS = ["cpu_ops", "fallback"]


def decode(kernel, q, k_cache, v_cache, tables, lens, scale):
    if kernel == "cpu_ops":
        if not cpu_ops.available():
            pytest.skip("model/cpu_ops.py does not build here")
        return cpu_ops.decode_attention(q, k_cache, v_cache, tables, lens, scale)
    return cpu_backend.load_kernels().paged_decode_attention(
        q, k_cache, v_cache, tables, lens, scale
    )


def paged_decode_case(
    num_seqs, num_heads, num_kv_heads, head_dim, block_size, seq_lens, seed=0, key_scale=1.0
):
    """Random caches in shuffled blocks; returns the arguments of decode_attention."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)
    width = max(blocks_per_seq)
    tables = []
    for count in blocks_per_seq:
        table = [free.pop() for _ in range(count)]
        tables.append(table + [0] * (width - count))
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen) * key_scale
    v_cache = torch.randn(shape, generator=gen)
    q = torch.randn(num_seqs, num_heads, head_dim, generator=gen)
    block_tables = torch.tensor(tables, dtype=torch.int32)
    return q, k_cache, v_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32)


@pytest.mark.parametrize("kernel", DECODE_KERNELS)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 2), (9, 3), (8, 1)])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_decode_kernel_matches_reference(kernel, num_heads, num_kv_heads, block_size):
    seq_lens = [1, block_size, block_size + 1, 3 * block_size - 1, 70]
    args = paged_decode_case(len(seq_lens), num_heads, num_kv_heads, 32, block_size, seq_lens)
    scale = 32**-0.5
    ours = decode(kernel, *args, scale)
    ref = torch_backend.decode_attention(*args, scale)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", DECODE_KERNELS)
@pytest.mark.parametrize(
    ("head_dim", "num_heads", "num_kv_heads"),  # head_dim 64, group <= 4: cpu_ops' fast path
    [(64, 6, 2), (64, 8, 2), (64, 10, 2), (80, 6, 2), (128, 6, 2)],
)
def test_decode_kernel_handles_head_dims_and_peaked_softmax(
    kernel, head_dim, num_heads, num_kv_heads
):
    """Large keys make most probabilities underflow (the kernel zeroes exp below e^-30)."""
    seq_lens = [300, 17, 129]
    args = paged_decode_case(
        3, num_heads, num_kv_heads, head_dim, 16, seq_lens, seed=3, key_scale=8.0
    )
    scale = head_dim**-0.5
    ours = decode(kernel, *args, scale)
    ref = torch_backend.decode_attention(*args, scale)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("head_dim", "num_heads", "num_kv_heads", "block_size"),
    [(64, 9, 3, 16), (64, 8, 2, 32), (80, 6, 2, 16)],  # the vector kernels, then plain loops
)
@pytest.mark.parametrize("key_scale", [1.0, 8.0])  # 8: most probabilities underflow
def test_long_contexts_attend_in_partitions_that_match_the_reference(
    head_dim, num_heads, num_kv_heads, block_size, key_scale
):
    """Contexts over cpu_ops' partition (512 tokens) are attended a partition at a time and
    merged by the partitions' maxima: one partition and a bit, several, a partial last one."""
    if not cpu_ops.available():
        pytest.skip("model/cpu_ops.py does not build here")
    seq_lens = [2048, 513, 512, 70, 1500]
    args = paged_decode_case(
        len(seq_lens),
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        seq_lens,
        seed=11,
        key_scale=key_scale,
    )
    scale = head_dim**-0.5
    ref = torch_backend.decode_attention(*args, scale)
    torch.testing.assert_close(cpu_ops.decode_attention(*args, scale), ref, atol=1e-5, rtol=1e-5)
    q, k_cache, v_cache, tables, lens = args
    bf16 = cpu_ops.decode_attention(q, k_cache.bfloat16(), v_cache.bfloat16(), tables, lens, scale)
    ref16 = torch_backend.decode_attention(
        q, k_cache.bfloat16().float(), v_cache.bfloat16().float(), tables, lens, scale
    )
    torch.testing.assert_close(bf16, ref16, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", DECODE_KERNELS)
@pytest.mark.parametrize(
    ("num_seqs", "base"),  # one sequence: its KV heads (or partitions) go to the threads
    [(1, 50), (16, 50), (1, 1200), (3, 900)],
)
def test_decode_kernel_uses_threads_without_changing_results(kernel, num_seqs, base):
    seq_lens = [base + 7 * i for i in range(num_seqs)]
    args = paged_decode_case(num_seqs, 8, 2, 64, 16, seq_lens, seed=5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = decode(kernel, *args, 0.125)
        torch.set_num_threads(2)
        two = decode(kernel, *args, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    # a sequence's rows do not depend on the others in the batch (sync = async tokens)
    q, k_cache, v_cache, tables, lens = args
    alone = decode(kernel, q[:1], k_cache, v_cache, tables[:1], lens[:1], 0.125)
    assert torch.equal(alone, one[:1])


def test_other_caches_take_the_bfloat16_kernel_or_the_reference_path():
    q, k_cache, v_cache, tables, lens = paged_decode_case(2, 4, 2, 16, 8, [5, 9])
    args = (q.half(), k_cache.half(), v_cache.half(), tables, lens)
    ours = cpu_backend.decode_attention(*args, 0.25)  # float16: the torch reference itself
    assert ours.dtype == torch.float16
    torch.testing.assert_close(ours, torch_backend.decode_attention(*args, 0.25))
    args = (q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), tables, lens)
    ours = cpu_backend.decode_attention(*args, 0.25)  # model/cpu_ops.py's bf16 twin
    assert ours.dtype == torch.bfloat16
    ref = torch_backend.decode_attention(*args, 0.25)
    torch.testing.assert_close(ours.float(), ref.float(), atol=0.02, rtol=0.02)


def test_kernel_rejects_bad_inputs_with_a_message():
    q, k_cache, v_cache, tables, lens = paged_decode_case(2, 4, 2, 16, 8, [5, 9])
    kernels = cpu_backend.load_kernels()
    with pytest.raises(RuntimeError, match="int32 block_tables"):
        kernels.paged_decode_attention(q, k_cache, v_cache, tables.long(), lens, 0.25)
    with pytest.raises(RuntimeError, match="shapes disagree"):
        kernels.paged_decode_attention(q[:, :3].contiguous(), k_cache, v_cache, tables, lens, 0.25)
    starts = torch.tensor([0, 1, 3], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="does not cover"):
        kernels.paged_chunk_attention(q, k_cache, v_cache, tables, lens, starts, 0.25)
    starts = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="bad block id"):
        kernels.paged_chunk_attention(q, k_cache, v_cache, tables + 1000, lens, starts, 0.25)
    with pytest.raises(RuntimeError, match="beyond the block table"):
        kernels.paged_chunk_attention(q, k_cache, v_cache, tables, lens * 10, starts, 0.25)
    with pytest.raises(RuntimeError, match="both alike"):
        kernels.paged_chunk_attention(q, k_cache, v_cache.bfloat16(), tables, lens, starts, 0.25)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 q"):
        kernels.paged_chunk_attention(q.half(), k_cache, v_cache, tables, lens, starts, 0.25)
    # Metadata of another rank, and caches no block or head fits in, are refused before a
    # read: each crashed the process (a read past an empty tensor, a division by zero).
    for bad in (
        (q, k_cache, v_cache, tables, lens.view(2, 1)[:, :0], starts),
        (q, k_cache, v_cache, tables.view(2, -1, 1)[..., :0], lens, starts),
        (q, k_cache, v_cache, tables, lens, starts.view(3, 1)[:, :0]),
    ):
        with pytest.raises(RuntimeError, match="shapes disagree"):
            kernels.paged_chunk_attention(*bad, 0.25)
    for empty in (k_cache[:, :0], k_cache[:, :, :0]):
        with pytest.raises(RuntimeError, match="an empty cache block or no KV head"):
            kernels.paged_chunk_attention(q, empty, empty, tables, lens, starts, 0.25)
    if not cpu_ops.available():
        return
    with pytest.raises(RuntimeError, match="shapes disagree"):
        cpu_ops.decode_attention(q[:, :3].contiguous(), k_cache, v_cache, tables, lens, 0.25)
    with pytest.raises(RuntimeError, match="both caches alike"):
        cpu_ops.decode_attention(q, k_cache, v_cache.bfloat16(), tables, lens, 0.25)
    with pytest.raises(RuntimeError, match="bad block id"):
        cpu_ops.decode_attention(q, k_cache, v_cache, tables + 1000, lens, 0.25)
    with pytest.raises(RuntimeError, match="beyond the block table"):
        cpu_ops.decode_attention(q, k_cache, v_cache, tables, lens * 10, 0.25)
    with pytest.raises(RuntimeError, match="beyond the block table"):  # refused, not partitioned
        cpu_ops.decode_attention(q, k_cache, v_cache, tables, lens * 0 + 2**31 - 1, 0.25)


def chunk_case(num_heads, num_kv_heads, head_dim, block_size, seq_lens, query_lens, seed=0):
    """Paged caches as in paged_decode_case, with a chunk of query_lens[i] rows at the end
    of sequence i; returns (q [T, Hq, D], k_cache, v_cache, metadata)."""
    _, k_cache, v_cache, tables, lens = paged_decode_case(
        len(seq_lens), num_heads, num_kv_heads, head_dim, block_size, seq_lens, seed
    )
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen)
    query_lens_t = torch.tensor(query_lens)
    positions = torch.cat(
        [torch.arange(n - m, n) for n, m in zip(seq_lens, query_lens, strict=True)]
    )
    meta = AttentionMetadata(
        positions=positions,
        slot_mapping=torch.zeros_like(positions),  # unused: the caches are written already
        query_start_loc=torch.nn.functional.pad(query_lens_t.cumsum(0), (1, 0)).int(),
        seq_lens=lens,
        block_tables=tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    return q, k_cache, v_cache, meta


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("block_size", [8, 16])
def test_chunk_kernel_matches_reference(num_heads, num_kv_heads, block_size):
    """Chunks of 2..17 rows (k + 1 for k up to 16), some as long as their whole context,
    contexts across tile (16 keys) and block edges."""
    seq_lens = [2, 5, block_size + 1, 3 * block_size - 1, 70, 17, 33]
    query_lens = [2, 5, 5, 17, 3, 17, 16]
    q, k_cache, v_cache, meta = chunk_case(
        num_heads, num_kv_heads, 64, block_size, seq_lens, query_lens
    )
    scale = 64**-0.5
    ours = cpu_backend.kernel_chunk_attention(q, k_cache, v_cache, meta, scale)
    ref = torch_backend.chunk_attention(q, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3])
def test_chunk_kernel_takes_prefill_chunks_and_bf16_caches(dtype, group):
    """Whole prompts (causal from the first key) and later chunks of a long context, across
    the 16-key tiles and the query blocks of the causal skip, over float32 and bfloat16
    caches: close to SDPA's result (float32 softmax in both)."""
    seq_lens = [128, 200, 1, 37, 300, 64]
    query_lens = [128, 200, 1, 37, 100, 33]
    q, k_cache, v_cache, meta = chunk_case(3 * group, 3, 64, 16, seq_lens, query_lens, seed=7)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    takes = cpu_backend.takes_chunk(k_cache)(meta.query_lens, meta.seq_lens)
    assert bool(takes.all())
    ours = cpu_backend.kernel_chunk_attention(q, k_cache, v_cache, meta, 0.125)
    ref = torch_backend.chunk_attention(q, k_cache.float(), v_cache.float(), meta, 0.125)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_chunk_kernel_reads_and_writes_bf16_rows_as_rounding_its_float32_result(cache_dtype):
    """A bfloat16 q is read as is and the result rounded once, as torch rounds: the same
    bits as the float32 path followed by a conversion (what the backend did before)."""
    q, k_cache, v_cache, meta = chunk_case(9, 3, 64, 16, [128, 70], [128, 33], seed=3)
    k_cache, v_cache, q = k_cache.to(cache_dtype), v_cache.to(cache_dtype), q.bfloat16()
    kernels = cpu_backend.load_kernels()
    args = (meta.block_tables, meta.seq_lens, meta.query_start_loc.int(), 0.125)
    ours = kernels.paged_chunk_attention(q, k_cache, v_cache, *args)
    assert ours.dtype == torch.bfloat16
    wide = kernels.paged_chunk_attention(q.float(), k_cache, v_cache, *args)
    assert torch.equal(ours, wide.bfloat16())


def test_prefill_chunks_take_the_kernel_up_to_its_context_bound(monkeypatch):
    """Short chunks always; longer ones while the context fits MAX_CHUNK_CONTEXT, and over a
    bfloat16 cache not on a CPU with AMX-BF16 (SDPA's tiles run on AMX there); decided per
    sequence, by its own lengths."""
    bound = cpu_backend.MAX_CHUNK_CONTEXT
    query_lens = torch.tensor([5, 128, 512, 32, 512])
    seq_lens = torch.tensor([4000, 128, bound + 1, 10**6, bound])
    cache = torch.zeros(1, 16, 3, 64)
    monkeypatch.setattr(cpu_backend, "_has_amx_bf16", lambda: False)
    for dtype in (torch.float32, torch.bfloat16):
        takes = cpu_backend.takes_chunk(cache.to(dtype))(query_lens, seq_lens)
        assert takes.tolist() == [True, True, False, True, True]
    monkeypatch.setattr(cpu_backend, "_has_amx_bf16", lambda: True)
    takes = cpu_backend.takes_chunk(cache.bfloat16())(query_lens, seq_lens)
    assert takes.tolist() == [True, False, False, True, False]
    takes = cpu_backend.takes_chunk(cache)(query_lens, seq_lens)
    assert takes.tolist() == [True, True, False, True, True]
    odd = torch.zeros(1, 16, 3, 40)  # head_dim not a multiple of the kernel's tile
    takes = cpu_backend.takes_chunk(odd)(query_lens, seq_lens)
    assert takes.tolist() == [True, False, False, True, False]  # short ones: torch inside


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_rows_do_not_depend_on_the_other_sequences(dtype):
    """Decode rows, short chunks and long chunks of different lengths (prefills) in one
    batch: each sequence's rows are bit-identical to those of the same sequence attended
    alone (sync and async mode batch requests differently), and close to the torch
    reference. Two prefills padded to one length in SDPA differed by a bfloat16 ulp."""
    seq_lens, query_lens = [40, 60, 90, 50, 300, 128, 128], [1, 5, 48, 1, 200, 128, 128]
    q, k_cache, v_cache, meta = chunk_case(9, 3, 64, 16, seq_lens, query_lens, seed=4)
    q, k_cache, v_cache = q.to(dtype), k_cache.to(dtype), v_cache.to(dtype)
    together = cpu_backend.attend_cached(q, k_cache, v_cache, meta, 0.125)
    ref = torch_backend.attend_cached(q, k_cache, v_cache, meta, 0.125)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(together, ref, atol=tolerance, rtol=tolerance)
    starts = meta.query_start_loc.tolist()
    for seq in range(len(seq_lens)):
        rows, alone = torch_backend._subset(meta, torch.tensor([seq]))
        out = cpu_backend.attend_cached(q[rows], k_cache, v_cache, alone, 0.125)
        assert torch.equal(out, together[starts[seq] : starts[seq + 1]]), seq


@pytest.mark.parametrize("query_len", [5, 100])
def test_chunk_kernel_uses_threads_without_changing_results(query_len):
    seq_lens = [query_len + 55 + 9 * i for i in range(8)]
    q, k_cache, v_cache, meta = chunk_case(9, 3, 64, 16, seq_lens, [query_len] * 8)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_backend.kernel_chunk_attention(q, k_cache, v_cache, meta, 0.125)
        torch.set_num_threads(2)
        two = cpu_backend.kernel_chunk_attention(q, k_cache, v_cache, meta, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_build_directory_is_per_torch_version(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    path = cpp_build.build_directory("probe")
    assert path.parent.name == f"conveyor-torch{torch.__version__}"


def test_build_lock_removes_the_lock_a_killed_build_left_and_excludes_others(tmp_path):
    """torch waits forever on the `lock` file of a build killed half-way; under Conveyor's
    flock no live build holds it, so it goes and the next worker builds. While one process
    holds the flock, another cannot take it."""
    import fcntl

    (tmp_path / "lock").touch()
    with cpp_build.build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
        with (
            open(tmp_path / ".conveyor-build.lock", "w") as other,
            pytest.raises(BlockingIOError),
        ):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_the_kernel_builds_from_a_copy_in_its_build_directory(tmp_path):
    """Two checkouts of the same source share one build: ninja sees one path, not two."""
    copy = cpu_backend._source_in(tmp_path)
    assert copy.parent == tmp_path and copy.read_bytes() == cpu_backend.SOURCE.read_bytes()
    mtime = copy.stat().st_mtime_ns
    assert cpu_backend._source_in(tmp_path).stat().st_mtime_ns == mtime  # unchanged: no rebuild
    copy.write_text("// another version\n")
    assert cpu_backend._source_in(tmp_path).read_bytes() == cpu_backend.SOURCE.read_bytes()


def test_a_missing_kernel_source_is_an_incomplete_install_not_a_missing_compiler(tmp_path):
    """A package installed without its csrc/*.cpp (the compose image until 2026-12-06) said
    "install a C++ compiler"; it names the missing file and says to reinstall."""
    from services.common.errors import ConfigError

    source = tmp_path / "csrc" / "gone.cpp"
    with pytest.raises(ConfigError, match="gone.cpp is missing.*incomplete.*reinstall"):
        cpp_build.build_extension("conveyor_probe_missing", source, [], "probe kernel")


def test_kernels_build_with_the_ninja_the_package_depends_on(monkeypatch):
    """Not whichever ninja is first on PATH: another version's build log makes ninja rebuild
    everything (~70 s at each switch between an activated venv and `make`)."""
    import os
    import shutil

    import ninja

    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    with cpp_build._our_ninja():
        assert shutil.which("ninja") == os.path.join(ninja.BIN_DIR, "ninja")
    assert os.environ["PATH"] == "/usr/bin:/bin"
