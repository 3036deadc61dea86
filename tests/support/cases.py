"""The prompts every equivalence test runs (transformers chat shape, media as bytes), and the same
prompts sent to a served app with the `openai` client."""

from __future__ import annotations

from tests.support.media_factory import data_uri, image_bytes, video_frames

LONG_TEXT = " ".join(f"word{i % 97} and the {i % 13} cat sat on mat number {i}." for i in range(140))


def cases() -> dict[str, list[dict]]:
    def user(*parts):
        return [{"role": "user", "content": list(parts)}]

    def text(t):
        return {"type": "text", "text": t}

    def image(h, w, seed):
        return {"type": "image", "bytes": image_bytes(h, w, seed)}

    def video(n, h, w, seed, fps=2.0):
        return {"type": "video", "frames": video_frames(n, h, w, seed), "fps": fps}

    return {
        "text_only": user(text("Hello, who are you? Tell me about the sky.")),
        "one_image": user(image(64, 96, 1), text("Describe this image.")),
        "three_images": user(
            text("Compare "), image(56, 56, 2), text(" with "), image(120, 40, 3), image(90, 200, 4),
            text(" please."),
        ),
        "video": user(video(4, 56, 84, 5, fps=1.0), text("What happens in the video?")),
        "image_and_video": user(image(80, 60, 6), video(3, 70, 70, 7, fps=4.0), text("Relate them.")),
        "long_prompt": [
            {"role": "system", "content": [text("You are terse.")]},
            {"role": "user", "content": [image(64, 64, 8), text(LONG_TEXT)]},
        ],
    }


def api_messages(messages: list[dict]) -> list[dict]:
    """The reference shape (media as bytes) as OpenAI chat messages (media as data: URIs)."""
    def part(p):
        if p["type"] == "image":
            return {"type": "image_url", "image_url": {"url": data_uri(p["bytes"])}}
        if p["type"] == "video":
            return {"type": "video", "video": [data_uri(f) for f in p["frames"]], "fps": p["fps"]}
        if p["type"] == "video_file":
            return {"type": "video_url", "video_url": {"url": data_uri(p["bytes"], "video/mp4")}}
        return p

    return [{"role": m["role"], "content": [part(p) for p in m["content"]]} for m in messages]


def openai_chat(url: str, model: str, messages: list[dict], max_tokens: int, stream: bool) -> tuple[str, list[int]]:
    """(text, token ids) of one chat completion from the app at `url`, streamed or not."""
    import openai

    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    resp = c.chat.completions.create(model=model, messages=api_messages(messages), max_tokens=max_tokens,
                                     stream=stream, extra_body={"return_token_ids": True})
    if not stream:
        return resp.choices[0].message.content, resp.choices[0].model_extra["token_ids"]
    text, tokens = [], []
    for chunk in resp:
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            tokens += choice.model_extra.get("token_ids", [])
    return "".join(text), tokens
