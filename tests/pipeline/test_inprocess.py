"""The real scheduler service driving real stage engines of a tiny model, in one process.

What the multi-process suites check in minutes, in seconds: tokens equal to Hugging Face,
sync = async for seeded sampling, stage 0 fed by the last stage in async mode, late
finishes and aborts that free their KV blocks. Harness: tests/pipeline/utils.py.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import redis
import torch

from services.common.sampling import SamplingParams
from services.models.tiny import make_tiny_model
from services.scheduler.peers import PipelinePeers
from services.scheduler.registry import PipelineRegistry
from services.scheduler.request import RequestStatus
from services.scheduler.store import meta_key
from tests.pipeline.utils import InProcessStack, Outcome
from tests.worker.utils import compare_greedy, hf_greedy, make_prompts

NUM_NEW = 24
NUM_LOGPROBS = 3
LOGPROB_ATOL = 1e-4  # fp32; observed differences are ~1e-6
TIE_MARGIN = 1e-4  # a flip to HF's 2nd choice is accepted only below this top-2 margin
STAGES_AND_MODES = [(p, m) for p in (1, 2, 3) for m in ("sync", "async")]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(model_dir, prompts, HF greedy tokens, HF logits per step). Untied embeddings: the
    tied tiny model just repeats the last prompt token, which would hide a wrong input."""
    model_dir = make_tiny_model(
        tmp_path_factory.mktemp("pipeline") / "tiny", tie_word_embeddings=False
    )
    prompts = make_prompts(6, vocab=512, seed=1)
    return (model_dir, prompts, *hf_greedy(model_dir, prompts, NUM_NEW))


def greedy(max_tokens: int = NUM_NEW, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kwargs)


def assert_whole(stack: InProcessStack) -> None:
    """No stage failed (a recovery by recompute would hide it) and every block is free."""
    assert stack.pipeline.errors == []
    assert stack.pipeline.num_sessions == 1
    assert stack.num_free_blocks == stack.num_blocks


def assert_equals_hf(outcome: Outcome, ref_tokens: list[int], ref_logits) -> None:
    """Greedy tokens equal HF's, and the logprobs the client got are HF's log_softmax."""
    matched = compare_greedy(outcome.token_ids, ref_tokens, ref_logits, TIE_MARGIN)
    for step in range(matched):
        ref = ref_logits[step].log_softmax(-1)
        top = ref.topk(NUM_LOGPROBS)
        lp = outcome.logprobs[step]
        assert lp.top_token_ids[0] == outcome.token_ids[step]
        torch.testing.assert_close(
            torch.tensor([lp.token_logprob, *lp.top_logprobs]),
            torch.cat([ref[outcome.token_ids[step]].reshape(1), top.values]),
            atol=LOGPROB_ATOL,
            rtol=0,
        )
    assert matched == len(ref_tokens), f"flipped at a near-tie at token {matched}"


@pytest.mark.parametrize(("num_stages", "scheduling"), STAGES_AND_MODES)
def test_pipeline_greedy_equals_transformers(num_stages, scheduling, model, redis_url):
    """Prompts chunked under a small token budget; two arrive while the others decode."""
    model_dir, prompts, ref_tokens, ref_logits = model

    async def main():
        async with InProcessStack(
            model_dir, num_stages, scheduling, redis_url, max_num_batched_tokens=24
        ) as stack:
            sampling = greedy(logprobs=NUM_LOGPROBS)
            first = [stack.submit(p, sampling)[1] for p in prompts[:4]]
            outcomes = [Outcome() for _ in prompts]
            await stack.collect(first[0], outcomes[0], num_tokens=2)
            late = [stack.submit(p, sampling)[1] for p in prompts[4:]]
            await asyncio.gather(
                *(stack.collect(q, o) for q, o in zip(first + late, outcomes, strict=True))
            )
            return stack, outcomes

    stack, outcomes = asyncio.run(main())
    for outcome, tokens, logits in zip(outcomes, ref_tokens, ref_logits, strict=True):
        assert outcome.finish_reason == "length"
        assert_equals_hf(outcome, tokens, logits)
    assert_whole(stack)


