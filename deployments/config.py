"""Application arguments: validated once here (pydantic), resolved into frozen runtime settings.

A setting a runtime uses is declared once, in its dataclass (`EngineConfig`, `BatchConfig`,
`PoolConfig`, `MediaLimits`, `VideoLimits`, `ResultStore`, `ServerOptions`: `mmserve.settings`):
the sections here take it from there (`runtime_settings`) and make the runtime from it (`build`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from deployments.deployment_args import DeploymentArgs, FrozenArgs, ReplicaRange, build, runtime_settings, serve_has
from deployments.media.allowlist import parse_allowlist_entry
from encoder_service.batching import BatchConfig
from encoder_service.pool import PoolConfig
from encoder_service.rpc.result_store import ResultStore
from encoder_service.rpc.server import ServerOptions
from llm_service.config import EngineConfig
from mmserve.request.prompt_plan import MediaLimits
from mmserve.video.container import VideoLimits


ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"


def is_loopback(host: str) -> bool:
    """Whether `host` (an address, bracketed IPv6 too, or "localhost") is this machine's loopback."""
    import ipaddress

    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


CHARS_PER_TOKEN = 16  # max_prompt_chars' default per token of context: far above any tokenizer's average


class LimitArgs(runtime_settings(MediaLimits, VideoLimits)):
    """Request limits and media access (see `deployments.media.fetch` for the rules)."""

    max_request_bytes: int = Field(
        default=64 * 1024 * 1024, ge=1024, description="request body; also all media URLs of one request together"
    )
    body_timeout_s: float = Field(
        default=30.0, gt=0, description="HTTP: seconds a request's body may take to arrive once the Router reads it "
        "(400 past it; a trickled body would hold a Router's place)",
    )
    max_prompt_chars: int | None = Field(
        default=None, ge=1, description="characters of everything of a request that is tokenized or compiled "
        "(messages with system text and tool results, tool calls' arguments, tool definitions and their schemas, "
        f"response_format's schema), checked before any of it is (413); default: {CHARS_PER_TOKEN} per token of the "
        "served context (max_model_len)",
    )
    check_timeout_s: float = Field(
        default=10.0, gt=0, description="the Router's costly work on one request, each part off its event loop: "
        "checking its tool schemas, then rendering and tokenizing its prompt; a part running past it is refused "
        "(400 naming the part), one that waited past it for a thread 429. The grammar it makes the LLM compile is "
        "compiled on the Router too, within engine.grammar_compile_timeout_s",
    )
    check_threads: int = Field(
        default=2, ge=1, description="threads of each Router replica for those checks, and as many for prompts: "
        "a flood of costly schemas holds only these, never the event loop",
    )
    allow_local_media: bool = Field(default=False, description="local paths / file: URLs, inside local_media_dir only")
    local_media_dir: str | None = Field(default=None, description="the only directory local media may come from")
    allow_http_media: bool = Field(default=False, description="http(s) media URLs, to http_media_allowlist only")
    http_media_allowlist: tuple[str, ...] = Field(
        default=(), description="where http(s) media may come from: `host` (ports 80 and 443 only) or "
        "`host:port` / `[v6addr]:port` (that port only); a name also admits its subdomains; a host listed "
        "exactly may also resolve to a private or loopback address",
    )
    media_fetch_timeout_s: float = Field(
        default=30.0, gt=0, description="all media URLs of one request together (fetched concurrently, "
        "redirects included); over it the request is refused (400)",
    )
    max_decoded_pixels_per_request: int = Field(
        default=VideoLimits.max_decoded_pixels, ge=1, description="video_url: pixels of all the videos of one "
        "request together, sampled frames before the resize (the default keeps one request's decoded frames under "
        "~400 MB); with several videos, their headers are read and this checked before any is decoded. At least "
        "max_decoded_pixels_per_video",
    )

    @field_validator("http_media_allowlist")
    @classmethod
    def _check_allowlist(cls, entries: tuple[str, ...]) -> tuple[str, ...]:
        for entry in entries:
            parse_allowlist_entry(entry)
        return entries

    @model_validator(mode="after")
    def _check_local_media(self) -> "LimitArgs":
        if self.allow_local_media and not self.local_media_dir:
            raise ValueError("allow_local_media needs local_media_dir (the one directory media may be read from)")
        if self.max_decoded_pixels_per_request < self.max_decoded_pixels_per_video:
            raise ValueError(f"max_decoded_pixels_per_request ({self.max_decoded_pixels_per_request}) < "
                             f"max_decoded_pixels_per_video ({self.max_decoded_pixels_per_video}): a request's one "
                             "video is checked by the per-video bound alone")
        return self

    def media_limits(self) -> MediaLimits:
        return build(self, MediaLimits)

    def video_limits(self) -> VideoLimits:
        return build(self, VideoLimits)


