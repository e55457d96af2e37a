"""Atropos's own line layout for `atropos-sft-gen` / `atropos-dpo-gen`: the rows atroposlib 0.4.0's CLIs write.

SFT lines are `{"prefix", "completion", "score"}` (the group's sequences decoded
with the tokenizer; `prefix` is the longest common prefix of all of them, text
not tokens) or, with `--save-messages`, `{"messages", "score"}`. DPO lines are
`{"prefix", "pos", "score", "neg"}` (pos/neg: completions) or `{"pos", "score",
"neg"}` (message lists). Lines are `json.dumps(row, ensure_ascii=False)`, as the
`jsonlines` writer Atropos uses, so a file from either CLI reads the same byte
for byte. Differences, on purpose: the completion is the decoded text after the
common prefix (Atropos's `text.split(prefix)[1]` also cuts it at a repeat of the
prompt, and fails on a group with no common prefix); the rejected of a pair is
drawn with a seeded generator (Atropos: the unseeded global one).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from factory.export import decode_cache
from factory.export.config import OutputConfig
from factory.export.select import Pair
from factory.export.source import ExportGroup
from factory.export.writer import OutputExistsError


class AtroposLayoutError(ValueError):
    """A group cannot be written in Atropos's layout; the message says why and what to pass instead."""


@contextmanager
def imports_failing(*names: str) -> Iterator[None]:
    """While inside, `import name` raises ImportError for each of `names` not imported yet (so a library that
    imports an optional package when installed goes without it); afterwards they import as usual."""
    blocked = [name for name in names if name not in sys.modules]
    for name in blocked:
        sys.modules[name] = None  # type: ignore[assignment]  # find_spec(name) -> None, `import name` fails
    try:
        yield
    finally:
        for name in blocked:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


def load_decode_tokenizer(name: str) -> Any:
    """`AutoTokenizer.from_pretrained(name)` for decoding only.

    Its decoder as saved by an earlier load (factory/export/decode_cache.py: a local dir whose decode is the Rust
    tokenizer's, same files, same transformers) when there is one, without importing transformers; else through
    transformers, imported without torch when torch is not loaded yet (torch is ~2 s of start-up and no tokenizer
    needs it; Atropos's venv has no torch either) and without trio (its hub client's httpcore imports trio, ~0.1 s,
    for async use under trio, which never happens here).
    """
    saved = decode_cache.load(name)
    if saved is not None:
        return saved
    quiet = "TRANSFORMERS_NO_ADVISORY_WARNINGS" not in os.environ
    if quiet:
        os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"  # not "PyTorch was not found" on stderr
    try:
        with imports_failing("torch", "trio"):
            from transformers import AutoTokenizer
            from transformers.utils import logging as hf_logging

            hf_logging.set_verbosity_error()
            tokenizer = AutoTokenizer.from_pretrained(name)
    except Exception as error:  # noqa: BLE001  # OSError, ValueError, HTTP errors, a broken tokenizer.json, ...
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise AtroposLayoutError(
            f"cannot load tokenizer {name!r} ({first}); pass a local tokenizer dir or a cached hub id as "
            "--tokenizer, or --save-messages to write message lists without one"
        ) from None
    finally:
        if quiet:
            os.environ.pop("TRANSFORMERS_NO_ADVISORY_WARNINGS", None)
    decode_cache.save(name, tokenizer)
    return tokenizer


class TokenizerLoader:
    """`load_decode_tokenizer(name)` in a background thread, started at once: the CLI resets and registers with the
    API while transformers is imported (about a second), so it is registered sooner than Atropos's, which loads the
    tokenizer first. `check()` raises a failed load's error while the CLI waits for batches; `get()` waits for it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._tokenizer: Any = None
        self._error: AtroposLayoutError | None = None
        self._thread = threading.Thread(target=self._load, name="tokenizer-load", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        try:
            self._tokenizer = load_decode_tokenizer(self.name)
        except AtroposLayoutError as error:
            self._error = error

    def check(self) -> None:
        if self._error is not None:
            raise self._error

    def get(self) -> Any:
        self._thread.join()
        self.check()
        return self._tokenizer


def common_prefix(texts: list[str]) -> str:
    """The longest common prefix of `texts` ("" for none), as Atropos's find_common_prefix."""
    if not texts:
        return ""
    shortest, longest = min(texts), max(texts)  # the common prefix of all is that of the extremes
    end = 0
    for a, b in zip(shortest, longest):
        if a != b:
            break
        end += 1
    return shortest[:end]


