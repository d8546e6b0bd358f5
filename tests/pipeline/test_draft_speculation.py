"""Draft-model speculative decoding through the real scheduler service, stage engines and a
draft worker served over gRPC on loopback (services/worker/draft_server.py).

What a user relies on: greedy tokens identical with and without the draft model, sync and
async; the target as its own draft has (nearly) every proposal accepted; a draft model that
knows nothing (random weights) changes nothing either; a draft worker that is down, loses
its state, or has another vocabulary never fails or stalls a request; a bad config is
refused with a message. Design: docs/speculative-decoding.md.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from services.common.errors import ConfigError
from services.common.proto.conveyor.v1 import draft_pb2_grpc
from services.common.redis_server import free_port
from services.common.serving import GrpcServer
from services.models.tiny import make_tiny_model
from services.scheduler.config import SchedulerConfig
from services.scheduler.speculative import SpeculativeConfig
from services.worker.draft import Drafter
from services.worker.draft_server import DraftWorkerServicer
from tests.pipeline.test_speculative import NUM_NEW, TIE_MARGIN, greedy, repeating_prompts
from tests.pipeline.utils import InProcessStack
from tests.worker.utils import compare_greedy, hf_greedy, make_runners

K = 4


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("draft") / "target", tie_word_embeddings=False)


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    """A draft with the target's vocabulary but other (random) weights."""
    return make_tiny_model(
        tmp_path_factory.mktemp("draft") / "other", num_layers=1, tie_word_embeddings=False, seed=7
    )


class ForgetfulDrafter(Drafter):
    """Loses every request's state before every other call, like a draft worker that
    restarted (the scheduler must send those requests again whole)."""

    num_calls = 0

    def propose(self, sequences, finished_ids):
        self.num_calls += 1
        if self.num_calls % 2 == 0:
            for request_id in list(self._recent):
                self.free(request_id)
        return super().propose(sequences, finished_ids)


class SlowDrafter(Drafter):
    """Answers after the scheduler's timeout."""

    def propose(self, sequences, finished_ids):
        time.sleep(0.3)
        return super().propose(sequences, finished_ids)


class ShortDrafter(Drafter):
    """A draft model with a context of 24 tokens, shorter than most requests here."""

    def __init__(self, runner, max_model_len):
        super().__init__(runner, 24)


async def _serve_draft(model_dir, drafter_cls=Drafter) -> tuple[GrpcServer, str]:
    port = free_port()
    server = GrpcServer("draft worker", "127.0.0.1", port, ["conveyor.v1.DraftWorker"])
    servicer = DraftWorkerServicer("draft")
    servicer.drafter = drafter_cls(make_runners(model_dir, 1, 16, 64)[0], 256)
    server.add(draft_pb2_grpc.add_DraftWorkerServicer_to_server, servicer)
    await server.start()
    await server.set_serving(True)
    return server, f"127.0.0.1:{port}"


def run(
    target,
    prompts,
    scheduling,
    redis_url,
    draft=None,
    drafter_cls=Drafter,
    down=False,
    timeout_s=5.0,
    num_stages=2,
):
    """(stack, token lists) of every prompt submitted at once on `num_stages` stages; `draft`:
    the draft model's directory (served in this process), or with `down` an address where
    nothing listens."""

    async def main():
        options = {}
        server = None
        if draft is not None:
            if down:
                address = f"127.0.0.1:{free_port()}"
            else:
                server, address = await _serve_draft(draft, drafter_cls)
            spec = SpeculativeConfig(
                model=str(draft),
                method="draft_model",
                num_speculative_tokens=K,
                draft_timeout_s=timeout_s,
            )
            options = {"speculative": spec, "draft_worker": address}
        try:
            async with InProcessStack(
                target, num_stages, scheduling, redis_url, **options
            ) as stack:
                sampling = [greedy()] * len(prompts)
                outcomes = await stack.generate(
                    prompts, sampling, [f"r{i}" for i in range(len(prompts))]
                )
                return stack, [o.token_ids for o in outcomes]
        finally:
            if server is not None:
                await server.stop(grace_s=0)

    stack, tokens = asyncio.run(main())
    assert stack.pipeline.errors == []
    assert stack.num_free_blocks == stack.num_blocks
    return stack, tokens


@pytest.fixture(scope="module")
def prompts():
    return repeating_prompts(4, seed=11)


