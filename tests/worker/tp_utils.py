"""Run one tensor-parallel rank of a single-stage model in a spawned process (gloo over a
FileStore): the same plans as an unsharded runner, results saved for the parent to compare."""

from __future__ import annotations

import datetime
import multiprocessing
from pathlib import Path

import torch


def run_rank(model_dir: str, rank: int, size: int, store_path: str, out_path: str) -> None:
    """Greedy-decode the tiny prompts on rank `rank` of `size`; save tokens, logits, bytes."""
    import torch.distributed as dist

    from services.worker.kv_cache import KVCache, KVCacheSpec
    from services.worker.model.loader import SafetensorsReader, load_stage_model
    from services.worker.model.stages import stage_spec
    from services.worker.runner import StageRunner
    from tests.worker.utils import TinyPlanner, make_prompts, run_plans

    torch.set_num_threads(1)
    reader = SafetensorsReader(model_dir)
    stage = stage_spec(3, 1, 0)
    model = load_stage_model(
        model_dir, stage, reader=reader, tp_rank=rank, tensor_parallel_size=size
    )
    bytes_read = reader.bytes_read
    store = dist.FileStore(store_path, size)
    model.tp.group = dist.ProcessGroupGloo(store, rank, size, datetime.timedelta(seconds=60))
    spec = KVCacheSpec(3, model.tp.shard.num_kv_heads, model.config.head_dim, 8, torch.float32)
    runner = StageRunner(model, KVCache(spec, 64))
    outputs, logits = greedy(runner, TinyPlanner, make_prompts, run_plans)
    torch.save({"outputs": outputs, "logits": logits, "bytes_read": bytes_read}, out_path)
    # Both ranks are done before either lets go of the group: a gloo group still alive at
    # interpreter exit can abort the process (SIGABRT) while its threads are torn down.
    model.tp.group.barrier().wait()
    model.tp.group.shutdown()


def greedy(runner, planner_cls, make_prompts, run_plans):
    planner = planner_cls(8, 64, chunk_size=5, shuffle_seed=3)
    for i, prompt in enumerate(make_prompts(4, max_len=20)):
        planner.add(f"req-{i}", prompt, 6, arrival_step=i)
    outputs = run_plans(planner, [runner])
    return outputs, dict(planner.logits)


def run_ranks(model_dir: Path, size: int, tmp_path: Path) -> list[dict]:
    """Spawn `size` ranks; each rank's saved results, in rank order."""
    ctx = multiprocessing.get_context("spawn")
    store_path = str(tmp_path / "store")
    outs = [str(tmp_path / f"rank{r}.pt") for r in range(size)]
    procs = [
        ctx.Process(target=run_rank, args=(str(model_dir), r, size, store_path, outs[r]))
        for r in range(size)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(180)
        assert proc.exitcode == 0, f"rank process exited with {proc.exitcode}"
    return [torch.load(path) for path in outs]
