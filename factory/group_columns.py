"""A chunk's kept groups as columns: what a datagen worker builds instead of one `ScoredGroup` per group.

Per group, validating a pydantic `ScoredGroup` and later walking its nested lists into Arrow cost a datagen
worker ~100 us of CPU (bench/RESULTS.md, issue 33). `GroupColumns` keeps a chunk's token ids, masks and
logprobs in flat arrays with their lengths, the JSON fields as the text they are stored as, and builds the
shard's rows from those (`to_record_batch`: the same GROUP_SCHEMA batch `groups_to_record_batch` makes of the
equivalent `ScoredGroup`s). For everything else it is a read-only sequence of `ScoredGroup`s, made on access.

`add` takes a group only when cheap checks show that `ScoredGroup` would keep it as it is and that Arrow can
hold it; otherwise it returns False, changes nothing, and the caller builds the `ScoredGroup` itself (pydantic's
coercions, checks and error messages stay the only ones).
"""

from __future__ import annotations

import json
import math
import os
import time
from array import array
from collections.abc import Iterator, Sequence
from datetime import datetime, timedelta, timezone
from itertools import accumulate
from json.encoder import encode_basestring
from typing import Any, overload

import numpy as np
import pyarrow as pa

from environments.groups import MASK_IGNORE, ScoredGroup
from factory.schema import GROUP_SCHEMA, _column, _numeric, _strings

try:  # group_arrays.c, built at install time (setup.py); optional: the Python path below does the same
    from factory import _group_arrays as _native
except ImportError:  # pragma: no cover - no C compiler when the package was installed
    _native = None
if os.environ.get("FACTORY_NATIVE_GROUPS", "1") == "0":
    _native = None

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_INT32 = (-(2**31), 2**31)
_NULL_FIELDS = ("advantages", "ref_logprobs", "overrides", "group_overrides", "env_id", "distill_token_ids",
                "distill_logprobs")
assert array("i").itemsize == 4 and array("d").itemsize == 8  # the Arrow buffers below read them as int32/float64


def _json(value: Any) -> str | None:
    """As `factory.schema._dump_json` stores a field (raises TypeError/ValueError where it would fail)."""
    return None if value is None else json.dumps(value, ensure_ascii=False, allow_nan=False)


_ENCODE = json.JSONEncoder(ensure_ascii=False, allow_nan=False).encode


def one_reply_messages_json(prompt: list[dict[str, Any]], replies: list[str]) -> str | None:
    """`_json([[*prompt, {"role": "assistant", "content": reply}] for reply in replies])`, the stored messages of a
    group of one-reply rollouts, with the prompt encoded once instead of once per reply (json.dumps of a group's
    8 conversations cost ~15 us). None where the prompt is not as ScoredGroup keeps it or not storable."""
    if not _messages_as_validated([prompt], 1):
        return None
    shared = _text_messages_json(prompt)
    if shared is None:
        try:
            shared = _ENCODE(prompt)[1:-1]
        except (TypeError, ValueError):
            return None
    opening = f"[{shared}, " if shared else "["
    return "[" + ", ".join(f'{opening}{{"role": "assistant", "content": {encode_basestring(reply)}}}]'
                           for reply in replies) + "]"


def _text_messages_json(messages: list[dict[str, Any]]) -> str | None:
    """`_ENCODE(messages)[1:-1]` for messages whose values are all text (the common prompt), written out: the
    encoder object `json.dumps` builds per call cost ~2 us of a group's; None for any other value."""
    for message in messages:
        for value in message.values():
            if type(value) is not str:
                return None
    return ", ".join(["{" + ", ".join([f"{encode_basestring(key)}: {encode_basestring(value)}"
                                       for key, value in message.items()]) + "}" for message in messages])