@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_pipeline_sync_and_async_sample_the_same_tokens(num_stages, model, redis_url):
    """Seeded sampling: the same tokens in sync and async mode, and when the requests arrive
    in the opposite order (other batches, other rows)."""
    model_dir, prompts, ref_tokens, _ = model
    sampling = [
        SamplingParams(max_tokens=NUM_NEW, ignore_eos=True, temperature=1.0, seed=1000 + i)
        for i in range(len(prompts))
    ]
    sampling[1].top_k, sampling[2].top_p, sampling[3].repetition_penalty = 20, 0.9, 1.3
    order = list(range(len(prompts)))
    outputs, batches = {}, {}
    for scheduling, arrival in (("sync", order), ("async", order), ("async", order[::-1])):

        async def main(scheduling=scheduling, arrival=arrival):
            async with InProcessStack(
                model_dir, num_stages, scheduling, redis_url, max_num_batched_tokens=24
            ) as stack:
                outcomes = await stack.generate(
                    [prompts[i] for i in arrival],
                    [sampling[i] for i in arrival],
                    [f"p{i}" for i in arrival],
                )
                return stack, dict(zip(arrival, outcomes, strict=True))

        stack, outcomes = asyncio.run(main())
        assert_whole(stack)
        run_name = f"{scheduling}, {'in order' if arrival == order else 'reversed'}"
        outputs[run_name] = [outcomes[i].token_ids for i in order]
        batches[run_name] = [
            [r.request_id for r in (*plan.new_requests, *plan.cached_requests)]
            for plan in stack.pipeline.plans
        ]
    assert outputs["sync, in order"] == outputs["async, in order"]
    assert outputs["sync, in order"] == outputs["async, reversed"]
    assert batches["async, reversed"] != batches["sync, in order"]
    assert all(len(tokens) == NUM_NEW for tokens in outputs["sync, in order"])
    assert outputs["sync, in order"] != ref_tokens, "temperature 1 sampled the greedy tokens"


@pytest.mark.parametrize("num_stages", [2, 3])
def test_pipeline_async_stage0_takes_decode_inputs_from_last_stage(num_stages, model, redis_url):
    model_dir, prompts, ref_tokens, ref_logits = model

    async def main():
        async with InProcessStack(model_dir, num_stages, "async", redis_url) as stack:
            sampling = [greedy(logprobs=NUM_LOGPROBS)] * len(prompts)
            return stack, await stack.generate(prompts, sampling)

    stack, outcomes = asyncio.run(main())
    for outcome, tokens, logits in zip(outcomes, ref_tokens, ref_logits, strict=True):
        assert_equals_hf(outcome, tokens, logits)
    assert_whole(stack)
    # The plans never told stage 0 a sampled token: it can only have come from the last stage.
    cached = [c for plan in stack.pipeline.plans for c in plan.cached_requests]
    assert cached and all(not c.new_token_ids for c in cached)
    # Every sampled token went last → stage 0, in step order; stage 0 received them in order
    # (but for the last steps' tokens, which no later step needed).
    sampled = [list(r.token_ids) for r in stack.pipeline.results if r.token_ids]
    hub = stack.hub
    assert hub.tokens_sent == sampled
    assert hub.tokens_received == hub.tokens_sent[: len(hub.tokens_received)]
    num_decode_inputs = sum(len(o.token_ids) - 1 for o in outcomes)
    assert sum(len(m) for m in hub.tokens_received) >= num_decode_inputs
    # Receives were posted ahead of the steps that take them (gloo sends a message's bytes
    # only once its receive is posted): stage 0's tokens P steps ahead, the later stages'
    # activations for the plans queued behind the one they run (LocalLink checks the order).
    assert hub.most_posted["tokens"] >= num_stages - 1
    assert hub.most_posted["hidden"] >= 2


@pytest.mark.parametrize("num_stages", [2, 3])
def test_pipeline_async_plans_a_lone_request_ahead(num_stages, model, redis_url):
    """One request (one micro-batch): its step s + P is planned and sent as soon as step s
    is, not after s reported, so the scheduler's round trip stays off the critical path."""
    model_dir, prompts, ref_tokens, ref_logits = model

    async def main():
        async with InProcessStack(model_dir, num_stages, "async", redis_url) as stack:
            return stack, await stack.generate(prompts[:1], [greedy(logprobs=NUM_LOGPROBS)])

    stack, (outcome,) = asyncio.run(main())
    assert_equals_hf(outcome, ref_tokens[0], ref_logits[0])
    assert_whole(stack)
    # The prefill (step 0) and the first decode (step P) went out together, before step 0
    # reported; later the plan of s + P goes out as soon as s - P reported (how that races
    # with s reporting depends on the machine, so only the first pair is checked).
    events = stack.pipeline.events
    assert events[:2] == [("plan", 0), ("plan", num_stages)], events[:6]


