from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MediaItem(_message.Message):
    __slots__ = ("kind", "frames", "fps", "decoded")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[MediaItem.Kind]
        IMAGE: _ClassVar[MediaItem.Kind]
        VIDEO: _ClassVar[MediaItem.Kind]
    KIND_UNSPECIFIED: MediaItem.Kind
    IMAGE: MediaItem.Kind
    VIDEO: MediaItem.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    DECODED_FIELD_NUMBER: _ClassVar[int]
    kind: MediaItem.Kind
    frames: _containers.RepeatedScalarFieldContainer[bytes]
    fps: float
    decoded: DecodedVideo
    def __init__(self, kind: _Optional[_Union[MediaItem.Kind, str]] = ..., frames: _Optional[_Iterable[bytes]] = ..., fps: _Optional[float] = ..., decoded: _Optional[_Union[DecodedVideo, _Mapping]] = ...) -> None: ...

class DecodedVideo(_message.Message):
    __slots__ = ("pixels", "shape", "fps", "total_num_frames", "indices", "content_hash")
    PIXELS_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    pixels: bytes
    shape: _containers.RepeatedScalarFieldContainer[int]
    fps: float
    total_num_frames: int
    indices: _containers.RepeatedScalarFieldContainer[int]
    content_hash: str
    def __init__(self, pixels: _Optional[bytes] = ..., shape: _Optional[_Iterable[int]] = ..., fps: _Optional[float] = ..., total_num_frames: _Optional[int] = ..., indices: _Optional[_Iterable[int]] = ..., content_hash: _Optional[str] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("item", "return_embedding")
    ITEM_FIELD_NUMBER: _ClassVar[int]
    RETURN_EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    item: MediaItem
    return_embedding: bool
    def __init__(self, item: _Optional[_Union[MediaItem, _Mapping]] = ..., return_embedding: _Optional[bool] = ...) -> None: ...

class EncodeChunk(_message.Message):
    __slots__ = ("request", "data")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    request: EncodeRequest
    data: bytes
    def __init__(self, request: _Optional[_Union[EncodeRequest, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class FetchEmbeddingRequest(_message.Message):
    __slots__ = ("content_hash", "wait_ms")
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    content_hash: str
    wait_ms: int
    def __init__(self, content_hash: _Optional[str] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class EmbeddingHeader(_message.Message):
    __slots__ = ("content_hash", "dtype", "shape", "num_bytes", "key")
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    content_hash: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    num_bytes: int
    key: str
    def __init__(self, content_hash: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., num_bytes: _Optional[int] = ..., key: _Optional[str] = ...) -> None: ...

class EmbeddingChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: EmbeddingHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[EmbeddingHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...
