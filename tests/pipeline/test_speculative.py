"""Speculative decoding (n-gram) through the real scheduler service and stage engines.

Checks what a user relies on: greedy tokens identical with and without speculation (and
equal to Hugging Face), in sync and async mode, on 1 to 3 stages; seeded sampling gives
the very same tokens; proposals are actually accepted (the steps are fewer); a request
aborted or preempted with a speculative step in flight leaves everything consistent.
Harness: tests/pipeline/utils.py; design: docs/speculative-decoding.md.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from services.common.proto.conveyor.v1 import scheduler_pb2
from services.common.sampling import SamplingParams
from services.common.stats_cli import format_table, stats_to_dict
from services.models.tiny import make_tiny_model
from services.scheduler.observability import snapshot
from services.scheduler.speculative import SpeculativeConfig
from tests.pipeline.utils import InProcessStack
from tests.worker.utils import compare_greedy, hf_greedy

NUM_NEW = 32
TIE_MARGIN = 1e-4
SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=4)


def repeating_prompts(num: int, seed: int = 3) -> list[list[int]]:
    """Prompts that repeat a random span (what prompt lookup finds), and one that does not."""
    rng = random.Random(seed)
    prompts = []
    for i in range(num):
        span = [rng.randrange(3, 500) for _ in range(rng.randint(4, 10))]
        filler = [rng.randrange(3, 500) for _ in range(rng.randint(0, 6))]
        prompts.append(span + filler + span * (1 + i % 3) if i else filler + span)
    return prompts


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """Untied tiny model (outputs vary) with its prompts and HF's greedy tokens."""
    model_dir = make_tiny_model(tmp_path_factory.mktemp("spec") / "tiny", tie_word_embeddings=False)
    prompts = repeating_prompts(5)
    return (model_dir, prompts, *hf_greedy(model_dir, prompts, NUM_NEW))


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory):
    """The tied tiny model repeats itself: most proposals are accepted, k + 1 per step."""
    return make_tiny_model(tmp_path_factory.mktemp("spec") / "tied")


def greedy(max_tokens: int = NUM_NEW, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kwargs)


def run(model_dir, prompts, sampling, num_stages, scheduling, redis_url, spec, **options):
    """(stack, token lists) of one run of every prompt submitted at once."""

    async def main():
        async with InProcessStack(
            model_dir, num_stages, scheduling, redis_url, speculative=spec, **options
        ) as stack:
            outcomes = await stack.generate(
                prompts, sampling, [f"r{i}" for i in range(len(prompts))]
            )
            return stack, outcomes

    stack, outcomes = asyncio.run(main())
    assert stack.pipeline.errors == []
    assert stack.num_free_blocks == stack.num_blocks
    stack.outcomes = outcomes
    return stack, [o.token_ids for o in outcomes]


def spec_entries(stack):
    return [c for plan in stack.pipeline.plans for c in plan.cached_requests if c.spec_token_ids]


@pytest.mark.parametrize(
    ("num_stages", "scheduling"),
    [(1, "sync"), (1, "async"), (2, "sync"), (2, "async"), (3, "async")],
)
def test_speculative_greedy_equals_plain_and_transformers(num_stages, scheduling, model, redis_url):
    model_dir, prompts, ref_tokens, ref_logits = model
    sampling = [greedy()] * len(prompts)
    stack, tokens = run(model_dir, prompts, sampling, num_stages, scheduling, redis_url, SPEC)
    _, plain = run(model_dir, prompts, sampling, num_stages, scheduling, redis_url, None)
    assert tokens == plain
    for ours, ref, logits in zip(tokens, ref_tokens, ref_logits, strict=True):
        assert compare_greedy(ours, ref, logits, TIE_MARGIN) == len(ref)
    entries = spec_entries(stack)
    assert entries, "nothing was proposed for prompts that repeat themselves"
    stats = stack.service.scheduler.spec_stats
    assert stats.num_steps == len(entries)
    assert stats.num_draft_tokens == sum(len(e.spec_token_ids) for e in entries)


