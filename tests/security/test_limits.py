"""The pure checks under the services: sampling ranges, the shared limits, the scheduler's
own validation of a Submit, the limit flags' validation, the JSON depth count."""

from __future__ import annotations

import math

import pytest

from services.common.errors import ConfigError, InvalidRequest, PromptTooLong
from services.common.limits import RequestLimits, check_request, check_request_id, clip
from services.common.sampling import SamplingParams
from services.router.config import RouterConfig
from services.router.kserve_tensors import json_depth
from services.scheduler.config import SchedulerConfig
from services.scheduler.validation import validate_submission


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({"temperature": math.nan}, "temperature=nan is not a finite number"),
        ({"repetition_penalty": math.nan}, "repetition_penalty=nan is not a finite number"),
        ({"frequency_penalty": -math.inf}, "frequency_penalty=-inf is not a finite number"),
        ({"top_p": 5e-324}, "top_p=5e-324 is subnormal"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty=1e-300 is out of range"),
        ({"top_k": 2**31}, f"top_k={2**31} is out of range"),
        ({"seed": -1}, "seed=-1 is out of range"),
        ({"seed": 2**64}, f"seed={2**64} is out of range"),
        ({"max_tokens": 2**32}, f"max_tokens={2**32} is out of range"),
        ({"stop_token_ids": [1, -2]}, "stop_token_ids[1]=-2 is out of range"),
        ({"stop_token_ids": [2**33]}, f"stop_token_ids[0]={2**33} is out of range"),
        ({"min_tokens": -1}, "min_tokens=-1 is out of range"),
        ({"min_tokens": 17}, "min_tokens=17 is out of range: must be in [0, max_tokens=16]"),
    ],
)
def test_sampling_params_refuse_values_no_stage_can_use(fields, expected):
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(**fields)
    assert expected in str(info.value)


def test_tiny_temperatures_mean_greedy():
    assert SamplingParams(temperature=1e-300).is_greedy
    assert SamplingParams(temperature=9.9e-6).is_greedy
    assert not SamplingParams(temperature=1e-5).is_greedy
    assert SamplingParams(seed=2**64 - 1, top_k=-1).top_k == 0  # vLLM's -1: disabled


def test_request_ids_end_at_the_end():
    check_request_id("a-Z_0.9:x" * 14 + "ab")  # 128 characters
    for bad in ("x\n", "", "a" * 129, "a b", "é", "{req:x}"):
        with pytest.raises(InvalidRequest, match="request_id="):
            check_request_id(bad)


def test_check_request_names_each_limit():
    limits = RequestLimits(max_stop_token_ids=2, max_logprobs=5, max_tenant_chars=3)
    cases = [
        (SamplingParams(stop_token_ids=[1, 2, 3]), 0, "", "at most 2 (--max-stop-token-ids)"),
        (SamplingParams(stop_token_ids=[1, 99]), 0, "", "stop_token_ids[1]=99 is out of range"),
        (SamplingParams(logprobs=6), 0, "", "must be in [0, 5] (--max-logprobs)"),
        (SamplingParams(), 1001, "", "must be in [-1000, 1000] (--max-abs-priority)"),
        (SamplingParams(), 0, "abcd", "tenant has 4 characters, too long: at most 3"),
    ]
    for sampling, priority, tenant, expected in cases:
        with pytest.raises(InvalidRequest) as info:
            check_request(sampling, priority, tenant, limits, vocab_size=50)
        assert expected in str(info.value)
    with pytest.raises(InvalidRequest, match=r"logprobs=8 .* \[0, 7\]"):  # capped by the vocab
        check_request(SamplingParams(logprobs=8), 0, "", RequestLimits(), vocab_size=7)


def test_clip_quotes_a_few_dozen_characters():
    assert clip("x" * 10) == repr("x" * 10)
    assert len(clip("x" * 1_000_000)) < 100


def test_clip_counts_what_the_client_sent_not_its_quoted_form():
    assert clip("é\n" * 100).endswith("(200 characters)")
    assert clip(b"\xff" * 100).endswith("(100 bytes)")


def _resolved(**limits) -> SchedulerConfig:
    return SchedulerConfig(
        num_blocks=64, block_size=16, max_model_len=256, max_num_batched_tokens=512, **limits
    )


def test_scheduler_validates_a_submission_itself():
    config = _resolved(max_stop_token_ids=4)
    ok = dict(
        request_id="r-1",
        prompt_token_ids=[1, 2, 3],
        sampling=SamplingParams(max_tokens=4),
        priority=0,
        tenant="",
        weight=0.0,
    )
    validate_submission(config, 512, **ok)
    cases = [
        ({"prompt_token_ids": [1, 512]}, InvalidRequest, "prompt_token_ids[1]=512"),
        ({"prompt_token_ids": []}, InvalidRequest, "prompt_token_ids is empty"),
        ({"prompt_token_ids": [1] * 256}, PromptTooLong, "max_model_len=256"),
        ({"sampling": SamplingParams(stop_token_ids=[1] * 5)}, InvalidRequest, "at most 4"),
        (
            {"prompt_token_ids": [1] * 250, "sampling": SamplingParams(min_tokens=7)},
            InvalidRequest,
            "min_tokens=7 after a prompt of 250 tokens exceeds max_model_len=256",
        ),
        ({"tenant": "t" * 129}, InvalidRequest, "--max-tenant-chars"),
        ({"priority": -(2**31)}, InvalidRequest, "--max-abs-priority"),
        ({"weight": math.nan}, InvalidRequest, "weight=nan"),
        ({"weight": -1.0}, InvalidRequest, "weight=-1.0"),
    ]
    for change, error, expected in cases:
        with pytest.raises(error) as info:
            validate_submission(config, 512, **{**ok, **change})
        assert expected in str(info.value)
    # the client's id is checked where the scheduler names the request (its namespace)
    from services.scheduler.ownership import request_key

    with pytest.raises(InvalidRequest, match="request_id="):
        request_key("anonymous", "r\n")


@pytest.mark.parametrize(
    "field, value", [("max_message_bytes", 100), ("max_tenant_chars", 0), ("max_logprobs", -1)]
)
def test_scheduler_limit_flags_are_validated(field, value):
    with pytest.raises(ConfigError, match=field):
        SchedulerConfig(**{field: value})


@pytest.mark.parametrize(
    "field, value, flag",
    [
        ("max_prompt_bytes", 0, "--max-prompt-bytes"),
        ("max_json_depth", 1000, "--max-json-depth"),
        ("max_concurrent_rpcs", 0, "--max-concurrent-rpcs"),
        ("max_message_bytes", 10, "--max-message-bytes"),
    ],
)
def test_router_limit_flags_are_validated(tmp_path, field, value, flag):
    with pytest.raises(ConfigError, match=flag):
        RouterConfig(scheduler_address="s:1", model_dir=str(tmp_path), **{field: value})


def test_json_depth_skips_strings():
    assert json_depth('{"a": [1, {"b": "[[[["}]}') == 3
    assert json_depth("[" * 500 + "]" * 500) == 500
    assert json_depth('{"s": "a\\\\", "t": [[]]}') == 3  # an escaped backslash ends the string
    assert json_depth("7") == 0
