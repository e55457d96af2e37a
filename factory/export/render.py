"""Turn kept sequences into dataset rows in the layouts TRL's SFTTrainer and DPOTrainer read as they are.

SFT rows are `messages` (conversational language modelling), `prompt` +
`completion` when asked, or `text` / string `prompt` + `completion` when
rendered with a tokenizer's chat template. DPO rows are `prompt`, `chosen`,
`rejected`, all message lists or all strings. Rows never carry `input_ids`,
`labels`, `image` or `images` (TRL would take them as pre-tokenized or
vision data), and a `prompt` column never sits next to `messages`.
With `output.images` the rows take TRL's vision layout instead: message
content becomes a list of parts with `{"type": "image"}` placeholders, and an
`images` column holds the pictures' bytes (see `images`). Without it a
multimodal sequence is left out and counted as `multimodal_needs_output_images`
(a text-only row would train on a question about a picture it never shows).
Groups without messages can still be written as text: the prompt is the
decoded masked (-100) tokens, the completion the decoded trained tokens.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import pyarrow as pa

from factory.export import images as vision
from factory.export import select as rules
from factory.export.config import OutputConfig
from factory.export.select import Pair
from factory.export.source import ExportGroup

logger = logging.getLogger(__name__)

Message = dict[str, str]
MESSAGES_TYPE = pa.list_(pa.struct([pa.field("role", pa.string()), pa.field("content", pa.string())]))
RESERVED_COLUMNS = ("input_ids", "labels", "image", "images", "attention_mask", "completion_mask")
_EXTRA = [
    pa.field("group_id", pa.string()),
    pa.field("env", pa.string()),
    pa.field("run_id", pa.string()),
    pa.field("item_key", pa.string()),
]


class RenderError(ValueError):
    """Rows cannot be rendered as configured; the message names the setting and the fix."""


def split_conversation(messages: list[Message]) -> tuple[list[Message], list[Message]] | None:
    """(prompt, completion): the completion is the trailing run of assistant messages; None if there is none."""
    cut = len(messages)
    while cut > 0 and messages[cut - 1].get("role") == "assistant":
        cut -= 1
    if cut == len(messages):
        return None
    return messages[:cut], messages[cut:]


def _clean(messages: Any) -> list[Message] | None:
    if not isinstance(messages, list):
        return None
    cleaned = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, str):
            return None
        role = message.get("role")
        cleaned.append({"role": role if isinstance(role, str) else str(role), "content": content})
    return cleaned


def trl_layout_problem(columns: list[str], kind: str, images: bool = False) -> str | None:
    """Why TRL would misread a dataset with these columns, or None if it reads them as intended.

    `images=True`: the `images` column is meant as TRL's vision data.
    """
    reserved = [c for c in columns if c in RESERVED_COLUMNS and not (images and c == "images")]
    if reserved:
        return f"columns {reserved} are read specially by TRL (pre-tokenized or vision data)"
    if kind == "sft" and "messages" in columns and "prompt" in columns:
        return "a prompt column next to messages switches TRL's SFT to prompt/completion mode"
    if kind == "dpo" and not {"prompt", "chosen", "rejected"} <= set(columns):
        return "DPO rows need prompt, chosen and rejected columns"
    return None


def load_tokenizer(name: str) -> Any:
    """The tokenizer for text rendering; it must have a chat template."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as error:
        raise RenderError(f"cannot load tokenizer {name!r}: {error}; pass a local tokenizer dir as output.tokenizer") from error
    return tokenizer


