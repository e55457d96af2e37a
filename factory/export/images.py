"""Multimodal sequences in TRL's vision layout: content parts with image placeholders, plus an `images` column.

Stored groups carry their pictures two ways (see `environments/shape_count.py`):
as OpenAI-style content parts in `messages` (`{"type": "image_url", "image_url":
{"url": "data:image/png;base64,..."}}`) and in the group's `images` field (a
list of base64 strings or data URLs). TRL's vision trainers read messages whose
content is a list of `{"type": "image"}` / `{"type": "text", "text": ...}` parts
and an `images` column with one picture per placeholder, in order; `datasets`
stores a picture as the struct {bytes: binary, path: string}. Here the bytes
are the stored picture's bytes exactly (base64-decoded, never re-encoded).

Pictures come from the message parts when there are any (they say where the
picture goes); otherwise the group's `images` are put, in order, before the
text of the first user message. Only inline pictures (base64 or data URLs)
can be exported; a sequence with any other picture is left out, counted.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

import pyarrow as pa

from factory.export.select import MULTIMODAL_SKIPPED  # noqa: F401  (its drop reason; defined with the others)
IMAGE_NOT_INLINE = "image_not_inline"
IMAGE_IN_COMPLETION = "image_in_completion"
UNKNOWN_PART = "unknown_content_part"

PART_TYPE = pa.struct([pa.field("type", pa.string()), pa.field("text", pa.string())])
VISION_MESSAGES_TYPE = pa.list_(pa.struct([pa.field("role", pa.string()), pa.field("content", pa.list_(PART_TYPE))]))
IMAGES_TYPE = pa.list_(pa.struct([pa.field("bytes", pa.binary()), pa.field("path", pa.string())]))
# `datasets` reads this schema metadata as the column's feature, so `load_dataset("parquet", ...)` yields pictures.
# "Sequence" (not datasets 4's "List") is understood by old and new `datasets` alike.
_IMAGES_FEATURE = {"feature": {"_type": "Image"}, "_type": "Sequence"}
HF_FEATURES_METADATA = {b"huggingface": json.dumps({"info": {"features": {"images": _IMAGES_FEATURE}}}).encode()}

IMAGE_PART_TYPES = ("image_url", "image", "input_image")


class Skip(ValueError):
    """This sequence cannot be exported as a vision row; `reason` is the drop reason counted in the stats."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def decode_image(value: Any) -> bytes:
    """The bytes of an inline picture: a `data:...;base64,` URL or a bare base64 string."""
    if isinstance(value, dict):  # {"url": ...} as in OpenAI's image_url parts
        value = value.get("url")
    if not isinstance(value, str):
        raise Skip(IMAGE_NOT_INLINE)
    if value.startswith("data:"):
        header, _, value = value.partition(",")
        if not header.endswith(";base64"):
            raise Skip(IMAGE_NOT_INLINE)
    elif "://" in value:
        raise Skip(IMAGE_NOT_INLINE)
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise Skip(IMAGE_NOT_INLINE) from None


def _part_image(part: dict[str, Any]) -> Any:
    kind = part.get("type")
    if kind == "image_url":
        return part.get("image_url")
    if kind == "input_image":
        return part.get("image_url") or part.get("image")
    return part.get("image") or part.get("url") or part.get("data")


def has_images(messages: Any, group_images: Any) -> bool:
    """Whether a sequence is multimodal: the group has pictures or a message has an image part."""
    if group_images:
        return True
    if not isinstance(messages, list):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(
            isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES for part in content
        ):
            return True
    return False


def vision_messages(messages: Any, group_images: Any) -> tuple[list[dict[str, Any]], list[bytes]]:
    """(messages with content parts and image placeholders, the pictures' bytes in placeholder order); raises Skip."""
    if not isinstance(messages, list):
        raise Skip("unrenderable")
    out: list[dict[str, Any]] = []
    pictures: list[bytes] = []
    for message in messages:
        if not isinstance(message, dict):
            raise Skip("unrenderable")
        content = message.get("content")
        if isinstance(content, str):
            parts = [{"type": "text", "text": content}]
        elif isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict):
                    raise Skip(UNKNOWN_PART)
                if part.get("type") == "text" and isinstance(part.get("text"), str):
                    parts.append({"type": "text", "text": part["text"]})
                elif part.get("type") in IMAGE_PART_TYPES:
                    pictures.append(decode_image(_part_image(part)))
                    parts.append({"type": "image", "text": None})
                else:
                    raise Skip(UNKNOWN_PART)
        else:
            raise Skip("unrenderable")
        out.append({"role": str(message.get("role")), "content": parts})
    if not pictures and group_images:
        if not isinstance(group_images, list):
            group_images = [group_images]
        pictures = [decode_image(image) for image in group_images]
        first_user = next((m for m in out if m["role"] == "user"), None)
        if first_user is None:
            raise Skip(IMAGE_NOT_INLINE)
        first_user["content"] = [{"type": "image", "text": None} for _ in pictures] + first_user["content"]
    return out, pictures


def count_placeholders(messages: list[dict[str, Any]]) -> int:
    return sum(part["type"] == "image" for message in messages for part in message["content"])


def image_column(pictures: list[bytes]) -> list[dict[str, Any]]:
    """The `images` cell of one row, as `datasets.Image` stores a picture."""
    return [{"bytes": picture, "path": None} for picture in pictures]
