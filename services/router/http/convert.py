"""OpenAI requests to the core's `GenerateInput`s, and the core's outputs to OpenAI's pieces
(pure: no HTTP here).

One OpenAI request fans out into one core request per choice: `prompts x n`, choice index
`prompt_index * n + sample_index`, as OpenAI and vLLM number them. With a seed, sample i
runs with seed + i: n samples that differ, and the same n again for the same seed.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from services.common.errors import InvalidRequest, ModelNotFound
from services.common.limits import clip
from services.common.sampling import MAX_SEED, SamplingParams
from services.common.step import TokenLogprobs
from services.router.http import schemas
from services.router.output import OutputDelta
from services.router.request import ChatTurn, GenerateInput, ModelLimits
from services.router.tokenizer import Tokenizer

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default: sampling, unlike conveyor.v1's greedy
CHAT_ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for system messages


def check_model(model: str | None, limits: ModelLimits) -> None:
    """Raises ModelNotFound (404) unless `model` is unset or the served model's name."""
    if model and model != limits.name:
        raise ModelNotFound(
            f"model={clip(model)} does not exist: this server serves {limits.name!r} "
            "(GET /v1/models)"
        )


def check_supported(body: schemas.SamplingFields) -> None:
    """Raises InvalidRequest naming every parameter this server would otherwise ignore."""
    unsupported = body.unsupported_fields()
    best_of = getattr(body, "best_of", None)
    if best_of is not None and best_of != body.n:
        unsupported.append("best_of (other than n)")
    if getattr(body, "echo", False) and getattr(body, "logprobs", None) not in (None, False):
        unsupported.append("echo with logprobs (prompt logprobs)")
    for i, message in enumerate(getattr(body, "messages", ())):  # tool_calls, name, ...
        given = dict(message.model_extra or {}, name=message.name)
        unsupported += [f"messages[{i}].{k}" for k, v in sorted(given.items()) if v is not None]
    if body.stream_options is not None and not body.stream:
        raise InvalidRequest("stream_options is only allowed with stream=true")
    if unsupported:
        raise InvalidRequest(f"unsupported parameter(s): {', '.join(unsupported)}")