@pytest.mark.parametrize(("num_stages", "scheduling"), [(1, "sync"), (2, "async")])
def test_speculative_accepted_proposals_take_fewer_steps(
    num_stages, scheduling, tied_model, redis_url
):
    """The tied model repeats its last tokens: proposals are accepted, several tokens come
    back per step, and the request needs fewer steps than it has tokens."""
    prompts = repeating_prompts(3, seed=5)
    sampling = [greedy()] * len(prompts)
    stack, tokens = run(tied_model, prompts, sampling, num_stages, scheduling, redis_url, SPEC)
    plain_stack, plain = run(tied_model, prompts, sampling, num_stages, scheduling, redis_url, None)
    assert tokens == plain
    stats = stack.service.scheduler.spec_stats
    assert stats.acceptance_rate > 0.5, stats
    assert stats.mean_accepted_length > 2.0, stats
    reports = [r for r in stack.pipeline.results if r.token_ids]
    plain_reports = [r for r in plain_stack.pipeline.results if r.token_ids]
    assert len(reports) < len(plain_reports)
    assert max(len(r.token_ids) for r in reports) > len(prompts), "no step yielded k + 1 tokens"
    # Each client saw its own counts (the last delta's), and they add up to the totals.
    deltas = [o.last_delta for o in stack.outcomes]
    assert sum(d.num_spec_steps for d in deltas) == stats.num_steps
    assert sum(d.num_spec_draft_tokens for d in deltas) == stats.num_draft_tokens
    assert sum(d.num_spec_accepted_tokens for d in deltas) == stats.num_accepted_tokens
    assert all(d.num_spec_accepted_tokens > 0 for d in deltas)
    # The same totals on the Prometheus endpoint and in `conveyor stats`.
    snap = snapshot(stack.service)
    assert (snap.num_spec_steps, snap.num_spec_draft_tokens, snap.num_spec_accepted_tokens) == (
        stats.num_steps,
        stats.num_draft_tokens,
        stats.num_accepted_tokens,
    )
    msg = scheduler_pb2.SchedulerStats(
        speculative_config=SPEC.to_json(),
        num_spec_steps=stats.num_steps,
        num_spec_draft_tokens=stats.num_draft_tokens,
        num_spec_accepted_tokens=stats.num_accepted_tokens,
        spec_acceptance_rate=stats.acceptance_rate,
        spec_mean_accepted_length=stats.mean_accepted_length,
    )
    table = format_table(stats_to_dict(msg, top=0))
    assert f"{stats.acceptance_rate:.1%} of {stats.num_draft_tokens} proposed" in table


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_speculative_seeded_sampling_is_the_plain_sampling(scheduling, model, redis_url):
    """Row i of a speculative step is sampled as position i would be without speculation
    (same seed stream, penalties over the proposed tokens before it): identical tokens."""
    model_dir, prompts, _, _ = model
    sampling = [
        SamplingParams(max_tokens=NUM_NEW, ignore_eos=True, temperature=0.8, seed=77 + i)
        for i in range(len(prompts))
    ]
    sampling[1].top_k, sampling[2].top_p, sampling[3].repetition_penalty = 20, 0.9, 1.3
    sampling[4].min_tokens = 5
    _, tokens = run(model_dir, prompts, sampling, 2, scheduling, redis_url, SPEC)
    _, again = run(model_dir, prompts, sampling, 2, scheduling, redis_url, SPEC)
    _, plain = run(model_dir, prompts, sampling, 2, "sync", redis_url, None)
    assert tokens == again == plain


def test_speculative_stops_inside_an_accepted_run(tied_model, redis_url):
    """max_tokens (and max_model_len) are never overrun by accepted proposals."""
    prompts = repeating_prompts(3, seed=5)
    sampling = [greedy(max_tokens=n) for n in (1, 5, 7)]
    stack, tokens = run(tied_model, prompts, sampling, 1, "sync", redis_url, SPEC)
    _, plain = run(tied_model, prompts, sampling, 1, "sync", redis_url, None)
    assert tokens == plain
    assert [len(t) for t in tokens] == [1, 5, 7]


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_speculative_abort_with_a_speculative_step_in_flight(scheduling, tied_model, redis_url):
    """The abort lands right after a plan carrying r0's proposals went to the stages: the
    step's tokens for r0 are dropped, its blocks freed, the other request is unaffected."""
    prompts = repeating_prompts(2, seed=5)
    sampling = [greedy()] * 2
    _, plain = run(tied_model, prompts, sampling, 2, scheduling, redis_url, None)

    async def main():
        async with InProcessStack(tied_model, 2, scheduling, redis_url, speculative=SPEC) as stack:
            send, aborted_at = stack.pipeline.send, []

            async def send_then_abort(plan_bytes: bytes) -> None:
                await send(plan_bytes)
                plan = stack.pipeline.plans[-1]
                has_spec = any(
                    c.request_id == "r0" and c.spec_token_ids for c in plan.cached_requests
                )
                if has_spec and not aborted_at and len(stack.pipeline.plans) > 3:
                    aborted_at.append(plan.step_id)
                    assert stack.service.abort("r0")

            stack.pipeline.send = send_then_abort
            outcomes = await stack.generate(prompts, sampling, ["r0", "r1"])
            return stack, outcomes, aborted_at

    stack, (aborted, other), aborted_at = asyncio.run(main())
    assert aborted_at, "no speculative step of r0 was in flight to abort"
    assert aborted.finish_reason == "abort"
    assert aborted.token_ids == plain[0][: len(aborted.token_ids)]
    assert len(aborted.token_ids) < NUM_NEW
    assert other.token_ids == plain[1]
    assert stack.pipeline.errors == []
    assert stack.num_free_blocks == stack.num_blocks
    # The report of the aborted step still listed r0's tokens; none reached the client.
    (report,) = [r for r in stack.pipeline.results if r.step_id == aborted_at[0]]
    assert "r0" in report.request_ids


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_speculative_under_preemption_keeps_the_tokens(scheduling, model, redis_url):
    """A KV pool too small for every request: requests are preempted (with their proposed
    slots) and recomputed, and the tokens are still those of plain decoding."""
    model_dir, prompts, ref_tokens, _ = model
    sampling = [greedy()] * len(prompts)
    options = dict(num_blocks=8, block_size=8, max_model_len=64)
    stack, tokens = run(model_dir, prompts, sampling, 2, scheduling, redis_url, SPEC, **options)
    assert stack.service.scheduler.num_preemptions > 0
    assert stack.service.scheduler.spec_stats.num_steps > 0
    assert tokens == ref_tokens
