"""The public gRPC API (`mmserve.v1.VLMService`) as methods of the Router deployment.

Ray Serve's gRPC proxy (port 9000 by default) deserializes each request with the generated
code and calls the method of the application's ingress deployment that has the RPC's name,
passing the protobuf request and a `RayServegRPCContext` as `grpc_context`; the same
deployment keeps serving the FastAPI routes over HTTP. The proxy picks the application by the
"application" metadata (optional while only one application runs). It also routes the
standard `grpc.health.v1.Health` service here (`Check`, `Watch`) when registered in
`grpc_servicer_functions` (see `grpc_options`).

Errors: the status code and details are set on `grpc_context` and an empty response (carrying
only `request_id`) is returned, so that the trailing metadata with the request id reaches the
client too: the proxy drops trailing metadata of a method that raises. A stream that fails
therefore ends with one such empty response, then the error status.

Message size: the proxy accepts requests up to RAY_SERVE_GRPC_MAX_MESSAGE_SIZE (env var read
by the proxy, default 2 GiB - 1); the app then rejects requests larger than
`limits.max_request_bytes` (64 MiB by default) with INVALID_ARGUMENT. Clients need no option
to send large images (gRPC clients do not cap what they send).
"""

from __future__ import annotations

import hmac
import logging
import uuid
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2
from ray.serve.config import gRPCOptions

from deployments import grpc_api
from deployments.generation import Generation, client_request_id
from protos.mmserve.v1 import vlm_pb2

logger = logging.getLogger("ray.serve")
VLM_SERVICE = vlm_pb2.DESCRIPTOR.services_by_name["VLMService"].full_name
SERVICER_FUNCTIONS = (
    "protos.mmserve.v1.vlm_pb2_grpc.add_VLMServiceServicer_to_server",
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
)


def grpc_options(port: int = 9000, request_timeout_s: float | None = None,
                 enable_reflection: bool = True) -> gRPCOptions:
    """Serve's gRPC proxy options for this app (`serve.start(grpc_options=...)`)."""
    return gRPCOptions(
        port=port, grpc_servicer_functions=list(SERVICER_FUNCTIONS),
        request_timeout_s=request_timeout_s, enable_reflection=enable_reflection,
    )


def _request_ids(request: vlm_pb2.GenerateRequest) -> tuple[str, str]:
    """(our id: the engine's and encoders' key, the id shown to the client: its own if it sent one)."""
    request_id = uuid.uuid4().hex
    return request_id, client_request_id(request.request_id, request_id)


class GrpcIngress:
    """VLMService + grpc.health.v1 for the Router; uses its `admitted`, `submit`, `settings`, `_record`, `_reject`."""

    async def Generate(self, request: vlm_pb2.GenerateRequest, grpc_context) -> vlm_pb2.GenerateResponse:
        request_id, shown_id = _request_ids(request)
        try:
            gen = await self._grpc_submit(request, request_id, grpc_context)
            response = await grpc_api.completion(gen, shown_id)
        except Exception as e:
            return self._grpc_failed(e, request_id, shown_id, grpc_context)
        self._record(gen)
        grpc_context.set_trailing_metadata([(grpc_api.REQUEST_ID_KEY, shown_id)])
        return response

    async def GenerateStream(self, request: vlm_pb2.GenerateRequest,
                             grpc_context) -> AsyncIterator[vlm_pb2.GenerateResponse]:
        request_id, shown_id = _request_ids(request)
        grpc_context.set_trailing_metadata([(grpc_api.REQUEST_ID_KEY, shown_id)])
        try:
            gen = await self._grpc_submit(request, request_id, grpc_context)
            async for response in grpc_api.stream(gen, shown_id):
                yield response
        except Exception as e:
            yield self._grpc_failed(e, request_id, shown_id, grpc_context)
            return
        self._record(gen)

    async def Check(self, request: health_pb2.HealthCheckRequest, grpc_context) -> health_pb2.HealthCheckResponse:
        """grpc.health.v1: SERVING for "" and the VLM service once this replica is up, NOT_SERVING
        while it drains before shutdown."""
        if request.service not in ("", VLM_SERVICE):
            grpc_context.set_code(grpc.StatusCode.NOT_FOUND)
            grpc_context.set_details(f"unknown service {request.service!r}")
            return health_pb2.HealthCheckResponse()
        self.drain.start()
        status = health_pb2.HealthCheckResponse.NOT_SERVING if self.drain.draining else health_pb2.HealthCheckResponse.SERVING
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest,
                    grpc_context) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        """The current status once (the proxy answers UNAVAILABLE when the replica goes away)."""
        yield await self.Check(request, grpc_context)

    # -- plumbing ---------------------------------------------------------------------------------
    async def _grpc_submit(self, request: vlm_pb2.GenerateRequest, request_id: str, grpc_context) -> Generation:
        settings = self.settings
        if settings.api_key:
            given = dict(grpc_context.invocation_metadata()).get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {settings.api_key}".encode()):
                raise grpc_api.Unauthenticated("invalid or missing API key (metadata 'authorization: Bearer KEY')")
        with self.admitted():
            grpc_api.check_request(request, settings.limits, settings.served_model_name)
            messages = await grpc_api.messages(request, settings.limits)
            return await self.submit(messages, grpc_api.options(request), request_id)

    def _grpc_failed(self, e: Exception, request_id: str, shown_id: str, grpc_context) -> vlm_pb2.GenerateResponse:
        code, message = grpc_api.status_for(e)
        if code is grpc.StatusCode.UNAUTHENTICATED:
            logger.info("request %s: %s", request_id, message)
        else:
            self._reject(e, request_id)  # counts and logs it
        grpc_context.set_code(code)
        grpc_context.set_details(message)
        grpc_context.set_trailing_metadata([(grpc_api.REQUEST_ID_KEY, shown_id)])
        return vlm_pb2.GenerateResponse(request_id=shown_id)