class _QueuedWorkScaling(ReplicaRange):
    """Autoscaling on the work queued per replica (`deployments.serve.autoscaling.QueuedWorkPolicy`):
    the encoder pool's on tokens, the video decoders' on decode seconds."""

    autoscale: bool = Field(default=False, description="replicas follow the work queued on them (the "
                            "deployment's num_replicas is then ignored)")
    upscale_delay_s: float = Field(default=5.0, ge=0, description="how long Serve must want more replicas to add one")
    downscale_delay_s: float = Field(default=120.0, ge=0, description="how long Serve must want fewer to remove one")
    look_back_period_s: float = Field(default=10.0, gt=0, description="Serve averages the queued work over this window")
    metrics_interval_s: float = Field(default=2.0, gt=0, description="how often replicas push their queued work")

    @model_validator(mode="after")
    def _check_autoscaling(self):
        if self.look_back_period_s <= self.metrics_interval_s:
            raise ValueError("look_back_period_s must be greater than metrics_interval_s")
        return self


class VideoDecodeArgs(_QueuedWorkScaling):
    """The VideoDecoder deployment's work (`video_url`): CPU replicas, each with `workers` decoding
    processes. With `autoscale` on, replicas follow the decode seconds queued on them
    (`deployments.serve.autoscaling.QueuedWorkPolicy`) and `video_decoder.num_replicas` is ignored."""

    workers: int = Field(default=2, ge=1, description="decoding processes per replica (one video each)")
    decode_threads: int | None = Field(
        default=None, ge=1, description="FFmpeg threads decoding one video (frame threading; the frames are the "
        "same bit for bit); default: the node's cores (its CPU quota in a container) divided among the decoder "
        "replicas at start and their workers, at least 1. 1 with skip_unsampled off is the decode before these "
        "options (the bench's baseline)",
    )
    skip_unsampled: bool = Field(
        default=True, description="frames that are neither sampled nor referenced by another frame are not "
        "decoded (FFmpeg's skip_frame, packet by packet; the sampled frames are the same bit for bit)",
    )
    segment_workers: int | None = Field(
        default=None, ge=1, description="segments of a clip decoded at once (split at keyframes, each decoded "
        "from its own keyframe in a thread of its own; the frames are the same bit for bit), sharing the "
        "video's decode_threads (each segment's FFmpeg threads: decode_threads // segment_workers, at least 1), "
        "never more than the cores; default: the node's cores (its CPU quota in a container) divided among the "
        "decoder replicas at start, at least decode_threads (2 cores, 1 replica: 2 segments of one FFmpeg thread "
        "each); 1: off. Only clips "
        "whose sampled frames span several GOPs are split; an open-GOP stream decodes in one pass "
        "(mmserve_video_segment_fallbacks)",
    )
    stream: bool = Field(
        default=True, description="stream video_url frames through the pipeline: each group of frames goes to "
        "the encoder as it is decoded, and the LLM prefills behind them (off: decode, then encode, then prefill; "
        "a standalone gRPC encoder never streams)",
    )
    stream_group_frames: int = Field(
        default=8, ge=1, description="frames per group of a streamed video (at least the model's temporal patch): "
        "larger groups cost fewer transfers and encoder calls, smaller ones let prefill follow the decoder closer",
    )
    stream_min_frames: int = Field(
        default=48, ge=1, description="with stream on, a video that samples to fewer frames than this is decoded "
        "whole and not streamed (a lone one in the same call as its header): streaming paid on 60 sampled frames "
        "and not reliably on 40 or fewer (bench/serve_video.py's stream_speedup_<clip>, TTFT streamed and not per "
        "clip length); 1: stream every video",
    )
    target_queued_seconds_per_replica: float = Field(default=4.0, gt=0, description="decode seconds queued "
                                                     "or running per replica")