def sampling_of(
    body: schemas.SamplingFields, max_tokens: int, logprobs: int | None
) -> SamplingParams:
    """SamplingParams of a request (unset fields take OpenAI's defaults)."""

    def given(value, default):
        return default if value is None else value

    return SamplingParams(
        temperature=given(body.temperature, DEFAULT_TEMPERATURE),
        top_p=given(body.top_p, 1.0),
        top_k=given(body.top_k, 0),
        min_p=given(body.min_p, 0.0),
        repetition_penalty=given(body.repetition_penalty, 1.0),
        presence_penalty=given(body.presence_penalty, 0.0),
        frequency_penalty=given(body.frequency_penalty, 0.0),
        seed=body.seed,
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        stop_token_ids=list(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
    )


def _stop_strings(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _fan_out(base: GenerateInput, n: int) -> list[GenerateInput]:
    """n copies of `base`, sample i seeded with seed + i (wrapping within the seed range)."""
    seed = base.sampling.seed
    return [
        replace(
            base,
            sampling=replace(
                base.sampling, seed=None if seed is None else (seed + index) % (MAX_SEED + 1)
            ),
            stop=list(base.stop),
        )
        for index in range(n)
    ]


def completion_prompts(prompt) -> list[tuple[str | None, list[int] | None]]:
    """(text, token ids) of each prompt: a string, strings, token ids, or lists of ids."""
    if isinstance(prompt, str):
        return [(prompt, None)]
    if not prompt:
        raise InvalidRequest("prompt is empty: give a string, strings or token ids")
    if all(isinstance(p, int) for p in prompt):
        return [(None, list(prompt))]
    return [(p, None) if isinstance(p, str) else (None, list(p)) for p in prompt]


def check_choices(num_prompts: int, n: int, max_choices: int) -> None:
    """Raises InvalidRequest when prompts x n exceed what one request may run at once
    (checked before the choices are built)."""
    if num_prompts * n > max_choices:
        raise InvalidRequest(
            f"the request asks for {num_prompts * n} choices (prompts x n), too many: at most "
            f"{max_choices} (--max-stream-requests)"
        )


def completion_inputs(body: schemas.CompletionRequest, max_choices: int) -> list[GenerateInput]:
    """One input per choice, in choice-index order."""
    check_supported(body)
    prompts = completion_prompts(body.prompt)
    check_choices(len(prompts), body.n, max_choices)
    max_tokens = body.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS
    sampling = sampling_of(body, max_tokens, body.logprobs)
    inputs = []
    for text, token_ids in prompts:
        base = GenerateInput(
            sampling=sampling,
            text=text,
            token_ids=token_ids,
            stop=_stop_strings(body.stop),
            include_stop_str_in_output=body.include_stop_str_in_output,
            priority=body.priority,
            tenant=body.tenant,
        )
        inputs.extend(_fan_out(base, body.n))
    return inputs


def chat_turns(messages: list[schemas.ChatMessage]) -> list[ChatTurn]:
    """The core's chat turns (the core checks roles against the ones it knows)."""
    return [
        ChatTurn(role=CHAT_ROLE_ALIASES.get(m.role, m.role), content=m.text()) for m in messages
    ]


def chat_input(
    body: schemas.ChatCompletionRequest, max_tokens: int, max_choices: int
) -> list[GenerateInput]:
    """One input per choice; `max_tokens` is resolved by the caller (the default is the rest
    of the context, which needs the prompt's length)."""
    check_supported(body)
    check_choices(1, body.n, max_choices)
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs=true")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    base = GenerateInput(
        sampling=sampling_of(body, max_tokens, logprobs),
        chat=chat_turns(body.messages),
        stop=_stop_strings(body.stop),
        include_stop_str_in_output=body.include_stop_str_in_output,
        priority=body.priority,
        tenant=body.tenant,
    )
    return _fan_out(base, body.n)


def requested_max_tokens(body: schemas.ChatCompletionRequest) -> int | None:
    """max_completion_tokens (OpenAI's current name), else max_tokens; None: the rest of the
    context."""
    return body.max_completion_tokens or body.max_tokens


# -- outputs --------------------------------------------------------------------------------


@dataclass(slots=True)
class ChoiceLogprobs:
    """Token strings and log-probabilities of one choice, for either response shape."""

    tokenizer: Tokenizer
    text_offset: int = 0  # where the next token starts in the choice's text (completions)
    entries: list[tuple[int, TokenLogprobs]] = field(default_factory=list)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _tokens(self, out: OutputDelta):
        """(token id, its TokenLogprobs, [(top token id, logprob)]) per output token."""
        # one TokenLogprobs per token when logprobs were asked for
        for token_id, lp in zip(out.token_ids, out.logprobs, strict=False):
            yield token_id, lp, list(zip(lp.top_token_ids, lp.top_logprobs, strict=True))

    def completion(self, out: OutputDelta) -> schemas.CompletionLogprobs:
        result = schemas.CompletionLogprobs()
        for i, (token_id, lp, top) in enumerate(self._tokens(out)):
            text = self.token_text(token_id)
            result.tokens.append(text)
            result.token_logprobs.append(lp.token_logprob)
            # Tokens of one text (byte tokens all read U+FFFD) share a key: the likelier
            # one's logprob stays (the top ones come first), not the last one's.
            alternatives: dict[str, float] = {}
            for top_id, logprob in top:
                alternatives.setdefault(self.token_text(top_id), logprob)
            result.top_logprobs.append(alternatives)
            # Where the token starts in the choice's text: a character cut between tokens
            # counts at the token that completes it (each reads U+FFFD alone).
            result.text_offset.append(self.text_offset)
            self.text_offset += out.text_lengths[i] if i < len(out.text_lengths) else len(text)
        return result

    def chat(self, out: OutputDelta) -> schemas.ChatLogprobs:
        def entry(token_id: int, logprob: float, cls=schemas.TopLogprob, **more):
            raw = self.tokenizer.token_bytes(token_id)
            return cls(token=self.token_text(token_id), logprob=logprob, bytes=list(raw), **more)

        content = [
            entry(
                token_id,
                lp.token_logprob,
                schemas.TokenLogprob,
                top_logprobs=[entry(t, v) for t, v in top],
            )
            for token_id, lp, top in self._tokens(out)
        ]
        return schemas.ChatLogprobs(content=content)


def usage_of(lasts: list[OutputDelta], n: int) -> schemas.UsageInfo:
    """Usage of a whole request from the last delta of each choice: each prompt counts once
    (the first sample of each prompt), every choice's completion tokens count."""
    prompt = sum(out.usage.prompt_tokens for out in lasts[::n])
    cached = sum(out.usage.cached_tokens for out in lasts[::n])
    completion = sum(out.usage.completion_tokens for out in lasts)
    return schemas.UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=schemas.PromptTokensDetails(cached_tokens=cached),
    )
