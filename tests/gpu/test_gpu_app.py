"""The whole app on one GPU: router, encoder and LLM replicas as users deploy them, in bf16.

Each app runs its encoder and its LLM as separate replicas on halves of the one GPU (`num_gpus`
0.5 each; colocated: one LLM replica on half, encoding in-process), and is checked over HTTP
(plain and streamed) and gRPC (unary and streamed) against `transformers`' `generate` in bf16 with
the near-tie rule of the engine's GPU tests (tests/support/reference.py): text, one image, three images
of different sizes, a video, then the mixed prompts of the engine tests all at once. Apps: both
embedding transports (`object_store`, `grpc`), the colocated mode, and a full-size random
Qwen2-VL-2B (mmserve/loadgen/checkpoints.py: gibberish answers, so only a memory burst runs on it).

A burst of mixed requests on each app must run out of memory in neither replica: every request
completes, and each replica stays inside its share (its KV pool sized from it, see
`llm_service.model.kv_cache.cuda_kv_budget`).

Marked `gpu` and `serve`, skipped without CUDA. Runs where the GPU host has Ray only as a wheel
set (README, "GPU"): no `openai` client, plain httpx and the project's gRPC client.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import pytest
import torch

from tests.support.cases import api_messages, cases
from tests.support.engine_support import mixed_cases
from tests.support.media_factory import image_bytes, video_frames
from tests.support.reference import NearTieTally, greedy_reference, load_reference

pytestmark = [pytest.mark.gpu, pytest.mark.serve,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MAX_TOKENS = 16
DTYPE, REF_DTYPE, DEVICE = "bfloat16", torch.bfloat16, "cuda"
SHARE = 0.5
UTILIZATION = 0.9  # EngineArgs' default gpu_memory_utilization
GIB = 2**30
VARIANTS = {
    "object_store": {"transport": "object_store"},
    "grpc": {"transport": "grpc"},
    "colocated": {"colocated": True},
    "full_size": {"transport": "object_store"},  # the random Qwen2-VL-2B
}
EQUIVALENCE_CASES = ("text_only", "one_image", "three_images", "video")


class App(NamedTuple):
    name: str
    url: str
    grpc_target: str
    model_dir: str
    colocated: bool


class Answer(NamedTuple):
    text: str
    tokens: list[int]
    finish_reason: str


def _app_args(model_dir: str, name: str, **extra) -> dict:
    """Both replicas on half the GPU; queue bounds wide enough that a burst reaches the devices."""
    wide = {"max_ongoing_requests": 256, "max_queued_requests": -1}
    return {
        "model": model_dir, "dtype": DTYPE, "device": DEVICE, "served_model_name": name,
        "router": {"num_cpus": 0.1, **wide}, "encoder": {"num_cpus": 0.1, "num_gpus": SHARE, **wide},
        "llm": {"num_cpus": 0.1, "num_gpus": SHARE, **wide},
        "limits": {"max_items_per_request": 4, "max_pixels_per_image": 4_000_000, "max_frames_per_video": 8},
        "max_pending_requests": 256, "ttft_budget_s": 3600.0, "engine": {"max_waiting_tokens": 1 << 20},
        "encoder_pool": {"max_queued_bytes": 8 << 30}, **extra,
    }


@pytest.fixture(scope="session")
def full_size_dir(models_root) -> str:
    from mmserve.loadgen.checkpoints import qwen2_vl_2b

    return qwen2_vl_2b(os.path.join(models_root, "qwen2_vl_2b_random"))


@pytest.fixture(scope="module", params=list(VARIANTS))
def gpu_app(request, serve_ports, tiny_models) -> App:
    """One app at a time (together they would need more than the one GPU)."""
    from ray import serve

    from deployments.serve.app import build_app

    variant = request.param
    name = f"gpu-{variant.replace('_', '-')}"
    try:
        model_dir = request.getfixturevalue("full_size_dir") if variant == "full_size" else tiny_models["qwen2_vl"]
        serve.run(build_app(_app_args(model_dir, name, **VARIANTS[variant])), name=name, route_prefix=f"/{name}")
    except BaseException as e:  # at once, past pytest's capture: a device run cut at its cap has no summary
        print(f"gpu_app {variant}: {type(e).__name__}: {e}", file=sys.__stderr__, flush=True)
        with contextlib.suppress(Exception):  # what serve.run left of it
            serve.delete(name)
        raise
    try:
        yield App(name, f"http://127.0.0.1:{serve_ports[0]}/{name}", f"127.0.0.1:{serve_ports[1]}", model_dir,
                  bool(VARIANTS[variant].get("colocated")))
    finally:
        serve.delete(name)


def _tiny_only(app: App) -> None:
    if app.name == "gpu-full-size":
        pytest.skip("random full-size weights: their flat logits tie everywhere, so only the burst runs on them")


# -- the two APIs, without the openai client ------------------------------------------------
def http_chat(app: App, messages: list[dict], stream: bool, max_tokens: int = MAX_TOKENS, **extra) -> Answer:
    import httpx

    body = {"model": app.name, "messages": api_messages(messages), "max_tokens": max_tokens,
            "return_token_ids": True, "stream": stream, **extra}
    url = app.url + "/v1/chat/completions"
    with httpx.Client(timeout=600) as client:
        if not stream:
            response = client.post(url, json=body)
            assert response.status_code == 200, response.text
            choice = response.json()["choices"][0]
            return Answer(choice["message"]["content"], choice["token_ids"], choice["finish_reason"])
        text, tokens, finish = [], [], None
        with client.stream("POST", url, json=body) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                assert "error" not in chunk, chunk
                for choice in chunk["choices"]:
                    text.append(choice["delta"].get("content") or "")
                    tokens += choice.get("token_ids") or []
                    finish = choice.get("finish_reason") or finish
        return Answer("".join(text), tokens, finish)


def proto_messages(messages: list[dict]):
    """The reference's messages (media as bytes) as `mmserve.v1` messages, parts in their order."""
    from protos.mmserve.v1 import vlm_pb2

    def part(p):
        if p["type"] == "image":
            return vlm_pb2.ContentPart(image=p["bytes"])
        if p["type"] == "video":
            return vlm_pb2.ContentPart(video=vlm_pb2.Video(frames=list(p["frames"]), fps=p["fps"]))
        return vlm_pb2.ContentPart(text=p["text"])

    return [vlm_pb2.ChatMessage(role=m["role"], content=[part(p) for p in m["content"]]) for m in messages]


