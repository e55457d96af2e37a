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

A DPO pair compares two sequences of one group at the first model turn where
they differ: the prompt is everything they share up to that turn (system,
user, earlier assistant and tool/env turns), chosen and rejected are that turn
(the run of consecutive assistant messages, or trained tokens, that starts
there). So a multi-turn pair never puts one episode's reply after the other
episode's history, and chosen and rejected always differ. Pairs whose
sequences are identical are left out as `identical_responses`; pairs that
part at an environment turn rather than a model turn (an env that is random
given the history) as `diverged_at_env_turn`.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import pyarrow as pa

from environments.groups import MASK_IGNORE
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


IDENTICAL = "identical_responses"
"""DPO drop reason: chosen and rejected are the same sequence (nothing to prefer)."""
DIVERGED_AT_ENV_TURN = "diverged_at_env_turn"
"""DPO drop reason: the two sequences first differ in a turn the model did not write, so no prompt is shared."""


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


def split_at_divergence(chosen: list[Message], rejected: list[Message]
                        ) -> tuple[list[Message], list[Message], list[Message]] | str:
    """(shared prompt, chosen turn, rejected turn) at the first assistant message where two conversations differ.

    A turn is the run of consecutive assistant messages that starts there. Returns a drop reason instead when
    the conversations are identical or first differ in a message that is not the model's.
    """
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == len(chosen) == len(rejected):
        return IDENTICAL
    if any(shared < len(m) and m[shared].get("role") != "assistant" for m in (chosen, rejected)):
        return DIVERGED_AT_ENV_TURN
    while shared > 0 and chosen[shared - 1].get("role") == "assistant":  # a turn that parts midway starts earlier
        shared -= 1
    sides = []
    for messages in (chosen, rejected):
        end = shared
        while end < len(messages) and messages[end].get("role") == "assistant":
            end += 1
        if end == shared:  # this side stopped where the other went on
            return DIVERGED_AT_ENV_TURN
        sides.append(messages[shared:end])
    return chosen[:shared], sides[0], sides[1]


def split_tokens_at_divergence(chosen: tuple[list[int], list[int]], rejected: tuple[list[int], list[int]]
                               ) -> tuple[int, int, int] | str:
    """(start, chosen end, rejected end) of the first trained-token run where two (tokens, masks) sequences differ.

    The shared prompt is `tokens[:start]`; each side's turn runs to its own end. Returns a drop reason when the
    sequences are identical or first differ inside masked (prompt or environment) tokens.
    """
    (c_tokens, c_masks), (r_tokens, r_masks) = chosen, rejected
    shared = 0
    while (shared < min(len(c_tokens), len(r_tokens)) and c_tokens[shared] == r_tokens[shared]
           and c_masks[shared] == r_masks[shared]):
        shared += 1
    if shared == len(c_tokens) == len(r_tokens):
        return IDENTICAL

    def trained_at(masks: list[int]) -> bool:  # position `shared` continues or starts a model turn
        return masks[shared] != MASK_IGNORE if shared < len(masks) else shared > 0 and masks[shared - 1] != MASK_IGNORE

    if not (trained_at(c_masks) and trained_at(r_masks)):
        return DIVERGED_AT_ENV_TURN
    start = shared
    while start > 0 and c_masks[start - 1] != MASK_IGNORE:
        start -= 1

    def end(masks: list[int]) -> int:
        return next((i for i in range(shared, len(masks)) if masks[i] == MASK_IGNORE), len(masks))

    return start, end(c_masks), end(r_masks)


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
        """The pair's row: the shared history as prompt, the first differing model turn of each as chosen/rejected.

        None (with the reason in `drop_reason`) when it cannot be rendered or the two sides do not differ.
        """
        parts = self._pair_parts(group, pair)
        if parts is None:
            return None
        prompt, chosen, rejected, pictures = parts
        row: dict[str, Any] = {"prompt": prompt, "chosen": chosen, "rejected": rejected}
        if self.images:
            if vision.count_placeholders(chosen) or vision.count_placeholders(rejected):
                self.drop_reason = vision.IMAGE_IN_COMPLETION
                return None
            row["images"] = vision.image_column(pictures)
        if self.extra:
            row["score_chosen"] = group.scores[pair.chosen]
            row["score_rejected"] = group.scores[pair.rejected]
            row.update(self._meta(group))
        return row

    def _pair_parts(self, group: ExportGroup, pair: Pair) -> tuple[Any, Any, Any, list[bytes]] | None:
        """(prompt, chosen, rejected, prompt pictures) of a pair, split where the two sequences part."""
        self.drop_reason = rules.UNRENDERABLE
        conversations = group.messages
        if conversations is None:
            if self.images or not self.text:
                return None
            if group.images:
                self.drop_reason = vision.MULTIMODAL_SKIPPED
                return None
            split = split_tokens_at_divergence((group.tokens(pair.chosen), group.masks(pair.chosen)),
                                               (group.tokens(pair.rejected), group.masks(pair.rejected)))
            if isinstance(split, str):
                self.drop_reason = split
                return None
            start, chosen_end, rejected_end = split
            tokens, decode = group.tokens(pair.chosen), self.tokenizer.decode
            return (decode(tokens[:start]), decode(tokens[start:chosen_end]),
                    decode(group.tokens(pair.rejected)[start:rejected_end]), [])
        pictures: list[bytes] = []
        if self.images:
            try:
                chosen, pictures = vision.vision_messages(conversations[pair.chosen], group.images)
                rejected, _ = vision.vision_messages(conversations[pair.rejected], group.images)
            except vision.Skip as skip:
                self.drop_reason = skip.reason
                return None
        else:
            chosen, rejected = _clean(conversations[pair.chosen]), _clean(conversations[pair.rejected])
            if chosen is None or rejected is None or group.images:
                if any(vision.has_images(conversations[i], group.images) for i in (pair.chosen, pair.rejected)):
                    self.drop_reason = vision.MULTIMODAL_SKIPPED
                return None
        split = split_at_divergence(chosen, rejected)
        if isinstance(split, str):
            self.drop_reason = split
            return None
        prompt, chosen_turn, rejected_turn = split
        if self.images:
            return prompt, chosen_turn, rejected_turn, pictures[: vision.count_placeholders(prompt)]
        if not self.text:
            return prompt, chosen_turn, rejected_turn, []
        head = self._template(prompt, generation_prompt=True)
        sides = []
        for turn in (chosen_turn, rejected_turn):
            full = self._template(prompt + turn, generation_prompt=False)
            if not full.startswith(head):
                logger.warning("group %s: chat template output does not extend the prompt; pair left out", group.group_id)
                return None
            sides.append(full[len(head):])
        return head, sides[0], sides[1], []

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
