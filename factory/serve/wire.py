"""Posted ScoredData bodies straight into Arrow rows, taking what Atropos's run-api takes.

The hot ingest path does not build pydantic models: msgspec decodes the body
into small typed structs (the free-form JSON fields as their raw JSON text,
stored verbatim), and the 2-D number lists (tokens, masks, logprobs, ...) are
read by numjson straight into typed buffers, without Python numbers and
without the GIL. Where numjson is not available, or does not take a body,
msgspec decodes them as Python lists, copied to Arrow buffers in one pass per
column; both ways give the same rows and the same answers. Types are checked as Atropos's
`ScoredData` checks them (lax: "3" is a number, as pydantic's lax mode has
it); lengths are not: `masks`, `advantages`, `ref_logprobs`,
`inference_logprobs`, `messages`, `overrides`, ... whose lengths don't match
`tokens` are stored as sent and counted per field ("unaligned"), unless the
service runs with `strict`, which refuses them with a 422 naming the field.
`strict` also refuses what pydantic's strict mode and the README refuse:
strings for numbers ("3", "NaN"), floats for ints, NaN and infinities in any
spelling (a string, a bare `NaN` token, an overflowing 1e999), negative token
ids and, given `vocab_size`, token ids at or above it.

Identity: a group is deduplicated only by an identity the client gives, its
`group_id` or the request's `Idempotency-Key` header (`<key>` for
/scored_data, `<key>:<index>` for /scored_data_list); a group without one gets
a fresh id and is always stored, however similar to another it is.
"""

from __future__ import annotations

import array
import itertools
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import msgspec
import numpy as np
import orjson
import pyarrow as pa

from factory.schema import GROUP_SCHEMA
from factory.serve.contract import JSON_TEXT_FIELDS, SEQUENCE_FIELDS, TOKEN_FIELDS, WireError
from factory.serve import numjson

_NULL = msgspec.Raw(b"null")


class WireGroup(msgspec.Struct):
    """Atropos's ScoredData (unknown keys ignored, as Atropos does) plus the factory's optional metadata."""

    tokens: list[list[int]]
    masks: list[list[int]]
    scores: list[float]
    advantages: list[list[float]] | None = None
    ref_logprobs: list[list[float]] | None = None
    messages: msgspec.Raw = _NULL
    generation_params: msgspec.Raw = _NULL
    inference_logprobs: list[list[float]] | None = None
    overrides: msgspec.Raw = _NULL
    group_overrides: msgspec.Raw = _NULL
    images: msgspec.Raw = _NULL
    env_id: int | None = None
    distill_token_ids: list[list[list[int]]] | None = None
    distill_logprobs: list[list[list[float]]] | None = None
    group_id: str | None = None
    env: str | None = None
    item_key: str | None = None
    policy_version: int | None = None


_ID_PREFIX = uuid.uuid4().hex[:20]
_ID_COUNTER = itertools.count()


def fresh_group_id() -> str:
    """A unique id (32 hex digits, like uuid4().hex) without a urandom call per group: random per process, then a counter."""
    return f"{_ID_PREFIX}{next(_ID_COUNTER):012x}"


_ONE = msgspec.json.Decoder(WireGroup, strict=False)
_MANY = msgspec.json.Decoder(list[WireGroup], strict=False)
_STRICT_ONE = msgspec.json.Decoder(WireGroup, strict=True)
_STRICT_MANY = msgspec.json.Decoder(list[WireGroup], strict=True)
_FLOAT_FIELDS = ("advantages", "ref_logprobs", "inference_logprobs")


