"""Router (ingress) deployment: the request core with its HTTP and gRPC adapters, on Serve.

(No `from __future__ import annotations` here: FastAPI reads the routes' annotations at runtime.)
It only composes: the core (`deployments.core.request_core`) with the media dispatcher of the app's mode, the
LLM deployment's handle and the VideoDecoder's, the OpenAI adapter behind the FastAPI routes, the gRPC adapter
behind the methods named as the RPCs (Serve's gRPC proxy calls those), and the Ray metrics.
"""

from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import Response
from ray import serve
from ray.serve.config import gRPCOptions
from ray.serve.handle import DeploymentHandle

from deployments.api.grpc_api import GrpcAdapter
from deployments.api.openai_api import OpenAIAdapter
from deployments.config import AppArgs
from deployments.core.dispatch import ColocatedDispatcher, EncoderPoolDispatcher, ExternalEncoderDispatcher, MediaDispatcher
from deployments.core.failover import TokenStream
from deployments.core.llm_inputs import PendingRequest
from deployments.core.request_core import CoreSettings, RequestCore
from deployments.serve.drain import DrainWatch
from deployments.serve.metrics import RouterMetrics
from deployments.serve.video_decoder import ServeVideoClient

app = FastAPI(title="mmserve", docs_url=None, redoc_url=None)
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


def media_dispatcher(args: AppArgs, encoder: DeploymentHandle | None) -> MediaDispatcher:
    """The app's mode: the LLM replicas encode (colocated), a standalone encoder, or the Encoder deployment."""
    if args.colocated:
        return ColocatedDispatcher()
    if args.grpc.encoder_address:
        return ExternalEncoderDispatcher(args.grpc.encoder_address, args.grpc.token, args.grpc.tls_ca)
    return EncoderPoolDispatcher(encoder, args.await_embeddings_in_router, args.routing.affinity and encoder is not None)


@dataclass(frozen=True)
class ServeLLMClient:
    """The core's `LLMClient` over the LLM deployment's handle."""

    handle: DeploymentHandle

    def generate(self, pending: PendingRequest) -> TokenStream:
        return self.handle.options(stream=True).generate.remote(pending)


@serve.deployment
@serve.ingress(app)
class Router:
    def __init__(self, encoder: DeploymentHandle | None, llm: DeploymentHandle, args: AppArgs,
                 video: DeploymentHandle | None = None):
        args = args.on_node()
        self.metrics = RouterMetrics()
        self.drain = DrainWatch(serve.get_replica_context().app_name)
        self.core = RequestCore.from_checkpoint(args.model, CoreSettings.from_args(args), media_dispatcher(args, encoder),
                                                ServeLLMClient(llm), self.metrics, self._draining,
                                                ServeVideoClient(video) if video is not None else None)
        self.http = OpenAIAdapter(self.core)
        self.grpc = GrpcAdapter(self.core)

    def _draining(self) -> bool:
        self.drain.start()  # (needs the replica's event loop: the first request starts the watch)
        return self.drain.draining

    # -- HTTP (OpenAI-compatible) ---------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> Response:
        return self.http.health()

    @app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        return self.http.models(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self.http.chat_completions(request)

    # -- gRPC: mmserve.v1.VLMService and grpc.health.v1.Health ----------------------------------
    async def Generate(self, request, grpc_context):
        return await self.grpc.generate(request, grpc_context)

    async def GenerateStream(self, request, grpc_context):
        async for response in self.grpc.generate_stream(request, grpc_context):
            yield response

    async def Check(self, request, grpc_context):
        return self.grpc.check(request, grpc_context)

    async def Watch(self, request, grpc_context):
        """The current status once (the proxy answers UNAVAILABLE when the replica goes away)."""
        yield self.grpc.check(request, grpc_context)

    # -- operations ------------------------------------------------------------------------------
    def failover_stats(self) -> dict:
        """This replica's failover counters (resubmits, resumed streams, tokens they carried)."""
        return self.metrics.failover_stats()

    def routing_stats(self) -> dict[str, int]:
        """This replica's affinity routing decisions, "deployment/outcome" -> requests."""
        from deployments.core.affinity import DECISIONS

        return {f"{deployment}/{outcome}": n for (deployment, outcome), n in DECISIONS.items()}

    def check_health(self) -> None:
        """Serve's liveness probe (a blocked event loop fails it by timing out): the tokenizer answers."""
        self.core.check_health()
