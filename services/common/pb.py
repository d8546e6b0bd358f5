"""Conversions between the internal dataclasses and their protobuf messages.

Proto messages stop at the edge (STYLE.md habit 4): servicers call these and hand plain
dataclasses to the core.
"""

from __future__ import annotations

from services.common.proto.conveyor.v1 import common_pb2, worker_pb2
from services.common.sampling import SamplingParams
from services.common.step import CachedRequest, NewRequest, StepPlan, StepResult, TokenLogprobs


def sampling_to_pb(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        max_tokens=params.max_tokens,
        min_tokens=params.min_tokens,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    return msg


FINISH_TO_PB = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
    "error": common_pb2.FINISH_REASON_ERROR,
}
"""Finish reason (`stop`, `length`, `abort`, `error`, None while running) → FinishReason."""
FINISH_FROM_PB = {code: reason for reason, code in FINISH_TO_PB.items()}


def sampling_from_pb(
    msg: common_pb2.SamplingParams, default_max_tokens: int | None = None
) -> SamplingParams:
    """Builds validated params; raises InvalidRequest naming a bad field.

    Proto3 cannot tell an unset double from 0: top_p and repetition_penalty of 0 (invalid
    values) mean "unset", i.e. 1; with `default_max_tokens`, so does max_tokens of 0.
    """
    return SamplingParams(
        temperature=msg.temperature,
        top_p=msg.top_p or 1.0,
        top_k=msg.top_k,
        min_p=msg.min_p,
        repetition_penalty=msg.repetition_penalty or 1.0,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        seed=msg.seed if msg.HasField("seed") else None,
        max_tokens=msg.max_tokens or default_max_tokens or 0,
        min_tokens=msg.min_tokens,
        stop_token_ids=list(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
    )


def plan_to_pb(plan: StepPlan, tokens_from_last_stage: bool) -> worker_pb2.StepPlan:
    """The plan's message: plain decodes (`is_plain_decode`) go in the decode columns."""
    num_input_tokens = 0 if tokens_from_last_stage else 1
    cached, decode_ids, decode_token_ids = [], [], []
    for r in plan.cached_requests:
        if is_plain_decode(r, num_input_tokens):
            decode_ids.append(r.request_id)
            decode_token_ids += r.new_token_ids
        else:
            cached.append(
                worker_pb2.CachedRequest(
                    request_id=r.request_id,
                    num_scheduled_tokens=r.num_scheduled_tokens,
                    new_block_ids=r.new_block_ids,
                    new_token_ids=r.new_token_ids,
                    spec_token_ids=r.spec_token_ids,
                    num_computed_tokens=r.num_computed_tokens,
                )
            )
    return worker_pb2.StepPlan(
        step_id=plan.step_id,
        new_requests=[
            worker_pb2.NewRequest(
                request_id=r.request_id,
                token_ids=r.token_ids,
                num_prompt_tokens=r.num_prompt_tokens,
                sampling=sampling_to_pb(r.sampling),
                block_ids=r.block_ids,
                num_computed_tokens=r.num_computed_tokens,
                num_scheduled_tokens=r.num_scheduled_tokens,
            )
            for r in plan.new_requests
        ],
        cached_requests=cached,
        finished_request_ids=plan.finished_request_ids,
        tokens_from_last_stage=tokens_from_last_stage,
        decode_request_ids=decode_ids,
        decode_token_ids=decode_token_ids,
    )


def is_plain_decode(request: CachedRequest, num_input_tokens: int) -> bool:
    """Whether `request` fits the plan's decode columns: one token, `num_input_tokens` input
    tokens with it (1 in sync mode, 0 in async), nothing else."""
    return (
        request.num_scheduled_tokens == 1
        and len(request.new_token_ids) == num_input_tokens
        and not request.new_block_ids
        and not request.spec_token_ids
        and request.num_computed_tokens is None
    )


def _ints(values) -> list[int]:
    """A repeated scalar field as a list (a slice: twice as fast as list() on upb, and
    most of a plan's fields are empty)."""
    return values[:] if values else []


def plan_from_pb(msg: worker_pb2.StepPlan) -> StepPlan:
    """The plan of a message; raises ValueError when its decode columns disagree."""
    decode_ids = msg.decode_request_ids[:]
    cached = [
        CachedRequest(
            request_id=r.request_id,
            num_scheduled_tokens=r.num_scheduled_tokens,
            new_block_ids=_ints(r.new_block_ids),
            new_token_ids=_ints(r.new_token_ids),
            spec_token_ids=_ints(r.spec_token_ids),
            num_computed_tokens=(
                r.num_computed_tokens if r.HasField("num_computed_tokens") else None
            ),
        )
        for r in msg.cached_requests
    ]
    if msg.decode_token_ids:
        if len(msg.decode_token_ids) != len(decode_ids):
            raise ValueError(
                f"{len(msg.decode_token_ids)} decode_token_ids for {len(decode_ids)} "
                "decode_request_ids (one each, or none in async mode)"
            )
        tokens = msg.decode_token_ids
        cached += [CachedRequest(i, 1, [], [t]) for i, t in zip(decode_ids, tokens, strict=True)]
    else:
        cached += [CachedRequest(i, 1, [], []) for i in decode_ids]
    return StepPlan(
        step_id=msg.step_id,
        new_requests=[
            NewRequest(
                request_id=r.request_id,
                token_ids=_ints(r.token_ids),
                num_prompt_tokens=r.num_prompt_tokens,
                sampling=sampling_from_pb(r.sampling),
                block_ids=_ints(r.block_ids),
                num_computed_tokens=r.num_computed_tokens,
                num_scheduled_tokens=r.num_scheduled_tokens,
            )
            for r in msg.new_requests
        ],
        cached_requests=cached,
        finished_request_ids=msg.finished_request_ids[:],
    )


def logprobs_to_pb(lp: TokenLogprobs) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(
        token_logprob=lp.token_logprob,
        top_token_ids=lp.top_token_ids,
        top_logprobs=lp.top_logprobs,
    )


def logprobs_from_pb(msg: common_pb2.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(
        token_logprob=msg.token_logprob,
        top_token_ids=list(msg.top_token_ids),
        top_logprobs=list(msg.top_logprobs),
    )


def result_from_report(msg: worker_pb2.StepReport) -> StepResult:
    """The sampled tokens of a last-stage report."""
    logprobs = None
    if msg.logprobs_index:
        logprobs = [None] * len(msg.request_ids)
        for index, lp in zip(msg.logprobs_index, msg.logprobs, strict=True):
            logprobs[index] = logprobs_from_pb(lp)
    return StepResult(
        step_id=msg.step_id,
        request_ids=list(msg.request_ids),
        token_ids=list(msg.token_ids),
        logprobs=logprobs,
    )