@dataclass
class WireGroups:
    """Decoded groups of one request, their identities and per-field unaligned counts."""

    groups: list[WireGroup]
    ids: list[str]
    identified: list[bool]
    unaligned: Counter[str] = field(default_factory=Counter)
    unaligned_by_group: list[list[str]] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    env_ids: list[int | None] = field(default_factory=list)
    envs: list[str | None] = field(default_factory=list)
    """Env names the client gave (None: the service names them from env_id)."""
    versions: list[int | None] = field(default_factory=list)
    """Policy versions the client gave (None: the service's current step)."""
    rows: pa.RecordBatch | DeferredRows | None = None
    """With `build=True`: every group as GROUP_SCHEMA rows (env '' and version 0 where not given, unless resolved
    by `env_name` and `version`); `groups` is then empty. With `defer`, a small body's rows may be `DeferredRows`,
    checked but not yet built."""
    resolved: bool = False
    """Whether `rows` carry the env names and policy versions the service resolves (decode_groups' `env_name`)."""


def _problem(kind: str, loc: list[Any], msg: str) -> dict[str, Any]:
    return {"type": kind, "loc": ["body", *loc], "msg": msg}


def _msgspec_loc(message: str) -> list[Any]:
    """`... - at `$[3].tokens[0]`` as ['3', 'tokens', 0]-style loc parts."""
    missing = message.split("missing required field `", 1)[1].split("`", 1)[0] if "missing required field `" in message else None
    if "- at `$" not in message:
        return [missing] if missing else []
    path = message.rsplit("- at `$", 1)[1].rstrip("`")
    parts: list[Any] = []
    for piece in path.replace("[", ".[").split("."):
        if not piece:
            continue
        parts.append(int(piece[1:-1]) if piece.startswith("[") and piece[1:-1].isdigit() else piece)
    return [*parts, missing] if missing else parts


def _check_json_fields(group: WireGroup, loc: list[Any], problems: list[dict[str, Any]]) -> None:
    """Atropos's checks of the free-form fields: types, and 'role'/'content' on every message."""
    expected = {"messages": list, "generation_params": dict, "overrides": list, "group_overrides": dict}
    for name, kind in expected.items():
        raw = getattr(group, name)
        if raw == _NULL:
            continue
        value = orjson.loads(bytes(raw))
        if value is None:
            continue
        if not isinstance(value, kind):
            problems.append(_problem(f"{kind.__name__}_type", [*loc, name], f"{name} must be a JSON {'list' if kind is list else 'object'} or null"))
            continue
        if name == "messages":
            for i, conversation in enumerate(value):
                if not isinstance(conversation, list):
                    problems.append(_problem("list_type", [*loc, name, i], f"messages[{i}] must be a list of messages"))
                    continue
                for j, message in enumerate(conversation):
                    if not isinstance(message, dict) or "role" not in message or "content" not in message:
                        problems.append(_problem("value_error", [*loc, name, i, j], f"messages[{i}][{j}] needs 'role' and 'content' keys"))
        if name == "overrides" and not all(isinstance(item, dict) for item in value):
            problems.append(_problem("dict_type", [*loc, name], "overrides must be a list of objects"))


def _json_len(raw: msgspec.Raw) -> int | None:
    if raw == _NULL:
        return None
    value = orjson.loads(bytes(raw))
    return len(value) if isinstance(value, list) else None


