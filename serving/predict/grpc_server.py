"""The Open Inference Protocol over gRPC: the protocol's ``inference.GRPCInferenceService``,
so the unmodified ``tritonclient.grpc`` (and KServe's clients) work against the platform.

It runs in its own process (``manage.py rungrpc``, started by ``runplatform``) on the same
request script as HTTP: the API key comes in the ``authorization`` metadata
(``Bearer sk-…``), and every inference is a ``serving.predict.call.PredictCall`` (limits,
routing, the result cache, metering). Tensors come as typed ``contents`` or as
``raw_input_contents`` (little-endian, row-major, BYTES as 4-byte lengths and bytes); outputs
go back as ``raw_output_contents``, as Triton sends them. Errors are gRPC statuses:
INVALID_ARGUMENT for a bad tensor (naming it), UNAUTHENTICATED, PERMISSION_DENIED,
NOT_FOUND, RESOURCE_EXHAUSTED for a limit or a full queue, UNAVAILABLE, DEADLINE_EXCEEDED.

The service's messages and stubs are the protocol's ``grpc_service.proto`` compiled, as
they ship in ``tritonclient`` (``tritonclient.grpc.service_pb2``, ``service_pb2_grpc``).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from django.conf import settings
from tritonclient.grpc import service_pb2, service_pb2_grpc

from accounts.grants import KeyGrant
from registry.signatures import Signature
from serving.gateway.auth import authenticate
from serving.gateway.errors import APIError
from serving.gateway.inference_protocol import (
    EXTENSIONS,
    MAX_DIMENSIONS,
    RAW,
    SERVER_NAME,
    BadRequest,
    BadTensor,
    to_raw,
)
from serving.gateway.routing import routing_table
from serving.predict.call import PredictCall, is_ready, model_metadata, predict_model, served_versions

logger = logging.getLogger(__name__)

T = TypeVar("T")
Context = grpc.aio.ServicerContext[Any, Any]

STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}

# Which typed field of InferTensorContents carries each datatype (FP16 travels raw only).
CONTENTS_FIELDS = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}  # fmt: skip


def _metadata(context: Context) -> dict[str, str]:
    return {key.lower(): value for key, value in (context.invocation_metadata() or ()) if isinstance(value, str)}


async def _grant(context: Context) -> KeyGrant:
    return await authenticate(_metadata(context).get("authorization"))


async def _answering(context: Context, work: Callable[[], Awaitable[T]]) -> T:
    """Run ``work``; an APIError ends the RPC with the matching status and its message."""
    try:
        return await work()
    except APIError as exc:
        code = STATUS_CODES.get(exc.status, grpc.StatusCode.INTERNAL)
        await context.abort(code, exc.message)
        raise  # abort raises; this keeps type checkers sure the function never falls through


def input_tensors(request: Any) -> list[dict[Any, Any]]:
    """A ModelInferRequest's inputs as the protocol's JSON tensors (``RAW`` for raw bytes)."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise BadTensor("raw_input_contents", f"{len(raw)} raw tensors for {len(request.inputs)} inputs.")
    tensors: list[dict[Any, Any]] = []
    for index, tensor in enumerate(request.inputs):
        if len(tensor.shape) > MAX_DIMENSIONS:  # before copying the shape (decode_inputs says the same)
            raise BadTensor(tensor.name, f"a shape of {len(tensor.shape)} dimensions; a tensor has at most "
                            f"{MAX_DIMENSIONS}.")  # fmt: skip
        described: dict[Any, Any] = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)}
        if raw:
            described[RAW] = raw[index]
        else:
            field = CONTENTS_FIELDS.get(tensor.datatype)
            if field is None:
                raise BadTensor(tensor.name, f"datatype {tensor.datatype} travels in raw_input_contents only.")
            described["data"] = list(getattr(tensor.contents, field))
        tensors.append(described)
    return tensors


def outputs_of(signature: Signature, request: Any) -> list[str]:
    """The outputs a ModelInferRequest asks for (all, when it names none), each the model's."""
    wanted = [o.name for o in request.outputs] or [spec.name for spec in signature.outputs]
    known = {spec.name for spec in signature.outputs}
    unknown = [name for name in wanted if name not in known]
    if unknown:
        raise BadRequest(f"Output {unknown[0]!r}: the model has no such output.")
    return wanted


class InferenceService(service_pb2_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    async def ServerLive(self, request: Any, context: Context) -> Any:
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Context) -> Any:
        async def ready() -> Any:
            await routing_table()
            return service_pb2.ServerReadyResponse(ready=True)

        return await _answering(context, ready)

    async def ServerMetadata(self, request: Any, context: Context) -> Any:
        return service_pb2.ServerMetadataResponse(
            name=SERVER_NAME, version=settings.PLATFORM_VERSION, extensions=list(EXTENSIONS)
        )

    async def ModelReady(self, request: Any, context: Context) -> Any:
        async def ready() -> Any:
            model = await predict_model(await _grant(context), request.name)
            return service_pb2.ModelReadyResponse(ready=is_ready(served_versions(model, request.version or None)))

        return await _answering(context, ready)

    async def ModelMetadata(self, request: Any, context: Context) -> Any:
        async def metadata() -> Any:
            model = await predict_model(await _grant(context), request.name)
            described = model_metadata(model, served_versions(model, request.version or None))
            tensor = service_pb2.ModelMetadataResponse.TensorMetadata
            return service_pb2.ModelMetadataResponse(
                name=described["name"],
                versions=described["versions"],
                platform=described["platform"],
                inputs=[tensor(**spec) for spec in described["inputs"]],
                outputs=[tensor(**spec) for spec in described["outputs"]],
            )

        return await _answering(context, metadata)

    async def ModelInfer(self, request: Any, context: Context) -> Any:
        call: PredictCall | None = None

        async def infer() -> Any:
            nonlocal call
            call = PredictCall(await _grant(context), uuid.uuid4(), endpoint="grpc-infer")
            await call.prepare(request.model_name, version=request.model_version or None, pin_param="model_version")
            wanted = await call.take_inputs(lambda signature: (input_tensors(request), outputs_of(signature, request)),
                                            size=request.ByteSize())  # fmt: skip
            known = {spec.name: spec for spec in call.signature.outputs}
            outputs = await call.run()
            response = service_pb2.ModelInferResponse(
                model_name=call.model.name, model_version=call.version.version, id=request.id
            )
            for name in wanted:
                array = outputs[name]
                response.outputs.add(name=name, datatype=known[name].datatype, shape=list(array.shape))
                response.raw_output_contents.append(to_raw(array, known[name].datatype))
            context.set_trailing_metadata((("x-cache", call.cache), ("x-model-version", call.version.version)))
            return response

        try:
            return await _answering(context, infer)
        finally:
            if call is not None:
                await call.close(500)  # a no-op once settled; settles one cut short


async def serve(host: str, port: int) -> None:
    """Serve until cancelled (``rungrpc``)."""
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", settings.API_MAX_BODY_BYTES),
        ("grpc.max_send_message_length", settings.API_MAX_BODY_BYTES),
    ])  # fmt: skip
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceService(), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    await server.start()
    logger.info("gRPC inference service on %s:%s", host, bound)
    try:
        await server.wait_for_termination()
    finally:
        await server.stop(grace=5)
