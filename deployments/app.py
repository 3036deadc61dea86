"""The application builder: `serve run deployments.app:build_app` or a Serve config YAML."""

from __future__ import annotations

from pathlib import Path

from ray.serve import Application

from deployments.config import AppArgs
from deployments.encoder import EncoderDeployment, encoder_options
from deployments.llm import LLMDeployment
from deployments.router import Router, RouterSettings


def resolve_model_dir(model: str | None) -> str:
    """The checkpoint to serve: `model`, or the embedded tiny model (built once into the cache)."""
    if model is None:
        from mmserve.tiny import ensure_tiny_model

        return str(ensure_tiny_model())
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(f"--model {model!r} is not a Hugging Face checkpoint directory (no config.json)")
    return str(path.resolve())


def build_app(args: dict | AppArgs | None = None) -> Application:
    """Router (ingress) + encoder pool + LLM replicas, from validated `AppArgs`."""
    args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args or {})
    model_dir = resolve_model_dir(args.model)
    encoder = None  # with grpc.encoder_address the router uses that standalone encoder instead
    if args.grpc.encoder_address is None:
        encoder = EncoderDeployment.options(**encoder_options(args.encoder, args.encoder_pool)).bind(
            model_dir, args.dtype, args.device, args.encoder_pool, args.transport, args.grpc
        )
    llm = LLMDeployment.options(**args.llm.options("LLM")).bind(
        model_dir, args.dtype, args.device, args.engine.resolve(), args.transport, args.grpc,
        args.engine.stall_timeout_s, args.engine.max_waiting_tokens,
    )
    settings = RouterSettings(
        model_dir=model_dir,
        served_model_name=args.served_model_name or Path(model_dir).name,
        limits=args.limits,
        api_key=args.api_key,
        await_embeddings=args.await_embeddings_in_router,
        external_encoder=args.grpc.encoder_address,
        encoder_token=args.grpc.token,
        encoder_tls_ca=args.grpc.tls_ca,
        llm_retries=args.llm_retries,
    )
    return Router.options(**args.router.options("Router")).bind(encoder, llm, settings)