def test_pipeline_sync_sends_tokens_in_the_plan(model, redis_url):
    """The contrast: in sync mode the scheduler carries each input token, nothing goes
    last → first."""
    model_dir, prompts, _, _ = model

    async def main():
        async with InProcessStack(model_dir, 2, "sync", redis_url) as stack:
            return stack, await stack.generate(prompts[:2], [greedy(max_tokens=4)] * 2)

    stack, _ = asyncio.run(main())
    assert stack.hub.tokens_sent == []
    cached = [c for plan in stack.pipeline.plans for c in plan.cached_requests]
    assert cached and all(len(c.new_token_ids) == 1 for c in cached)


def test_pipeline_sync_stage0_waits_for_the_plan_of_every_step_of_a_lone_request(model, redis_url):
    """Stage 0's plan wait is the control plane's share of its bubble: in sync mode a lone
    request's next plan is made only once its token came back, after stage 0 was done with
    the step before, so stage 0 waited for each plan (and for nothing else)."""
    model_dir, prompts, _, _ = model

    async def main():
        async with InProcessStack(model_dir, 2, "sync", redis_url) as stack:
            return stack, await stack.generate(prompts[:1], [greedy(max_tokens=6)])

    stack, _ = asyncio.run(main())
    first, *later = stack.pipeline.engines[0].timeline.records
    assert len(later) == 5
    assert all(r.plan_wait_ns > 0 for r in later), [r.plan_wait_ns for r in later]
    for prev, cur in zip([first, *later], later, strict=False):
        assert cur.plan_wait_ns <= cur.start_ns - prev.end_ns
    busy, bubble, plan_wait = stack.pipeline.engines[0].timeline.fractions()
    assert 0.0 < plan_wait <= bubble + 1e-9 and busy + bubble == pytest.approx(1.0)


@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_pipeline_async_late_finish_discards_the_extra_token(num_stages, model, redis_url):
    """Request "stop" ends at its first token (a stop token id). One request per step, one
    per micro-batch: the first dispatch round plans its decode step before that token is
    back, so the decode is computed and its token must be dropped. The workers forget it
    with the next plan (the others run on after it)."""
    model_dir, prompts, ref_tokens, _ = model
    stop_token = ref_tokens[0][0]

    async def main():
        async with InProcessStack(
            model_dir, num_stages, "async", redis_url, max_num_seqs=1
        ) as stack:
            queues = [stack.submit(prompts[0], greedy(stop_token_ids=[stop_token]), "stop")[1]]
            for i in range(1, max(num_stages, 2)):
                queues.append(stack.submit(prompts[i], greedy(max_tokens=8), f"other-{i}")[1])
            outcomes = await asyncio.gather(*(stack.collect(q) for q in queues))
            return stack, outcomes, stack.store.read_tokens("stop"), stack.store.read_state("stop")

    stack, (stopped, *others), logged_tokens, logged_state = asyncio.run(main())
    assert stopped == Outcome([stop_token], [None], "stop")
    for i, outcome in enumerate(others, start=1):
        assert outcome.token_ids == ref_tokens[i][:8]
    stop_step = next(r.step_id for r in stack.pipeline.results if "stop" in r.request_ids)
    extra = [
        r.step_id
        for r in stack.pipeline.results
        if r.step_id > stop_step and "stop" in r.request_ids
    ]
    assert extra == [stop_step + num_stages], "the late decode step was not computed"
    assert logged_tokens == [stop_token]  # the Redis token log
    assert logged_state is RequestStatus.FINISHED_STOPPED
    assert all("stop" not in runner.requests for runner in stack.runners)
    assert_whole(stack)


