"""The checked-in generated code matches the .proto files (regenerate: `python -m protos.generate`)."""

import importlib
import re

import pytest
from google.protobuf import descriptor_pb2

from protos.generate import descriptor_set, proto_files


def _module(proto: str, suffix: str):
    return importlib.import_module(proto.removesuffix(".proto").replace("/", ".") + suffix)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[str, descriptor_pb2.FileDescriptorProto]:
    out = tmp_path_factory.mktemp("protoc") / "set.pb"
    descriptor_set(out)
    files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    for f in files:  # protoc adds json_name to descriptor sets only, never to generated code
        for message in _messages(f.message_type):
            for field in message.field:
                field.ClearField("json_name")
    return {f.name: f for f in files}


def _messages(messages):
    for message in messages:
        yield message
        yield from _messages(message.nested_type)


@pytest.mark.parametrize("proto", proto_files())
def test_generated_messages_match_proto(compiled, proto):
    checked_in = descriptor_pb2.FileDescriptorProto.FromString(_module(proto, "_pb2").DESCRIPTOR.serialized_pb)
    assert checked_in == compiled[proto], f"{proto} changed: run `python -m protos.generate`"


@pytest.mark.parametrize("proto", proto_files())
def test_generated_stubs_match_proto(compiled, proto):
    grpc_module = _module(proto, "_pb2_grpc")
    source = open(grpc_module.__file__).read()
    package = compiled[proto].package
    expected = {f"/{package}.{s.name}/{m.name}" for s in compiled[proto].service for m in s.method}
    assert set(re.findall(r"'(/[\w.]+/\w+)'", source)) == expected
    for service in compiled[proto].service:
        assert hasattr(grpc_module, f"add_{service.name}Servicer_to_server")


def test_packages_importable_by_path():
    from protos.mmserve.v1 import encoder_pb2, vlm_pb2

    assert vlm_pb2.DESCRIPTOR.services_by_name["VLMService"].full_name == "mmserve.v1.VLMService"
    assert encoder_pb2.DESCRIPTOR.services_by_name["EncoderService"].full_name == "mmserve.v1.EncoderService"