class AtroposRenderer:
    """Rows in Atropos's layout, with the `Renderer` interface the pipeline drives (sft_row, dpo_row, content_hash)."""

    def __init__(self, kind: str, output: OutputConfig, tokenizer: Any | None = None) -> None:
        self.kind = kind
        self.text = output.style == "text"
        self._tokenizer = tokenizer
        self.drop_reason: str | None = None
        self._group: ExportGroup | None = None
        self._split: tuple[str, list[str]] = ("", [])
        if self.text and tokenizer is None:
            raise AtroposLayoutError("Atropos's text layout decodes tokens: it needs --tokenizer")

    @property
    def tokenizer(self) -> Any:
        if isinstance(self._tokenizer, TokenizerLoader):
            self._tokenizer = self._tokenizer.get()
        return self._tokenizer

    def check(self) -> None:
        """Raise now if the tokenizer is being loaded in the background and that failed (called while idle)."""
        if isinstance(self._tokenizer, TokenizerLoader):
            self._tokenizer.check()

    def _text(self, group: ExportGroup) -> tuple[str, list[str]]:
        """(common prefix, completion per sequence) of the whole group, decoded once per group."""
        if self._group is not group:
            decode = self.tokenizer.decode
            decoded = [decode(group.tokens(i)) for i in range(len(group.scores))]
            prefix = common_prefix(decoded)
            self._group, self._split = group, (prefix, [text[len(prefix) :] for text in decoded])
        return self._split

    def _messages(self, group: ExportGroup, index: int) -> Any:
        conversations = group.messages
        if conversations is None:
            raise AtroposLayoutError(
                f"group {group.group_id!r} has no messages, which --save-messages writes; leave --save-messages out "
                "to write decoded text"
            )
        return conversations[index]

    def sft_row(self, group: ExportGroup, index: int) -> dict[str, Any] | None:
        score = group.scores[index]
        if not self.text:
            return {"messages": self._messages(group, index), "score": score}
        prefix, completions = self._text(group)
        return {"prefix": prefix, "completion": completions[index], "score": score}

    def dpo_row(self, group: ExportGroup, pair: Pair) -> dict[str, Any] | None:
        score = group.scores[pair.chosen]
        if not self.text:
            return {"pos": self._messages(group, pair.chosen), "score": score,
                    "neg": self._messages(group, pair.rejected)}
        prefix, completions = self._text(group)
        return {"prefix": prefix, "pos": completions[pair.chosen], "score": score, "neg": completions[pair.rejected]}

    def content_hash(self, row: dict[str, Any]) -> int:
        """64-bit hash of a row without its score (for --dedup)."""
        content = {k: v for k, v in row.items() if k != "score"}
        digest = hashlib.blake2b(json.dumps(content, ensure_ascii=False, sort_keys=True).encode(), digest_size=8)
        return int.from_bytes(digest.digest(), "little", signed=True)


class JsonLinesWriter:
    """Rows as Atropos's jsonlines writer formats them, into one file whatever its name.

    A new file is written under a hidden temporary name and renamed on close (a reader never sees half of it);
    `append` adds to the end of an existing file, as Atropos's --append-to-previous.
    """

    def __init__(self, output: OutputConfig) -> None:
        self.path = Path(output.path)
        if self.path.is_dir():
            raise AtroposLayoutError(f"{self.path} is a directory; Atropos's layout is one JSON lines file: give a "
                                     "file path (or --layout trl for a directory of Parquet shards)")
        if self.path.exists() and not (output.append or output.overwrite):
            raise OutputExistsError(f"{self.path} already exists: pass --append-to-previous to add to it, or "
                                    "--overwrite to replace it")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.appending = output.append and self.path.exists()
        self.start_size = self.path.stat().st_size if self.appending else 0
        self.target = self.path if self.appending else self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        self.handle = open(self.target, "a" if self.appending else "w", encoding="utf-8")  # noqa: SIM115
        self._dumps = json.JSONEncoder(ensure_ascii=False).encode

    def write(self, row: dict[str, Any]) -> None:
        self.handle.write(self._dumps(row) + "\n")

    def close(self) -> list[Path]:
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.handle.close()
        if not self.appending:
            os.replace(self.target, self.path)
        return [self.path]

    def abort(self) -> None:
        self.handle.close()
        if self.appending:
            os.truncate(self.target, self.start_size)  # the file as it was before this export
        else:
            self.target.unlink(missing_ok=True)