class GrpcArgs(runtime_settings(ServerOptions, ResultStore)):
    """Embedding transfer over gRPC (`transport: grpc`) and the internal EncoderService.

    The public gRPC API's port, reflection and timeout are Serve's `grpc_options` (proxy-wide,
    set at `serve.start` / in the Serve config), not application arguments.
    """

    bind_host: str | None = Field(
        default=None, description="address each encoder replica's server binds; null: every interface ([::]) "
        "with a token, loopback (127.0.0.1, one node only) without one. Beyond loopback it needs grpc.token_env",
    )
    token: str | None = Field(default=None, description="shared token every EncoderService call must carry")
    token_env: str | None = Field(
        default=None, pattern=ENV_NAME, description="environment variable holding `token`, read where each "
        "replica runs (the Serve config then holds only the name)",
    )
    fetch_timeout_s: float = Field(default=60.0, gt=0, description="an LLM replica's call fetching one embedding")
    encoder_address: str | None = Field(
        default=None, description="host:port of a standalone `mmserve encoder-server` to use instead of an "
        "Encoder deployment (needs transport: grpc; `token` is sent to it)",
    )
    tls_ca: str | None = Field(
        default=None, description="PEM file of the CA that signed the standalone encoder's certificate: "
        "connect to `encoder_address` over TLS",
    )

    @model_validator(mode="after")
    def _check_token(self) -> "GrpcArgs":
        if self.token is not None and self.token_env is not None:
            raise ValueError("set grpc.token or grpc.token_env, not both")
        if self.bind_host is not None and not is_loopback(self.bind_host) and not self._has_token():
            raise ValueError(f"grpc.bind_host {self.bind_host!r} is beyond loopback and needs grpc.token_env (or "
                             "grpc.token): without a token every encoder replica's EncoderService would answer Encode "
                             "and FetchEmbedding to anyone who reaches its port. Set grpc.token_env (on Kubernetes "
                             "from a Secret), or leave grpc.bind_host unset on one node (loopback)")
        return self

    def _has_token(self) -> bool:
        return self.token is not None or self.token_env is not None

    def listen_host(self) -> str:
        """Where each encoder replica's EncoderService binds: `bind_host`, else every interface with a
        token (other nodes' LLM replicas fetch from it) and loopback without one (one node only)."""
        if self.bind_host is not None:
            return self.bind_host
        return ServerOptions.host if self._has_token() else "127.0.0.1"

    def on_node(self) -> "GrpcArgs":
        """These arguments with `token` read from `token_env` on this node (a replica's)."""
        if self.token_env is None:
            return self
        from deployments.replica_env import secret

        return self.model_copy(update={"token": secret(None, self.token_env, "grpc.token_env"), "token_env": None})


