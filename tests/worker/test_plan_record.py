"""`--record-plans`: the file a stage writes, read back (services/worker/plan_record.py)."""

from __future__ import annotations

import pytest

from services.common.errors import ConfigError
from services.common.proto.conveyor.v1 import worker_pb2
from services.worker.config import WorkerConfig
from services.worker.plan_record import (
    SESSION_START,
    PlanRecorder,
    read_header,
    read_plans,
    runner_config,
)


def _plan(step_id: int, *request_ids: str) -> worker_pb2.StepPlan:
    msg = worker_pb2.StepPlan(step_id=step_id, tokens_from_last_stage=step_id % 2 == 1)
    msg.finished_request_ids.extend(request_ids)
    return msg


def test_a_recording_reads_back_plan_by_plan_with_its_sessions(tmp_path):
    config = WorkerConfig(
        "/models/m",
        stage_index=1,
        num_stages=2,
        dtype="bfloat16",
        num_threads=3,
        quantization="int8",
        quantization_ignore=("o_proj",),
        internal_token="secret",
    )
    path = tmp_path / "stage1.plans"
    recorder = PlanRecorder(path, config)
    recorder.session_started()
    recorder.plan(_plan(1, "a"))
    joined = _plan(2, "b")
    joined.following.append(_plan(3, "c"))
    recorder.plan(joined)  # as the worker does: the outer plan first, then its following
    recorder.plan(joined.following[0])
    recorder.session_started()
    recorder.plan(_plan(7))
    recorder.close()

    header = read_header(path)
    assert "secret" not in path.read_bytes().decode("latin-1")  # no token, no address
    assert header["stage_index"] == 1 and header["dtype"] == "bfloat16"
    rebuilt = runner_config(header)
    assert (rebuilt.num_stages, rebuilt.threads, rebuilt.quantization_ignore) == (
        2,
        3,
        ("o_proj",),
    )
    read = list(read_plans(path))
    assert read[0] is SESSION_START and read[4] is SESSION_START
    plans = [p for p in read if p is not SESSION_START]
    assert [p.step_id for p in plans] == [1, 2, 3, 7]
    assert [list(p.finished_request_ids) for p in plans] == [["a"], ["b"], ["c"], []]
    assert not plans[1].following  # recorded one by one
    assert [p.tokens_from_last_stage for p in plans] == [True, False, True, True]
    assert len(joined.following) == 1  # the worker's message is left as it was


def test_a_recording_cut_short_keeps_the_plans_before_the_cut(tmp_path):
    path = tmp_path / "s.plans"
    recorder = PlanRecorder(path, WorkerConfig("/m"))
    recorder.plan(_plan(1))
    recorder.plan(_plan(2, "r"))
    recorder.close()
    data = path.read_bytes()
    path.write_bytes(data[:-3])  # the worker was killed while writing step 2
    assert [p.step_id for p in read_plans(path)] == [1]


def test_what_is_not_a_recording_is_refused_with_a_clear_error(tmp_path):
    other = tmp_path / "trace.json"
    other.write_text('{"traceEvents": []}')
    with pytest.raises(ConfigError, match="not a plan recording"):
        read_header(other)
    with pytest.raises(ConfigError, match="not a plan recording"):
        list(read_plans(other))
    with pytest.raises(ConfigError, match="cannot write there"):
        PlanRecorder(tmp_path / "no-such-dir" / "s.plans", WorkerConfig("/m"))