@pytest.mark.parametrize(("num_stages", "scheduling"), [(2, "async"), (3, "async"), (2, "sync")])
def test_pipeline_abort_mid_stream_frees_blocks_and_spares_the_others(
    num_stages, scheduling, model, redis_url
):
    model_dir, prompts, ref_tokens, _ = model

    async def main():
        async with InProcessStack(model_dir, num_stages, scheduling, redis_url) as stack:
            queues = [stack.submit(p, greedy(), f"r{i}")[1] for i, p in enumerate(prompts[:3])]
            aborted = await stack.collect(queues[0], num_tokens=2)
            block_manager = stack.service.scheduler.block_manager
            num_held = len(block_manager.block_table("r0"))
            num_free = block_manager.num_free_blocks
            assert stack.service.abort("r0")
            # Freed at once, not when its in-flight steps come back (prompts share no prefix).
            assert num_held > 0
            assert block_manager.num_free_blocks == num_free + num_held
            outcomes = await asyncio.gather(
                stack.collect(queues[0], aborted), *(stack.collect(q) for q in queues[1:])
            )
            return stack, outcomes, stack.store.read_tokens("r0"), stack.store.read_state("r0")

    stack, (aborted, *others), logged_tokens, logged_state = asyncio.run(main())
    assert aborted.finish_reason == "abort"
    assert 2 <= len(aborted.token_ids) < NUM_NEW
    assert aborted.token_ids == ref_tokens[0][: len(aborted.token_ids)]
    assert logged_tokens == aborted.token_ids  # late tokens of r0 never reached Redis
    assert logged_state is RequestStatus.FINISHED_ABORTED
    for i, outcome in enumerate(others, start=1):
        assert outcome.token_ids == ref_tokens[i]
        assert outcome.finish_reason == "length"
    assert all("r0" not in runner.requests for runner in stack.runners)
    assert_whole(stack)


def test_an_abort_behind_a_write_in_flight_ends_the_stream_after_the_written_tokens(
    model, redis_url, monkeypatch
):
    """The service writes a step's tokens in a thread while it plans the next. An abort
    that comes while that write is held up waits for it: the client gets the written
    tokens, then the abort, nothing skipped or repeated, and the store holds what the
    client got, the abort last. The others are served as HF."""
    model_dir, prompts, ref_tokens, _ = model
    armed, gate, holding = threading.Event(), threading.Event(), threading.Event()

    async def main():
        async with InProcessStack(model_dir, 2, "async", redis_url) as stack:
            apply = stack.store.apply

            def held_apply(updates):  # the real write, once the test lets it go
                is_r0 = any(u.request_id == "r0" for u in updates)
                if is_r0 and armed.is_set() and not gate.is_set():
                    holding.set()
                    gate.wait(timeout=30)
                return apply(updates)

            monkeypatch.setattr(stack.store, "apply", held_apply)
            queues = [stack.submit(p, greedy(), f"r{i}")[1] for i, p in enumerate(prompts[:2])]
            aborted = await stack.collect(queues[0], num_tokens=1)
            armed.set()
            while not holding.is_set():  # the next write of r0's tokens is held up
                await asyncio.sleep(0.005)
            assert stack.service.abort("r0")
            while not queues[0].empty():  # tokens written before the held write was armed
                more = len(aborted.token_ids) + 1
                aborted = await stack.collect(queues[0], aborted, num_tokens=more)
            assert aborted.finish_reason is None  # not before the tokens being written
            gate.set()
            outcomes = await asyncio.gather(
                stack.collect(queues[0], aborted), stack.collect(queues[1])
            )
            return stack, outcomes, stack.store.read_tokens("r0"), stack.store.read_state("r0")

    stack, (aborted, other), logged_tokens, logged_state = asyncio.run(main())
    assert aborted.finish_reason == "abort"
    assert 1 < len(aborted.token_ids) < NUM_NEW
    assert aborted.token_ids == ref_tokens[0][: len(aborted.token_ids)]
    assert logged_tokens == aborted.token_ids
    assert logged_state is RequestStatus.FINISHED_ABORTED
    assert other.token_ids == ref_tokens[1] and other.finish_reason == "length"
    assert_whole(stack)


def adopt_elsewhere(stack: InProcessStack, request_ids: list[str]) -> None:
    """What another pipeline's adoption does to these requests in Redis (registry.py): their
    owner is that pipeline now, so this one's writes to them are refused (MOVED)."""
    client = redis.Redis.from_url(stack.redis_url)
    for request_id in request_ids:
        client.hset(meta_key(request_id), "owner", "p-adopter")


async def let_go(stack: InProcessStack) -> None:
    """One pass of the peers task's letting go (services/scheduler/peers.py)."""
    await PipelinePeers(stack.service, registry=None, address="")._let_go()


async def read_moved(stack: InProcessStack, deltas: asyncio.Queue, outcome: Outcome) -> Outcome:
    """Reads `deltas` to the one that names the new owner; the tokens before it are the
    store's (none of the refused ones)."""
    while True:
        delta = await stack._next(deltas)
        if delta.owner_pipeline_id is not None:
            assert not delta.token_ids and delta.finish_reason is None
            outcome.last_delta = delta
            return outcome
        assert delta.offset == len(outcome.token_ids), "a delta skips or repeats tokens"
        outcome.token_ids.extend(delta.token_ids)


