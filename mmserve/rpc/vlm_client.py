"""A small client of the public gRPC API (`mmserve.v1.VLMService`).

    client = VLMClient("localhost:9000")
    for delta in client.stream([user("What is in this image?", images=[png_bytes])], max_tokens=64):
        print(delta.text, end="")
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import grpc

from protos.mmserve.v1 import vlm_pb2, vlm_pb2_grpc


@dataclass(frozen=True)
class VideoFrames:
    frames: tuple[bytes, ...]
    fps: float = 2.0


def user(text: str, images: Sequence[bytes] = (), videos: Sequence[VideoFrames] = (),
         video_files: Sequence[bytes] = ()) -> vlm_pb2.ChatMessage:
    """A user message: the media first, then the text (the usual VLM prompt layout). `video_files`:
    mp4 / webm / mkv / mov files, decoded and sampled on the server."""
    parts = [vlm_pb2.ContentPart(image=data) for data in images]
    parts += [vlm_pb2.ContentPart(video=vlm_pb2.Video(frames=list(v.frames), fps=v.fps)) for v in videos]
    parts += [vlm_pb2.ContentPart(video_file=data) for data in video_files]
    parts.append(vlm_pb2.ContentPart(text=text))
    return vlm_pb2.ChatMessage(role="user", content=parts)


def request(messages: Sequence[vlm_pb2.ChatMessage], request_id: str = "", model: str = "",
            json_schema: dict | None = None, tools: Sequence[dict] = (), tool_choice: str = "",
            **sampling) -> vlm_pb2.GenerateRequest:
    """`sampling`: max_tokens, temperature, top_p, top_k, seed, stop, stop_token_ids, ignore_eos.
    `json_schema`: the answer is JSON valid against it (`response_format`). `tools`: functions as
    {"name", "description", "parameters": JSON Schema}; `tool_choice`: none, auto, required or a name."""
    fmt = None if json_schema is None else vlm_pb2.ResponseFormat(type="json_schema",
                                                                  json_schema=json.dumps(json_schema))
    specs = [vlm_pb2.Tool(name=t["name"], description=t.get("description", ""),
                          parameters=json.dumps(t["parameters"]) if t.get("parameters") else "") for t in tools]
    return vlm_pb2.GenerateRequest(messages=list(messages), sampling=vlm_pb2.SamplingParams(**sampling),
                                   request_id=request_id, model=model, response_format=fmt, tools=specs,
                                   tool_choice=tool_choice)


class VLMClient:
    """Blocking client; `application` names the Serve app when several run behind one proxy."""

    def __init__(self, target: str, api_key: str | None = None, application: str | None = None,
                 root_certificates: bytes | None = None, timeout_s: float | None = 300.0):
        self.timeout_s = timeout_s
        metadata = []
        if api_key:
            metadata.append(("authorization", f"Bearer {api_key}"))
        if application:
            metadata.append(("application", application))
        self.metadata = tuple(metadata)
        self.channel = (grpc.insecure_channel(target) if root_certificates is None else
                        grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates)))
        self.stub = vlm_pb2_grpc.VLMServiceStub(self.channel)

    def generate(self, messages: Sequence[vlm_pb2.ChatMessage], **kw) -> vlm_pb2.GenerateResponse:
        """The whole answer; raises `grpc.RpcError` (code(), details(), trailing_metadata())."""
        return self.stub.Generate(request(messages, **kw), metadata=self.metadata, timeout=self.timeout_s)

    def stream(self, messages: Sequence[vlm_pb2.ChatMessage], **kw) -> Iterator[vlm_pb2.GenerateResponse]:
        """Responses as tokens are generated; the last carries finish_reason and usage."""
        yield from self.stub.GenerateStream(request(messages, **kw), metadata=self.metadata, timeout=self.timeout_s)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> VLMClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