def decode_groups(
    body: bytes | memoryview, *, many: bool, strict: bool = False, idempotency_key: str | None = None, build: bool = False,
    run_id: str = "", vocab_size: int | None = None, env_name: Callable[[int | None], str] | None = None,
    version: int = 0, defer: bool = False,
) -> WireGroups:
    """Decode and check a /scored_data (one object) or /scored_data_list (a list) body; raises WireError.

    With `build`, the groups are also turned into Arrow rows (`rows`) and the decoded Python lists are dropped,
    all in the caller's thread (the API calls this in a worker thread). Where numjson is available, `build`
    first tries the native path (numeric lists parsed straight into buffers, without the GIL); a body it does
    not take (anything but plain numbers, or a problem to report) goes the general way, which decides.
    `strict` bodies always go the general way, with msgspec's strict decoders and the value checks.
    With `env_name` (env_id -> name), rows of groups that name no env get that name, and groups without a
    policy_version get `version`: the rows are then final (`resolved`), built once, in the caller's thread.
    With `defer` (and `build`), the rows of a body of fewer than DEFER_MAX_GROUPS groups that numjson read may be
    `DeferredRows` instead: checked, not yet Arrow columns (`rows_table` builds them, a commit's at once).
    """
    if build and not strict and numjson.available():
        parsed = _decode_native(body, many=many, strict=strict, idempotency_key=idempotency_key, run_id=run_id,
                                env_name=env_name, version=version, defer=defer)
        if parsed is not None:
            return parsed
    if not isinstance(body, bytes):  # a view of a reused buffer: msgspec's Raw fields must not point into it
        body = bytes(body)
    try:
        if strict:
            groups = _STRICT_MANY.decode(body) if many else [_STRICT_ONE.decode(body)]
        else:
            groups = _MANY.decode(body) if many else [_ONE.decode(body)]
    except msgspec.ValidationError as error:
        message = str(error)
        return _raise([_problem("type_error", _msgspec_loc(message), message.split(" - at ")[0])])
    except msgspec.DecodeError as error:
        return _raise([_problem("json_invalid", _key_before_error(body, str(error)) if strict else [],
                                f"body is not valid JSON: {error}" + (" (NaN and Infinity are not JSON numbers)"
                                                                       if strict else ""))])
    shapes = [_shapes_of_lists(group) for group in groups]
    if strict:
        _check_values(groups, many=many, vocab_size=vocab_size)
    parsed = _checked(groups, shapes, many=many, strict=strict, idempotency_key=idempotency_key)
    if build:
        parsed.rows = to_record_batch(groups, parsed.ids, run_id=run_id, envs=_envs(groups, env_name),
                                      versions=_versions(groups, env_name, version))
        parsed.groups, parsed.resolved = [], env_name is not None
    return parsed


def _envs(groups: list[Any], env_name: Callable[[int | None], str] | None) -> list[str]:
    if env_name is None:
        return [g.env or "" for g in groups]
    return [g.env or env_name(g.env_id) for g in groups]


def _versions(groups: list[Any], env_name: Callable[[int | None], str] | None, version: int) -> list[int]:
    if env_name is None:
        return [g.policy_version or 0 for g in groups]
    return [g.policy_version if g.policy_version is not None else version for g in groups]


def _key_before_error(body: bytes, message: str) -> list[Any]:
    """The last object key before a JSON syntax error's byte offset (`... (byte 26)`), to name the field in the 422."""
    if "(byte " not in message:
        return []
    try:
        offset = int(message.rsplit("(byte ", 1)[1].split(")", 1)[0])
    except ValueError:
        return []
    head = body[:offset]
    end = head.rfind(b'":')
    start = head.rfind(b'"', 0, end) if end > 0 else -1
    return [head[start + 1 : end].decode("utf-8", "replace")] if start >= 0 else []


def _first_bad(values: Any, bad: Any) -> tuple[int, int] | None:
    """(sequence, position) of the first value of a 2-D list for which `bad` (on a numpy array) is true."""
    for i, sequence in enumerate(values):
        flags = bad(np.asarray(sequence, dtype=np.float64))
        if flags.any():
            return i, int(np.argmax(flags))
    return None