class Renderer:
    """Builds rows (and their Arrow schema) for one export's kind and output settings."""

    def __init__(self, kind: str, output: OutputConfig, tokenizer: Any | None = None) -> None:
        self.kind = kind
        self.text = output.style == "text"
        self.prompt_completion = output.prompt_completion
        self.extra = output.extra_columns
        self.tokenizer = tokenizer
        self.images = output.images
        self.drop_reason: str | None = None  # why the last sft_row / dpo_row returned None
        if self.text and tokenizer is None:
            raise RenderError("output.style 'text' needs a tokenizer: set output.tokenizer")

    # ---- layout ----
    def content_columns(self) -> list[str]:
        if self.kind == "dpo":
            return ["prompt", "chosen", "rejected"]
        if self.prompt_completion:
            return ["prompt", "completion"]
        return ["text"] if self.text else ["messages"]

    def schema(self) -> pa.Schema:
        value_type = pa.string() if self.text else vision.VISION_MESSAGES_TYPE if self.images else MESSAGES_TYPE
        fields = [pa.field(name, value_type) for name in self.content_columns()]
        if self.images:
            fields.append(pa.field("images", vision.IMAGES_TYPE))
        if self.extra:
            scores = ["score_chosen", "score_rejected"] if self.kind == "dpo" else ["score"]
            fields += [pa.field(name, pa.float64()) for name in scores] + _EXTRA
        schema = pa.schema(fields, metadata=vision.HF_FEATURES_METADATA if self.images else None)
        problem = trl_layout_problem(schema.names, self.kind, images=self.images)
        if problem:
            raise RenderError(f"refusing to write columns {schema.names}: {problem}")
        return schema

    # ---- one sequence ----
    def _parts(self, group: ExportGroup, index: int) -> tuple[Any, Any] | None:
        """(prompt, completion) of one sequence: message lists, or strings in text style.

        None when it cannot be rendered, with the reason in `drop_reason`.
        """
        self.drop_reason = rules.UNRENDERABLE
        conversations = group.messages
        if self.images:
            return self._vision_parts(group, index)
        if conversations is not None:
            messages = _clean(conversations[index])
            if messages is not None and group.images:
                messages = None  # the pictures live only in the group's images field
            parts = split_conversation(messages) if messages else None
            if parts is None:
                if vision.has_images(conversations[index], group.images):
                    self.drop_reason = vision.MULTIMODAL_SKIPPED
                return None
            if not self.text:
                return parts
            prompt = self._template(parts[0], generation_prompt=True)
            full = self._template(parts[0] + parts[1], generation_prompt=False)
            if not full.startswith(prompt):
                logger.warning("group %s: chat template output does not extend the prompt; row left out", group.group_id)
                return None
            return prompt, full[len(prompt) :]
        if not self.text:
            return None
        if group.images:
            self.drop_reason = vision.MULTIMODAL_SKIPPED
            return None
        tokens, masks = group.tokens(index), group.masks(index)
        cut = next((i for i, m in enumerate(masks) if m != -100), len(masks))
        return self.tokenizer.decode(tokens[:cut]), self.tokenizer.decode(tokens[cut:])

    def _vision_parts(self, group: ExportGroup, index: int) -> tuple[Any, Any, list[bytes]] | None:
        """(prompt, completion, pictures) in TRL's vision layout (conversational style only)."""
        conversations = group.messages
        if conversations is None:
            return None
        try:
            messages, pictures = vision.vision_messages(conversations[index], group.images)
        except vision.Skip as skip:
            self.drop_reason = skip.reason
            return None
        parts = split_conversation(messages)
        if parts is None:
            return None
        return parts[0], parts[1], pictures

    def _template(self, messages: list[Message], generation_prompt: bool) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise RenderError("the tokenizer has no chat_template; pick a chat tokenizer as output.tokenizer")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _meta(self, group: ExportGroup) -> dict[str, Any]:
        return {"group_id": group.group_id, "env": group.env, "run_id": group.run_id, "item_key": group.item_key}

    # ---- rows ----
    def sft_row(self, group: ExportGroup, index: int) -> dict[str, Any] | None:
        parts = self._parts(group, index)
        if parts is None:
            return None
        prompt, completion = parts[0], parts[1]
        if self.prompt_completion:
            row: dict[str, Any] = {"prompt": prompt, "completion": completion}
        else:
            row = {"text": prompt + completion} if self.text else {"messages": prompt + completion}
        if self.images:
            row["images"] = vision.image_column(parts[2])
        if self.extra:
            row["score"] = group.scores[index]
            row.update(self._meta(group))
        return row

    def dpo_row(self, group: ExportGroup, pair: Pair) -> dict[str, Any] | None:
        chosen, rejected = self._parts(group, pair.chosen), self._parts(group, pair.rejected)
        if chosen is None or rejected is None:
            return None
        row: dict[str, Any] = {"prompt": chosen[0], "chosen": chosen[1], "rejected": rejected[1]}
        if self.images:
            if vision.count_placeholders(chosen[1]) or vision.count_placeholders(rejected[1]):
                self.drop_reason = vision.IMAGE_IN_COMPLETION
                return None
            row["images"] = vision.image_column(chosen[2])
        if self.extra:
            row["score_chosen"] = group.scores[pair.chosen]
            row["score_rejected"] = group.scores[pair.rejected]
            row.update(self._meta(group))
        return row

    def content_hash(self, row: dict[str, Any]) -> int:
        """64-bit hash of a row's content columns (not its scores or metadata), for dedup."""
        digest = hashlib.blake2b(digest_size=8)
        for name in self.content_columns():
            value = row[name]
            if isinstance(value, str):
                digest.update(b"\x1d" + value.encode())
            else:
                digest.update(b"\x1d" + "\x1e".join(f"{m['role']}\x1f{m['content']}" for m in value).encode())
        if self.images:
            for picture in row["images"]:
                digest.update(b"\x1c" + picture["bytes"])
        return int.from_bytes(digest.digest(), "little", signed=True)
