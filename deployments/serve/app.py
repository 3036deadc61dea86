"""The application builder: `serve run deployments.serve.app:build_app` or a Serve config YAML.

Serve calls the builder in a task that may run on any node (on KubeRay usually the head: no
GPU, no model volume), so it only validates arguments: it never reads the checkpoint or builds
the tiny model. Replicas resolve the model and secrets on their own nodes
(`deployments.replica_env`).
"""

from __future__ import annotations

from ray.serve import Application

from deployments.config import AppArgs
from deployments.serve.encoder import EncoderDeployment, encoder_options
from deployments.serve.llm import LLMDeployment
from deployments.replica_env import model_name
from deployments.serve.router import Router
from deployments.serve.video_decoder import VideoDecoder, video_decoder_options


def build_app(args: dict | AppArgs | None = None) -> Application:
    """Router (ingress) + video decoders + encoder pool + LLM replicas (or, colocated, LLM replicas
    that encode), from `AppArgs`."""
    args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args or {})
    # the served name from the model path as given: no disk is read here
    args = args.model_copy(update={"served_model_name": args.served_model_name or model_name(args.model)})
    encoder_routing, llm_routing = args.routing.deployment_options(args.engine.block_size)
    encoder = None  # colocated: none; with grpc.encoder_address the router uses that standalone encoder
    if args.grpc.encoder_address is None and not args.colocated:
        encoder = EncoderDeployment.options(**encoder_options(args.encoder, args.encoder_pool), **encoder_routing).bind(args)
    video = VideoDecoder.options(**video_decoder_options(args.video_decoder, args.video_decode)).bind(
        args.model, args.limits.video_limits(), args.video_decode.workers, args.video_decode.decode_threads,
        args.video_decode.skip_unsampled, args.replicas_at_start("video_decoder"), args.video_decode.segment_workers)
    # an LLM replica at its target runs a full batch (max_num_seqs): more replicas beyond that
    # tensor parallelism: a placement group per replica, a bundle per rank (`DeploymentArgs.placement`)
    llm_options = args.llm.options("LLM", default_target_ongoing_requests=args.engine.max_num_seqs,
                                   ranks=args.engine.tensor_parallel_size) | llm_routing
    streamed = (encoder, video) if args.stream_video else (None, None)  # the LLM replica drives streamed videos
    llm = LLMDeployment.options(**llm_options).bind(args, *streamed)
    return Router.options(**args.router.options("Router")).bind(encoder, llm, args, video)