def _check_values(groups: list[WireGroup], *, many: bool, vocab_size: int | None) -> None:
    """strict: finite numbers only, token ids in [0, vocab_size); raises WireError naming each field."""
    problems: list[dict[str, Any]] = []
    for index, group in enumerate(groups):
        loc: list[Any] = [index] if many else []
        scores = np.asarray(group.scores, dtype=np.float64)
        if not np.isfinite(scores).all():
            where = int(np.argmax(~np.isfinite(scores)))
            problems.append(_problem("finite_number", [*loc, "scores", where],
                                     f"scores[{where}] is {scores[where]}: strict takes finite numbers only"))
        for name in _FLOAT_FIELDS:
            value = getattr(group, name)
            if value is not None and (bad := _first_bad(value, lambda a: ~np.isfinite(a))) is not None:
                problems.append(_problem("finite_number", [*loc, name, *bad],
                                         f"{name}[{bad[0]}][{bad[1]}] is not a finite number (strict)"))
        for name in ("tokens", "distill_token_ids"):
            value = getattr(group, name)
            if value is None:
                continue
            rows = value if name == "tokens" else [t for seq in value for t in seq]
            if (bad := _first_bad(rows, lambda a: a < 0)) is not None:
                problems.append(_problem("greater_than_equal", [*loc, name, *bad],
                                         f"{name}[{bad[0]}][{bad[1]}] is negative: token ids are >= 0 (strict)"))
            if vocab_size is not None and (bad := _first_bad(rows, lambda a: a >= vocab_size)) is not None:
                problems.append(_problem("less_than", [*loc, name, *bad],
                                         f"{name}[{bad[0]}][{bad[1]}] is not below the vocab size {vocab_size} "
                                         "(serve config vocab_size)"))
        if group.distill_logprobs is not None:
            flat = [t for seq in group.distill_logprobs for t in seq]
            if (bad := _first_bad(flat, np.isnan)) is not None:
                problems.append(_problem("finite_number", [*loc, "distill_logprobs", *bad],
                                         "distill_logprobs holds NaN (strict)"))
    if problems:
        _raise(problems)


_Shape = tuple[int, Any]
"""A numeric field's shape: (sequences, per-sequence lengths as a sequence of ints or None where not per token)."""


def _shapes_of_lists(group: WireGroup) -> dict[str, _Shape | None]:
    shapes: dict[str, _Shape | None] = {"scores": (len(group.scores), None)}
    for name in ("tokens", *TOKEN_FIELDS):
        value = getattr(group, name)
        shapes[name] = None if value is None else (len(value), [len(v) for v in value])
    return shapes


def _misfits(group: Any, shapes: dict[str, _Shape | None]) -> list[str]:
    """Fields whose lengths don't match `tokens` (per sequence, or per token), in SEQUENCE_FIELDS order."""
    size, lengths = shapes["tokens"]
    found = []
    for name in SEQUENCE_FIELDS:
        if name in JSON_TEXT_FIELDS:
            if (n := _json_len(getattr(group, name))) is not None and n != size:
                found.append(name)
            continue
        shape = shapes[name]
        if shape is None:
            continue
        if shape[0] != size or (name in TOKEN_FIELDS and not np.array_equal(shape[1], lengths)):
            found.append(name)
    return found


def _checked(groups: list[Any], shapes: list[dict[str, _Shape | None]], *, many: bool, strict: bool,
             idempotency_key: str | None) -> WireGroups:
    """Atropos's checks of decoded groups (raising WireError), their identities and unaligned fields."""
    problems: list[dict[str, Any]] = []
    unaligned: Counter[str] = Counter()
    ids, identified, by_group = [], [], []
    for index, (group, shape) in enumerate(zip(groups, shapes)):
        loc: list[Any] = [index] if many else []
        if not shape["tokens"][0]:
            problems.append(_problem("too_short", [*loc, "tokens"], "tokens: a group needs at least one sequence"))
        if group.policy_version is not None and group.policy_version < 0:
            problems.append(_problem("greater_than_equal", [*loc, "policy_version"], "policy_version must be >= 0"))
        try:
            _check_json_fields(group, loc, problems)
        except orjson.JSONDecodeError as error:  # pragma: no cover - msgspec already checked the JSON
            problems.append(_problem("json_invalid", loc, str(error)))
        misfits = _misfits(group, shape)
        by_group.append(misfits)
        for name in misfits:
            if strict:
                problems.append(_problem("unaligned", [*loc, name], f"{name} does not line up with tokens (the service runs with strict)"))
            unaligned[name] += 1
        if group.group_id:
            ids.append(group.group_id)
            identified.append(True)
        elif idempotency_key:
            ids.append(f"{idempotency_key}:{index}" if many else idempotency_key)
            identified.append(True)
        else:
            ids.append(fresh_group_id())
            identified.append(False)
    if problems:
        _raise(problems)
    return WireGroups(
        groups, ids, identified, unaligned, by_group,
        sizes=[s["tokens"][0] for s in shapes], env_ids=[g.env_id for g in groups],
        envs=[g.env or None for g in groups], versions=[g.policy_version for g in groups],
    )


