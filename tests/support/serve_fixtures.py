"""One Ray + Serve instance per test session (registered as a plugin in conftest.py).

`serve_urls`: one float64 app per tiny model family, HTTP + the public gRPC API on Serve's proxy.
`secured_url`: one more qwen2_vl app, started on first use, with `transport: grpc`, an API key (read
from an environment variable by its replicas, never in the Serve config) and
the router awaiting embeddings before it calls the LLM (the non-default hand-off), and a KV pool
of 1 MiB (1,024 float64 tokens of the tiny model), so `engine.max_model_len` 1,024 below the
checkpoint's 4,096 tokens, and a `response_format` compile deadline of `SECURED_COMPILE_TIMEOUT_S`
(a schema's grammar compiles in ~1 ms; tests/serve/test_structured_serve.py sends one over it).

The session's Ray node has one unit of each of `GATES`, custom resources no app asks for unless a
test says so: `hold` takes one, so a replica that needs it cannot be scheduled until the holder is
killed (as replicas wait for GPU nodes to join).
"""

from __future__ import annotations

import os
import socket

import pytest

from tests.conftest import FAMILIES

TEST_LIMITS = {"max_items_per_request": 4, "max_pixels_per_image": 1_000_000, "max_frames_per_video": 8,
               "max_video_seconds": 20, "max_pixels_per_video_frame": 1_000_000}
TEST_API_KEY = "test-key"
TEST_API_KEY_ENV = "MMSERVE_TEST_API_KEY"  # the secured app reads its key from here, as deployments should
SECURED_COMPILE_TIMEOUT_S = 0.25  # the secured app's engine.grammar_compile_timeout_s (default 10)
_SMALL = {"num_cpus": 0.1}
GATES = ("mmserve_test_gate_llm", "mmserve_test_gate_encoder")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _app_args(model_dir: str, name: str, **extra) -> dict:
    return {
        "model": model_dir, "dtype": "float64", "served_model_name": name,
        "router": _SMALL, "encoder": _SMALL, "llm": _SMALL, "video_decoder": _SMALL, "limits": TEST_LIMITS,
        # a streamed test video is several groups, and a short one streams too
        "video_decode": {"stream_group_frames": 2, "stream_min_frames": 1},
        # admission by expected latency is tests/unit/test_admission_units.py's subject; a loaded 2-core
        # box (two test workers) expects first tokens past the default 5 s, and the apps would shed load
        "ttft_budget_s": 600.0, **extra,
    }


@pytest.fixture(scope="session")
def serve_ports():
    """(HTTP port, gRPC port) of the session's Serve instance; Ray and Serve live until the end. Ray
    starts as every entry point starts it (`deployments.cli.ray_head`: a head process of its own)."""
    from ray import serve

    from deployments.cli.ray_head import HeadSpec, start_head
    from deployments.serve.router import grpc_options

    http_port, grpc_port = _free_port(), _free_port()
    os.environ[TEST_API_KEY_ENV] = TEST_API_KEY  # before Ray starts: its replicas inherit it
    head = start_head(HeadSpec(num_cpus=4, resources=dict.fromkeys(GATES, 1)))
    _ends.append(lambda: (serve.shutdown(), head.stop()))
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port},
                    grpc_options=grpc_options(port=grpc_port))
        yield http_port, grpc_port
    finally:
        end_session_cluster()


_ends = []  # the session's Serve and Ray, to stop once (`end_session_cluster`)


def end_session_cluster() -> None:
    """Stop the session's Serve and Ray now (once): tests/conftest.py calls it after its last test, so the
    tests that start a Ray of their own run without its idle apps (a head and ~16 replicas: a quarter of
    a core, and memory)."""
    while _ends:
        _ends.pop()()


def hold(resource: str):
    """An actor holding the session node's one unit of `resource` (one of `GATES`), once it has it."""
    import ray

    @ray.remote(num_cpus=0, resources={resource: 1})
    class Holder:
        def holding(self) -> bool:
            return True

    holder = Holder.remote()
    ray.get(holder.holding.remote(), timeout=60)
    return holder


TINY_LORA = "tiny-lora"  # the session's qwen2_vl app serves the `tiny_lora` adapter under this name


@pytest.fixture(scope="session")
def serve_urls(serve_ports, tiny_models, tiny_loras) -> dict[str, str]:
    """{family: base URL of its app}; each app serves its family's `tiny_loras` adapters too."""
    from ray import serve

    from deployments.serve.app import build_app
    from deployments.serve.router import wait_until_ready

    for family in FAMILIES:
        serve.run(build_app(_app_args(tiny_models[family], family, lora_modules=tiny_loras[family])), name=family,
                  route_prefix=f"/{family}")
    for family in FAMILIES:
        wait_until_ready(family)
    return {f: f"http://127.0.0.1:{serve_ports[0]}/{f}" for f in FAMILIES}


@pytest.fixture(scope="session")
def grpc_target(serve_urls, serve_ports) -> str:
    """host:port of Serve's gRPC proxy (the apps of `serve_urls` are up)."""
    return f"127.0.0.1:{serve_ports[1]}"


@pytest.fixture(scope="session")
def secured_url(serve_ports, tiny_models) -> str:
    """Base URL of a qwen2_vl app whose embeddings travel over gRPC and that needs TEST_API_KEY."""
    from ray import serve

    from deployments.serve.app import build_app
    from deployments.serve.router import wait_until_ready

    # max_prompt_chars: the 16 per token of its 1,024 would refuse the largest response_format schema (64 KiB)
    # before its compile, which tests/serve/test_structured_serve.py sends over the deadline
    args = _app_args(tiny_models["qwen2_vl"], "secured", transport="grpc", api_key_env=TEST_API_KEY_ENV,
                     await_embeddings_in_router=True, limits={**TEST_LIMITS, "max_prompt_chars": 1 << 17},
                     engine={"kv_cache_memory_mb": 1, "max_model_len": 1024,
                             "grammar_compile_timeout_s": SECURED_COMPILE_TIMEOUT_S})
    serve.run(build_app(args), name="secured", route_prefix="/secured")
    wait_until_ready("secured")
    return f"http://127.0.0.1:{serve_ports[0]}/secured"


@pytest.fixture(scope="session")
def external_encoder_url(serve_ports, tiny_models, tmp_path_factory):
    """Base URL of a qwen2_vl app with no Encoder deployment: it uses a standalone EncoderService
    (running in this process, float64, behind TLS and a token) through `grpc.encoder_address`."""
    from ray import serve

    from deployments.serve.app import build_app
    from deployments.serve.router import wait_until_ready
    from encoder_service import VisionEncoder
    from encoder_service.rpc.result_store import ResultStore
    from encoder_service.rpc.server import ServerOptions, ServerSecurity, ServerThread

    from tests.support.tls_certs import self_signed

    token = "encoder-secret"
    cert, key = self_signed(tmp_path_factory.mktemp("tls"))
    security = ServerSecurity(token, tls_cert=str(cert), tls_key=str(key))
    encoder = VisionEncoder(tiny_models["qwen2_vl"], dtype="float64")
    server = ServerThread(encoder, ResultStore(ttl_s=60), ServerOptions("127.0.0.1", 0, security=security))
    grpc_args = {"encoder_address": f"localhost:{server.port}", "token": token, "tls_ca": str(cert)}
    args = _app_args(tiny_models["qwen2_vl"], "external", transport="grpc", grpc=grpc_args)
    serve.run(build_app(args), name="external", route_prefix="/external")
    wait_until_ready("external")
    yield f"http://127.0.0.1:{serve_ports[0]}/external"
    server.stop()
