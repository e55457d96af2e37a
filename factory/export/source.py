"""Groups to export, read in a streaming way from the shard store or from an Atropos-compatible batching API.

Both sources yield `ExportGroup`s: scores and per-sequence lengths up front
(all that selection needs), messages and tokens only when a kept row asks for
them, so groups whose sequences are all dropped cost no JSON parsing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import orjson

from environments.groups import MASK_IGNORE, content_group_id, content_group_id_of_texts
from factory.export.config import SourceConfig
from factory.serve.contract import ARROW_STREAM

if TYPE_CHECKING:
    import httpx
    import numpy as np
    import pyarrow as pa

# pyarrow and numpy (~0.25 s of start-up) are imported where a store or an Arrow /batch is read, and httpx where an
# API is, not at import: an export from Atropos's API (JSON /batch) never needs the first two, one from a store never
# needs httpx.

logger = logging.getLogger(__name__)

_META_COLUMNS = ["group_id", "run_id", "env", "item_key", "scores", "messages", "images"]


class SourceError(RuntimeError):
    """The groups cannot be read; the message names the source and the fix."""


@dataclass
class ExportGroup:
    """One group as the exporter sees it."""

    group_id: str
    env: str
    run_id: str
    item_key: str
    scores: list[float]
    seq_lens: list[int]
    completion_lens: list[int]
    _messages: Any = None
    _messages_json: str | bytes | None = None
    _tokens: list[list[int]] | None = None
    _masks: list[list[int]] | None = None
    _token_texts: list[bytes] | None = None
    _mask_texts: list[bytes] | None = None
    _arrow_row: tuple[pa.Array, pa.Array, int] | None = None
    _images: Any = None
    _images_json: str | bytes | None = None

    @property
    def messages(self) -> list[list[dict[str, Any]]] | None:
        if self._messages is None and self._messages_json is not None:
            self._messages = orjson.loads(self._messages_json)
            self._messages_json = None
        return self._messages

    @property
    def images(self) -> Any:
        """The group's pictures (multimodal groups: base64 strings or data URLs), or None."""
        if self._images is None and self._images_json is not None:
            self._images = orjson.loads(self._images_json)
            self._images_json = None
        return self._images

    def tokens(self, index: int) -> list[int]:
        if self._tokens is not None:
            return self._tokens[index]
        if self._token_texts is not None:
            return orjson.loads(b"[" + self._token_texts[index] + b"]")
        if self._arrow_row is None:
            raise SourceError(f"group {self.group_id} was read without its tokens")
        column, _, row = self._arrow_row
        return column[row].values[index].as_py()

    def masks(self, index: int) -> list[int]:
        if self._masks is not None:
            return self._masks[index]
        if self._mask_texts is not None:
            return orjson.loads(b"[" + self._mask_texts[index] + b"]")
        if self._arrow_row is None:
            raise SourceError(f"group {self.group_id} was read without its masks")
        _, column, row = self._arrow_row
        return column[row].values[index].as_py()