def test_a_request_adopted_elsewhere_that_finished_here_still_ends_its_stream(model, redis_url):
    """A pipeline judged lost while only stalled steps on: its writes are refused and their
    tokens never streamed. A request that finishes here before the peers task lets go has
    left the scheduler, yet its stream must end naming the new owner (left open, it hung to
    its deadline: tests/scaleout's stalled pipeline)."""
    model_dir, prompts, ref_tokens, _ = model

    async def main():
        async with InProcessStack(model_dir, 2, "async", redis_url) as stack:
            _, deltas = stack.submit(prompts[0], greedy(), "r0")
            seen = await stack.collect(deltas, num_tokens=2)
            adopt_elsewhere(stack, ["r0"])
            while "r0" in stack.service.scheduler.requests:  # it finishes here, unwritten
                await asyncio.sleep(0.01)
            await let_go(stack)
            return stack, await read_moved(stack, deltas, seen), stack.store.read_tokens("r0")

    stack, outcome, logged = asyncio.run(main())
    assert outcome.last_delta.owner_pipeline_id == "p-adopter"
    assert outcome.token_ids == logged == ref_tokens[0][: len(logged)]
    assert len(logged) < NUM_NEW
    assert_whole(stack)


def test_one_refused_write_lets_go_of_every_request_adopted_even_the_waiting(model, redis_url):
    """An adoption takes all of a pipeline's unfinished requests at once. The first refused
    write lets go of every one the adopter owns, also one still waiting here, which writes
    nothing to be refused: both streams end naming the adopter, and nothing runs here."""
    model_dir, prompts, _, _ = model
    refused = threading.Event()

    async def main():
        async with InProcessStack(model_dir, 1, "async", redis_url, max_num_seqs=1) as stack:
            apply = stack.store.apply

            def noted_apply(updates):
                moved = apply(updates)
                if moved:
                    refused.set()
                return moved

            stack.store.apply = noted_apply
            _, running = stack.submit(prompts[0], greedy(max_tokens=200), "r0")
            _, waiting = stack.submit(prompts[1], greedy(), "r1")
            seen = await stack.collect(running, num_tokens=2)
            adopt_elsewhere(stack, ["r0", "r1"])
            while not refused.is_set():
                await asyncio.sleep(0.005)
            await let_go(stack)
            outcomes = (
                await read_moved(stack, running, seen),
                await read_moved(stack, waiting, Outcome()),
            )
            return stack, outcomes

    stack, (running, waiting) = asyncio.run(main())
    assert running.last_delta.owner_pipeline_id == waiting.last_delta.owner_pipeline_id
    assert waiting.token_ids == []
    assert stack.service.scheduler.requests == {}
    assert_whole(stack)


def test_a_refused_write_wakes_the_peers_task_to_let_go(model, redis_url):
    """The peers task lets go as soon as a write is refused, not at its next tick: with
    announcements a minute apart, the adopted request's stream still ends naming the
    adopter (the pipeline stepped it, thrown away, until the tick)."""
    model_dir, prompts, _, _ = model

    async def main():
        options = {"announce_ttl_s": 180.0}  # ticks 60 s apart
        async with InProcessStack(model_dir, 1, "async", redis_url, **options) as stack:
            registry = PipelineRegistry(stack.redis_url, "")
            peers = PipelinePeers(stack.service, registry, "127.0.0.1:1")
            task = asyncio.create_task(peers.run())
            try:
                _, running = stack.submit(prompts[0], greedy(max_tokens=200), "r0")
                seen = await stack.collect(running, num_tokens=2)
                adopt_elsewhere(stack, ["r0"])
                moved = await asyncio.wait_for(read_moved(stack, running, seen), 30)
            finally:
                task.cancel()
            return stack, moved

    stack, moved = asyncio.run(main())
    assert moved.last_delta.owner_pipeline_id == "p-adopter"
    assert stack.service.scheduler.requests == {}
    assert_whole(stack)