def grpc_chat(app: App, messages: list[dict], stream: bool, max_tokens: int = MAX_TOKENS, **sampling) -> Answer:
    from mmserve.rpc.vlm_client import VLMClient

    with VLMClient(app.grpc_target, application=app.name, timeout_s=600) as client:
        if not stream:
            r = client.generate(proto_messages(messages), max_tokens=max_tokens, **sampling)
            return Answer(r.text, list(r.token_ids), r.finish_reason)
        responses = list(client.stream(proto_messages(messages), max_tokens=max_tokens, **sampling))
    return Answer("".join(r.text for r in responses), [t for r in responses for t in r.token_ids],
                  responses[-1].finish_reason)


CALLS = {
    "http": lambda app, m, **kw: http_chat(app, m, stream=False, **kw),
    "http-stream": lambda app, m, **kw: http_chat(app, m, stream=True, **kw),
    "grpc": lambda app, m, **kw: grpc_chat(app, m, stream=False, **kw),
    "grpc-stream": lambda app, m, **kw: grpc_chat(app, m, stream=True, **kw),
}


def _check_all(app: App, named: list[tuple[str, list[dict]]], answers: list[Answer]) -> NearTieTally:
    """Each answer equals bf16 `generate` or splits from it at a near-tie; its text is its tokens'."""
    processor, _ = load_reference(app.model_dir)
    tally = NearTieTally()
    for (name, messages), answer in zip(named, answers):
        assert answer.finish_reason in ("stop", "length"), (name, answer)
        assert answer.text == processor.tokenizer.decode(answer.tokens, skip_special_tokens=True), name
        ref = greedy_reference(app.model_dir, messages, MAX_TOKENS, REF_DTYPE, DEVICE, key=name.split("/")[0])
        tally.check(name, answer.tokens, answer.finish_reason == "stop", ref)
    return tally


