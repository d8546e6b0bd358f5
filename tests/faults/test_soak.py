"""A soak: 1,000 requests through the router of a 2-stage async stack, with random cancels,
reused ids, stop strings and mixed lengths. Nobody receives a stale or a foreign token, KV
and Redis end empty, and no service's resident memory keeps growing."""

from __future__ import annotations

import concurrent.futures
import random
from pathlib import Path

import grpc
import pytest

from services.common.proto.conveyor.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.faults.utils import redis_leftovers, wait_until

pytestmark = pytest.mark.slow

NUM_REQUESTS = 1000
NUM_PROMPTS = 40
MAX_TOKENS = 48
CONCURRENCY = 32
WARM_UP = 200


def _prompt(i: int) -> list[int]:
    return [(i * 97 + j * 13) % 300 + 1 for j in range(3 + (i * 11) % 60)]


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise LookupError(pid)


class Client:
    """Streams through the router; remembers every id it used."""

    def __init__(self, router: str):
        self.channel = grpc.insecure_channel(router)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)

    def run(self, prompt: list[int], max_tokens: int, request_id: str, stop: str | None,
            cancel_after: int | None) -> dict:  # fmt: skip
        request = generation_pb2.GenerateRequest(
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            request_id=request_id,
            stop=[stop] if stop else [],
        )
        request.token_ids.ids.extend(prompt)
        out = {"tokens": [], "text": "", "finish": None, "error": None, "offsets_ok": True}
        call = self.stub.Generate(request, timeout=120)
        try:
            for n, msg in enumerate(call):
                out["offsets_ok"] &= msg.offset == len(out["tokens"])
                out["tokens"] += msg.token_ids
                out["text"] += msg.text
                out["finish"] = msg.finish_reason or out["finish"]
                if cancel_after is not None and n + 1 >= cancel_after:
                    call.cancel()
                    break
        except grpc.RpcError as exc:
            out["error"] = exc.code()
        return out


def test_soak_no_stale_or_foreign_token_and_nothing_left_behind(stack, redis_proc):
    client = Client(stack.router)
    reference = [
        client.run(_prompt(i), MAX_TOKENS, f"ref-{i}", None, None) for i in range(NUM_PROMPTS)
    ]
    assert all(r["error"] is None and len(r["tokens"]) == MAX_TOKENS for r in reference)

    rng = random.Random(7)
    plans = []
    for n in range(NUM_REQUESTS):
        i = rng.randrange(NUM_PROMPTS)
        kind = rng.choices(["plain", "cancel", "stop", "reuse"], [60, 15, 15, 10])[0]
        text = reference[i]["text"]
        stop = text[len(text) // 2 : len(text) // 2 + 2] if kind == "stop" and text else None
        plans.append(
            dict(
                i=i,
                max_tokens=MAX_TOKENS if stop else rng.randint(1, MAX_TOKENS),
                # the id of a request a little earlier: finished, or still running (then this
                # one gets ALREADY_EXISTS and the running one must not notice)
                request_id=f"s-{max(0, n - rng.randint(1, 2 * CONCURRENCY))}"
                if kind == "reuse"
                else f"s-{n}",
                stop=stop,
                cancel_after=rng.randint(1, 6) if kind == "cancel" else None,
            )
        )

    pids = {kind: stack.child_pid(kind) for kind in ("router", "scheduler", "worker 0", "worker 1")}
    memory: dict[str, list[int]] = {kind: [] for kind in pids}

    def one(plan: dict) -> dict:
        p = plan
        return client.run(_prompt(p["i"]), p["max_tokens"], p["request_id"], p["stop"],
                          p["cancel_after"])  # fmt: skip

    with concurrent.futures.ThreadPoolExecutor(CONCURRENCY) as pool:
        results = list(pool.map(one, plans[:WARM_UP]))
        for kind, pid in pids.items():
            memory[kind].append(_rss_kib(pid))
        results += list(pool.map(one, plans[WARM_UP:]))
    for kind, pid in pids.items():
        memory[kind].append(_rss_kib(pid))

    reuses_refused = 0
    for plan, result in zip(plans, results, strict=True):
        ref = reference[plan["i"]]
        if result["error"] is grpc.StatusCode.ALREADY_EXISTS:
            assert not result["tokens"], plan
            reuses_refused += 1
            continue
        assert result["error"] is None, (plan, result["error"])
        assert result["offsets_ok"], f"a gap or a duplicate: {plan}"
        assert result["tokens"] == ref["tokens"][: len(result["tokens"])], f"foreign: {plan}"
        if plan["cancel_after"] is None and plan["stop"] is None:
            assert len(result["tokens"]) == plan["max_tokens"], (plan, result["finish"])
            assert result["finish"] == common_pb2.FINISH_REASON_LENGTH
        if plan["stop"]:
            cut = ref["text"].index(plan["stop"])
            assert result["text"] == ref["text"][:cut], plan
            assert result["finish"] == common_pb2.FINISH_REASON_STOP

    stats = stack.wait_idle()
    assert stats.num_free_blocks == stats.num_blocks
    wait_until(lambda: not redis_leftovers(redis_proc.client()), 15)
    print(f"\n{reuses_refused} reused ids were running and got ALREADY_EXISTS")
    print("resident memory after warm-up -> after 1,000 requests (KiB):")
    for kind, (warm, end) in memory.items():
        print(f"  {kind:10} {warm:8d} -> {end:8d}  ({end / warm - 1:+.1%})")
    grown = {kind: end / warm for kind, (warm, end) in memory.items() if end > 1.10 * warm}
    assert not grown, f"resident memory grew more than 10% after warm-up: {grown}"
