"""OpenAI-compatible request bodies (pydantic, validated at the HTTP edge only)."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field


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


ContentPart = Annotated[Union[TextPart, ImageURLPart, VideoPart], Field(discriminator="type")]


class ChatMessage(_Model):
    role: Literal["system", "user", "assistant"]
    content: str | list[ContentPart]


class StreamOptions(_Model):
    include_usage: bool = False


class ChatCompletionRequest(_Model):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    seed: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    return_token_ids: bool = False  # vLLM extension: generated token ids in each choice / chunk
    stream_options: StreamOptions | None = None