class _TextGroup(WireGroup):
    """WireGroup with its 2-D numeric lists kept as raw JSON (same fields, same order): numjson.read_body has
    read them already and left [] in their place, or they are null."""

    tokens: msgspec.Raw
    masks: msgspec.Raw
    advantages: msgspec.Raw = _NULL
    ref_logprobs: msgspec.Raw = _NULL
    inference_logprobs: msgspec.Raw = _NULL


_TEXT_ONE = msgspec.json.Decoder(_TextGroup, strict=False)
_TEXT_MANY = msgspec.json.Decoder(list[_TextGroup], strict=False)
_NATIVE_INTEGERS = {"tokens": True, "masks": True, "advantages": False, "ref_logprobs": False, "inference_logprobs": False}
_Parsed = tuple[np.ndarray, np.ndarray]


def _decode_native(body: bytes | memoryview, *, many: bool, strict: bool, idempotency_key: str | None, run_id: str,
                   env_name: Callable[[int | None], str] | None = None, version: int = 0, defer: bool = False
                   ) -> WireGroups | None:
    """decode_groups(build=True) with numjson, or None where the general path must decide."""
    read = numjson.read_body(body, many)
    if read is None:
        return None
    stripped, read_fields = read
    try:  # only what numjson left: messages, scores, ids... (the number lists are [] now)
        groups = _TEXT_MANY.decode(stripped) if many else [_TEXT_ONE.decode(stripped)]
    except msgspec.DecodeError:  # ValidationError included: the general path names the problem
        return None
    if len(groups) != len(read_fields):  # pragma: no cover - both read the same list
        return None
    parsed_groups: list[dict[str, _Parsed | None]] = []
    for group, found in zip(groups, read_fields):
        fields: dict[str, _Parsed | None] = {}
        for name in _NATIVE_INTEGERS:
            if name in found:
                fields[name] = found[name]
            elif name in ("tokens", "masks") or getattr(group, name) != _NULL:
                return None  # a field numjson did not read (not numbers): the general path decides
            else:
                fields[name] = None
        parsed_groups.append(fields)
    shapes = []
    for group, fields in zip(groups, parsed_groups):
        shape: dict[str, _Shape | None] = {"scores": (len(group.scores), None)}
        for name, value in fields.items():
            shape[name] = None if value is None else (len(value[1]), value[1])
        for name in ("distill_token_ids", "distill_logprobs"):
            value = getattr(group, name)
            shape[name] = None if value is None else (len(value), [len(v) for v in value])
        shapes.append(shape)
    try:
        parsed = _checked(groups, shapes, many=many, strict=strict, idempotency_key=idempotency_key)
    except WireError:
        return None
    envs, versions = _envs(groups, env_name), _versions(groups, env_name, version)
    if defer and len(groups) < DEFER_MAX_GROUPS:
        parsed.rows = _deferred(groups, parsed, parsed_groups, run_id=run_id, envs=envs, versions=versions)
    if parsed.rows is None:
        try:
            lists = {name: _native_list_2d([fields[name] for fields in parsed_groups], pa.int32() if integers else pa.float64())
                     for name, integers in _NATIVE_INTEGERS.items()}
            parsed.rows = _build_rows(groups, parsed.ids, parsed.sizes, lists, run_id=run_id, envs=envs, versions=versions)
        except (pa.ArrowInvalid, OverflowError, TypeError):
            return None
    parsed.groups, parsed.resolved = [], env_name is not None
    return parsed


