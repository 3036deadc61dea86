"""Router (ingress) deployment: the request core with its HTTP and gRPC adapters, on Serve.

(No `from __future__ import annotations` here: FastAPI reads the routes' annotations at runtime.)
It only composes: the core (`deployments.core.request_core`) with the media dispatcher of the app's mode, the
LLM deployment's handle and the VideoDecoder's, the OpenAI adapter behind the FastAPI routes, the gRPC adapter
behind the methods named as the RPCs (Serve's gRPC proxy calls those), and the Ray metrics.
"""

from dataclasses import dataclass, replace

from fastapi import FastAPI, Request
from fastapi.responses import Response
from ray import serve
from ray.serve.config import gRPCOptions
from ray.serve.handle import DeploymentHandle

from deployments.config import LimitArgs
from deployments.core.request_core import CoreSettings, RequestCore
from deployments.core.dispatch import ColocatedDispatcher, EncoderPoolDispatcher, ExternalEncoderDispatcher, MediaDispatcher
from deployments.serve.drain import DrainWatch
from deployments.core.failover import TokenStream
from deployments.api.grpc_api import GrpcAdapter
from deployments.core.llm_inputs import PendingRequest
from deployments.serve.metrics import RouterMetrics
from deployments.api.openai_api import OpenAIAdapter
from deployments.serve.replica_env import resolve_model_dir, secret
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


@dataclass(frozen=True)
class RouterSettings:
    model_dir: str | None  # as given (None: the tiny model); `on_node()` resolves it where the replica runs
    served_model_name: str
    limits: LimitArgs
    api_key: str | None
    await_embeddings: bool = False  # True: wait for the encoder before calling the LLM (see AppArgs)
    external_encoder: str | None = None  # host:port of a standalone EncoderService, used instead of `encoder`
    encoder_token: str | None = None
    encoder_tls_ca: str | None = None  # PEM file: reach external_encoder over TLS
    llm_retries: int = 2  # resubmissions of one request after its LLM replica was lost (failover)
    max_pending_requests: int = 16  # admitted requests without a first token yet; more: 429
    max_fetching_requests: int = 64  # requests being read or having media fetched; more: 429
    api_key_env: str | None = None  # environment variable holding api_key, read on the replica's node
    encoder_token_env: str | None = None  # likewise for encoder_token
    colocated: bool = False  # no encoder: the LLM replica encodes the media it is handed
    affinity: bool = False  # encoder items and LLM requests routed by AffinityRequestRouter
    prefix_block_size: int = 16  # the engine's KV block size: the unit of prefix affinity
    stream_video: bool = False  # video_url files stream through the pipeline (the LLM replica drives them)
    stream_group_frames: int = 8

    def on_node(self) -> "RouterSettings":
        """These settings with the model directory and secrets resolved on this node."""
        return replace(
            self,
            model_dir=resolve_model_dir(self.model_dir),
            api_key=secret(self.api_key, self.api_key_env, "api_key_env"),
            encoder_token=secret(self.encoder_token, self.encoder_token_env, "grpc.token_env"),
        )

    def core(self) -> CoreSettings:
        return CoreSettings(self.served_model_name, self.limits, self.model_dir, self.api_key, self.llm_retries,
                            self.max_pending_requests, self.max_fetching_requests, self.prefix_block_size,
                            self.stream_video and not self.external_encoder, self.stream_group_frames)

    def dispatcher(self, encoder: DeploymentHandle | None) -> MediaDispatcher:
        if self.colocated:
            return ColocatedDispatcher()
        if self.external_encoder:
            return ExternalEncoderDispatcher(self.external_encoder, self.encoder_token, self.encoder_tls_ca)
        return EncoderPoolDispatcher(encoder, self.await_embeddings, self.affinity)


@dataclass(frozen=True)
class ServeLLMClient:
    """The core's `LLMClient` over the LLM deployment's handle."""

    handle: DeploymentHandle

    def generate(self, pending: PendingRequest) -> TokenStream:
        return self.handle.options(stream=True).generate.remote(pending)


@serve.deployment
@serve.ingress(app)
class Router:
    def __init__(self, encoder: DeploymentHandle | None, llm: DeploymentHandle, settings: RouterSettings,
                 video: DeploymentHandle | None = None):
        settings = settings.on_node()
        self.metrics = RouterMetrics()
        self.drain = DrainWatch(serve.get_replica_context().app_name)
        self.core = RequestCore.from_checkpoint(settings.model_dir, settings.core(), settings.dispatcher(encoder),
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
