"""The prompts every equivalence test runs (transformers chat shape, media as bytes)."""

from __future__ import annotations

from tests.media_factory import image_bytes, video_frames

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