def _native_list_2d(rows: list[_Parsed | None], value_type: pa.DataType) -> pa.Array:
    """list<list<value_type>> from numjson's (values, lengths) per group (None rows are null)."""
    if all(row is None for row in rows):
        return pa.nulls(len(rows), pa.list_(pa.list_(value_type)))
    present = [row for row in rows if row is not None]
    values = np.concatenate([row[0] for row in present]) if len(present) > 1 else present[0][0]
    inner_offsets = np.zeros(sum(len(row[1]) for row in present) + 1, dtype=np.int32)
    np.cumsum(np.concatenate([row[1] for row in present]), out=inner_offsets[1:])
    inner = pa.ListArray.from_arrays(_numpy_array(inner_offsets, pa.int32()), _numpy_array(values, value_type))
    mask = pa.array([row is None for row in rows]) if len(present) < len(rows) else None
    return pa.ListArray.from_arrays(_offsets(len(row[1]) if row is not None else 0 for row in rows), inner, mask=mask)


_NUMPY_TYPES = {pa.int32(): np.int32, pa.float64(): np.float64}


def _numpy_array(values: np.ndarray, value_type: pa.DataType) -> pa.Array:
    """A 1-D numpy array as an Arrow array over the same memory (pa.array(ndarray) imports pandas on first use:
    ~35 MiB of RSS and about a second of CPU in the first post after start)."""
    values = np.ascontiguousarray(values, dtype=_NUMPY_TYPES[value_type])
    return pa.Array.from_buffers(value_type, len(values), [None, pa.py_buffer(values)])


def _raise(problems: list[dict[str, Any]]) -> Any:
    raise WireError(problems)


def _offsets(lengths: Any) -> pa.Array:
    offsets = array.array("i", [0])
    offsets.extend(itertools.accumulate(lengths))
    return pa.Array.from_buffers(pa.int32(), len(offsets), [None, pa.py_buffer(offsets)])


_TYPECODES = {pa.int32(): "i", pa.float64(): "d"}


def _flat_list(sequences: list[list[Any]], value_type: pa.DataType) -> pa.Array:
    """list<value_type> from Python lists: copied into one typed buffer by array.fromlist (a C loop that
    checks each value's type and range), about 2x faster than pyarrow's conversion of Python objects."""
    flat = array.array(_TYPECODES[value_type])
    for sequence in sequences:
        flat.fromlist(sequence)
    values = pa.Array.from_buffers(value_type, len(flat), [None, pa.py_buffer(flat)])
    return pa.ListArray.from_arrays(_offsets(map(len, sequences)), values)


def _list_2d(rows: list[list[list[Any]] | None], value_type: pa.DataType) -> pa.Array:
    """list<list<value_type>> from per-group lists of sequences (None rows are null), via flat buffers."""
    if all(row is None for row in rows):
        return pa.nulls(len(rows), pa.list_(pa.list_(value_type)))
    present = [row if row is not None else [] for row in rows]
    inner = _flat_list([sequence for row in present for sequence in row], value_type)
    mask = pa.array([row is None for row in rows]) if any(row is None for row in rows) else None
    return pa.ListArray.from_arrays(_offsets(map(len, present)), inner, mask=mask)


def _text(raw: msgspec.Raw) -> str | None:
    return None if raw == _NULL else bytes(raw).decode()


def to_record_batch(groups: list[WireGroup], ids: list[str], *, run_id: str, envs: list[str], versions: list[int]) -> pa.RecordBatch:
    """Rows of GROUP_SCHEMA for decoded groups (env names and policy versions already resolved)."""
    try:
        lists = {name: _list_2d([getattr(g, name) for g in groups], value_type) for name, value_type in _LIST_2D_TYPES.items()}
        return _build_rows(groups, ids, [len(g.tokens) for g in groups], lists, run_id=run_id, envs=envs, versions=versions)
    except (pa.ArrowInvalid, OverflowError, TypeError) as error:
        return _raise([_problem("value_error", [], f"a numeric field is out of range for the store: {error}")])