@pytest.mark.parametrize("num_stages,failing_stage", [(1, 0), (2, 1), (2, 0)])
def test_a_request_that_breaks_a_stage_is_failed_alone_and_the_rest_is_served(
    model, redis_url, monkeypatch, num_stages, failing_stage
):
    """A stage raises whenever the poison request is in its step: after the first failure
    every request of that step is a suspect and runs alone; the poison one fails alone and
    is failed with the stage's message, everyone else gets exactly HF's tokens."""
    model_dir, prompts, ref_tokens, ref_logits = model

    async def main():
        async with InProcessStack(model_dir, num_stages, "async", redis_url) as stack:
            runner = stack.runners[failing_stage]
            execute = runner.execute

            def poisoned(plan, **kwargs):
                ids = {r.request_id for r in (*plan.new_requests, *plan.cached_requests)}
                if "poison" in ids:
                    raise RuntimeError("index 60000 is out of range (a poison request)")
                return execute(plan, **kwargs)

            monkeypatch.setattr(runner, "execute", poisoned)
            ids = ["a", "poison", "b"]
            queues = [stack.submit(p, greedy(), i)[1] for p, i in zip(prompts, ids, strict=False)]
            outcomes = [Outcome() for _ in queues]
            for queue, outcome in zip(queues, outcomes, strict=True):
                while outcome.finish_reason is None:
                    delta = await asyncio.wait_for(queue.get(), 60)
                    assert delta.offset == len(outcome.token_ids)
                    outcome.token_ids += delta.token_ids
                    outcome.finish_reason = delta.finish_reason
                    outcome.logprobs.append(delta.error)
            assert outcomes[1].finish_reason == "error" and not outcomes[1].token_ids
            assert "a poison request" in outcomes[1].logprobs[-1]
            for i in (0, 2):
                assert outcomes[i].finish_reason == "length"
                assert compare_greedy(
                    outcomes[i].token_ids, ref_tokens[i], ref_logits[i], TIE_MARGIN
                )
            # one failure with everyone, one with the poison request alone; nothing else (a
            # broken session answers its later plans with its first error again)
            assert len(set(stack.pipeline.errors)) == 2 and stack.pipeline.num_sessions == 3
            assert stack.service.scheduler.num_poisoned == 1
            status = stack.store.read_state("poison")
            assert status is RequestStatus.FAILED
            await asyncio.sleep(0)  # the flush of the last step
            assert stack.num_free_blocks == stack.num_blocks

    asyncio.run(main())


def test_an_unexpected_error_ends_the_loop_visibly(model, redis_url, monkeypatch):
    """A bug in planning must not leave a SERVING scheduler whose loop is dead: loop_done()
    returns the exception (serve() then exits 1 for the supervisor to restart it)."""
    model_dir, prompts, _, _ = model

    async def main():
        async with InProcessStack(model_dir, 1, "async", redis_url) as stack:

            def broken(*_proposals):
                raise RuntimeError("a bug in schedule()")

            monkeypatch.setattr(stack.service.scheduler, "schedule", broken)
            stack.submit(prompts[0], greedy())
            error = await asyncio.wait_for(stack.service.loop_done(), 30)
            assert isinstance(error, RuntimeError) and "a bug" in str(error)

    asyncio.run(main())


def test_pipeline_stops_on_any_eos_id_of_generation_config(model, redis_url, tmp_path):
    """Llama 3 Instruct lists several EOS ids in generation_config.json: the workers read
    them with the model, the scheduler stops a request on whichever comes first."""
    import json
    import shutil

    model_dir, prompts, ref_tokens, _ = model
    target = tmp_path / "several-eos"
    shutil.copytree(model_dir, target)
    # For each of two prompts, a token its greedy output first produces after position 0.
    stops = [next(i for i in range(1, NUM_NEW) if t[i] not in t[:i]) for t in ref_tokens[:2]]
    eos_ids = [ref_tokens[0][stops[0]], ref_tokens[1][stops[1]]]
    generation = json.loads((target / "generation_config.json").read_text())
    generation["eos_token_id"] = eos_ids
    (target / "generation_config.json").write_text(json.dumps(generation))

    async def main():
        async with InProcessStack(target, 2, "async", redis_url) as stack:
            sampling = SamplingParams(max_tokens=NUM_NEW)
            return await stack.generate(prompts[:2], [sampling, sampling])

    outcomes = asyncio.run(main())
    for outcome, tokens in zip(outcomes, ref_tokens[:2], strict=True):
        end = next(i for i, t in enumerate(tokens) if t in eos_ids) + 1
        assert outcome.token_ids == tokens[:end] and outcome.finish_reason == "stop"
    assert len(outcomes[0].token_ids) <= stops[0] + 1 < NUM_NEW
