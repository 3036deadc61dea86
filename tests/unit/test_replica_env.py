"""The builder touches no disk; replicas resolve the model and secrets on their own node."""

import asyncio
import sys
import threading

import pytest
from pydantic import ValidationError

from deployments.config import AppArgs, GrpcArgs
from deployments import replica_env
from deployments.serve.app import build_app
from deployments.serve.encoder import EncoderDeployment
from deployments.serve.llm import LLMDeployment
from deployments.serve.router import Router


class _FileAccess:
    """Records files opened (not imports) while `active`; audit hooks cannot be removed, so one."""

    active = False
    opened: list[str] = []

    @classmethod
    def hook(cls, event, args):
        if cls.active and event == "open" and isinstance(args[0], str) and not args[0].endswith((".py", ".pyc")):
            cls.opened.append(args[0])


sys.addaudithook(_FileAccess.hook)


@pytest.mark.parametrize("model", [None, "/nonexistent/checkpoint"])
def test_build_app_touches_no_disk(model, tmp_path, monkeypatch):
    from ray.serve import Application

    cache = tmp_path / "cache"
    monkeypatch.setenv("MMSERVE_CACHE", str(cache))
    build_app({"model": None})  # first call: lazy imports done outside the recorded window
    _FileAccess.opened.clear()
    _FileAccess.active = True
    try:
        app = build_app({"model": model})
    finally:
        _FileAccess.active = False
    assert isinstance(app, Application)
    assert _FileAccess.opened == []
    assert not cache.exists()  # the tiny model is built by replicas, on their nodes


@pytest.mark.parametrize("replica", ["router", "encoder", "llm"])
def test_missing_model_fails_the_replica_naming_the_path(replica):
    args = AppArgs(model="/models/not-mounted-here", served_model_name="m", dtype="float32", device="cpu")
    with pytest.raises(FileNotFoundError, match="/models/not-mounted-here.*mount the model volume"):
        if replica == "router":
            cls = Router.func_or_class  # Serve's ingress wrapper: an async __init__
            asyncio.run(cls.__init__(cls.__new__(cls), None, None, args))
        elif replica == "encoder":
            EncoderDeployment.func_or_class(args)
        else:
            LLMDeployment.func_or_class(args)


def test_replicas_on_one_node_build_the_tiny_model_once(tmp_path, monkeypatch):
    import mmserve.tiny

    monkeypatch.setenv("MMSERVE_CACHE", str(tmp_path))
    builds = []

    def fake_build(family, out_dir, seed=0):
        builds.append(out_dir)
        threading.Event().wait(0.2)  # long enough for every other replica to be waiting on the lock
        out_dir.mkdir(parents=True)
        (out_dir / "mmserve_tiny.json").write_text("{}")
        return out_dir

    monkeypatch.setattr(mmserve.tiny, "build_tiny_model", fake_build)
    results = []
    threads = [threading.Thread(target=lambda: results.append(replica_env.resolve_model_dir(None))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1
    assert results == [str(mmserve.tiny.default_model_dir())] * 4


def test_served_model_name_needs_no_disk():
    assert replica_env.model_name("/models/Qwen2-VL-2B-Instruct/") == "Qwen2-VL-2B-Instruct"
    assert replica_env.model_name(None) == "tiny-qwen2_vl-seed0"


def test_secrets_are_read_from_the_environment_on_the_replica(monkeypatch, tiny_models):
    monkeypatch.setenv("MMSERVE_TEST_TOKEN", "s3cret")
    args = AppArgs(api_key_env="MMSERVE_TEST_KEY", transport="grpc", grpc={"token_env": "MMSERVE_TEST_TOKEN"})
    assert "s3cret" not in args.model_dump_json()
    assert args.grpc.on_node().token == "s3cret"
    monkeypatch.delenv("MMSERVE_TEST_KEY", raising=False)
    with pytest.raises(RuntimeError, match="api_key_env: environment variable MMSERVE_TEST_KEY is not set"):
        replica_env.secret(None, args.api_key_env, "api_key_env")
    monkeypatch.setenv("MMSERVE_TEST_KEY", "k")
    monkeypatch.setattr("deployments.replica_env.resolve_model_dir", lambda model: tiny_models["qwen2_vl"])
    resolved = args.on_node()  # the Router's
    assert (resolved.api_key, resolved.model, resolved.grpc.token) == ("k", tiny_models["qwen2_vl"], "s3cret")
    assert resolved.engine.max_model_len == 4096 and args.on_node(api_key=False).api_key is None  # an LLM replica's


def test_secret_value_and_env_name_are_exclusive():
    with pytest.raises(ValidationError, match="api_key or api_key_env"):
        AppArgs(api_key="k", api_key_env="MMSERVE_API_KEY")
    with pytest.raises(ValidationError, match="grpc.token or grpc.token_env"):
        GrpcArgs(token="t", token_env="MMSERVE_GRPC_TOKEN")
    with pytest.raises(ValidationError):
        AppArgs(api_key_env="not a variable name")


def test_replicas_at_start_count_each_model_deployment():
    assert AppArgs().replicas_at_start("llm") == AppArgs().replicas_at_start("encoder") == 1
    args = AppArgs(llm={"num_replicas": 3}, encoder={"num_replicas": 2})
    assert (args.replicas_at_start("llm"), args.replicas_at_start("encoder")) == (3, 2)
    assert AppArgs(encoder_pool={"autoscale": True, "min_replicas": 0}).replicas_at_start("encoder") == 1
    assert AppArgs(llm={"autoscaling": {"min_replicas": 2, "max_replicas": 4}}).replicas_at_start("llm") == 2
    assert AppArgs(video_decoder={"num_replicas": 2}).replicas_at_start("video_decoder") == 2
    assert AppArgs(video_decode={"autoscale": True, "min_replicas": 3}).replicas_at_start("video_decoder") == 3


def test_decode_threads_are_a_workers_share_of_the_node_or_follow_the_setting():
    cores = replica_env.node_cores()
    assert replica_env.decode_threads(None, 1, 2) == max(1, cores // 2)
    assert replica_env.decode_threads(None, cores, 2) == 1
    assert replica_env.decode_threads(5, 1, 2) == 5


def test_decode_segments_are_the_replicas_share_of_the_node_or_follow_the_setting():
    cores = replica_env.node_cores()
    assert replica_env.decode_segments(None, 1, 1) == cores
    assert replica_env.decode_segments(None, cores, 1) == 1
    assert replica_env.decode_segments(None, cores, 3) == 3  # never fewer than the video's threads
    assert replica_env.decode_segments(4, 1, 1) == 4


def test_cpu_threads_divide_the_node_among_a_deployments_replicas_or_follow_the_setting():
    import torch

    before = torch.get_num_threads()
    try:
        cores = replica_env.node_cores()
        assert replica_env.set_cpu_threads(None, 2, "LLM") == max(1, cores // 2) == torch.get_num_threads()
        assert replica_env.set_cpu_threads(None, 10 * cores, "LLM") == 1
        assert replica_env.set_cpu_threads(3, 2, "Encoder") == 3 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValidationError, match="cpu_threads"):
        AppArgs(llm={"cpu_threads": 0})