_LIST_2D_TYPES = {"tokens": pa.int32(), "masks": pa.int32(), "advantages": pa.float64(), "ref_logprobs": pa.float64(),
                  "inference_logprobs": pa.float64()}


def _build_rows(groups: list[Any], ids: list[str], sizes: list[int], lists: dict[str, pa.Array], *, run_id: str,
                envs: list[str], versions: list[int]) -> pa.RecordBatch:
    """GROUP_SCHEMA rows from decoded groups whose 2-D numeric columns (`lists`) are already built."""
    return _assemble(ids, run_id=run_id, envs=envs, item_keys=[g.item_key or "" for g in groups], versions=versions,
                     sizes=sizes, scores=[g.scores for g in groups], env_ids=[g.env_id for g in groups], lists=lists,
                     texts={name: [_text(getattr(g, name)) for g in groups] for name in JSON_TEXT_FIELDS},
                     distill={name: [getattr(g, name) for g in groups] for name in _DISTILL_FIELDS})


_DISTILL_FIELDS = ("distill_token_ids", "distill_logprobs")


def _assemble(ids: list[str], *, run_id: str, envs: list[str], item_keys: list[str], versions: list[int], sizes: list[int],
              scores: list[list[float]], env_ids: list[int | None], lists: dict[str, pa.Array],
              texts: dict[str, list[str | None]], distill: dict[str, list[Any]] | None) -> pa.RecordBatch:
    """GROUP_SCHEMA rows, column by column (`distill` None: no group has those fields)."""
    count = len(ids)
    now = datetime.now(timezone.utc)
    columns: dict[str, pa.Array] = {
        "group_id": pa.array(ids, pa.string()),
        "run_id": pa.array([run_id] * count, pa.string()),
        "env": pa.array(envs, pa.string()),
        "item_key": pa.array(item_keys, pa.string()),
        "policy_version": pa.array(versions, pa.int64()),
        "created_at": pa.array([now] * count, pa.timestamp("us", tz="UTC")),
        "group_size": pa.array(sizes, pa.int32()),
        "scores": _flat_list(scores, pa.float64()),
        "env_id": pa.array(env_ids, pa.int64()),
        **lists,
    }
    for name, values in texts.items():
        columns[name] = pa.array(values, pa.large_string()) if any(t is not None for t in values) else pa.nulls(count, pa.large_string())
    for name in _DISTILL_FIELDS:
        values, kind = distill[name] if distill is not None else None, GROUP_SCHEMA.field(name).type
        columns[name] = pa.array(values, kind) if values is not None and any(v is not None for v in values) else pa.nulls(count, kind)
    columns["difficulty"] = pa.nulls(count, pa.int32())  # a factory-only field; Atropos envs never send it
    return pa.RecordBatch.from_arrays([columns[f.name] for f in GROUP_SCHEMA], schema=GROUP_SCHEMA)


DEFER_MAX_GROUPS = 8
"""Bodies of fewer groups than this are left as `DeferredRows` by decode_groups(defer=True)."""
_INT64_MAX = (1 << 63) - 1


@dataclass
class DeferredRows:
    """The GROUP_SCHEMA rows of a small post, decoded and checked but not yet Arrow columns: `rows_table` builds the
    columns of all such posts of a commit at once.

    Building one row's 22 Arrow columns costs ~0.35-0.45 ms of fixed per-call work (a pa.array call per column, the
    2-D lists' offsets), about as much as numjson's parse of the whole one-group body; a commit of one-group posts
    pays it once instead of once per post (bench/RESULTS.md, issue 29, "One group per request: rows built once per
    commit"). Everything that can refuse a post (types, lengths, JSON, text, integer ranges) is checked before a
    post becomes one, so building them cannot fail a commit for one post's content."""

    ids: list[str]
    run_id: str
    envs: list[str]
    item_keys: list[str]
    versions: list[int]
    sizes: list[int]
    scores: list[list[float]]
    env_ids: list[int | None]
    lists: dict[str, list[_Parsed | None]]
    texts: dict[str, list[str | None]]

    @property
    def num_rows(self) -> int:
        return len(self.ids)

    def select(self, keep: list[int], envs: list[str], versions: list[int]) -> DeferredRows:
        """Rows `keep`, with the env names and policy versions the service resolved."""
        def pick(values: list[Any]) -> list[Any]:
            return [values[i] for i in keep]

        return DeferredRows(pick(self.ids), self.run_id, list(envs), pick(self.item_keys), list(versions), pick(self.sizes),
                            pick(self.scores), pick(self.env_ids), {k: pick(v) for k, v in self.lists.items()},
                            {k: pick(v) for k, v in self.texts.items()})


