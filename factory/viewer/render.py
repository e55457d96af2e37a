"""Templates and view models shared by the viewer and `process` mode's self-contained `groups.html`.

Jinja autoescaping is on for every template, so text from the model (prompts,
completions, item keys, image values) is always shown as text. Images (the
`images` field, and `image_url` content parts of messages) are drawn only
from `data:` URLs declaring PNG, JPEG, GIF or WebP, or raw base64 whose bytes
are one of those; anything else (remote URLs, SVG, unknown strings) is listed
as text and never fetched. The prompt is every turn before the first
assistant turn and a completion every turn from there, so multi-turn
episodes are shown whole.

Characters that change how text around them reads without showing themselves
(bidi controls such as RIGHT-TO-LEFT OVERRIDE, zero-width and other format
characters, tag characters, control characters, invisible fillers) are never
written raw: every `{{ }}` output shows them as a marker such as `⟨U+202E RLO⟩`,
and message text (`reveal`) also highlights the marker with its Unicode name.
Zero-width (non-)joiners stay, as Persian, Indic scripts and emoji need them.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import unicodedata
from collections.abc import Iterable
from importlib import resources
from typing import Any

from jinja2 import Environment, PackageLoader, select_autoescape
from markupsafe import Markup, escape

MASK_IGNORE = -100
MAX_IMAGES = 16
_IMAGE_MAGIC = ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF87a", "image/gif"),
                (b"GIF89a", "image/gif"))
_DATA_URL = re.compile(r"^data:(image/(?:png|jpeg|gif|webp));base64,([A-Za-z0-9+/=\s]+)$")
_BASE64 = re.compile(r"^[A-Za-z0-9+/=\s]{32,}$")


INVISIBLE = re.compile(
    "[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u00ad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2"
    "\u115f\u1160\u180e\u200b\u200e\u200f\u2028-\u202e\u2060-\u2064\u2066-\u206f\u3164\ufeff\uffa0"
    "\ufff9-\ufffb\U000110bd\U000110cd\U00013430-\U0001343f\U0001bca0-\U0001bca3\U0001d173-\U0001d17a"
    "\U000e0001\U000e0020-\U000e007f\U000e0100-\U000e01ef]")
"""Characters shown as markers: C0/C1 controls but tab and newlines, every format (Cf) character except the
zero-width joiner and non-joiner, line/paragraph separators, Hangul fillers, tag characters and the variation
selectors of the supplement (both used to hide text in plain sight)."""
_SHORT = {0x202A: "LRE", 0x202B: "RLE", 0x202C: "PDF", 0x202D: "LRO", 0x202E: "RLO", 0x2066: "LRI", 0x2067: "RLI",
          0x2068: "FSI", 0x2069: "PDI", 0x200E: "LRM", 0x200F: "RLM", 0x061C: "ALM", 0x200B: "ZWSP", 0xFEFF: "BOM",
          0x00AD: "SHY", 0x2060: "WJ", 0x2028: "LSEP", 0x2029: "PSEP"}


def invisible_label(char: str) -> str:
    """The marker text of one invisible character: `U+202E RLO`, `U+0007`, `U+E0041 TAG`."""
    code = ord(char)
    short = _SHORT.get(code) or ("TAG" if 0xE0000 <= code <= 0xE007F else "VS" if code >= 0xE0100 else "")
    return f"U+{code:04X}" + (f" {short}" if short else "")


def mark_invisible(value: Any) -> Any:
    """Every `{{ }}` output (Jinja's finalize): plain text with invisible characters as `⟨U+202E RLO⟩` markers.

    The markers hold no markup, so this is safe in attributes and titles too; Markup (already rendered HTML,
    e.g. from `reveal` or `tojson`) passes through."""
    if isinstance(value, str) and not isinstance(value, Markup) and INVISIBLE.search(value):
        return INVISIBLE.sub(lambda m: f"⟨{invisible_label(m[0])}⟩", value)
    return value


def reveal(value: Any) -> Markup:
    """Text for element content: escaped, each invisible character a highlighted marker naming it."""
    text = value if isinstance(value, str) else str(value)
    parts, last = [], 0
    for match in INVISIBLE.finditer(text):
        parts.append(escape(text[last:match.start()]))
        name = unicodedata.name(match[0], "control character")
        parts.append(Markup('<mark class="invisible" title="{}">⟨{}⟩</mark>').format(name, invisible_label(match[0])))
        last = match.end()
    parts.append(escape(text[last:]))
    return Markup("").join(parts)


def environment() -> Environment:
    """The Jinja environment of the viewer's templates (autoescape on for everything, invisible characters marked)."""
    env = Environment(loader=PackageLoader("factory.viewer", "templates"), autoescape=select_autoescape(default=True,
                      default_for_string=True), trim_blocks=True, lstrip_blocks=True, finalize=mark_invisible)
    env.filters["fmt"] = fmt_number
    env.filters["image_part"] = image_part
    env.filters["reveal"] = reveal
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


def image_part(part: Any) -> str | None:
    """The `data:` URL of an OpenAI-style image content part (`{"type": "image_url", "image_url": {"url": ...}}`)."""
    if not isinstance(part, dict) or part.get("type") not in ("image_url", "image"):
        return None
    url = part.get("image_url", part.get("image"))
    url = url.get("url") if isinstance(url, dict) else url
    return _image_entry(url).get("src") if isinstance(url, str) else None


def _image_entry(value: str) -> dict[str, str]:
    text = value.strip()
    if match := _DATA_URL.match(text):
        # A data: URL of a raster image type can only ever draw pixels in an <img>; it is shown as declared.
        return {"src": f"data:{match[1]};base64,{re.sub(r'[^A-Za-z0-9+/=]', '', match[2])}"}
    if _BASE64.match(text):
        payload = re.sub(r"\s", "", text)
        try:
            mime = _sniff(base64.b64decode(payload[:64]))
        except (binascii.Error, ValueError):
            mime = None
        if mime is not None:
            return {"src": f"data:{mime};base64,{payload}"}
    return {"text": text[:200] + ("…" if len(text) > 200 else "")}


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
    # The prompt is everything before the first assistant turn; a completion is every turn from there (multi-turn).
    start = next((k for k, m in enumerate(first) if isinstance(m, dict) and m.get("role") == "assistant"), len(first))
    prompt = first[:start]
    best = max(scores) if scores else None
    completions = []
    for index, score in enumerate(scores):
        conversation = conversations[index] if index < len(conversations) else []
        conversation = conversation if isinstance(conversation, list) else []
        reply = conversation[start:]
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