def _numpy(array: pa.Array) -> np.ndarray:
    """An int32/int64 Arrow array as a zero-copy numpy view of its values buffer (nulls read as 0).

    Not `to_numpy()`: pyarrow imports pandas for it, which costs ~0.3 s of CPU at the first batch of an
    export that never needs pandas.
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    if array.null_count:
        array = pc.fill_null(array, 0)
    dtype = np.dtype({pa.int32(): np.int32, pa.int64(): np.int64}[array.type])
    if len(array) == 0:
        return np.zeros(0, dtype=dtype)
    return np.frombuffer(array.buffers()[1], dtype=dtype, count=len(array), offset=array.offset * dtype.itemsize)


def _lengths(column: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(sequences per group offsets, tokens per sequence) of a list<list<int>> column, without Python objects."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    per_group = _numpy(pc.list_value_length(column))
    per_seq = _numpy(pc.list_value_length(pc.list_flatten(column)))
    offsets = np.concatenate([[0], np.cumsum(per_group)])
    return offsets, per_seq


def _completion_lengths(masks: pa.Array, per_seq: np.ndarray) -> np.ndarray:
    import numpy as np
    import pyarrow.compute as pc

    values = _numpy(pc.list_flatten(pc.list_flatten(masks)))
    trained = np.concatenate([[0], np.cumsum(values != MASK_IGNORE)])
    ends = np.cumsum(per_seq)
    return trained[ends] - trained[ends - per_seq]


def groups_from_batch(batch: pa.RecordBatch) -> Iterator[ExportGroup]:
    """ExportGroups of one stored record batch (GROUP_SCHEMA columns, projected).

    Without `tokens`/`masks` columns (nothing needs lengths or token text),
    lengths are reported as 0 and the group carries no tokens.
    """
    import numpy as np
    import pyarrow.compute as pc

    has_tokens = "tokens" in batch.schema.names
    if has_tokens:
        offsets, per_seq = _lengths(batch.column("tokens"))
        completion = _completion_lengths(batch.column("masks"), per_seq)
    else:
        per_group = _numpy(pc.list_value_length(batch.column("scores")))
        offsets = np.concatenate([[0], np.cumsum(per_group)])
        per_seq = completion = np.zeros(int(offsets[-1]), dtype=np.int64)
    per_seq_list, completion_list = per_seq.tolist(), completion.tolist()
    columns = {name: batch.column(name) for name in ("group_id", "run_id", "env", "item_key")}
    ids, runs, envs, keys = (columns[name].to_pylist() for name in ("group_id", "run_id", "env", "item_key"))
    scores = batch.column("scores").to_pylist()
    messages = batch.column("messages").to_pylist()
    images = batch.column("images") if "images" in batch.schema.names else None
    images = images.to_pylist() if images is not None and images.null_count < batch.num_rows else None
    tokens, masks = (batch.column("tokens"), batch.column("masks")) if has_tokens else (None, None)
    for row in range(batch.num_rows):
        start, end = int(offsets[row]), int(offsets[row + 1])
        yield ExportGroup(
            group_id=ids[row],
            env=envs[row],
            run_id=runs[row],
            item_key=keys[row],
            scores=scores[row],
            seq_lens=per_seq_list[start:end],
            completion_lens=completion_list[start:end],
            _messages_json=messages[row],
            _images_json=images[row] if images is not None else None,
            _arrow_row=(tokens, masks, row) if has_tokens else None,
        )


def iter_store_groups(config: SourceConfig, *, need_tokens: bool = True) -> Iterator[ExportGroup]:
    """Stream the chosen runs' groups in commit order, one Arrow batch at a time.

    `need_tokens=False` skips reading the token and mask columns (the bulk of
    a shard) when no length limit or token decoding needs them.
    """
    from factory.store_object import open_store  # not imported by API exports (their start-up)
    import pyarrow as pa
    import pyarrow.compute as pc

    columns = _META_COLUMNS + (["tokens", "masks"] if need_tokens else [])
    store = open_store(config.store)
    runs = config.runs or store.runs()
    if not runs:
        raise SourceError(f"store {store.root} holds no runs: check source.store, or write a run first")
    known = set(store.runs())
    missing = [run for run in runs if run not in known]
    if missing:
        raise SourceError(f"run(s) {missing} not found in store {store.root}; runs there: {sorted(known) or 'none'}")
    envs = pa.array(config.envs, pa.string()) if config.envs else None
    for run in runs:
        for batch in store.iter_batches(run, columns=columns, batch_size=config.batch_groups):
            if envs is not None:
                batch = batch.filter(pc.is_in(batch.column("env").cast(pa.string()), value_set=envs))
                if batch.num_rows == 0:
                    continue
            yield from groups_from_batch(batch)
        for problem in store.problems:
            logger.error("run %s: shard %s left out of the export: %s", run, problem.path, problem.reason)


def group_from_wire(data: dict[str, Any]) -> ExportGroup:
    """An ExportGroup from Atropos's ScoredData JSON (as GET /batch returns it)."""
    for name in ("tokens", "masks", "scores"):
        if not isinstance(data.get(name), list):
            raise SourceError(f"a group from the API has no list field {name!r}; is this an Atropos-compatible /batch?")
    tokens, masks = data["tokens"], data["masks"]
    env_id = data.get("env_id")
    return ExportGroup(
        group_id=data.get("group_id") or content_group_id(tokens, data["scores"], env_id),
        env=data.get("env") or (f"env-{env_id}" if env_id is not None else ""),
        run_id=data.get("run_id") or "",
        item_key=data.get("item_key") or "",
        scores=[float(s) for s in data["scores"]],
        seq_lens=[len(t) for t in tokens],
        completion_lens=[len(mask) - mask.count(MASK_IGNORE) for mask in masks],
        _messages=data.get("messages"),
        _images=data.get("images"),
        _tokens=tokens,
        _masks=masks,
    )