class EncoderPoolArgs(runtime_settings(BatchConfig, PoolConfig, base=_QueuedWorkScaling)):
    """The encoder pool: token-budget batching, preprocessing workers, embedding cache, autoscaling.

    With `autoscale` on, the encoder deployment runs `min_replicas`..`max_replicas` replicas sized
    by `deployments.serve.autoscaling.QueuedTokensPolicy` to ceil(queued tokens / target per replica),
    and `encoder.num_replicas` is ignored.
    """

    target_queued_tokens_per_replica: int = Field(default=32768, ge=1, description="autoscale: embedding tokens "
                                                  "waiting or encoding per replica")
    cuda_graphs: bool = Field(default=True, description="capture the ViT per patch budget up to "
                              "cuda_graphs_max_patches (Qwen2-VL / Qwen2.5-VL, CUDA; encoder_service.vit_graphs); "
                              "larger batches run eager")
    cuda_graphs_max_patches: int = Field(default=4096, ge=1, description="the largest captured budget, in ViT "
                                         "patches: on an H100 graphs ran 2.3x eager at 1,024 patches, 1.2x at 4,096, "
                                         "0.98x at 16,384 and slower on padded larger batches (docs/gpu.md)")

    def resolve(self) -> PoolConfig:
        return build(self, PoolConfig, batch=build(self, BatchConfig))


class EngineArgs(runtime_settings(EngineConfig)):
    """LLM engine settings (continuous batching, paged KV cache); resolved into `EngineConfig`."""

    kv_cache_memory_mb: int | None = Field(
        default=None, ge=1, description="KV pool size, taken as given (with the per-sequence state slots of "
        "hybrid linear-attention models, at most half of it); default: from the device (CPU: 512 MiB)"
    )
    max_waiting_tokens: int = Field(
        default=32768, ge=1, description="prompt tokens per LLM replica admitted but not prefilled yet (a request "
        "with n choices counts its prompt n times); a request over it gets 429 + Retry-After / RESOURCE_EXHAUSTED "
        "(one request is always admitted)",
    )
    stall_timeout_s: float = Field(
        default=60.0, gt=0, description="an LLM replica holding work with no engine step in this long is "
        "unhealthy (Serve replaces it; its requests fail over)",
    )

    def resolve(self, device_share: float) -> EngineConfig:
        """The `EngineConfig` of an LLM replica owning `device_share` of its GPU."""
        kv_cache_bytes = self.kv_cache_memory_mb * 2**20 if self.kv_cache_memory_mb else None
        return build(self, EngineConfig, kv_cache_bytes=kv_cache_bytes, device_share=device_share)


class RoutingArgs(FrozenArgs):
    """How the router picks encoder and LLM replicas (`mmserve.routing.affinity`).

    `affinity`: an item goes to the encoder replica owning its content hash, a request to the LLM
    replica that got its longest prompt prefix, each within (1 + epsilon) x the mean load
    (`AffinityRequestRouter`, Serve's request-router API). `default`: Serve's power-of-two
    choices, one request's items split into size-balanced calls. Affinity is opt-in until it is
    measured on GPUs: on 2 CPU cores (bench/serve_routing.py) it raised cluster-wide embedding
    hits but its goodput above saturation varied from 0.46x to 1.86x of the default's.
    """

    policy: Literal["affinity", "default"] = Field(default="default", description="affinity: by content hash and "
                                                  "prompt prefix, within a load bound; default: Serve's own")
    epsilon: float = Field(default=0.25, ge=0, description="encoder items: no replica above (1 + epsilon) x the "
                           "mean queued tokens")
    prefix_epsilon: float = Field(default=0.1, ge=0, description="LLM requests: a prefix's replica is passed over "
                                  "above (1 + prefix_epsilon) x the mean (its imbalance costs decode throughput)")

    @property
    def affinity(self) -> bool:
        """Affinity routing, asked for and possible (this Serve has the request-router API)."""
        return self.policy == "affinity" and serve_has("request_router_config")

    def deployment_options(self, block_size: int) -> tuple[dict, dict]:
        """The Encoder's and the LLM's `request_router_config` options ({} without `affinity`)."""
        if not self.affinity:
            return {}, {}
        router = "deployments.serve.affinity_routing:AffinityRequestRouter"

        def options(epsilon: float) -> dict:
            kwargs = {"epsilon": epsilon, "block_size": block_size}
            return {"request_router_config": {"request_router_class": router, "request_router_kwargs": kwargs}}

        return options(self.epsilon), options(self.prefix_epsilon)


