"""Checks every Triton kernel on a CUDA GPU against its reference, then times it.

    python -m services.bench.check_gpu                 # correctness + timing table (~1-2 min on an H200)
    python -m services.bench.check_gpu --model DIR     # + greedy generation, triton vs torch backend

Attention is timed against torch's scaled_dot_product_attention on K/V already gathered
into contiguous [B, H, L, D] tensors (the gather is not timed: the baseline is the best
case of dense attention), for decode at batch 1/32/256 with contexts 1k/8k and a 2k-token
prefill, for a SmolLM2-like head shape (9 q heads, 3 kv heads, dim 64) and a Llama-8B-like
one (32/8/128). Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import sys

import torch

from services.kernels.metadata import AttentionMetadata
from services.kernels.reference import (
    fp8_linear_ref,
    paged_attention_ref,
    reshape_and_cache_ref,
    rms_norm_ref,
    rotary_embedding_ref,
    silu_and_mul_ref,
)

HEAD_SHAPES = {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128)}
TOLERANCES = {torch.float32: 2e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
BLOCK_SIZE = 16


def make_batch(seqs, num_kv_heads, head_dim, dtype, device, block_size=BLOCK_SIZE):
    """(meta, k_cache, v_cache) for sequences (cached_len, query_len), blocks in random order."""
    blocks_per_seq = [-(-(ctx + qlen) // block_size) for ctx, qlen in seqs]
    num_blocks = sum(blocks_per_seq)
    pool = torch.randperm(num_blocks, device=device).to(torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, device=device, dtype=dtype)
    v_cache = torch.randn(shape, device=device, dtype=dtype)
    block_tables = torch.zeros(len(seqs), max(blocks_per_seq), dtype=torch.int32, device=device)
    start = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = pool[start : start + n]
        start += n
    query_lens = torch.tensor([q for _, q in seqs], device=device)
    seq_lens = torch.tensor([c + q for c, q in seqs], device=device, dtype=torch.int32)
    seq_of_row = torch.repeat_interleave(torch.arange(len(seqs), device=device), query_lens)
    first_row = torch.cumsum(query_lens, 0) - query_lens
    positions = (
        torch.arange(int(query_lens.sum()), device=device)
        - first_row[seq_of_row]
        + (seq_lens - query_lens)[seq_of_row]
    )
    blocks = block_tables[seq_of_row, positions // block_size].long()
    meta = AttentionMetadata(
        positions=positions,
        slot_mapping=blocks * block_size + positions % block_size,
        query_start_loc=torch.nn.functional.pad(torch.cumsum(query_lens, 0), (1, 0)).to(
            torch.int32
        ),
        seq_lens=seq_lens,
        block_tables=block_tables,
        max_query_len=max(q for _, q in seqs),
        max_seq_len=max(c + q for c, q in seqs),
    )
    return meta, k_cache, v_cache


def max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max())


def check_correctness(device: str) -> list[str]:
    """Each kernel vs its reference on small-to-medium shapes; returns failure lines."""
    from services.kernels.fp8_matmul import fp8_linear
    from services.kernels.paged_attention import paged_attention
    from services.kernels.reshape_and_cache import reshape_and_cache
    from services.kernels.rms_norm import rms_norm
    from services.kernels.rotary_embedding import rotary_embedding
    from services.kernels.silu_and_mul import silu_and_mul

    failures = []

    def expect(name, dtype, got, want):
        err = max_error(got, want)
        status = (
            "ok" if err <= TOLERANCES[dtype] * max(1.0, float(want.float().abs().max())) else "FAIL"
        )
        print(f"  {status:4} {name:48} {str(dtype):15} max err {err:.2e}")
        if status == "FAIL":
            failures.append(f"{name} {dtype}: max err {err:.2e}")

    mixed = [(0, 100), (37, 1), (500, 64), (1000, 1), (3, 1)]
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for rows in (1, 33, 300):
            w, s = _fp8_weight(1000, 576, device)
            x = torch.randn(rows, 576, device=device, dtype=dtype)
            expect(
                f"fp8_linear [{rows},576]x[1000,576]",
                dtype,
                fp8_linear(x, w, s),
                fp8_linear_ref(x, w, s),
            )
        for label, (hq, hkv, d) in HEAD_SHAPES.items():
            for seqs, kind, splits in (
                (mixed, "mixed", None),
                ([(4000, 1)], "decode", None),
                ([(4000, 1), (50, 1)], "decode split-K=7", 7),
            ):
                meta, k_cache, v_cache = make_batch(seqs, hkv, d, dtype, device)
                q = torch.randn(meta.num_tokens, hq, d, device=device, dtype=dtype)
                got = paged_attention(q, k_cache, v_cache, meta, d**-0.5, num_splits=splits)
                want = paged_attention_ref(q, k_cache, v_cache, meta, d**-0.5)
                expect(f"paged_attention {label} {kind}", dtype, got, want)
        k = torch.randn(300, 8, 128, device=device, dtype=dtype)
        caches = [torch.zeros(40, 16, 8, 128, device=device, dtype=dtype) for _ in range(4)]
        slots = torch.randperm(640, device=device)[:300]
        slots[::7] = -1
        reshape_and_cache(k, 2 * k, caches[0], caches[1], slots)
        reshape_and_cache_ref(k, 2 * k, caches[2], caches[3], slots)
        expect("reshape_and_cache", dtype, torch.stack(caches[:2]), torch.stack(caches[2:]))
        x, res, w = (
            torch.randn(*s, device=device, dtype=dtype) for s in ((300, 4096), (300, 4096), (4096,))
        )
        got, got_res = rms_norm(x, w, 1e-5, residual=res)
        want, want_res = rms_norm_ref(x, w, 1e-5, residual=res)
        expect(
            "rms_norm (fused residual)",
            dtype,
            torch.stack((got, got_res)),
            torch.stack((want, want_res)),
        )
        positions = torch.randint(0, 4096, (300,), device=device)
        cache = torch.randn(4096, 128, device=device)
        q = torch.randn(300, 32, 128, device=device, dtype=dtype)
        want_q, want_k = rotary_embedding_ref(positions, q, k, cache)
        rotary_embedding(positions, q, k, cache)  # in place
        expect("rotary_embedding", dtype, torch.cat((q, k), 1), torch.cat((want_q, want_k), 1))
        x = torch.randn(300, 2 * 14336, device=device, dtype=dtype)
        expect("silu_and_mul", dtype, silu_and_mul(x), silu_and_mul_ref(x))
    return failures


def time_attention(device: str) -> None:
    """Prints paged attention (Triton) vs SDPA on contiguous K/V, in microseconds."""
    print(f"\n  {'heads':8} {'case':22} {'triton us':>10} {'sdpa us':>10} {'speedup':>8}")
    dtype = torch.bfloat16
    for label, (hq, hkv, d) in HEAD_SHAPES.items():
        cases = [
            (f"decode B={b} ctx={c // 1024}k", [(c - 1, 1)] * b)
            for b in (1, 32, 256)
            for c in (1024, 8192)
        ]
        cases.append(("prefill 2k", [(0, 2048)]))
        for name, seqs in cases:
            ours, theirs = _bench_attention(seqs, hq, hkv, d, dtype, device)
            print(f"  {label:8} {name:22} {ours:10.1f} {theirs:10.1f} {theirs / ours:7.2f}x")


def _bench_attention(seqs, num_q_heads, num_kv_heads, head_dim, dtype, device):
    """(triton us, sdpa us) for one batch of equal-length sequences."""
    import torch.nn.functional as F
    from triton.testing import do_bench

    from services.kernels.paged_attention import paged_attention

    meta, k_cache, v_cache = make_batch(seqs, num_kv_heads, head_dim, dtype, device)
    q = torch.randn(meta.num_tokens, num_q_heads, head_dim, device=device, dtype=dtype)
    out, scale = torch.empty_like(q), head_dim**-0.5
    ours = do_bench(lambda: paged_attention(q, k_cache, v_cache, meta, scale, out=out))
    keys = _gather(k_cache, meta, meta.max_seq_len)  # [B, Hkv, L, D]
    values = _gather(v_cache, meta, meta.max_seq_len)
    queries = q.view(len(seqs), -1, num_q_heads, head_dim).transpose(1, 2)  # [B, Hq, Lq, D]
    is_causal = meta.max_query_len > 1
    theirs = do_bench(
        lambda: F.scaled_dot_product_attention(
            queries, keys, values, is_causal=is_causal, scale=scale, enable_gqa=True
        )
    )
    return ours * 1e3, theirs * 1e3


def _gather(cache: torch.Tensor, meta: AttentionMetadata, seq_len: int) -> torch.Tensor:
    """[B, Hkv, L, D] contiguous context of equal-length sequences."""
    blocks = cache[meta.block_tables.long()]  # [B, nb, bs, Hkv, D]
    return blocks.flatten(1, 2)[:, :seq_len].transpose(1, 2).contiguous()


def time_pointwise(device: str) -> None:
    """Prints the small kernels vs their PyTorch references (bf16, 256 tokens)."""
    from triton.testing import do_bench

    from services.kernels.rms_norm import rms_norm
    from services.kernels.silu_and_mul import silu_and_mul

    dtype = torch.bfloat16
    x, res, w = (
        torch.randn(*s, device=device, dtype=dtype) for s in ((256, 4096), (256, 4096), (4096,))
    )
    gate_up = torch.randn(256, 2 * 14336, device=device, dtype=dtype)
    print(f"\n  {'kernel':30} {'triton us':>10} {'torch us':>10}")
    for name, ours, theirs in (
        (
            "rms_norm + residual [256,4096]",
            lambda: rms_norm(x, w, 1e-5, res),
            lambda: rms_norm_ref(x, w, 1e-5, res),
        ),
        (
            "silu_and_mul [256,2x14336]",
            lambda: silu_and_mul(gate_up),
            lambda: silu_and_mul_ref(gate_up),
        ),
    ):
        print(f"  {name:30} {do_bench(ours) * 1e3:10.1f} {do_bench(theirs) * 1e3:10.1f}")


def _fp8_weight(out_features: int, in_features: int, device: str):
    from services.worker.model.quant import quantize_fp8

    weight = torch.randn(out_features, in_features, device=device)
    return quantize_fp8(weight)


def time_fp8(device: str) -> None:
    """Prints the FP8 weight-only matmul vs a bf16 F.linear (Llama-8B MLP shapes): decode
    reads the weight once per step, so its target is half the bf16 time (issue 22)."""
    from triton.testing import do_bench

    from services.kernels.fp8_matmul import fp8_linear

    print(f"\n  {'fp8 matmul (bf16 x)':34} {'fp8 us':>10} {'bf16 us':>10} {'ratio':>7}")
    for rows in (1, 16, 64, 512):
        for out_features, in_features in ((2 * 14336, 4096), (4096, 14336)):
            w, s = _fp8_weight(out_features, in_features, device)
            w_bf16 = torch.randn(out_features, in_features, device=device, dtype=torch.bfloat16)
            x = torch.randn(rows, in_features, device=device, dtype=torch.bfloat16)
            ours = do_bench(lambda: fp8_linear(x, w, s)) * 1e3  # noqa: B023
            theirs = do_bench(lambda: torch.nn.functional.linear(x, w_bf16)) * 1e3  # noqa: B023
            name = f"[{rows},{in_features}]x[{out_features}]"
            print(f"  {name:34} {ours:10.1f} {theirs:10.1f} {ours / theirs:6.2f}x")


def check_generation(model_dir: str, device: str, num_tokens: int = 32) -> bool:
    """Greedy generation through the worker's model, attention_backend triton vs torch."""
    try:
        from services.worker.model.loader import load_stage_model
        from services.worker.model.stages import stage_spec
    except ImportError as exc:
        print(f"\n  skipping generation: services.worker.model is not importable ({exc})")
        return True
    from services.worker.model.config import ModelConfig

    config = ModelConfig.from_dir(model_dir)
    stage = stage_spec(config.num_hidden_layers, 1, 0)
    outputs = {}
    for backend in ("torch", "triton"):
        model = load_stage_model(model_dir, stage, "bfloat16", attention_backend=backend).to(device)
        outputs[backend] = _greedy(model, config, device, list(range(1, 33)), num_tokens)
        del model
    same = sum(a == b for a, b in zip(outputs["torch"], outputs["triton"], strict=True))
    print(f"\n  greedy {num_tokens} tokens: triton == torch on {same}/{num_tokens}")
    print(f"    torch : {outputs['torch']}\n    triton: {outputs['triton']}")
    return outputs["torch"][:8] == outputs["triton"][:8]


