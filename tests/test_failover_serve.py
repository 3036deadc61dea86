"""Lossless LLM failover in a real Serve app with two LLM replicas: one is killed with `ray.kill`
while every stream is mid-way; every request completes with the output of an uninterrupted run."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.media_factory import data_uri, image_bytes
from tests.serve_fixtures import _app_args

pytestmark = pytest.mark.serve
APP = "failover"
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def failover_url(serve_ports, tiny_models):
    from ray import serve

    from deployments.app import build_app

    args = _app_args(tiny_models["qwen2_vl"], APP, llm={"num_replicas": 2, "num_cpus": 0.1}, llm_retries=2)
    serve.run(build_app(args), name=APP, route_prefix=f"/{APP}")
    yield f"http://127.0.0.1:{serve_ports[0]}/{APP}/v1/chat/completions"
    serve.delete(APP)


def _bodies() -> list[dict]:
    bodies = []
    for i in range(6):
        content = [{"type": "text", "text": f"request {i}: describe the weather in city {i * 7}"}]
        if i % 2:  # every other request carries an image
            content.insert(0, {"type": "image_url", "image_url": {"url": data_uri(image_bytes(32 + 8 * i, 40, seed=i))}})
        bodies.append({
            "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True,
        })
    return bodies


def _stream(url: str, body: dict, tokens: list[int], errors: list[str]) -> None:
    try:
        with httpx.stream("POST", url, json=body, timeout=120) as resp:
            if resp.status_code != 200:
                errors.append(f"{resp.status_code}: {resp.read().decode()}")
                return
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    errors.append(str(event["error"]))
                for choice in event.get("choices", []):
                    tokens.extend(choice.get("token_ids", []))
    except Exception as e:  # reported by the test
        errors.append(repr(e))


def _run_all(url: str, bodies: list[dict], while_running=None) -> tuple[list[list[int]], list[str]]:
    outputs: list[list[int]] = [[] for _ in bodies]
    errors: list[str] = []
    threads = [threading.Thread(target=_stream, args=(url, b, out, errors)) for b, out in zip(bodies, outputs)]
    for t in threads:
        t.start()
    result = while_running(outputs) if while_running else None
    for t in threads:
        t.join(timeout=180)
    return outputs, errors, result


def _llm_replicas() -> list:
    import ray

    return [(a["name"], a["namespace"]) for a in ray.util.list_named_actors(all_namespaces=True)
            if f"{APP}#LLM#" in a["name"]]


def _kill_mid_stream(outputs: list[list[int]]) -> bool:
    """Kills one LLM replica once every stream has sent >= 2 tokens and has >= 8 left."""
    import ray

    replicas = _llm_replicas()
    assert len(replicas) == 2, replicas
    victim = ray.get_actor(replicas[0][0], namespace=replicas[0][1])
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        counts = [len(o) for o in outputs]
        if any(c > MAX_TOKENS - 8 for c in counts):
            return False  # missed the window
        if all(c >= 2 for c in counts):
            ray.kill(victim, no_restart=False)
            return True
        time.sleep(0.002)
    return False


def test_killing_an_llm_replica_mid_stream_loses_nothing(failover_url):
    from ray import serve

    bodies = _bodies()
    expected, errors, _ = _run_all(failover_url, bodies)  # recorded before any fault
    assert not errors, errors
    assert all(len(e) == MAX_TOKENS for e in expected)
    router = serve.get_deployment_handle("Router", app_name=APP)
    before = router.failover_stats.remote().result()
    for _attempt in range(3):  # a loaded machine may let a stream run past the window: try again
        outputs, errors, killed = _run_all(failover_url, bodies, _kill_mid_stream)
        if killed:
            break
    assert killed, "never caught every stream mid-way"
    assert not errors, errors
    assert outputs == expected  # greedy: the same tokens as the uninterrupted run, nothing lost
    after = router.failover_stats.remote().result()
    resumed = after["resumed_streams"] - before["resumed_streams"]
    assert 0 < resumed <= len(bodies), after
    assert after["resumed_tokens"] - before["resumed_tokens"] >= 2 * resumed
    assert after["resumed_with_media"] > before["resumed_with_media"], after
