"""`mmserve` command line: serve, chat, encoder-server, build-tiny-model, build-tiny-adapter, bench, plan."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path


def _int_from(least: int, what: str):
    def parse(text: str) -> int:
        if not text.isdigit() or int(text) < least:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return int(text)
    return parse


_positive_int, _count = _int_from(1, "a positive integer"), _int_from(0, "a count (0 or more)")


def _serve(ns: argparse.Namespace) -> int:
    from deployments.cli.local_serve import RefusedToStart, serve_app, serve_config
    from deployments.cli.ray_head import RayStartFailed

    if ns.config is None:  # with --config, the file's http_options.host / ports unless the flags are given
        ns.host = "127.0.0.1" if ns.host is None else ns.host
        ns.http_port = 8000 if ns.http_port is None else ns.http_port
    try:
        return serve_config(ns) if ns.config else serve_app(ns)
    except (RefusedToStart, RayStartFailed) as e:
        print(f"mmserve serve: {e}", file=sys.stderr)
        return 2 if isinstance(e, RefusedToStart) else 1


def _build_tiny(ns: argparse.Namespace) -> int:
    from mmserve.tiny import build_tiny_model

    print(build_tiny_model(ns.family, ns.out, seed=ns.seed, quantization=ns.quantization))
    return 0


def _build_tiny_adapter(ns: argparse.Namespace) -> int:
    from mmserve.tiny.lora import VISION_TARGETS, build_tiny_adapter

    vision = VISION_TARGETS if ns.vision else tuple(t for t in ns.vision_targets.split(",") if t)
    print(build_tiny_adapter(ns.model, ns.out, seed=ns.seed, rank=ns.rank, alpha=ns.alpha, vision_targets=vision,
                             targets=tuple(t for t in ns.targets.split(",") if t), use_rslora=ns.rslora))
    return 0


def _chat_grpc(ns: argparse.Namespace) -> int:
    import grpc

    from mmserve.rpc.vlm_client import VLMClient, user

    images = [Path(path).read_bytes() for path in ns.image or []]
    with VLMClient(ns.grpc, api_key=ns.api_key, application=ns.application) as client:
        try:
            for response in client.stream([user(ns.prompt, images)], max_tokens=ns.max_tokens):
                print(response.text, end="", flush=True)
        except grpc.RpcError as e:
            print(f"\nerror {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    print()
    return 0


def _encoder_server(ns: argparse.Namespace) -> int:
    import asyncio
    import logging

    from encoder_service import VisionEncoder
    from encoder_service.pool import EncoderPool
    from encoder_service.rpc.server import PooledEncoder, ServerOptions, ServerSecurity, serve_forever

    from deployments.config import is_loopback
    from mmserve.request.prompt_plan import MediaLimits

    if not is_loopback(ns.host) and not ns.token:
        print(f"mmserve encoder-server: refusing to listen on {ns.host} without a token: anyone who reaches the "
              "port could use the encoder. Set --token (or MMSERVE_ENCODER_TOKEN), with --tls-cert/--tls-key on "
              "an untrusted network, or keep --host 127.0.0.1", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO)
    encoder = VisionEncoder(ns.model, dtype=ns.dtype, device=ns.device)
    encoder.warm_up()  # before the server starts: its health says SERVING once the tower is warm
    security = ServerSecurity(ns.token, ns.tls_cert, ns.tls_key, ns.tls_client_ca)
    limits = MediaLimits(max_frames_per_video=ns.max_frames_per_video, max_pixels_per_image=ns.max_pixels_per_image)
    options = ServerOptions(host=ns.host, port=ns.port, security=security, limits=limits)

    async def main() -> None:
        pool = EncoderPool(encoder)  # token-budget batching, cache and dedup across callers
        pool.start(asyncio.get_running_loop())
        await serve_forever(PooledEncoder(pool), options, ttl_s=ns.result_ttl_s)

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
    return 0


def _chat(ns: argparse.Namespace) -> int:
    if ns.grpc:
        return _chat_grpc(ns)
    import mimetypes
    import urllib.request

    from mmserve.loadgen.dataset import data_uri

    uris = [data_uri(Path(p).read_bytes(), mimetypes.guess_type(p)[0] or "image/png") for p in ns.image or []]
    content = [{"type": "image_url", "image_url": {"url": uri}} for uri in uris] + [{"type": "text", "text": ns.prompt}]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": ns.max_tokens, "stream": True}
    headers = {"Content-Type": "application/json"}
    if ns.api_key:
        headers["Authorization"] = f"Bearer {ns.api_key}"
    req = urllib.request.Request(ns.url.rstrip("/") + "/v1/chat/completions", json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req) as resp:
            for line in resp:
                line = line.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    print(f"\nerror: {event['error']['message']}", file=sys.stderr)
                    return 1
                for choice in event.get("choices", []):
                    print(choice.get("delta", {}).get("content", ""), end="", flush=True)
    except urllib.error.HTTPError as e:
        print(f"error {e.code}: {e.read().decode()}", file=sys.stderr)
        return 1
    print()
    return 0


BENCHMARKS = ("encoder", "llm", "transfer", "dispatch", "serve", "soak", "load", "grammar")


def _bench(ns: argparse.Namespace, extra: list[str]) -> int:
    """Runs `bench/<name>.py` of this source checkout with the remaining arguments."""
    import runpy

    script = Path(__file__).resolve().parents[2] / "bench" / f"{ns.name}.py"
    if not script.is_file():
        print(f"{script} not found: benchmarks run from a source checkout", file=sys.stderr)
        return 1
    sys.argv = [str(script), *extra]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not (sep and name and path):
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=DIR")
    return name, path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plan"]:  # ahead of the other commands' imports (torch: seconds)
        from deployments.cli.plan_runs import collect
        from deployments.cli.routing_runs import collect as collect_routing
        from mmserve.capacity.cli import main as plan

        return plan(argv[1:], collect, collect_routing)
    from encoder_service.rpc.result_store import ResultStore
    from mmserve.checkpoint import DTYPE_CHOICES
    from mmserve.request.prompt_plan import MediaLimits
    from mmserve.tiny import FAMILIES
    from mmserve.tiny.quantized import QUANTIZATIONS

    parser = argparse.ArgumentParser(prog="mmserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve_p = sub.add_parser("serve", help="start an embedded Ray, deploy the app, serve until Ctrl-C")
    serve_p.add_argument("--model", default=None, help="checkpoint directory (default: embedded tiny Qwen2-VL)")
    serve_p.add_argument("--host", default=None,
                         help="where HTTP listens (default 127.0.0.1; with --config: the file's http_options.host)")
    serve_p.add_argument("--http-port", type=int, default=None,
                         help="Serve's HTTP port (default 8000; with --config: the file's http_options.port)")
    serve_p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto")
    serve_p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    serve_p.add_argument("--num-cpus", type=float, default=2, help="CPUs given to the embedded Ray")
    serve_p.add_argument("--encoder-gpus", type=float, default=None,
                         help="GPUs of the encoder replica (a fraction: that share of one); default: on a host with "
                         "GPUs, chosen with --llm-gpus and printed (deployments/cli/gpu_shares.py), else 0")
    serve_p.add_argument("--llm-gpus", type=float, default=None,
                         help="GPUs of the LLM replica (of each rank with --tensor-parallel-size); default: as "
                         "--encoder-gpus")
    serve_p.add_argument("--max-model-len", type=_positive_int, default=None, metavar="TOKENS",
                         help="longest prompt + max_tokens served (engine.max_model_len; default: the checkpoint's "
                         "max_position_embeddings)")
    serve_p.add_argument("--tensor-parallel-size", type=_positive_int, default=1, metavar="N",
                         help="ranks each LLM replica's decoder is split over, one process each on one node "
                         "(engine.tensor_parallel_size; with --llm-gpus 1, a GPU each; the LLM's CPUs are shared "
                         "among its ranks); default 1")
    serve_p.add_argument("--lora", action="append", default=[], metavar="NAME=DIR", type=_lora_module,
                         help="a LoRA adapter (PEFT directory) served beside the model as NAME, which requests name "
                         "as their model (repeatable; lora_modules, docs/lora.md)")
    serve_p.add_argument("--grpc-port", type=int, default=None,
                         help="Serve's gRPC proxy port (default 9000; with --config: the file's grpc_options.port). "
                         "It listens on every interface whatever --host says: without an API key it starts only "
                         "when this flag is given")
    serve_p.add_argument("--ingress", choices=("proxy", "direct"), default="proxy",
                         help="Serve's ingress: its Python proxy (default; a request cap in front), or the "
                         "Router replicas listening themselves (direct, loopback only; experimental in Serve 2.60) "
                         "(deployments/cli/ingress_modes.py)")
    serve_p.add_argument("--max-connections-per-client", type=_count, default=256, metavar="N",
                         help="connections one source address may hold open through the request cap in front of "
                         "Serve's proxy, on loopback too (default 256; 0: no limit, e.g. behind a load balancer "
                         "every request comes from)")
    serve_p.add_argument("--grace-period", type=float, default=30.0,
                         help="on SIGTERM / Ctrl-C: seconds requests in flight may take to finish")
    serve_p.add_argument("--api-key-env", default=None, metavar="NAME",
                         help="require 'Authorization: Bearer KEY' (HTTP header, gRPC metadata), KEY being the "
                         "value of environment variable NAME (default: MMSERVE_API_KEY when it is set)")
    serve_p.add_argument("--api-key", default=None, help="the key itself: visible in ps; prefer MMSERVE_API_KEY")
    serve_p.add_argument(
        "--dashboard", action=argparse.BooleanOptionalAction, default=True,
        help="start the Ray dashboard (default; port 8265) and print its URL",
    )
    serve_p.add_argument("--dashboard-host", default="127.0.0.1",
                         help="where the dashboard listens (default 127.0.0.1, whatever --host says)")
    serve_p.add_argument("--public-metrics", action="store_true",
                         help="let Ray's ports, its Prometheus metrics among them, listen on this machine's address "
                         "(default: loopback only)")
    serve_p.add_argument(
        "--config", default=None, metavar="YAML",
        help="a Serve config file (e.g. deployments/serve_config.yaml, the one `serve run` and k8s take); "
        "--host, --http-port and --grpc-port replace its http_options.host / .port and grpc_options.port, and "
        "the API key (--api-key-env, --api-key, MMSERVE_API_KEY) goes to every application that names none; the "
        "app flags (--model, --dtype, ...) are ignored",
    )
    serve_p.set_defaults(func=_serve)

    tiny_p = sub.add_parser("build-tiny-model", help="write a deterministic tiny checkpoint")
    tiny_p.add_argument("--family", choices=FAMILIES, default="qwen2_vl")
    tiny_p.add_argument("--out", required=True)
    tiny_p.add_argument("--seed", type=int, default=0)
    tiny_p.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                        help="the language model's weights in this format (fp8-block: Qwen's -FP8 releases; "
                             "fp8-channel: llm-compressor's FP8-dynamic; awq: AutoAWQ int4 GEMM)")
    tiny_p.set_defaults(func=_build_tiny)

    from mmserve.tiny.lora import LM_TARGETS, VISION_TARGETS

    adapter_p = sub.add_parser("build-tiny-adapter", help="write a deterministic LoRA adapter (PEFT format) of a "
                               "tiny checkpoint's language model, and optionally of its vision tower (needs peft: "
                               "mmserve[test])")
    adapter_p.add_argument("--model", required=True, help="the tiny checkpoint directory")
    adapter_p.add_argument("--out", required=True)
    adapter_p.add_argument("--seed", type=int, default=0)
    adapter_p.add_argument("--rank", type=_positive_int, default=4)
    adapter_p.add_argument("--alpha", type=float, default=8.0)
    adapter_p.add_argument("--targets", default=",".join(LM_TARGETS), help="comma-separated projections of the "
                           "language model (empty: none)")
    adapter_p.add_argument("--vision-targets", default="", help="comma-separated linears of the vision tower, among "
                           f"{','.join(VISION_TARGETS)} (merger: the merger's MLP); default none")
    adapter_p.add_argument("--vision", action="store_true", help="every vision-tower linear and the merger "
                           "(--vision-targets all of them)")
    adapter_p.add_argument("--rslora", action="store_true", help="scale by alpha / sqrt(rank)")
    adapter_p.set_defaults(func=_build_tiny_adapter)

    chat_p = sub.add_parser("chat", help="stream one answer from a running server")
    chat_p.add_argument("prompt")
    chat_p.add_argument("--image", action="append", help="image file (repeatable)")
    chat_p.add_argument("--url", default="http://127.0.0.1:8000")
    chat_p.add_argument("--max-tokens", type=int, default=64)
    chat_p.add_argument("--api-key", default=os.environ.get("MMSERVE_API_KEY"), help="default: $MMSERVE_API_KEY")
    chat_p.add_argument("--grpc", metavar="HOST:PORT", default=None, help="use the gRPC API at HOST:PORT instead of HTTP")
    chat_p.add_argument("--application", default=None, help="Serve application name (gRPC, several apps)")
    chat_p.set_defaults(func=_chat)

    enc_p = sub.add_parser("encoder-server", help="serve the vision encoder alone over gRPC (no Ray)")
    enc_p.add_argument("--model", required=True, help="checkpoint directory")
    enc_p.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default loopback; any other needs --token)")
    enc_p.add_argument("--port", type=int, default=9100)
    enc_p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto")
    enc_p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    enc_p.add_argument("--token", default=os.environ.get("MMSERVE_ENCODER_TOKEN"),
                       help="shared token callers must send (authorization: Bearer); default: $MMSERVE_ENCODER_TOKEN")
    enc_p.add_argument("--tls-cert", default=None, help="PEM certificate chain (with --tls-key: TLS on)")
    enc_p.add_argument("--tls-key", default=None)
    enc_p.add_argument("--tls-client-ca", default=None, help="PEM CA for client certificates (mutual TLS)")
    enc_p.add_argument("--result-ttl-s", type=float, default=ResultStore.ttl_s, help="how long unfetched results stay")
    enc_p.add_argument("--max-pixels-per-image", type=int, default=MediaLimits.max_pixels_per_image,
                       help="pixels of an image (or video frame), read from its header before decoding")
    enc_p.add_argument("--max-frames-per-video", type=int, default=MediaLimits.max_frames_per_video)
    enc_p.set_defaults(func=_encoder_server)

    bench_p = sub.add_parser("bench", help="run a benchmark of bench/ (extra arguments go to it; needs a source checkout)")
    bench_p.add_argument("name", choices=BENCHMARKS)

    sub.add_parser("plan", help="how many encoder and LLM replicas a workload needs, for its SLOs (a simulation; "
                   "arguments go to mmserve.capacity.cli; --validate: against real runs here)", add_help=False)

    ns, extra = parser.parse_known_args(argv)
    if ns.command == "bench":
        return _bench(ns, extra)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return ns.func(ns)


if __name__ == "__main__":
    sys.exit(main())
