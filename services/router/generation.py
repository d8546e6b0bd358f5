"""conveyor.v1.Generation: the public servicer (thin edge over RouterCore)."""

from __future__ import annotations

import logging

from services.common.auth import current_principal
from services.common.errors import InvalidRequest
from services.common.pb import FINISH_TO_PB, logprobs_to_pb, sampling_from_pb
from services.common.proto.conveyor.v1 import generation_pb2, generation_pb2_grpc
from services.common.sampling import SamplingParams
from services.router.core import RouterCore
from services.router.output import OutputDelta
from services.router.request import ChatTurn, GenerateInput, check_model

logger = logging.getLogger(__name__)

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


def chat_from_pb(chat: generation_pb2.Chat) -> list[ChatTurn]:
    return [ChatTurn(role=m.role, content=m.content) for m in chat.messages]


def input_from_pb(msg: generation_pb2.GenerateRequest) -> GenerateInput:
    """The core's view of a GenerateRequest (sampling ranges are checked here)."""
    which = msg.WhichOneof("prompt")
    if which is None:
        raise InvalidRequest("prompt is missing: set exactly one of text, token_ids or chat")
    return GenerateInput(
        sampling=sampling_from_pb(msg.sampling, default_max_tokens=16),
        text=msg.text if which == "text" else None,
        token_ids=list(msg.token_ids.ids) if which == "token_ids" else None,
        chat=chat_from_pb(msg.chat) if which == "chat" else None,
        stop=list(msg.stop),
        include_stop_str_in_output=msg.include_stop_str_in_output,
        priority=msg.priority,
        tenant=msg.tenant,
        request_id=msg.request_id,
        model=msg.model,
    )


def output_to_pb(request_id: str, out: OutputDelta) -> generation_pb2.GenerateResponse:
    msg = generation_pb2.GenerateResponse(
        request_id=request_id,
        text=out.text,
        token_ids=out.token_ids,
        offset=out.offset,
        finish_reason=FINISH_TO_PB[out.finish_reason],
        logprobs=[logprobs_to_pb(lp) for lp in out.logprobs],
        weight_version=out.weight_version,
    )
    if out.usage is not None:
        msg.usage.CopyFrom(
            generation_pb2.Usage(
                prompt_tokens=out.usage.prompt_tokens,
                completion_tokens=out.usage.completion_tokens,
                cached_tokens=out.usage.cached_tokens,
            )
        )
    return msg


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """Generate, Resume, Tokenize and ListModels over one RouterCore."""

    def __init__(self, core: RouterCore):
        self.core = core

    async def Generate(self, request, context):
        prepared = await self.core.prepare(input_from_pb(request), current_principal.get())
        async for out in self.core.generate(prepared):
            yield output_to_pb(prepared.request_id, out)

    async def Resume(self, request, context):
        principal = current_principal.get()
        async for out in self.core.resume(request.request_id, request.offset, principal):
            yield output_to_pb(request.request_id, out)

    async def Tokenize(self, request, context):
        check_model(request.model, self.core.limits)
        which = request.WhichOneof("input")
        if which is None:
            raise InvalidRequest("input is missing: set text or chat")
        req = GenerateInput(
            sampling=SamplingParams(),
            text=request.text if which == "text" else None,
            chat=chat_from_pb(request.chat) if which == "chat" else None,
        )
        token_ids = await self.core.tokenize(req)
        return generation_pb2.TokenizeResponse(
            token_ids=token_ids, max_model_len=self.core.limits.max_model_len
        )

    async def ListModels(self, request, context):
        limits = self.core.limits
        return generation_pb2.ListModelsResponse(
            models=[generation_pb2.ModelInfo(name=limits.name, max_model_len=limits.max_model_len)]
        )