@pytest.fixture(scope="module")
def plain(target, prompts, redis_url):
    return run(target, prompts, "async", redis_url)[1]


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_target_as_its_own_draft_is_accepted_and_changes_nothing(
    scheduling, target, prompts, plain, redis_url
):
    stack, tokens = run(target, prompts, scheduling, redis_url, draft=target)
    assert tokens == plain
    stats = stack.service.scheduler.spec_stats
    assert stats.num_steps > 0
    assert stats.acceptance_rate > 0.9, stats  # the same model proposes its own argmax
    drafts = stack.service.drafts
    assert drafts.problem is None and drafts.counters.num_failures == 0


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_draft_model_over_3_stages_equals_plain_and_transformers(
    scheduling, target, prompts, plain, redis_url
):
    """The draft model's proposals verified through 3 stages (a middle stage that neither
    embeds nor samples): the same greedy tokens as without speculation, and as HF's."""
    stack, tokens = run(target, prompts, scheduling, redis_url, draft=target, num_stages=3)
    assert tokens == plain
    ref_tokens, ref_logits = hf_greedy(target, prompts, NUM_NEW)
    for ours, ref, logits in zip(tokens, ref_tokens, ref_logits, strict=True):
        assert compare_greedy(ours, ref, logits, TIE_MARGIN) == len(ref)
    stats = stack.service.scheduler.spec_stats
    assert stats.num_steps > 0 and stats.acceptance_rate > 0.9, stats


def test_unrelated_draft_model_changes_nothing(target, other_draft, prompts, plain, redis_url):
    stack, tokens = run(target, prompts, "async", redis_url, draft=other_draft)
    assert tokens == plain
    assert stack.service.scheduler.spec_stats.num_steps > 0


def test_draft_worker_that_loses_its_state_gets_requests_whole(target, prompts, plain, redis_url):
    stack, tokens = run(
        target, prompts, "sync", redis_url, draft=target, drafter_cls=ForgetfulDrafter
    )
    assert tokens == plain
    drafts = stack.service.drafts
    assert drafts.counters.num_resent > 0
    assert stack.service.scheduler.spec_stats.acceptance_rate > 0.9


def test_requests_past_the_draft_models_context_are_not_sent(target, prompts, plain, redis_url):
    stack, tokens = run(target, prompts, "async", redis_url, draft=target, drafter_cls=ShortDrafter)
    assert tokens == plain
    drafts = stack.service.drafts
    assert drafts.counters.num_resent == 0, "requests it cannot hold were sent whole every step"
    assert drafts.counters.num_failures == 0
    assert stack.service.scheduler.spec_stats.num_steps > 0  # the short ones speculate


def test_draft_worker_down_requests_still_finish(target, prompts, plain, redis_url):
    stack, tokens = run(target, prompts, "async", redis_url, draft=target, down=True)
    assert tokens == plain
    drafts = stack.service.drafts
    assert drafts.counters.num_failures > 0 and "UNAVAILABLE" in drafts.problem
    assert stack.service.scheduler.spec_stats.num_steps == 0


def test_draft_worker_too_slow_requests_still_finish(target, prompts, plain, redis_url):
    stack, tokens = run(
        target, prompts, "async", redis_url, draft=target, drafter_cls=SlowDrafter, timeout_s=0.05
    )
    assert tokens == plain
    drafts = stack.service.drafts
    assert drafts.counters.num_failures > 0 and "DEADLINE_EXCEEDED" in drafts.problem


def test_draft_model_with_another_vocabulary_is_refused(
    target, prompts, plain, redis_url, tmp_path
):
    small = make_tiny_model(tmp_path / "small", num_layers=1, vocab_size=640)
    stack, tokens = run(target, prompts, "async", redis_url, draft=small)
    assert tokens == plain
    problem = stack.service.drafts.problem
    assert "vocabulary of 640 tokens" in problem and "512" in problem
    assert stack.service.scheduler.spec_stats.num_steps == 0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"method": "draft_model"}', 'needs "model"'),
        ('{"method": "ngram", "model": "/m"}', '"model" is for method "draft_model"'),
        ('{"method": "eagle"}', "is not one of"),
        ('{"model": "/m", "draft_timeout_s": 0}', "draft_timeout_s=0 is out of range"),
        ('{"model": 5}', "model=5 is not a directory name"),
        ('{"model": ["/m"]}', "model=\\['/m'\\] is not a directory name"),
        ('{"method": "ngram", "model": 0}', "model=0 is not a directory name"),
    ],
)
def test_draft_config_errors_say_what_is_wrong(text, message):
    with pytest.raises(ConfigError, match=message):
        SpeculativeConfig.from_json(text)


def test_draft_config_in_vllm_form_and_scheduler_flags():
    spec = SpeculativeConfig.from_json('{"model": "/m", "num_speculative_tokens": 3}')
    assert spec.uses_draft_model and spec.method == "draft_model" and spec.model == "/m"
    with pytest.raises(ConfigError, match="needs --draft-worker"):
        SchedulerConfig(speculative=spec)
    with pytest.raises(ConfigError, match="--draft-worker is used by"):
        SchedulerConfig(draft_worker="127.0.0.1:1")
    with pytest.raises(ConfigError, match="draft worker address 'draft' must be HOST:PORT"):
        SchedulerConfig(speculative=spec, draft_worker="draft")
    assert SchedulerConfig(speculative=spec, draft_worker="127.0.0.1:1").draft_worker