# -- the tests ---------------------------------------------------------------------------------
def test_encoder_and_llm_run_as_separate_replicas_each_on_its_share_of_the_gpu(gpu_app):
    from ray import serve

    deployments = serve.status().applications[gpu_app.name].deployments
    assert ("Encoder" in deployments) != gpu_app.colocated
    llm = serve.get_deployment_handle("LLM", gpu_app.name).memory.remote().result()
    assert llm["device_share"] == SHARE and llm["total_bytes"] > 0
    budget = SHARE * llm["total_bytes"] * UTILIZATION
    # the KV pool: the share's budget less the weights (a few GiB at most), never the whole device
    assert budget - 6 * GIB < llm["kv_cache_bytes"] < budget
    if not gpu_app.colocated:
        encoder = serve.get_deployment_handle("Encoder", gpu_app.name).memory.remote().result()
        assert encoder["device_share"] == SHARE and 0 < encoder["reserved_bytes"] <= SHARE * encoder["total_bytes"]


@pytest.mark.parametrize("call", list(CALLS))
def test_each_case_equals_bf16_generate_or_splits_at_a_near_tie(gpu_app, call):
    """Text, one image, three images of different sizes, a video: one request at a time."""
    _tiny_only(gpu_app)
    named = [(f"{name}/{call}", cases()[name]) for name in EQUIVALENCE_CASES]
    tally = _check_all(gpu_app, named, [CALLS[call](gpu_app, messages) for _, messages in named])
    print(f"{gpu_app.name} {call} vs bf16 generate: {tally.summary(len(named))}")


def test_concurrent_mixed_requests_over_http_and_grpc_equal_bf16_generate_or_split_at_near_ties(gpu_app):
    """The engine tests' 18 mixed prompts (text, images, videos, a long prompt), each over HTTP and
    over gRPC (streamed every other one): 36 requests at once, batched together on the GPU."""
    _tiny_only(gpu_app)
    calls = ("http", "grpc-stream", "http-stream", "grpc")
    named = [(f"{name}/{calls[(i + k) % 4]}", messages) for i, (name, messages) in enumerate(mixed_cases())
             for k in (0, 1)]
    with ThreadPoolExecutor(len(named)) as pool:
        answers = list(pool.map(lambda nm: CALLS[nm[0].split("/")[1]](gpu_app, nm[1]), named))
    tally = _check_all(gpu_app, named, answers)
    print(f"{gpu_app.name} concurrent vs bf16 generate: {tally.summary(len(named))}")
    assert tally.exact >= len(named) // 2


def _burst(model_dir: str, tiny: bool) -> list[list[dict]]:
    """Mixed requests; on the full-size model with real image sizes (up to 1344x896, 3 a request)
    and an 8-frame 448^2 video."""
    if tiny:
        return [messages for _, messages in mixed_cases()] * 3

    def user(*parts):
        return [{"role": "user", "content": list(parts)}]

    def image(h, w, seed):
        return {"type": "image", "bytes": image_bytes(h, w, seed)}

    text = {"type": "text", "text": "Describe everything you see, in detail. " * 8}
    shapes = [
        user(text),
        user(image(448, 448, 1), text),
        user(image(1024, 1024, 2), text),
        user(image(224, 224, 3), image(672, 448, 4), image(896, 1344, 5), text),
        user({"type": "video", "frames": video_frames(8, 448, 448, 6), "fps": 2.0}, text),
    ]
    return [shapes[i % len(shapes)] for i in range(40)]


def test_a_burst_of_mixed_requests_runs_out_of_memory_in_neither_replica(gpu_app):
    from ray import serve

    burst = _burst(gpu_app.model_dir, tiny=gpu_app.name != "gpu-full-size")
    protocols = ("http-stream", "grpc-stream")
    with ThreadPoolExecutor(len(burst)) as pool:
        answers = list(pool.map(lambda im: CALLS[protocols[im[0] % 2]](gpu_app, im[1], max_tokens=32, ignore_eos=True),
                                enumerate(burst)))
    assert [len(a.tokens) for a in answers] == [32] * len(burst)  # every one completed: no 503, no 500
    assert serve.status().applications[gpu_app.name].status == "RUNNING"
    names = ["LLM"] if gpu_app.colocated else ["LLM", "Encoder"]
    for name in names:
        memory = serve.get_deployment_handle(name, gpu_app.name).memory.remote().result()
        assert memory["max_reserved_bytes"] <= SHARE * memory["total_bytes"], (name, memory)
    stats = serve.get_deployment_handle("LLM", gpu_app.name).stats.remote().result()
    assert stats["kv_blocks_used"] == 0  # every request's blocks were freed
