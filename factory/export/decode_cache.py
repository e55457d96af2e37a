"""A tokenizer's decoder as transformers builds it, kept on disk so the next export decodes without transformers.

Atropos's text rows are `AutoTokenizer.from_pretrained(dir).decode(tokens)`. Importing transformers is most of the
export CLIs' start-up (~0.8 s of CPU), yet for most tokenizers `decode` is only the Rust tokenizer that transformers
builds (`TokenizersBackend._decode`, no text clean-up). After a load through transformers, such a tokenizer is saved
as that Rust tokenizer's JSON under a key over the directory's files and the installed transformers and tokenizers;
the next load with the same key reads it with `tokenizers` alone and decodes to the same text. Anything else (a hub
id, which transformers checks for a newer revision; a class with its own decode; clean-up on; a save that fails)
goes through transformers every time, as before.

Where: `$FACTORY_DECODE_CACHE`, else `$XDG_CACHE_HOME/rollout-factory/decoders` (default `~/.cache/...`);
`FACTORY_DECODE_CACHE=off` turns it off.
"""

from __future__ import annotations

import hashlib
import logging
import os
from importlib.util import find_spec
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

ENV = "FACTORY_DECODE_CACHE"


class BackendDecoder:
    """`decode(tokens)` as a transformers `TokenizersBackend` does it (special tokens kept, no clean-up)."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def decode(self, tokens: list[int]) -> str:
        return self.backend.decode(tokens, skip_special_tokens=False)


def cache_dir() -> Path | None:
    chosen = os.environ.get(ENV, "")
    if chosen.lower() in ("off", "0", "false", "no"):
        return None
    if chosen:
        return Path(chosen).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "rollout-factory" / "decoders"


def _key(name: str) -> str | None:
    """A digest of the tokenizer directory's files (name, size, mtime) and the installed transformers and
    tokenizers; None when `name` is not a local directory or either package is missing."""
    directory = Path(name).expanduser()
    if not directory.is_dir():
        return None
    digest = hashlib.sha256(str(directory.resolve()).encode())
    for package in ("transformers", "tokenizers"):
        spec = find_spec(package)
        if spec is None or spec.origin is None:
            return None
        stat = os.stat(spec.origin)
        digest.update(f"{spec.origin}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if entry.is_file():
            stat = entry.stat()
            digest.update(f"{entry.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:32]


def _path(name: str) -> Path | None:
    where = cache_dir()
    key = _key(name) if where is not None else None
    return where / f"{key}.json" if where is not None and key is not None else None


def load(name: str) -> BackendDecoder | None:
    """The saved decoder of tokenizer dir `name`, or None (not saved, stale, unreadable, or the cache is off)."""
    path = None
    try:
        path = _path(name)
        if path is None or not path.is_file():
            return None
        from tokenizers import Tokenizer

        return BackendDecoder(Tokenizer.from_str(path.read_text(encoding="utf-8")))
    except Exception as error:  # noqa: BLE001  # a cache: any failure means "load through transformers"
        logger.debug("decode cache: not used for %s (%s)", name, error)
        if path is not None:
            path.unlink(missing_ok=True)  # unreadable: the load through transformers saves it again
        return None


def _decodes_as_backend(tokenizer: Any) -> bool:
    """Whether `tokenizer.decode(ids)` is `backend_tokenizer.decode(ids, skip_special_tokens=False)`: transformers'
    own decode path, untouched by the class, with no clean-up of the text."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: not known to decode that way
        return False
    cls = type(tokenizer)
    if not isinstance(tokenizer, TokenizersBackend) or cls.decode is not PreTrainedTokenizerBase.decode \
            or cls._decode is not TokenizersBackend._decode:
        return False
    if tokenizer.clean_up_tokenization_spaces:  # transformers skips the clean-up for BPE models unless forced
        forced = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", True)
        if type(tokenizer.backend_tokenizer.model).__name__ != "BPE" or forced:
            return False
    return True


def save(name: str, tokenizer: Any) -> None:
    """Keep `tokenizer`'s decoder for the next load of `name`, when it decodes as its backend (checked on a sample
    of ids spread over the vocabulary, added tokens included). Best effort: a failure is logged, not raised."""
    try:
        path = _path(name)
        if path is None or path.is_file() or not _decodes_as_backend(tokenizer):
            return
        backend = tokenizer.backend_tokenizer
        size = backend.get_vocab_size(with_added_tokens=True)
        sample = list(range(0, size, max(1, size // 4096))) + sorted(backend.get_added_tokens_decoder())
        for start in range(0, len(sample), 64):
            ids = sample[start : start + 64]
            if tokenizer.decode(ids) != backend.decode(ids, skip_special_tokens=False):
                return
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        temp.write_text(backend.to_str(), encoding="utf-8")
        os.replace(temp, path)
    except Exception as error:  # noqa: BLE001  # a cache: never the reason an export fails
        logger.debug("decode cache: %s not saved (%s)", name, error)
