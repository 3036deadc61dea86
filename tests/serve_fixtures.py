"""One Ray + Serve instance per test session, with one app per tiny model family (float64)."""

from __future__ import annotations

import socket

import pytest

from tests.conftest import FAMILIES

TEST_LIMITS = {"max_items_per_request": 4, "max_pixels_per_image": 1_000_000, "max_frames_per_video": 8}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def serve_urls(tiny_models):
    """{family: base URL of its app}; the apps run until the session ends."""
    import ray
    from ray import serve

    from deployments.app import build_app

    port = _free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    small = {"num_cpus": 0.1}
    try:
        for family in FAMILIES:
            args = {
                "model": tiny_models[family], "dtype": "float64", "served_model_name": family,
                "router": small, "encoder": small, "llm": small, "limits": TEST_LIMITS,
            }
            serve.run(build_app(args), name=family, route_prefix=f"/{family}")
        yield {f: f"http://127.0.0.1:{port}/{f}" for f in FAMILIES}
    finally:
        serve.shutdown()
        ray.shutdown()
