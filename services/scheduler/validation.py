"""What a Submit may carry, checked by the scheduler itself (pure; no grpc, no redis).

The scheduler is a service of its own: anyone who reaches its port can Submit, so it trusts
no caller, not even a router that validated the request already. A prompt token past the
model's embedding rows would fail stage 0 on every step it is planned in (a device assert
on CUDA), and an unbounded list would bloat memory and Redis for the finished-request TTL;
both are refused here, before the request is persisted or reaches a worker.
"""

from __future__ import annotations

from services.common.errors import InvalidRequest, PromptTooLong
from services.common.limits import check_request, check_token_ids, check_weight
from services.common.sampling import SamplingParams
from services.scheduler.config import SchedulerConfig


def validate_submission(
    config: SchedulerConfig,
    vocab_size: int,
    request_id: str,
    prompt_token_ids: list[int],
    sampling: SamplingParams,
    priority: int,
    tenant: str,
    weight: float,
) -> None:
    """Raises InvalidRequest (PromptTooLong for a prompt over the context) naming the first
    field out of bounds.

    Args:
        config: the resolved config (max_model_len and the --max-* limits).
        vocab_size: the model's embedding rows, as the workers report them (Describe).
    """
    # request_id is the namespaced key; the client's part was checked by request_key.
    if not prompt_token_ids:
        raise InvalidRequest(f"request {request_id}: prompt_token_ids is empty")
    if len(prompt_token_ids) >= config.max_model_len:
        raise PromptTooLong(
            f"request {request_id}: prompt of {len(prompt_token_ids)} tokens leaves no room "
            f"to generate under max_model_len={config.max_model_len}"
        )
    if len(prompt_token_ids) + sampling.min_tokens > config.max_model_len:
        # The context would end the request first: refuse what cannot be honoured.
        raise InvalidRequest(
            f"request {request_id}: min_tokens={sampling.min_tokens} after a prompt of "
            f"{len(prompt_token_ids)} tokens exceeds max_model_len={config.max_model_len}"
        )
    check_token_ids("prompt_token_ids", prompt_token_ids, vocab_size)
    # SamplingParams checked its own ranges when it was built; these depend on the model
    # and on the flags.
    check_request(sampling, priority, tenant, config.request_limits, vocab_size)
    check_weight(weight)
