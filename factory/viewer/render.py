"""Templates and view models shared by the viewer and `process` mode's self-contained `groups.html`.

Jinja autoescaping is on for every template, so text from the model (prompts,
completions, item keys, image values) is always shown as text. Images are
shown only as `data:` URLs of PNG, JPEG, GIF or WebP bytes; anything else
(remote URLs, SVG, unknown strings) is listed as text and never fetched.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Iterable
from importlib import resources
from typing import Any

from jinja2 import Environment, PackageLoader, select_autoescape

MASK_IGNORE = -100
MAX_IMAGES = 16
_IMAGE_MAGIC = ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF87a", "image/gif"),
                (b"GIF89a", "image/gif"))
_DATA_URL = re.compile(r"^data:(image/(?:png|jpeg|gif|webp));base64,([A-Za-z0-9+/=\s]+)$")
_BASE64 = re.compile(r"^[A-Za-z0-9+/=\s]{32,}$")


def environment() -> Environment:
    """The Jinja environment of the viewer's templates (autoescape on for everything)."""
    env = Environment(loader=PackageLoader("factory.viewer", "templates"), autoescape=select_autoescape(default=True,
                      default_for_string=True), trim_blocks=True, lstrip_blocks=True)
    env.filters["fmt"] = fmt_number
    env.filters["content_parts"] = content_parts
    return env


def stylesheet() -> str:
    """The viewer's CSS, inlined into self-contained pages."""
    return resources.files("factory.viewer").joinpath("static/viewer.css").read_text(encoding="utf-8")


def fmt_number(value: Any, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def _json(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _sniff(raw: bytes) -> str | None:
    for magic, mime in _IMAGE_MAGIC:
        if raw.startswith(magic):
            return mime
    if raw[:4] == b"RIFF" and raw[8:12] == b"WEBP":
        return "image/webp"
    return None


def image_sources(images: Any) -> list[dict[str, str]]:
    """Displayable images of a group: `{"src": data URL}` for image bytes, `{"text": ...}` for anything else."""
    found: list[dict[str, str]] = []

    def walk(value: Any) -> None:
        if len(found) >= MAX_IMAGES or value is None:
            return
        if isinstance(value, list | tuple):
            for item in value:
                walk(item)
        elif isinstance(value, dict):
            for key in ("url", "image_url", "data", "image", "b64_json"):
                if key in value:
                    walk(value[key])
                    return
            found.append({"text": json.dumps(value)[:200]})
        elif isinstance(value, str):
            found.append(_image_entry(value))
        else:
            found.append({"text": str(value)[:200]})

    walk(_json(images))
    return found


def _image_entry(value: str) -> dict[str, str]:
    text = value.strip()
    if match := _DATA_URL.match(text):
        payload = re.sub(r"\s", "", match[2])
        try:
            mime = _sniff(base64.b64decode(payload[:64] + "=" * (-len(payload[:64]) % 4)))
        except (binascii.Error, ValueError):
            mime = None
        if mime is not None:
            return {"src": f"data:{mime};base64,{payload}"}
    elif _BASE64.match(text):
        payload = re.sub(r"\s", "", text)
        try:
            mime = _sniff(base64.b64decode(payload[:64]))
        except (binascii.Error, ValueError):
            mime = None
        if mime is not None:
            return {"src": f"data:{mime};base64,{payload}"}
    return {"text": text[:200] + ("…" if len(text) > 200 else "")}


def content_parts(content: Any) -> list[dict[str, str]]:
    """A message's content as parts to show: `{"text": ...}`, or `{"src": data URL}` for an image part."""
    if isinstance(content, str):
        return [{"text": content}]
    if not isinstance(content, list):
        return [{"text": json.dumps(content)}]
    parts = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "image_url":
            url = part.get("image_url")
            parts.append(_image_entry(str(url.get("url", "") if isinstance(url, dict) else url or "")))
        elif isinstance(part, dict) and part.get("type") == "text":
            parts.append({"text": str(part.get("text", ""))})
        else:
            parts.append({"text": json.dumps(part)})
    return parts


def group_view(row: dict[str, Any], lengths: list[int] | None = None) -> dict[str, Any]:
    """What a page shows of one group: prompt, completions (score, length, policy version), images.

    `row` is a stored row (JSON fields as text) or a group dict (JSON fields
    as objects); lengths come from `tokens` when not given.
    """
    scores = [float(s) for s in row.get("scores") or []]
    conversations = _json(row.get("messages")) or [[] for _ in scores]
    tokens = row.get("tokens")
    masks = row.get("masks")
    if lengths is None:
        lengths = [len(t) for t in tokens] if tokens is not None else [0] * len(scores)
    first = conversations[0] if conversations and isinstance(conversations[0], list) else []
    # The prompt ends at the model's first turn; a multi-turn episode's later user/tool turns belong to the reply.
    start = next((k for k, m in enumerate(first) if isinstance(m, dict) and m.get("role") == "assistant"), len(first))
    prompt = first[:start]
    best = max(scores) if scores else None
    completions = []
    for index, score in enumerate(scores):
        conversation = conversations[index] if index < len(conversations) and isinstance(conversations[index], list) else []
        reply = conversation[len(prompt):] if conversation[: len(prompt)] == prompt else conversation[-1:]
        trained = sum(1 for m in masks[index] if m != MASK_IGNORE) if masks is not None else None
        completions.append({
            "index": index, "score": score, "length": lengths[index] if index < len(lengths) else None,
            "completion_tokens": trained, "messages": reply, "best": score == best,
        })
    return {
        "group_id": row.get("group_id", ""), "env": row.get("env", ""), "item_key": row.get("item_key", ""),
        "run_id": row.get("run_id", ""), "policy_version": row.get("policy_version"),
        "created_at": row.get("created_at"), "scores": scores, "prompt": prompt, "completions": completions,
        "images": image_sources(row.get("images")), "generation_params": _json(row.get("generation_params")),
    }


def render_static_groups(groups: Iterable[dict[str, Any]], *, title: str, total: int | None = None,
                         limit: int = 500, source_name: str = "") -> str:
    """A self-contained HTML page (CSS inlined, no scripts, no external assets) of groups, for `process` mode."""
    views, shown = [], 0
    for group in groups:
        if shown >= limit:
            break
        views.append(group_view(group))
        shown += 1
    return environment().get_template("static_groups.html").render(
        title=title, groups=views, limit=limit, truncated=total is not None and total > shown, total=total,
        source_name=source_name, inline_css=stylesheet(),
    )