_NULL = msgspec.Raw(b"null")
_WHITESPACE = b" \t\r\n"
_INT_LIST_BYTES = b"0123456789,-[]"
_IGNORED = str(MASK_IGNORE).encode()


class _BatchGroup(msgspec.Struct):
    """A /batch group with its number lists kept as JSON text: the exporter needs their lengths (and, for the
    rows it keeps, maybe their values), so they are not turned into Python ints up front."""

    tokens: msgspec.Raw
    masks: msgspec.Raw
    scores: list[float]
    messages: msgspec.Raw = _NULL
    images: msgspec.Raw = _NULL
    env_id: int | None = None
    group_id: str | None = None
    env: str | None = None
    run_id: str | None = None
    item_key: str | None = None


class _Batch(msgspec.Struct):
    batch: list[_BatchGroup] | None = None


_BATCH = msgspec.json.Decoder(_Batch, strict=False)


def _int_texts(raw: msgspec.Raw) -> list[bytes] | None:
    """`[[1,2],[3]]` as [b"1,2", b"3"] (each sequence's numbers as compact JSON text), or None unless the value is
    a list of lists of plain integers."""
    compact = bytes(raw)
    if b" " in compact or b"\n" in compact or b"\t" in compact or b"\r" in compact:  # not compact JSON (Atropos's has ", ")
        compact = compact.translate(None, _WHITESPACE)
    if compact.translate(None, _INT_LIST_BYTES) or not compact.startswith(b"[") or not compact.endswith(b"]"):
        return None
    if b"-0," in compact or b"-0]" in compact:  # "-0" is written "0" by the slow way: keep the ids equal
        return None
    inner = compact[1:-1]
    if not inner:
        return []
    if not (inner.startswith(b"[") and inner.endswith(b"]")):
        return None
    return inner[1:-1].split(b"],[")


def _count(text: bytes) -> int:
    return text.count(b",") + 1 if text else 0


def _trained(text: bytes) -> int:
    """Entries of a compact int list text that are not MASK_IGNORE."""
    ignored = text.count(_IGNORED + b",") + (1 if text == _IGNORED or text.endswith(b"," + _IGNORED) else 0)
    return _count(text) - ignored


def groups_from_batch_json(body: bytes) -> list[ExportGroup] | None:
    """The groups of a /batch response body (None when it has no batch), without parsing token values.

    Lengths come from the number texts, and a group without a group_id is named by `content_group_id` over
    the same bytes (so the ids match groups parsed the slow way). A group whose tokens or masks are not
    plain integer lists takes the slow way, through Python objects.
    """
    try:
        batch = _BATCH.decode(body).batch
    except msgspec.DecodeError as error:
        raise SourceError(f"/batch answered something that is not an Atropos batch: {error}") from None
    if batch is None:
        return None
    groups = []
    for wire in batch:
        tokens, masks = _int_texts(wire.tokens), _int_texts(wire.masks)
        if tokens is None or masks is None:
            data = {"tokens": orjson.loads(bytes(wire.tokens)), "masks": orjson.loads(bytes(wire.masks)), "scores": wire.scores,
                    "messages": orjson.loads(bytes(wire.messages)), "images": orjson.loads(bytes(wire.images)),
                    "env_id": wire.env_id, "group_id": wire.group_id, "env": wire.env, "run_id": wire.run_id,
                    "item_key": wire.item_key}
            groups.append(group_from_wire(data))
            continue
        groups.append(ExportGroup(
            group_id=wire.group_id or content_group_id_of_texts(tokens, wire.scores, wire.env_id),
            env=wire.env or (f"env-{wire.env_id}" if wire.env_id is not None else ""),
            run_id=wire.run_id or "",
            item_key=wire.item_key or "",
            scores=wire.scores,
            seq_lens=[_count(text) for text in tokens],
            completion_lens=[_trained(text) for text in masks],
            _messages_json=None if wire.messages == _NULL else bytes(wire.messages),
            _images_json=None if wire.images == _NULL else bytes(wire.images),
            _token_texts=tokens,
            _mask_texts=masks,
        ))
    return groups


def groups_from_arrow_stream(body: bytes) -> list[ExportGroup]:
    """The groups of an Arrow /batch (IPC stream of `groups_from_batch`'s columns, as the factory's run-api sends)."""
    import pyarrow as pa

    try:
        reader = pa.ipc.open_stream(body)
        return [group for batch in reader for group in groups_from_batch(batch)]
    except (pa.ArrowInvalid, KeyError) as error:
        raise SourceError(f"/batch answered an Arrow stream the exporter cannot read: {error}") from None


