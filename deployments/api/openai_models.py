"""OpenAI-compatible request bodies (pydantic, validated at the HTTP edge only)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, create_model

from deployments.core.generation import SAMPLING_OPTIONS, GenerationOptions
from mmserve.settings import setting_name, type_hints


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Model):
    type: Literal["text"]
    text: str


class ImageURL(_Model):
    url: str
    detail: str | None = None


class ImageURLPart(_Model):
    type: Literal["image_url"]
    image_url: ImageURL


class VideoPart(_Model):
    """Qwen's OpenAI-compatible video part: frames as URLs, all used, none resampled."""

    type: Literal["video"]
    video: list[str] = Field(min_length=1)
    fps: float = Field(default=2.0, gt=0)


class VideoURLPart(_Model):
    """A video file (mp4, webm, mkv, mov) decoded and sampled on the server, as vLLM takes it."""

    type: Literal["video_url"]
    video_url: ImageURL


class MMProcessorKwargs(_Model):
    """vLLM's `mm_processor_kwargs`, as far as they reach video files: the frames the processor's
    `sample_frames` picks, at `fps` or `num_frames` (one of them; ranges checked by the core)."""

    fps: float | None = None
    num_frames: int | None = None


ContentPart = Annotated[Union[TextPart, ImageURLPart, VideoPart, VideoURLPart], Field(discriminator="type")]


# A string or a list of parts, chosen by the value's type: a bad part is reported as
# "messages.0.content.1.image_url...", without the unrelated "content.str: ..." branch error.
Content = Annotated[
    Union[Annotated[str, Tag("text")], Annotated[list[ContentPart], Tag("parts")]],
    Discriminator(lambda value: "text" if isinstance(value, str) else "parts"),
]


class FunctionCall(_Model):
    name: str
    arguments: str = "{}"  # JSON text of an object


class ToolCallModel(_Model):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatCompletionMessage(_Model):
    role: str  # checked by the request core, as for gRPC
    content: Content | None = None  # None: an assistant turn of tool calls only
    tool_calls: list[ToolCallModel] | None = None
    tool_call_id: str | None = None


class FunctionSpec(_Model):
    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # arguments are always held to `parameters` when a call is forced


class ToolModel(_Model):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Model):
    include_usage: bool = False


class JSONSchemaFormat(_Model):
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(alias="schema")
    strict: bool | None = None  # the schema is enforced either way (a grammar masks the tokens)


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


# The sampling options as `GenerationOptions` declares them, under their names in the API
# (`top_logprobs`), each optional (None: the model's default); their ranges are checked there, for
# HTTP and gRPC alike (`openai_api.options`)
_SamplingOptions = create_model("_SamplingOptions", __base__=_Model, __module__=__name__, **{
    setting_name(f): (type_hints(GenerationOptions)[f.name] | None, None) for f in SAMPLING_OPTIONS})


class ChatCompletionRequest(_SamplingOptions):
    model: str | None = None
    messages: list[ChatCompletionMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name of max_tokens (it wins when both are sent)
    logprobs: bool = False
    stop: str | list[str] | None = None
    stream: bool = False
    return_token_ids: bool = False  # vLLM extension: generated token ids in each choice / chunk
    return_stage_times: bool = False  # mmserve extension: usage.stage_ms, milliseconds per stage of the request
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolModel] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    mm_processor_kwargs: MMProcessorKwargs | None = None  # vLLM extension: video files' sampling
