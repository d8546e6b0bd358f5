"""Weight updates on a live pipeline (SmolLM2): from files and from a trainer process, at
P = 1 and 2, sync and async; greedy output equals HF on the new weights each time."""

from __future__ import annotations

import grpc
import pytest

from services.client.rl import EngineControl
from services.common.proto.conveyor.v1 import scheduler_pb2
from tests.integration.utils import ProcessStack
from tests.integration.weights_utils import assert_matches

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "stages,scheduling", [(1, "sync"), (1, "async"), (2, "sync"), (2, "async")]
)
def test_update_weights_from_files_then_trainer_matches_hf(
    smollm2_dir, weights, stages, scheduling
):
    stack = ProcessStack(smollm2_dir, stages, scheduling).start()
    try:
        with EngineControl(stack.address) as engine:
            assert_matches(stack, weights.prompts, weights.original, 0)

            update = engine.update_from_files(str(weights.trained_dir))
            # every tensor once; a tied embedding again on the last stage when it is not the first
            num_tensors = 272 + (stages > 1)
            assert update.weight_version == 1 and update.num_tensors == num_tensors
            assert_matches(stack, weights.prompts, weights.trained, 1)

            assert engine.init_weight_transfer() == 1 + stages
            update = engine.push_weights(weights.pushed_state)
            assert update.weight_version == 2 and update.num_tensors == num_tensors
            assert_matches(stack, weights.prompts, weights.pushed, 2)

            stats = engine.stats()
            assert stats.serving and not stats.paused
            assert (stats.weight_version, stats.num_weight_updates) == (2, 2)
    finally:
        stack.stop()


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


def test_update_weights_layers_reload_only_those_layers(stack, engine, weights, smollm2_dir):
    """The trained directory differs from the original in layers 3 and 27 only: reloading
    just those gives the trained model; reloading them from the original dir undoes it."""
    update = engine.update_from_files(str(weights.trained_dir), layers=[3, 27])
    assert update.num_tensors == 2 * 9
    assert_matches(stack, weights.prompts, weights.trained, update.weight_version)
    update = engine.update_from_files(str(smollm2_dir), layers=[27, 3])
    assert_matches(stack, weights.prompts, weights.original, update.weight_version)


def test_update_weights_bad_input_changes_nothing(stack, engine, weights, tmp_path):
    before = engine.stats().weight_version
    for kwargs in (
        dict(path=str(tmp_path / "missing")),
        dict(path=str(weights.trained_dir), layers=[30]),
        dict(path=str(tmp_path)),  # a directory without weights
    ):
        with pytest.raises(grpc.RpcError) as err:
            engine.update_from_files(**kwargs)
        assert err.value.code() in (
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.FAILED_PRECONDITION,
        ), err.value.details()
        assert "stage" in err.value.details()
    stats = engine.stats()
    assert stats.weight_version == before and not stats.paused and stats.serving
    assert_matches(
        stack, weights.prompts[:1], (weights.original[0][:1], weights.original[1][:1]), before
    )


def test_update_weights_from_trainer_without_group_is_refused(stack):
    request = scheduler_pb2.UpdateWeightsRequest()  # no path: from the trainer
    with pytest.raises(grpc.RpcError) as err:
        list(stack.stub.UpdateWeights(request, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "InitWeightTransfer" in err.value.details()
    assert not stack.stats().paused