def _deferred(groups: list[Any], parsed: WireGroups, fields: list[dict[str, _Parsed | None]], *, run_id: str,
              envs: list[str], versions: list[int]) -> DeferredRows | None:
    """The rows of `groups` as DeferredRows, or None where they should be built now (distillation fields, or an
    integer outside int64: built now, their problems are the post's own)."""
    if any(g.distill_token_ids is not None or g.distill_logprobs is not None for g in groups):
        return None
    if any(v > _INT64_MAX for v in versions) or any(
            g.env_id is not None and not -_INT64_MAX - 1 <= g.env_id <= _INT64_MAX for g in groups):
        return None
    return DeferredRows(
        list(parsed.ids), run_id, envs, [g.item_key or "" for g in groups], versions, list(parsed.sizes),
        [g.scores for g in groups], [g.env_id for g in groups],
        {name: [f[name] for f in fields] for name in _NATIVE_INTEGERS},
        {name: [_text(getattr(g, name)) for g in groups] for name in JSON_TEXT_FIELDS})


def rows_table(parts: list[pa.RecordBatch | DeferredRows]) -> pa.Table:
    """One table of a commit's rows, in order: runs of DeferredRows are built into one record batch each."""
    batches: list[pa.RecordBatch] = []
    run: list[DeferredRows] = []
    for part in [*parts, None]:
        if isinstance(part, DeferredRows):
            run.append(part)
            continue
        if run:
            batches.append(_deferred_batch(run))
            run = []
        if part is not None:
            batches.append(part)
    return pa.Table.from_batches(batches, schema=GROUP_SCHEMA)


def _deferred_batch(parts: list[DeferredRows]) -> pa.RecordBatch:
    def joined(values: Callable[[DeferredRows], list[Any]]) -> list[Any]:
        return [value for part in parts for value in values(part)] if len(parts) > 1 else values(parts[0])

    return _assemble(
        joined(lambda p: p.ids), run_id=parts[0].run_id, envs=joined(lambda p: p.envs), item_keys=joined(lambda p: p.item_keys),
        versions=joined(lambda p: p.versions), sizes=joined(lambda p: p.sizes), scores=joined(lambda p: p.scores),
        env_ids=joined(lambda p: p.env_ids),
        lists={name: _native_list_2d(joined(lambda p: p.lists[name]), pa.int32() if integers else pa.float64())
               for name, integers in _NATIVE_INTEGERS.items()},
        texts={name: joined(lambda p: p.texts[name]) for name in JSON_TEXT_FIELDS}, distill=None)


def stamp(rows: pa.RecordBatch | DeferredRows, keep: list[int], envs: list[str], versions: list[int]
          ) -> pa.RecordBatch | DeferredRows:
    """Rows `keep` of `rows`, with the env names and policy versions the service resolved."""
    if isinstance(rows, DeferredRows):
        return rows.select(keep, envs, versions)
    if len(keep) != rows.num_rows:
        rows = rows.take(pa.array(keep, pa.int64()))
    columns = list(rows.columns)
    columns[rows.schema.get_field_index("env")] = pa.array(envs, pa.string())
    columns[rows.schema.get_field_index("policy_version")] = pa.array(versions, pa.int64())
    return pa.RecordBatch.from_arrays(columns, schema=rows.schema)


