"""Pause modes on a live pipeline (SmolLM2, P=2, async), and updates under load: each mode
keeps, finishes or aborts exactly what it says; queued requests survive and run after."""

from __future__ import annotations

import pytest

from services.client.rl import EngineControl
from services.common.proto.conveyor.v1 import common_pb2, scheduler_pb2
from tests.integration.utils import ProcessStack, wait_until
from tests.integration.weights_utils import (
    TIE_MARGIN,
    Stream,
    assert_matches,
    generate,
    hf_greedy,
    load_hf,
)
from tests.worker.utils import compare_greedy

pytestmark = pytest.mark.slow

LONG = 32


@pytest.fixture(scope="module")
def stack(smollm2_dir):
    stack = ProcessStack(smollm2_dir, 2, "async").start()
    yield stack
    stack.stop()


@pytest.fixture
def engine(stack):
    with EngineControl(stack.address) as engine:
        yield engine
        engine.unpause()


def queued(stack, engine, prompt, max_tokens=8) -> Stream:
    """A request submitted while paused: it waits in the queue."""
    num_waiting = engine.stats().num_waiting
    stream = Stream(stack, prompt, max_tokens)
    wait_until(lambda: engine.stats().num_waiting == num_waiting + 1)
    return stream


def test_pause_keep_freezes_running_requests_and_unpause_finishes_them(
    stack, engine, smollm2_prompts
):
    prompt = smollm2_prompts[1]
    alone = generate(stack, prompt, LONG)
    running = Stream(stack, prompt, LONG).wait_first_token()
    state = engine.pause("keep")
    assert state.paused and state.mode == scheduler_pb2.PAUSE_MODE_KEEP
    assert state.num_running == 1
    waiting = queued(stack, engine, smollm2_prompts[2])
    stats = engine.stats()
    assert stats.paused and stats.serving, "paused is not dead: health stays SERVING"
    assert stats.num_running == 1 and stats.num_inflight == 0
    engine.unpause()
    running.join()
    assert running.tokens == alone.tokens, "a kept request continues exactly where it was"
    assert running.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert len(waiting.join().tokens) == 8


def test_pause_wait_finishes_running_requests_and_holds_queued_ones(stack, engine, smollm2_prompts):
    running = Stream(stack, smollm2_prompts[3], LONG).wait_first_token()
    state = engine.pause("wait")  # returns once the running request has finished
    assert state.paused and state.mode == scheduler_pb2.PAUSE_MODE_WAIT
    assert state.num_running == 0
    assert len(running.join().tokens) == LONG
    assert running.finish_reason == common_pb2.FINISH_REASON_LENGTH
    waiting = queued(stack, engine, smollm2_prompts[4])
    assert engine.stats().num_running == 0, "WAIT admits nothing new"
    engine.unpause()
    assert len(waiting.join().tokens) == 8


def test_pause_abort_aborts_running_requests_and_keeps_queued_ones(stack, engine, smollm2_prompts):
    running = Stream(stack, smollm2_prompts[5], LONG).wait_first_token()
    engine.pause("keep")
    waiting = queued(stack, engine, smollm2_prompts[6])
    state = engine.pause("abort")
    assert state.mode == scheduler_pb2.PAUSE_MODE_ABORT
    assert (state.num_aborted, state.num_running, state.num_waiting) == (1, 0, 1)
    running.join()
    assert running.finish_reason == common_pb2.FINISH_REASON_ABORT
    assert "Pause(mode=abort)" in running.error
    assert len(running.tokens) < LONG
    engine.unpause()
    assert len(waiting.join().tokens) == 8
    assert waiting.finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_request_queued_during_update_runs_on_new_weights(stack, engine, weights, smollm2_dir):
    engine.pause("keep")
    waiting = [queued(stack, engine, p, len(weights.trained[0][0])) for p in weights.prompts]
    update = engine.update_from_files(str(weights.trained_dir))
    assert engine.stats().paused, "an update keeps the pause it found"
    engine.unpause()
    ref_tokens, ref_logits = weights.trained
    for stream, ref, logits in zip(waiting, ref_tokens, ref_logits, strict=True):
        compare_greedy(stream.join().tokens, ref, logits, TIE_MARGIN)
        assert set(stream.versions) == {update.weight_version}
    engine.update_from_files(str(smollm2_dir))  # back to the original for the next tests


def test_update_under_load_never_mixes_weights(stack, engine, weights, smollm2_dir):
    """Requests running when the weights change, recomputed (recompute_kept): the tokens of
    the old weights are HF's original greedy, those after are HF's continuation under the new
    weights of prompt + the old tokens; never a token of a step with both."""
    prompts = weights.prompts
    streams = [Stream(stack, p, LONG) for p in prompts]
    for stream in streams:
        stream.wait_first_token()
    update = engine.update_from_files(str(weights.trained_dir), recompute_kept=True)
    for stream in streams:
        stream.join()
    old_model, new_model = load_hf(smollm2_dir), load_hf(weights.trained_dir)
    for prompt, stream in zip(prompts, streams, strict=True):
        assert len(stream.tokens) == LONG
        num_old = stream.versions.count(update.weight_version - 1)
        assert stream.versions == [update.weight_version - 1] * num_old + [
            update.weight_version
        ] * (LONG - num_old)
        assert 0 < num_old < LONG, "the update came while the request ran"
        old_tokens, old_logits = hf_greedy(old_model, [prompt], num_old)
        compare_greedy(stream.tokens[:num_old], old_tokens[0], old_logits[0], TIE_MARGIN)
        new_tokens, new_logits = hf_greedy(
            new_model, [prompt + stream.tokens[:num_old]], LONG - num_old
        )
        compare_greedy(stream.tokens[num_old:], new_tokens[0], new_logits[0], TIE_MARGIN)
    engine.update_from_files(str(smollm2_dir))


def test_restarted_stage_with_old_weights_stops_serving_until_an_update(
    stack, engine, weights, smollm2_dir
):
    """A stage restarted after an update loads --model again: the scheduler steps nothing
    on the mix and says why, until an update of every layer makes the stages agree."""
    update = engine.update_from_files(str(weights.trained_dir))
    stack.kill_worker(1)
    stack.start_worker(1)
    wait_until(lambda: "different weights" in engine.stats().not_serving_reason, 300)
    assert not engine.stats().serving
    update = engine.update_from_files(str(weights.trained_dir))
    wait_until(lambda: engine.stats().serving)
    assert_matches(stack, weights.prompts, weights.trained, update.weight_version)
    engine.update_from_files(str(smollm2_dir))