def groups_from_batch_response(response: httpx.Response) -> list[ExportGroup] | None:
    """The groups of a /batch response, Arrow or JSON by its Content-Type (None when it has no batch)."""
    if response.headers.get("content-type", "").split(";")[0].strip().lower() == ARROW_STREAM:
        return groups_from_arrow_stream(response.content)
    return groups_from_batch_json(response.content)


def iter_api_groups(
    config: SourceConfig, client: httpx.Client | None = None, on_idle: Callable[[], None] | None = None
) -> Iterator[ExportGroup]:
    """Register as a trainer with the batching API, then yield groups from GET /batch until it stays empty.

    With `api_arrow` the batches are asked for as Arrow IPC streams (the factory's run-api sends them, with each
    group's stored id, env, run and item key); an API that answers JSON (Atropos's) is read as JSON.

    Registers as Atropos's CLIs do (GET /reset_data first when `api_reset_first`, then POST /register with the
    same body), and stops after `api_idle_timeout_s` without a batch, or, when that is None, polls until the caller
    stops reading (its row limit), as Atropos's CLIs do. `on_idle` is called while no batch is there (it may raise
    to end the export).
    """
    import httpx

    url = (config.api_url or "").rstrip("/")
    own_client = client is None
    client = client or httpx.Client(timeout=httpx.Timeout(60.0, connect=5.0))
    try:
        if config.api_reset_first:
            answer = _request(client, "GET", f"{url}/reset_data")
            if config.api_print_responses:
                print(answer.text)
        registration = {
            "wandb_group": "test",
            "wandb_project": "test",
            "batch_size": config.api_group_size * config.api_tasks_per_step,
            "max_token_len": config.api_max_token_len,
            "checkpoint_dir": "checkpoints",
            "save_checkpoint_interval": 10,
            "starting_step": 0,
            "num_steps": config.api_num_steps,
        }
        answer = _request(client, "POST", f"{url}/register", json=registration)
        if config.api_print_responses:
            print("output of register is")
            print(answer.text)
        batch_headers = {}
        if config.api_arrow:
            batch_headers["Accept"] = f"{ARROW_STREAM}, application/json;q=0.5"
        if httpx.URL(url).host in ("127.0.0.1", "localhost", "::1"):
            batch_headers["Accept-Encoding"] = "identity"  # an API on this machine: gzip would only cost CPU on both ends
        envs = set(config.envs)
        idle_since = time.monotonic()
        while True:
            batch = groups_from_batch_response(_request(client, "GET", f"{url}/batch", headers=batch_headers))
            if not batch:
                if on_idle is not None:
                    on_idle()
                idle_for = time.monotonic() - idle_since
                if config.api_idle_timeout_s is not None and idle_for > config.api_idle_timeout_s:
                    logger.info("no batch from %s for %.0f s; export done", url, config.api_idle_timeout_s)
                    return
                time.sleep(config.api_poll_s)
                continue
            idle_since = time.monotonic()
            for group in batch:
                if not envs or group.env in envs:
                    yield group
    finally:
        if own_client:
            client.close()


def _request(client: httpx.Client, method: str, url: str, **kwargs: Any) -> httpx.Response:
    import httpx

    try:
        response = client.request(method, url, **kwargs)
    except (httpx.HTTPError, httpx.InvalidURL) as error:
        raise SourceError(f"cannot reach the batching API at {url}: {error}; is run-api up at that address "
                          "(--api-url)?") from None
    if response.status_code >= 400:
        raise SourceError(f"{method} {url} answered {response.status_code}: {response.text[:300]}")
    return response


def iter_groups(
    config: SourceConfig, *, need_tokens: bool = True, on_idle: Callable[[], None] | None = None
) -> Iterator[ExportGroup]:
    if config.api_url:
        return iter_api_groups(config, on_idle=on_idle)
    return iter_store_groups(config, need_tokens=need_tokens)


def check_store_source(config: SourceConfig) -> None:
    """Raise SourceError now when the store holds none of the chosen runs (what `iter_store_groups` would find later),
    so a command can refuse before it starts a flow run."""
    if config.api_url:
        return
    from factory.store_object import open_store

    store = open_store(config.store)
    known = store.runs()
    if not known:
        raise SourceError(f"store {store.root} holds no runs: check source.store, or write a run first")
    missing = [run for run in config.runs if run not in known]
    if missing:
        raise SourceError(f"run(s) {missing} not found in store {store.root}; runs there: {sorted(known)}")
