"""`BlockTables` (the runner's persistent block table rows) and the step inputs built from
them: the metadata of a long random plan stream equals the documented block math."""

from __future__ import annotations

import random

import numpy as np

from services.common.sampling import SamplingParams
from services.common.step import CachedRequest, NewRequest, StepPlan
from services.worker.block_tables import BlockTables
from services.worker.config import WorkerConfig
from services.worker.sim import MODELS_DIR
from services.worker.sim.runner import SimStageRunner


def tables(live: set[int] | None = None, rows: int = 2, width: int = 2) -> BlockTables:
    """Small buffers, so that every test crosses a growth; `live`: the rows held."""
    return BlockTables(lambda: live if live is not None else range(10**6), rows, width)


def test_block_tables_gather_pads_each_row_with_zero_to_the_longest():
    t = tables()
    a, b = t.add([7, 8, 9]), t.add([4])
    t.append(b, [5])
    assert t.gather(np.array([b, a])).tolist() == [[4, 5, 0], [7, 8, 9]]
    assert t.gather(np.array([b])).tolist() == [[4, 5]]
    assert t.block_ids(a) == [7, 8, 9]


def test_block_tables_grow_in_rows_and_width_keeping_every_table():
    t = tables()
    expected = {}
    for i in range(9):  # every row stays held: the buffer must grow
        blocks = list(range(100 * i, 100 * i + i + 1))
        expected[t.add(blocks)] = blocks
    for row, blocks in expected.items():
        t.append(row, [1, 2, 3])
        blocks += [1, 2, 3]
    assert t.num_rows >= 9
    for row, blocks in expected.items():
        assert t.block_ids(row) == blocks


def test_block_tables_reuse_the_rows_of_dropped_requests_with_no_stale_blocks():
    live: set[int] = set()
    t = tables(live, rows=4, width=8)
    for i in range(100):  # one request held at a time: the rows come back, none added
        row = t.add([i] * (1 + i % 5))
        live.clear()
        live.add(row)
        assert t.gather(np.array([row])).tolist() == [[i] * (1 + i % 5)]
        assert t.table[row, 1 + i % 5 :].tolist() == [0] * (8 - 1 - i % 5)
    assert t.num_rows == 4


def test_block_tables_gather_is_a_copy_later_appends_leave_alone():
    t = tables()
    row = t.add([3])
    step_table = t.gather(np.array([row]))
    t.append(row, [4])
    assert step_table.tolist() == [[3]]


def first_stage(block_size: int) -> SimStageRunner:
    config = WorkerConfig(
        model_dir=str(MODELS_DIR / "llama-3-8b"),
        stage_index=0,
        num_stages=2,
        device="sim",
        sim_profile="h100",
        max_model_len=4096,
        block_size=block_size,
    )
    return SimStageRunner.from_config(config)


class Reference:
    """The scheduler's side of a random plan stream, and the inputs each step must give."""

    def __init__(self, block_size: int, seed: int) -> None:
        self.block_size, self.rng = block_size, random.Random(seed)
        self.requests: dict[str, tuple[list[int], list[int], int]] = {}
        """id -> (tokens, block ids, computed tokens)"""
        self.next_id = self.next_block = 0

    def _blocks_for(self, blocks: list[int], num_tokens: int) -> list[int]:
        """Appends to `blocks` what `num_tokens` tokens need; returns the new ones."""
        num_new = max(0, -(-num_tokens // self.block_size) - len(blocks))
        new = list(range(self.next_block, self.next_block + num_new))
        self.next_block += num_new + self.rng.randrange(3)  # not contiguous
        blocks += new
        return new

    def plan(self, step_id: int) -> tuple[StepPlan, list[tuple[list[int], list[int], int, int]]]:
        """A plan, and per scheduled request (tokens, blocks, start, num) in batch order."""
        rng, plan, rows = self.rng, StepPlan(step_id), []
        for request_id in list(self.requests):
            if rng.random() < (0.01 if int(request_id[1:]) % 4 == 0 else 0.3):  # some stay
                del self.requests[request_id]
                plan.finished_request_ids.append(request_id)
        for _ in range(rng.randrange(4)):
            request_id, self.next_id = f"r{self.next_id}", self.next_id + 1
            tokens = [rng.randrange(1000) for _ in range(rng.randrange(1, 600))]
            start = rng.randrange(len(tokens)) // self.block_size * self.block_size  # prefix hit
            num = rng.randrange(1, len(tokens) - start + 1)  # a chunk, or the rest
            blocks: list[int] = []
            self._blocks_for(blocks, start + num)
            sampling = SamplingParams()
            plan.new_requests.append(
                NewRequest(request_id, tokens, len(tokens), sampling, list(blocks), start, num)
            )
            rows.append((tokens, blocks, start, num))
            self.requests[request_id] = (tokens, blocks, start + num)
        for request_id, (tokens, blocks, start) in list(self.requests.items()):
            if any(r.request_id == request_id for r in plan.new_requests) or rng.random() < 0.2:
                continue
            new_tokens = []
            if start == len(tokens):  # decodes the token sampled last
                new_tokens = [rng.randrange(1000)]
                tokens += new_tokens
            num = 1 if new_tokens else rng.randrange(1, len(tokens) - start + 1)
            new_blocks = self._blocks_for(blocks, start + num)
            plan.cached_requests.append(CachedRequest(request_id, num, new_blocks, new_tokens))
            rows.append((tokens, blocks, start, num))
            self.requests[request_id] = (tokens, blocks, start + num)
        return plan, rows


def test_runner_inputs_follow_the_block_math_over_a_random_plan_stream():
    block_size = 8
    runner, reference = first_stage(block_size), Reference(block_size, seed=3)
    max_held = 0
    for step_id in range(500):
        plan, rows = reference.plan(step_id)
        batch = runner._apply_plan(plan, None)
        max_held = max(max_held, len(runner.requests))
        if not rows:
            continue
        meta, input_ids = runner._prepare(batch)
        width = max(len(blocks) for _, blocks, _, _ in rows)
        positions = [p for _, _, start, num in rows for p in range(start, start + num)]
        slots = [
            blocks[p // block_size] * block_size + p % block_size
            for _, blocks, start, num in rows
            for p in range(start, start + num)
        ]
        assert meta.positions.tolist() == positions
        assert meta.slot_mapping.tolist() == slots
        assert meta.block_tables.tolist() == [b + [0] * (width - len(b)) for _, b, _, _ in rows]
        assert meta.seq_lens.tolist() == [start + num for _, _, start, num in rows]
        assert meta.query_start_loc.tolist() == np.cumsum([0] + [r[3] for r in rows]).tolist()
        assert input_ids.tolist() == [t for tokens, _, s, n in rows for t in tokens[s : s + n]]
        for state, num in zip(batch.states, batch.num_scheduled, strict=True):
            state.num_computed_tokens += num  # what execute does after the forward
    assert runner.block_tables.table.shape[1] > 64  # a table outgrew the first width
    # dropped requests gave their rows back: the rows follow the requests held, not the
    # hundreds seen (the buffer doubles when over half its rows are held)
    assert runner.block_tables.num_rows <= 4 * max_held < reference.next_id
