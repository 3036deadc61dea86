"""The application builder: `serve run deployments.serve.app:build_app` or a Serve config YAML.

Serve calls the builder in a task that may run on any node (on KubeRay usually the head: no
GPU, no model volume), so it only validates arguments: it never reads the checkpoint or builds
the tiny model. Replicas resolve the model and secrets on their own nodes
(`deployments.serve.replica_env`).
"""

from __future__ import annotations

from ray.serve import Application

from deployments.config import AppArgs
from deployments.serve.encoder import EncoderDeployment, encoder_options
from deployments.serve.llm import LLMDeployment
from deployments.serve.replica_env import model_name
from deployments.serve.router import Router, RouterSettings
from deployments.serve.video_decoder import VideoDecoder, video_decoder_options


def build_app(args: dict | AppArgs | None = None) -> Application:
    """Router (ingress) + video decoders + encoder pool + LLM replicas (or, colocated, LLM replicas
    that encode), from `AppArgs`."""
    args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args or {})
    encoder_routing, llm_routing = args.routing.deployment_options(args.engine.block_size)
    encoder = None  # colocated: none; with grpc.encoder_address the router uses that standalone encoder
    if args.grpc.encoder_address is None and not args.colocated:
        encoder = EncoderDeployment.options(**encoder_options(args.encoder, args.encoder_pool), **encoder_routing).bind(
            args.model, args.dtype, args.device, args.encoder_pool, args.transport, args.grpc,
            device_share=args.encoder.device_share,
        )
    video = VideoDecoder.options(**video_decoder_options(args.video_decoder, args.video_decode)).bind(
        args.model, args.limits.video_limits(), args.video_decode.workers)
    stream_video = args.video_decode.stream and args.grpc.encoder_address is None
    # an LLM replica at its target runs a full batch (max_num_seqs): more replicas beyond that
    llm_options = args.llm.options("LLM", default_target_ongoing_requests=args.engine.max_num_seqs) | llm_routing
    llm = LLMDeployment.options(**llm_options).bind(
        args.model, args.dtype, args.device, engine=args.engine.resolve(args.llm.device_share), transport=args.transport,
        grpc=args.grpc, stall_timeout_s=args.engine.stall_timeout_s, max_waiting_tokens=args.engine.max_waiting_tokens,
        colocated_pool=args.encoder_pool if args.colocated else None,
        encoder=encoder if stream_video else None, video=video if stream_video else None,
    )
    settings = RouterSettings(
        model_dir=args.model,
        served_model_name=args.served_model_name or model_name(args.model),
        limits=args.limits,
        api_key=args.api_key,
        api_key_env=args.api_key_env,
        await_embeddings=args.await_embeddings_in_router,
        external_encoder=args.grpc.encoder_address,
        encoder_token=args.grpc.token,
        encoder_token_env=args.grpc.token_env,
        encoder_tls_ca=args.grpc.tls_ca,
        llm_retries=args.llm_retries,
        colocated=args.colocated,
        max_pending_requests=args.max_pending_requests,
        max_fetching_requests=args.max_fetching_requests,
        affinity=bool(encoder_routing) and encoder is not None,
        prefix_block_size=args.engine.block_size,
        stream_video=stream_video,
        stream_group_frames=args.video_decode.stream_group_frames,
    )
    return Router.options(**args.router.options("Router")).bind(encoder, llm, settings, video)