def _messages_as_validated(messages: Any, size: int) -> bool:
    """Whether ScoredGroup would keep `messages` as they are: a list per sequence of dicts with str keys and
    'role' and 'content' (anything else goes through pydantic, which coerces or refuses it)."""
    if messages is None:
        return True
    if type(messages) is not list or len(messages) != size:
        return False
    for conversation in messages:
        if type(conversation) is not list:
            return False
        for message in conversation:
            if type(message) is not dict or "role" not in message or "content" not in message:
                return False
            for key in message:
                if type(key) is not str:
                    return False
    return True


class GroupColumns(Sequence[ScoredGroup]):
    """Kept groups of one chunk, column by column (see the module docstring)."""

    def __init__(self) -> None:
        self.tokens, self.masks = array("i"), array("i")
        self.lengths = array("i")  # per sequence
        self.sizes = array("i")  # sequences per group
        self.logprobs = array("d")  # groups with inference logprobs only, aligned with their tokens
        self.has_logprobs = bytearray()  # per group
        self.scores = array("d")
        self.policy_versions, self.created_us = array("q"), array("q")
        self.group_ids: list[str] = []
        self.envs: list[str] = []
        self.item_keys: list[str] = []
        self.run_ids: list[str] = []
        self.messages: list[str | None] = []  # JSON texts, as stored
        self.generation_params: list[str | None] = []
        self.images: list[str | None] = []
        self.difficulty: list[int | None] = []
        self._last_params: tuple[Any, str | None] = (None, None)  # a chunk's groups share one params dict
        self._starts: tuple[list[int], list[int], list[int]] | None = None

    # ---- building ----
    def add(self, *, tokens: list[list[int]], masks: list[list[int]], scores: list[float],
            inference_logprobs: list[list[float]] | None = None, messages: list[list[dict[str, Any]]] | None = None,
            generation_params: dict[str, Any] | None = None, images: Any = None, group_id: str, env: str,
            item_key: str, policy_version: int, run_id: str, difficulty: int | None = None,
            messages_json: str | None = None) -> bool:
        """Append a group given as ScoredGroup's fields; False (nothing appended) when it needs pydantic.
        Sequences may be lists or arrays ("i" for ids and masks, "d" for logprobs). `messages_json`, instead of
        `messages`: their stored text, made by `one_reply_messages_json`."""
        size = len(tokens)
        if not self._group_fields_kept(size, scores, generation_params, group_id, env, item_key, run_id,
                                       policy_version, difficulty):
            return False
        lengths = [len(sequence) for sequence in tokens]
        if len(masks) != size or 0 in lengths or [len(m) for m in masks] != lengths:
            return False
        if inference_logprobs is not None and (len(inference_logprobs) != size
                                               or [len(lp) for lp in inference_logprobs] != lengths):
            return False
        if messages_json is None and not _messages_as_validated(messages, size):
            return False
        try:
            if messages_json is None:
                messages_json = _json(messages)
        except (TypeError, ValueError):  # not storable: the ScoredGroup path raises it at commit, as it did
            return False
        storable, images_json = self._stored_json(images, generation_params)
        if not storable:
            return False
        marks = len(self.tokens), len(self.masks), len(self.logprobs)
        try:  # the arrays check every value: an int out of int32, or a value that is not an int, is refused
            for sequence in tokens:
                self.tokens.extend(sequence)
            for sequence in masks:
                self.masks.extend(sequence)
            if inference_logprobs is not None:
                for sequence in inference_logprobs:
                    self.logprobs.extend(sequence)
        except (TypeError, OverflowError):
            del self.tokens[marks[0]:], self.masks[marks[1]:], self.logprobs[marks[2]:]
            return False
        self.lengths.extend(lengths)
        self._append_fields(size, inference_logprobs is not None, scores, policy_version, group_id, env, item_key,
                            run_id, messages_json, images_json, difficulty)
        return True

    def add_shared_prompt(self, *, prompt: list[int], outputs: list[list[int]], logprobs: list[list[float]] | None,
                          scores: list[float], messages_json: str, generation_params: dict[str, Any] | None,
                          images: Any, group_id: str, env: str, item_key: str, policy_version: int, run_id: str,
                          difficulty: int | None) -> bool:
        """`add` for the common group: one-reply sequences that share one prompt, each `prompt + output` with the
        prompt masked (and given logprob 1.0). The same rows as `add` of `sequence_tokens`' lists, without those
        lists: the prompt is converted once and each output once. False (nothing appended) where `add` would
        refuse; `outputs` must be non-empty lists, `logprobs` (if given) one per output and aligned with it."""
        size = len(outputs)
        if not (prompt and type(messages_json) is str and self._group_fields_kept(
                size, scores, generation_params, group_id, env, item_key, run_id, policy_version, difficulty)):
            return False
        storable, images_json = self._stored_json(images, generation_params)
        if not storable:
            return False
        if not self._append_shared_prompt_sequences(prompt, outputs, logprobs):
            return False
        self._append_fields(size, logprobs is not None, scores, policy_version, group_id, env, item_key, run_id,
                            messages_json, images_json, difficulty)
        return True

    def _append_shared_prompt_sequences(self, prompt: list[int], outputs: list[list[int]],
                                        logprobs: list[list[float]] | None) -> bool:
        """`add_shared_prompt`'s tokens, masks, lengths and logprobs; False (nothing appended) where a value does not
        fit the arrays: an id out of int32, or not an int, is refused (as in `add`)."""
        if _native is not None:  # the same bytes as the loop below, in one C call (~1 us against ~10)
            try:
                token_bytes, mask_bytes, length_bytes, logprob_bytes = _native.shared_prompt_sequences(
                    prompt, outputs, logprobs)
            except (TypeError, OverflowError):
                return False
            self.tokens.frombytes(token_bytes)
            self.masks.frombytes(mask_bytes)
            self.lengths.frombytes(length_bytes)
            if logprob_bytes is not None:
                self.logprobs.frombytes(logprob_bytes)
            return True
        tokens, masks = self.tokens, self.masks
        marks = len(tokens), len(masks), len(self.logprobs)
        width = len(prompt)
        try:  # the arrays check every value
            prompt_ids = array("i", prompt)
            ignored = array("i", [MASK_IGNORE]) * width
            for output in outputs:
                ids = array("i", output)
                tokens += prompt_ids
                tokens += ids
                masks += ignored
                masks += ids
            if logprobs is not None:
                prompt_logprobs = array("d", [1.0]) * width
                for values in logprobs:
                    self.logprobs += prompt_logprobs
                    self.logprobs.extend(values)
        except (TypeError, OverflowError):
            del tokens[marks[0]:], masks[marks[1]:], self.logprobs[marks[2]:]
            return False
        self.lengths.extend([width + len(output) for output in outputs])
        return True

    @staticmethod
    def _group_fields_kept(size: int, scores: list[float], generation_params: Any, group_id: Any, env: Any,
                           item_key: Any, run_id: Any, policy_version: Any, difficulty: Any) -> bool:
        """Whether ScoredGroup would keep a group's own fields as they are (both `add`s check these)."""
        return bool(size and type(group_id) is str and group_id and type(env) is str and type(item_key) is str
                    and type(run_id) is str and type(policy_version) is int and policy_version >= 0
                    and (difficulty is None or (type(difficulty) is int and _INT32[0] <= difficulty < _INT32[1]))
                    and len(scores) == size and all(type(s) is float and math.isfinite(s) for s in scores)
                    and (generation_params is None or (type(generation_params) is dict
                                                       and all(type(k) is str for k in generation_params))))

    def _stored_json(self, images: Any, generation_params: dict[str, Any] | None) -> tuple[bool, str | None]:
        """(storable, the images' JSON); the params' JSON is kept in `_last_params` (a chunk's groups share one)."""
        try:
            images_json = _json(images)
            if self._last_params[0] is not generation_params:
                self._last_params = (generation_params, _json(generation_params))
        except (TypeError, ValueError):  # not storable: the ScoredGroup path raises it at commit, as it did
            return False, None
        return True, images_json

    def _append_fields(self, size: int, has_logprobs: bool, scores: list[float], policy_version: int, group_id: str,
                       env: str, item_key: str, run_id: str, messages_json: str | None, images_json: str | None,
                       difficulty: int | None) -> None:
        """A checked group's per-group columns, after its sequences (generation_params: `_last_params`)."""
        self.sizes.append(size)
        self.has_logprobs.append(has_logprobs)
        self.scores.extend(scores)
        self.policy_versions.append(policy_version)
        self.created_us.append(time.time_ns() // 1000)
        self.group_ids.append(group_id)
        self.envs.append(env)
        self.item_keys.append(item_key)
        self.run_ids.append(run_id)
        self.messages.append(messages_json)
        self.generation_params.append(self._last_params[1])
        self.images.append(images_json)
        self.difficulty.append(difficulty)
        self._starts = None

    # ---- the shard's rows ----
    def to_record_batch(self) -> pa.RecordBatch:
        """The groups in GROUP_SCHEMA: the batch `groups_to_record_batch` makes of the same ScoredGroups."""
        count = len(self.sizes)
        sequence_offsets = _offsets(self.sizes)
        token_offsets = _offsets(self.lengths)
        columns: dict[str, pa.Array] = {name: pa.nulls(count, GROUP_SCHEMA.field(name).type) for name in _NULL_FIELDS}
        columns["tokens"] = _lists_of_lists(sequence_offsets, token_offsets, self.tokens, pa.int32())
        columns["masks"] = _lists_of_lists(sequence_offsets, token_offsets, self.masks, pa.int32())
        columns["scores"] = pa.ListArray.from_arrays(
            _numeric(sequence_offsets, pa.int32()), _numeric(np.frombuffer(self.scores, dtype=np.float64).copy(), pa.float64()))
        field = GROUP_SCHEMA.field("inference_logprobs")
        if all(self.has_logprobs) and count:
            columns[field.name] = _lists_of_lists(sequence_offsets, token_offsets, self.logprobs, pa.float64())
        elif not any(self.has_logprobs):
            columns[field.name] = pa.nulls(count, field.type)
        else:  # some groups without: pyarrow's own conversion of the lists, as groups_to_record_batch does
            columns[field.name] = _column(field, [group.inference_logprobs for group in self])
        for name, values in (("group_id", self.group_ids), ("run_id", self.run_ids), ("env", self.envs),
                             ("item_key", self.item_keys)):
            columns[name] = _strings(values, GROUP_SCHEMA.field(name).type)
        columns["policy_version"] = _numeric(np.frombuffer(self.policy_versions, dtype=np.int64).copy(), pa.int64())
        columns["created_at"] = _numeric(np.frombuffer(self.created_us, dtype=np.int64).copy(), GROUP_SCHEMA.field("created_at").type)
        columns["group_size"] = _numeric(np.frombuffer(self.sizes, dtype=np.int32).copy(), pa.int32())
        for name, values in (("messages", self.messages), ("generation_params", self.generation_params),
                             ("images", self.images), ("difficulty", self.difficulty)):
            columns[name] = _column(GROUP_SCHEMA.field(name), values)
        return pa.RecordBatch.from_arrays([columns[field.name] for field in GROUP_SCHEMA], schema=GROUP_SCHEMA)

    # ---- the ScoredGroup view ----
    def __len__(self) -> int:
        return len(self.sizes)

    @overload
    def __getitem__(self, index: int) -> ScoredGroup: ...

    @overload
    def __getitem__(self, index: slice) -> GroupColumns: ...

    def __getitem__(self, index: int | slice) -> ScoredGroup | GroupColumns:
        if isinstance(index, slice):
            return self._take(range(len(self))[index])
        count = len(self)
        if index < 0:
            index += count
        if not 0 <= index < count:
            raise IndexError(f"group {index} of {count}")
        return self._group(index)

    def __iter__(self) -> Iterator[ScoredGroup]:
        return (self._group(index) for index in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (GroupColumns, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"GroupColumns({len(self)} groups, {len(self.lengths)} sequences, {len(self.tokens)} tokens)"

    def _starts_of(self) -> tuple[list[int], list[int], list[int]]:
        """Per group: its first sequence, first token and first logprob; one past the end last."""
        if self._starts is None:
            sequences = [0, *accumulate(self.sizes)]
            tokens = [0, *accumulate(self.lengths)]
            token_starts = [tokens[s] for s in sequences]
            logprobs = [0, *accumulate((b - a) * has for a, b, has in zip(token_starts, token_starts[1:],
                                                                          self.has_logprobs))]
            self._starts = (sequences, token_starts, logprobs)
        return self._starts

    def _group(self, index: int) -> ScoredGroup:
        sequences, token_starts, logprob_starts = self._starts_of()
        first, last = sequences[index], sequences[index + 1]
        bounds = list(accumulate(self.lengths[first:last], initial=token_starts[index]))
        spans = list(zip(bounds, bounds[1:]))
        logprobs = None
        if self.has_logprobs[index]:
            shift = logprob_starts[index] - token_starts[index]
            logprobs = [self.logprobs[a + shift:b + shift].tolist() for a, b in spans]
        fields = {
            "tokens": [self.tokens[a:b].tolist() for a, b in spans],
            "masks": [self.masks[a:b].tolist() for a, b in spans],
            "scores": self.scores[first:last].tolist(),
            "inference_logprobs": logprobs,
            "messages": _loads(self.messages[index]),
            "generation_params": _loads(self.generation_params[index]),
            "images": _loads(self.images[index]),
            "group_id": self.group_ids[index],
            "env": self.envs[index],
            "item_key": self.item_keys[index],
            "policy_version": self.policy_versions[index],
            "run_id": self.run_ids[index],
            "created_at": _EPOCH + timedelta(microseconds=self.created_us[index]),
            "difficulty": self.difficulty[index],
        }
        return ScoredGroup.model_construct(**fields)  # checked when added

    def _take(self, indices: range) -> GroupColumns:
        """The groups at `indices` (a slice's range) as new columns."""
        taken = GroupColumns()
        if indices.step != 1:
            for index in indices:
                taken._append_from(self, index, index + 1)
        elif len(indices):
            taken._append_from(self, indices.start, indices.stop)
        return taken

    def _append_from(self, source: GroupColumns, start: int, stop: int) -> None:
        sequences, token_starts, logprob_starts = source._starts_of()
        first, last = sequences[start], sequences[stop]
        self.tokens.extend(source.tokens[token_starts[start]:token_starts[stop]])
        self.masks.extend(source.masks[token_starts[start]:token_starts[stop]])
        self.logprobs.extend(source.logprobs[logprob_starts[start]:logprob_starts[stop]])
        self.lengths.extend(source.lengths[first:last])
        self.scores.extend(source.scores[first:last])
        self.sizes.extend(source.sizes[start:stop])
        self.has_logprobs.extend(source.has_logprobs[start:stop])
        self.policy_versions.extend(source.policy_versions[start:stop])
        self.created_us.extend(source.created_us[start:stop])
        for name in ("group_ids", "envs", "item_keys", "run_ids", "messages", "generation_params", "images",
                     "difficulty"):
            getattr(self, name).extend(getattr(source, name)[start:stop])
        self._starts = None


def _loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def _offsets(lengths: array) -> np.ndarray:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(np.frombuffer(lengths, dtype=np.int32), out=offsets[1:])
    return offsets


def _lists_of_lists(outer: np.ndarray, inner: np.ndarray, values: array, value_type: pa.DataType) -> pa.Array:
    """list<list<value_type>> over a copy of `values` (the array must stay free to grow: it cannot while a
    buffer over it is alive)."""
    flat = np.frombuffer(values, dtype=np.int32 if value_type == pa.int32() else np.float64).copy()
    return pa.ListArray.from_arrays(_numeric(outer, pa.int32()),
                                    pa.ListArray.from_arrays(_numeric(inner, pa.int32()), _numeric(flat, value_type)))

