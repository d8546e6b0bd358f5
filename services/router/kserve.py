"""inference.GRPCInferenceService (KServe v2 + Triton's ModelStreamInfer), over RouterCore."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from services.common.auth import current_principal
from services.common.errors import ModelNotFound
from services.common.limits import clip
from services.common.proto.inference import grpc_service_pb2 as pb
from services.common.proto.inference import grpc_service_pb2_grpc as pb_grpc
from services.common.serving import message_for
from services.router.core import RouterCore
from services.router.kserve_tensors import (
    INPUT_DATATYPES,
    REQUIRED_INPUTS,
    KServeRequest,
    request_from_pb,
    text_response,
)

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
SERVER_NAME = "conveyor"
SERVER_VERSION = "0.1.0"
_FINAL = "triton_final_response"
_WANTS_EMPTY_FINAL = "triton_enable_empty_final_response"
_DONE = object()  # a stream producer finished
_CONFIG_TYPES = {"BYTES": pb.DataType.TYPE_STRING, "BOOL": pb.DataType.TYPE_BOOL}


def _tensor(name: str, datatype: str) -> pb.ModelMetadataResponse.TensorMetadata:
    return pb.ModelMetadataResponse.TensorMetadata(name=name, datatype=datatype, shape=[1])


class KServeServicer(pb_grpc.GRPCInferenceServiceServicer):
    """The served model as one KServe model (version "1") with Triton's LLM tensors."""

    def __init__(self, core: RouterCore):
        self.core = core

    def _check_model(self, name: str) -> None:
        if name != self.core.limits.name:
            raise ModelNotFound(
                f"model {clip(name)} is not served here: the served model is "
                f"{self.core.limits.name!r}"
            )

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.core.is_ready)

    async def ModelReady(self, request, context):
        is_ours = request.name == self.core.limits.name and request.version in ("", "1")
        return pb.ModelReadyResponse(ready=is_ours and self.core.is_ready)

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=SERVER_VERSION, extensions=[])

    async def ModelMetadata(self, request, context):
        self._check_model(request.name)
        return pb.ModelMetadataResponse(
            name=self.core.limits.name,
            versions=["1"],
            platform="conveyor",
            inputs=[_tensor(name, datatype) for name, datatype in INPUT_DATATYPES.items()],
            outputs=[_tensor("text_output", "BYTES")],
        )

    async def ModelConfig(self, request, context):
        """Triton's configuration of a decoupled LLM model (the tensors of ModelMetadata):
        perf_analyzer and genai-perf read it before they stream."""
        self._check_model(request.name)
        inputs = [
            pb.ModelInput(
                name=name,
                data_type=_CONFIG_TYPES[datatype],
                dims=[1],
                optional=name not in REQUIRED_INPUTS,
            )
            for name, datatype in INPUT_DATATYPES.items()
        ]
        config = pb.ModelConfig(
            name=self.core.limits.name,
            platform="conveyor",
            backend="conveyor",
            max_batch_size=0,  # one prompt per request: the scheduler batches
            input=inputs,
            output=[pb.ModelOutput(name="text_output", data_type=_CONFIG_TYPES["BYTES"], dims=[1])],
            model_transaction_policy=pb.ModelTransactionPolicy(decoupled=True),
        )
        return pb.ModelConfigResponse(config=config)

    async def ModelInfer(self, request, context):
        """The whole text at once; the prompt is prepended unless exclude_input_in_output."""
        self._check_model(request.model_name)
        decoded = request_from_pb(request, self.core.limits)
        prepared = await self.core.prepare(decoded.generate, current_principal.get())
        text, _ = await self.core.collect(prepared)
        if not decoded.exclude_input_in_output:
            text = prepared.prompt_text + text
        return text_response(self.core.limits.name, request.id, text)

    async def ModelStreamInfer(self, request_iterator, context):
        """Runs every request of the stream concurrently; responses carry the request's id.

        At most --max-stream-requests run at once (one more is answered with an error
        response, and the stream goes on); the response queue holds as many, so a client
        that does not read stalls its own requests, never the router's memory."""
        limit = self.core.limits.max_stream_requests
        queue: asyncio.Queue = asyncio.Queue(maxsize=limit)
        tasks: set[asyncio.Task] = set()

        async def read_requests() -> None:
            try:
                async for msg in request_iterator:
                    if len(tasks) >= limit:
                        await queue.put(_refused(msg, limit))
                        continue
                    await queue.put(1)  # counted before this reader's _DONE can be seen
                    task = asyncio.create_task(self._produce(msg, queue))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
            except Exception as exc:  # noqa: BLE001 - e.g. a message that does not parse
                await queue.put(_Failed(exc))
            await queue.put(_DONE)

        reader = asyncio.create_task(read_requests())
        num_active = 1  # the reader, then one per request
        try:
            while num_active:
                item = await queue.get()
                if item is _DONE:
                    num_active -= 1
                elif isinstance(item, int):
                    num_active += item
                elif isinstance(item, _Failed):
                    raise item.error  # the stream ends with the error's status
                else:
                    yield item
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()

    async def _produce(self, msg: pb.ModelInferRequest, queue: asyncio.Queue) -> None:
        try:
            async for response in self._stream_one(msg):
                await queue.put(pb.ModelStreamInferResponse(infer_response=response))
        except Exception as exc:  # noqa: BLE001 - an error ends this request, not the stream
            failed = _mark(pb.ModelInferResponse(model_name=msg.model_name, id=msg.id), True)
            await queue.put(
                pb.ModelStreamInferResponse(
                    error_message=message_for(exc, "router"), infer_response=failed
                )
            )
        finally:
            await queue.put(_DONE)

    async def _stream_one(self, msg: pb.ModelInferRequest):
        self._check_model(msg.model_name)
        decoded: KServeRequest = request_from_pb(msg, self.core.limits)
        prepared = await self.core.prepare(decoded.generate, current_principal.get())
        wants_empty_final = (
            _WANTS_EMPTY_FINAL in msg.parameters and msg.parameters[_WANTS_EMPTY_FINAL].bool_param
        )
        name = self.core.limits.name
        if not decoded.is_stream:  # one response; the prompt is prepended unless excluded
            text, _ = await self.core.collect(prepared)
            prefix = "" if decoded.exclude_input_in_output else prepared.prompt_text
            yield _mark(text_response(name, msg.id, prefix + text), not wants_empty_final)
        else:  # deltas; the prompt comes first only if exclude_input_in_output is false
            prefix = prepared.prompt_text if decoded.exclude_input_in_output is False else ""
            async for out in self.core.generate(prepared):
                is_last = out.finish_reason is not None
                text, prefix = prefix + out.text, ""
                yield _mark(text_response(name, msg.id, text), is_last and not wants_empty_final)
        if wants_empty_final:
            empty = pb.ModelInferResponse(model_name=name, model_version="1", id=msg.id)
            yield _mark(empty, True)


@dataclass(slots=True)
class _Failed:
    """The stream's request messages could not be read: the stream ends with `error`."""

    error: Exception


def _refused(msg: pb.ModelInferRequest, limit: int) -> pb.ModelStreamInferResponse:
    """The answer to one request too many on a stream."""
    failed = _mark(pb.ModelInferResponse(model_name=msg.model_name, id=msg.id), True)
    return pb.ModelStreamInferResponse(
        error_message=f"this stream already runs {limit} requests, the limit "
        "(--max-stream-requests): wait for one to finish, or open another stream",
        infer_response=failed,
    )


def _mark(response: pb.ModelInferResponse, is_final: bool) -> pb.ModelInferResponse:
    response.parameters[_FINAL].bool_param = is_final
    return response
