"""The running Serve app over a real gRPC channel (Serve's gRPC proxy in front of the Router)."""

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from mmserve.rpc.vlm_client import VLMClient, user
from protos.mmserve.v1 import vlm_pb2
from tests.serve.test_serve_app import MAX_TOKENS, chat, check_embedding_stages, client, image_case, video_case
from tests.support.cases import proto_messages
from tests.support.media_factory import image_bytes
from tests.support.reference import reference_generate

pytestmark = pytest.mark.serve


@pytest.mark.parametrize("case", [image_case, video_case])
def test_grpc_equals_http_and_monolithic(serve_urls, grpc_target, family, tiny_models, case):
    ref_messages, api_messages = case()
    expected = reference_generate(tiny_models[family], ref_messages, MAX_TOKENS)
    http_text, http_tokens = chat(client(serve_urls, family), api_messages)
    with VLMClient(grpc_target, application=family) as c:
        unary = c.generate(proto_messages(ref_messages), max_tokens=MAX_TOKENS, request_id="unary-1")
        streamed = list(c.stream(proto_messages(ref_messages), max_tokens=MAX_TOKENS))
    assert list(unary.token_ids) == expected == http_tokens
    assert unary.text == http_text and unary.request_id == "unary-1"
    assert [t for r in streamed for t in r.token_ids] == expected
    assert "".join(r.text for r in streamed) == http_text
    last = streamed[-1]
    assert last.finish_reason == unary.finish_reason != ""
    assert last.usage == unary.usage
    assert unary.usage.completion_tokens == len(expected)
    assert 0 < unary.usage.image_tokens < unary.usage.prompt_tokens
    assert all(not r.finish_reason for r in streamed[:-1])


def test_grpc_usage_carries_stage_times_when_asked(grpc_target):
    """`return_stage_times` in the request: usage.stage_ms as HTTP's, the embeddings split into
    encode queue, encode and transfer; the same image again is a cache hit (no encode)."""
    from mmserve.rpc.vlm_client import request

    messages = [user("Describe this.", [image_bytes(64, 96, 4802)])]  # an image no other test sends
    message = request(messages, max_tokens=4, ignore_eos=True)
    message.return_stage_times = True
    with VLMClient(grpc_target, application="qwen2_vl") as c:
        miss = c.stub.Generate(message, metadata=c.metadata, timeout=120).usage.stage_ms
        streamed = list(c.stub.GenerateStream(message, metadata=c.metadata, timeout=120))
        assert not c.generate(messages, max_tokens=4).usage.stage_ms  # not asked
    check_embedding_stages(dict(miss), hit=False)
    check_embedding_stages(dict(streamed[-1].usage.stage_ms), hit=True)
    assert miss["decode_ms"] > 0


def test_corrupt_image_is_invalid_argument_and_next_request_succeeds(grpc_target):
    data = image_bytes(64, 64, 13)
    corrupt = user("What is this?", images=[data[: len(data) // 2]])
    with VLMClient(grpc_target, application="qwen2_vl") as c:
        for call in (lambda: c.generate([corrupt], max_tokens=4, request_id="bad-1"),
                     lambda: list(c.stream([corrupt], max_tokens=4, request_id="bad-1"))):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "decode" in e.value.details()
            assert ("x-request-id", "bad-1") in tuple(e.value.trailing_metadata())
        ok = c.generate([user("hi")], max_tokens=3)
    assert ok.usage.completion_tokens >= 1 and ok.request_id


@pytest.mark.parametrize("request_kw, needle", [
    ({"messages": [vlm_pb2.ChatMessage(role="robot", content=[vlm_pb2.ContentPart(text="hi")])]}, "role"),
    ({"messages": [user("hi")], "sampling": vlm_pb2.SamplingParams(temperature=3.0)}, "temperature"),
    ({"messages": [user("hi")], "model": "other"}, "not served"),
    ({"messages": [user("hello " * 5000)]}, "context"),
])
def test_bad_requests_are_invalid_argument(grpc_target, request_kw, needle):
    channel = grpc.insecure_channel(grpc_target)
    from protos.mmserve.v1 import vlm_pb2_grpc

    with pytest.raises(grpc.RpcError) as e:
        vlm_pb2_grpc.VLMServiceStub(channel).Generate(
            vlm_pb2.GenerateRequest(**request_kw), metadata=(("application", "qwen2_vl"),), timeout=60
        )
    channel.close()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in e.value.details()


def test_client_deadline_is_deadline_exceeded_and_server_recovers(grpc_target):
    with VLMClient(grpc_target, application="qwen2_vl", timeout_s=0.3) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.generate([user("tell a long story")], max_tokens=2000, ignore_eos=True)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    with VLMClient(grpc_target, application="qwen2_vl") as c:
        assert c.generate([user("hi")], max_tokens=2).usage.completion_tokens >= 1


def test_reflection_lists_the_service(grpc_target):
    with grpc.insecure_channel(grpc_target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        [answer] = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in answer.list_services_response.service}
        assert {"mmserve.v1.VLMService", "grpc.health.v1.Health"} <= names
        [answer] = list(stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol="mmserve.v1.VLMService")])
        ))
        assert answer.file_descriptor_response.file_descriptor_proto


def test_health_is_serving(grpc_target, serve_urls):
    with grpc.insecure_channel(grpc_target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "mmserve.v1.VLMService"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service),
                               metadata=(("application", "qwen2_vl"),), timeout=30)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        from ray.serve.generated import serve_pb2, serve_pb2_grpc

        healthz = serve_pb2_grpc.RayServeAPIServiceStub(channel).Healthz(serve_pb2.HealthzRequest(), timeout=30)
        assert healthz.message == "success"
    assert httpx.get(serve_urls["qwen2_vl"] + "/health").status_code == 200  # HTTP still served alongside


def test_cli_chat_over_grpc_streams_the_answer(grpc_target, tmp_path, capsys):
    from deployments.cli.main import main

    path = tmp_path / "img.png"
    path.write_bytes(image_bytes(64, 96, 11))
    with VLMClient(grpc_target, application="qwen2_vl") as c:
        expected = c.generate([user("Describe this.", images=[path.read_bytes()])], max_tokens=6).text
    argv = ["chat", "--grpc", grpc_target, "--application", "qwen2_vl", "--image", str(path),
            "--max-tokens", "6", "Describe this."]
    assert main(argv) == 0
    assert capsys.readouterr().out == expected + "\n"