def adapter_dir(name: str, path: str) -> str:
    """`lora_modules[name]` as an absolute directory holding a PEFT adapter, or ValueError saying so."""
    from pathlib import Path

    found = Path(path).expanduser().resolve()
    if not (found / "adapter_config.json").is_file():
        raise ValueError(f"lora_modules.{name}: {path} holds no adapter_config.json (a PEFT adapter directory)")
    return str(found)


class AppArgs(FrozenArgs):
    """Arguments of `deployments.serve.app:build_app` (the `args:` of a Serve config YAML)."""

    model: str | None = Field(default=None, description="checkpoint directory; default: the embedded tiny model")
    served_model_name: str | None = Field(default=None, description="the model's name in the API (requests' "
                                          "`model`, /v1/models); default: the checkpoint directory's name")
    lora_modules: dict[str, str] = Field(
        default_factory=dict, description="LoRA adapters served beside the base model: name -> PEFT adapter "
        "directory (adapter_config.json + adapter_model.safetensors); a request names one as its `model`; each LLM "
        "replica keeps engine.max_loras of them loaded (docs/lora.md)")
    dtype: Literal["auto", "float32", "bfloat16", "float16", "float64"] = Field(
        default="auto", description="of the weights; auto: the checkpoint's own (float32 when it names none)")
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto",
                                                   description="auto: CUDA where a replica sees a GPU, else CPU")
    transport: Literal["object_store", "grpc"] = Field(
        default="object_store", description="how embeddings reach the LLM replicas (same tensors either way)"
    )
    api_key: str | None = Field(default=None, description="clients must send `Authorization: Bearer KEY` (HTTP "
                                "header, gRPC metadata); a value here is in the Serve config: prefer api_key_env")
    api_key_env: str | None = Field(
        default=None, pattern=ENV_NAME, description="environment variable holding the API key, read where "
        "each router replica runs (the Serve config then holds only the name)",
    )
    await_embeddings_in_router: bool = Field(
        default=False,
        description="wait for the encoder before calling the LLM instead of passing the pending refs "
        "(slower: see bench/dispatch.py); errors then surface before an LLM replica is involved",
    )
    colocated: bool = Field(
        default=False, description="no Encoder deployment: each LLM replica encodes its requests' media "
        "in-process with its own encoder pool (the baseline of bench/serve.py --compare colocated)",
    )
    llm_retries: int = Field(
        default=2, ge=0, description="resubmissions of one request after its LLM replica was lost "
        "(a stream resumes from the tokens it sent); then 503 / UNAVAILABLE",
    )
    max_pending_requests: int = Field(
        default=16, ge=1, description="per Router replica: sequences (a request with n choices counts n) admitted "
        "that have no first token yet (planning, encoding, waiting for prefill); more get 429 + Retry-After / "
        "RESOURCE_EXHAUSTED at once. With ttft_budget_s it bounds TTFT under bursts; raise it with faster replicas "
        "(bench/soak.py measures the trade)",
    )
    ttft_budget_s: float = Field(
        default=5.0, gt=0, description="per Router replica: a planned request is admitted while the expected time "
        "to its first token (the work of the requests admitted ahead of it and its own, at the seconds per token "
        "measured on the requests before) fits this budget, else 429 + Retry-After / RESOURCE_EXHAUSTED; each "
        "client (by address) holding places gets its share of it; a request arriving when none waits always runs "
        "(docs/operations.md#admission)",
    )
    max_fetching_requests: int = Field(
        default=64, ge=1, description="per Router replica: requests whose body is being read or whose media URLs "
        "are being fetched (they hold no max_pending_requests place, so slow media never crowd out ready "
        "requests); more get 429 + Retry-After / RESOURCE_EXHAUSTED at once",
    )
    readiness_wait_s: float = Field(
        default=5.0, ge=0, description="a request that comes before the app is ready (before an LLM replica, and "
        "an Encoder replica when the app has an Encoder deployment, has loaded its model and warmed up) waits up "
        "to this long, then gets 503 + Retry-After / UNAVAILABLE; /health answers 503 until then",
    )
    # the Router's requests are mostly streams past their first token (cheap: a socket and a task each); its own
    # admission (max_fetching_requests, max_pending_requests, ttft_budget_s) sheds, not Serve's queue in front of
    # it, which no admission sees (at 64, a 256-request burst waited there up to 24 s for streams to end)
    router: DeploymentArgs = Field(default=DeploymentArgs(num_cpus=0.25, max_ongoing_requests=1024),
                                   description="the Router (ingress) deployment; the four deployments' defaults fit a "
                                   "2-core laptop (1.5 CPUs in all): size them for real clusters (k8s/overlays/gpu); "
                                   "a deployment given in part keeps its defaults for the rest")
    encoder: DeploymentArgs = Field(default=DeploymentArgs(num_cpus=0.5), description="the Encoder deployment")
    llm: DeploymentArgs = Field(default=DeploymentArgs(num_cpus=0.5), description="the LLM deployment")
    video_decoder: DeploymentArgs = Field(default=DeploymentArgs(num_cpus=0.25),
                                          description="the VideoDecoder deployment")
    video_decode: VideoDecodeArgs = Field(default=VideoDecodeArgs(), description="video_url decoding")
    limits: LimitArgs = Field(default=LimitArgs(), description="request limits and media access")
    routing: RoutingArgs = Field(default=RoutingArgs(), description="how the router picks encoder and LLM replicas")
    encoder_pool: EncoderPoolArgs = Field(default=EncoderPoolArgs(), description="the encoder replicas' batching, "
                                          "cache and autoscaling")
    grpc: GrpcArgs = Field(default=GrpcArgs(), description="embedding transfer over gRPC; a standalone encoder")
    engine: EngineArgs = Field(default=EngineArgs(), description="the LLM replicas' engine")

    def replicas_at_start(self, deployment: Literal["encoder", "llm", "video_decoder"]) -> int:
        """Replicas of the Encoder, LLM or VideoDecoder deployment when the app starts (autoscaling:
        its minimum, at least 1); the default `cpu_threads` (`decode_threads`) divides a node's cores among them."""
        scaling = {"llm": self.llm.autoscaling, "encoder": self.encoder_pool if self.encoder_pool.autoscale else None,
                   "video_decoder": self.video_decode if self.video_decode.autoscale else None}[deployment]
        return max(scaling.min_replicas if scaling else getattr(self, deployment).num_replicas, 1)

    @property
    def stream_video(self) -> bool:
        """video_url files stream through the pipeline (`video_decode.stream`; never to a standalone encoder)."""
        return self.video_decode.stream and self.grpc.encoder_address is None

    def on_node(self, api_key: bool = True) -> "AppArgs":
        """These arguments resolved on this node, the one place they are (the Router's, an LLM
        replica's, and `mmserve serve`'s before Ray starts): the model directory (the embedded tiny
        model built), `engine.max_model_len` from its checkpoint (`resolve_max_model_len`: an int from
        here on), `grpc.token` and, with `api_key` (the Router: it alone takes clients' calls), the API key."""
        from deployments.replica_env import resolve_model_dir, secret
        from mmserve.checkpoint import load_config, resolve_max_model_len

        model = resolve_model_dir(self.model)
        engine = {"max_model_len": resolve_max_model_len(load_config(model), self.engine.max_model_len)}
        if self.lora_modules and not self.engine.max_loras:
            engine["max_loras"] = len(self.lora_modules)  # every adapter listed stays loaded
        update = {"model": model, "engine": self.engine.model_copy(update=engine), "grpc": self.grpc.on_node(),
                  "lora_modules": {name: adapter_dir(name, path) for name, path in self.lora_modules.items()}}
        if api_key:
            update |= {"api_key": secret(self.api_key, self.api_key_env, "api_key_env"), "api_key_env": None}
        return self.model_copy(update=update)

    @model_validator(mode="before")
    @classmethod
    def _over_defaults(cls, data):
        """A deployment given in part (`router: {num_replicas: 2}`) keeps its own defaults for the rest
        (the Router's `num_cpus` 0.25, not the class's 1.0), as the configuration page lists them."""
        if not isinstance(data, dict):
            return data
        merged = dict(data)
        for name in ("router", "encoder", "llm", "video_decoder"):
            if isinstance(given := data.get(name), dict):
                merged[name] = {**cls.model_fields[name].default.model_dump(exclude_unset=True), **given}
        return merged

    @model_validator(mode="after")
    def _check_across_sections(self) -> "AppArgs":
        if self.api_key is not None and self.api_key_env is not None:
            raise ValueError("set api_key or api_key_env, not both")
        if self.encoder.autoscaling is not None:
            raise ValueError("the encoder autoscales on queued tokens: use encoder_pool.autoscale, not encoder.autoscaling")
        if self.video_decoder.autoscaling is not None:
            raise ValueError("the video decoder autoscales on queued decode seconds: use video_decode.autoscale, "
                             "not video_decoder.autoscaling")
        if self.llm.autoscaling is not None:
            target = self.llm.autoscaling.target_ongoing_requests or self.engine.max_num_seqs
            if target > self.llm.max_ongoing_requests:
                raise ValueError(f"llm: target_ongoing_requests ({target:g}) > max_ongoing_requests "
                                 f"({self.llm.max_ongoing_requests}): replicas could never reach the target")
        for name in self.lora_modules:
            if not name or name == self.served_model_name:
                raise ValueError(f"lora_modules: {name!r} cannot name an adapter (it must be set and differ from "
                                 "served_model_name)")
        if self.lora_modules and self.engine.tensor_parallel_size > 1:
            raise ValueError("lora_modules with engine.tensor_parallel_size > 1: LoRA adapters are not supported "
                             "with tensor parallelism yet")
        size, gpus = self.engine.tensor_parallel_size, self.llm.num_gpus
        if size > 1 and self.colocated:
            raise ValueError(f"engine.tensor_parallel_size {size} with colocated: true: a colocated replica encodes "
                             "in its own process, which the other ranks do not share; run the Encoder deployment "
                             "(colocated: false) with tensor parallelism")
        if size > 1 and 0 < gpus < 1:
            raise ValueError(f"engine.tensor_parallel_size {size} with llm.num_gpus {gpus:g}: every rank takes one "
                             "whole GPU (its share of a device cannot be split over ranks); set llm.num_gpus: 1 "
                             "(or 0 on CPU)")
        if size > 1 and gpus > 1:
            raise ValueError(f"engine.tensor_parallel_size {size} with llm.num_gpus {gpus:g}: llm.num_gpus is each "
                             f"rank's GPU (1), the replica takes {size} in all; set llm.num_gpus: 1")
        if self.grpc.encoder_address and self.transport != "grpc":
            raise ValueError("grpc.encoder_address (a standalone encoder) needs transport: grpc")
        if self.colocated and (self.grpc.encoder_address or self.transport != "object_store"):
            raise ValueError("colocated: true encodes inside the LLM replicas: no transport: grpc or grpc.encoder_address")
        if self.grpc.tls_ca and not self.grpc.encoder_address:
            raise ValueError("grpc.tls_ca applies to a standalone encoder: set grpc.encoder_address")
        return self