@torch.inference_mode()
def _greedy(model, config, device, prompt: list[int], num_tokens: int) -> list[int]:
    """Prefill the prompt, then decode num_tokens greedily on one sequence."""
    max_len = len(prompt) + num_tokens
    num_blocks = -(-max_len // BLOCK_SIZE)
    shape = (num_blocks, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
    caches = [
        (
            torch.zeros(shape, device=device, dtype=torch.bfloat16),
            torch.zeros(shape, device=device, dtype=torch.bfloat16),
        )
        for _ in range(config.num_hidden_layers)
    ]
    block_table = torch.arange(num_blocks, device=device, dtype=torch.int32)[None]
    tokens, produced, ctx = list(prompt), [], 0
    while len(produced) < num_tokens:
        new = tokens[ctx:]
        positions = torch.arange(ctx, ctx + len(new), device=device)
        meta = AttentionMetadata(
            positions=positions,
            slot_mapping=positions,  # block i is block id i
            query_start_loc=torch.tensor([0, len(new)], device=device, dtype=torch.int32),
            seq_lens=torch.tensor([ctx + len(new)], device=device, dtype=torch.int32),
            block_tables=block_table,
            max_query_len=len(new),
            max_seq_len=ctx + len(new),
        )
        hidden = model(meta, caches, input_ids=torch.tensor(new, device=device))
        token = int(model.compute_logits(hidden[-1:]).argmax())
        ctx += len(new)
        tokens.append(token)
        produced.append(token)
    return produced


def compare_pipeline(model_dir: str, sim_profile: str, num_stages: int = 2) -> None:
    """Sync vs async on this GPU (real weights, bf16, 64 x 128/128) and the same on the
    simulated device, one table: does the model's bubble match the GPU's?"""
    from pathlib import Path

    from services.bench import sim_experiment as sx

    out = Path("bench/results/gpu-pipeline")
    out.mkdir(parents=True, exist_ok=True)
    sx.WORKLOADS["gpu"] = (64, 128, 128)
    points = []
    for label, device_args in (
        ("gpu", ["--device", "cuda", "--dtype", "bfloat16"]),
        ("sim", None),
    ):
        for scheduling in ("sync", "async"):
            result = sx.serve_workload(
                Path(model_dir), sim_profile, num_stages, scheduling, "gpu", None, out, device_args
            )
            points.append(sx.Point("gpu", label, num_stages, scheduling, None, result))
    print("\nsync vs async, real GPU beside the simulated device ('arrival' column):")
    print(sx.experiment_table(points))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory for a greedy triton-vs-torch check")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument(
        "--pipeline",
        action="store_true",
        help="with --model: 2 stages sync vs async on this GPU with the real weights, beside "
        "the same stacks simulated on --sim-profile (issue 16's comparison)",
    )
    parser.add_argument("--sim-profile", default="h100", help="the simulated twin (default: h100)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "no CUDA device: nothing to check (the kernels' CPU tests run under "
            "TRITON_INTERPRET=1 in tests/kernels)"
        )
        return 0
    device = "cuda"
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}\ncorrectness:")
    failures = check_correctness(device)
    if not args.skip_timing:
        time_attention(device)
        time_pointwise(device)
        time_fp8(device)
    if args.model and not check_generation(args.model, device):
        failures.append("greedy generation: triton and torch differ in the first 8 tokens")
    if args.model and args.pipeline:
        compare_pipeline(args.model, args.sim_profile)
    print("\n" + ("all checks passed" if not failures else "FAILURES:\n  " + "\n  ".join(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
