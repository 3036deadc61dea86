"""Router (ingress) deployment: the request core with its HTTP and gRPC adapters, on Serve.

(No `from __future__ import annotations` here: FastAPI reads the routes' annotations at runtime.)
It only composes: the core (`deployments.core.request_core`) with the media dispatcher of the app's mode, the
LLM deployment's handle and the VideoDecoder's, the OpenAI adapter behind the FastAPI routes, the gRPC adapter
behind the methods named as the RPCs (Serve's gRPC proxy calls those), and the Ray metrics.
"""

import contextlib
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
from deployments.core.readiness import Readiness
from deployments.core.request_core import RequestCore
from deployments.serve.drain import DrainWatch
from deployments.serve.metrics import RouterMetrics
from deployments.serve.video_decoder import ServeVideoClient

# no /docs, /redoc or /openapi.json: they answered without the API key (issue 59); docs/api.md is the reference
app = FastAPI(title="mmserve", docs_url=None, redoc_url=None, openapi_url=None)
SERVICER_FUNCTIONS = (
    "protos.mmserve.v1.vlm_pb2_grpc.add_VLMServiceServicer_to_server",
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
)


def grpc_options(port: int = 9000) -> gRPCOptions:
    """Serve's gRPC proxy options for this app (`serve.start(grpc_options=...)`)."""
    return gRPCOptions(port=port, grpc_servicer_functions=list(SERVICER_FUNCTIONS), enable_reflection=True)


def app_unavailable(app_name: str, timeout_s: float = 5.0) -> str | None:
    """What a Router replica of the running app `app_name` says (`Router.unavailable`): None once it
    is ready. TimeoutError while no Router replica answers within `timeout_s`."""
    response = serve.get_app_handle(app_name).unavailable.remote()
    try:
        return response.result(timeout_s=timeout_s)
    except TimeoutError:
        response.cancel()  # no call left queued for a Router replica still starting
        raise


def wait_until_ready(app_name: str, timeout_s: float = 600.0) -> None:
    """Block until the app answers ready, as `/health` would. `serve.run` returns once every replica
    is up; the routers' first calls to the LLM and Encoder replicas may still be on their way."""
    import time

    deadline = time.monotonic() + timeout_s
    reason = "no Router replica answered"
    while time.monotonic() < deadline:
        with contextlib.suppress(TimeoutError):
            if (reason := app_unavailable(app_name)) is None:
                return
        time.sleep(0.1)
    raise TimeoutError(f"application {app_name} not ready after {timeout_s:g}s: {reason}")


def media_dispatcher(args: AppArgs, encoder: DeploymentHandle | None) -> MediaDispatcher:
    """The app's mode: the LLM replicas encode (colocated), a standalone encoder, or the Encoder deployment."""
    if args.colocated:
        return ColocatedDispatcher()
    if args.grpc.encoder_address:
        return ExternalEncoderDispatcher(args.grpc.encoder_address, args.grpc.token, args.grpc.tls_ca)
    return EncoderPoolDispatcher(encoder, args.await_embeddings_in_router, args.routing.affinity and encoder is not None)


def readiness(encoder: DeploymentHandle | None, llm: DeploymentHandle) -> Readiness:
    """The backends the app must have a replica of (loaded and warm: their `ready()` answered)
    before it answers ready: the LLM, and the Encoder deployment when the app has one. Colocated,
    the LLM replicas encode (and warm their own encoder up); a standalone encoder
    (`grpc.encoder_address`) is a service of its own with its own health checks, not waited for:
    text-only requests need none, and an image request while it is down gets 503 UNAVAILABLE."""
    return Readiness({"LLM": llm.ready.remote, **({"Encoder": encoder.ready.remote} if encoder is not None else {})})


@dataclass(frozen=True)
class ServeLLMClient:
    """The core's `LLMClient` over the LLM deployment's handle."""

    handle: DeploymentHandle

    def generate(self, pending: PendingRequest) -> TokenStream:
        # a LoRA adapter is Serve's multiplexed model: replicas that hold it are preferred (`LLMDeployment`)
        model_id = {"multiplexed_model_id": pending.lora.name} if pending.lora is not None else {}
        return self.handle.options(stream=True, **model_id).generate.remote(pending)


@serve.deployment
@serve.ingress(app)
class Router:
    def __init__(self, encoder: DeploymentHandle | None, llm: DeploymentHandle, args: AppArgs,
                 video: DeploymentHandle | None = None):
        args = args.on_node()
        self.metrics = RouterMetrics()
        self.drain = DrainWatch(serve.get_replica_context().app_name)
        self.core = RequestCore.from_checkpoint(args, media_dispatcher(args, encoder), ServeLLMClient(llm),
                                                self.metrics, self._draining,
                                                ServeVideoClient(video) if video is not None else None,
                                                readiness(encoder, llm))
        self.core.warm_up()
        self.core.readiness.start()  # (the constructor runs on the replica's event loop; else the first request)
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
    async def unavailable(self) -> str | None:
        """Why this replica takes no new requests (not ready yet, draining), or None: what `/health`
        answers, for callers without HTTP (`mmserve serve` waits for None before it says ready)."""
        return self.core.unavailable()

    def failover_stats(self) -> dict:
        """This replica's failover counters (resubmits, resumed streams, tokens they carried)."""
        return self.metrics.failover_stats()

    def routing_stats(self) -> dict[str, int]:
        """This replica's affinity routing decisions, "deployment/outcome" -> requests."""
        from mmserve.routing.affinity import DECISIONS

        return {f"{deployment}/{outcome}": n for (deployment, outcome), n in DECISIONS.items()}

    def check_health(self) -> None:
        """Serve's liveness probe (a blocked event loop fails it by timing out): the tokenizer answers."""
        self.core.check_health()
