"""The commit log's line format and its one durable append: a record is in the log whole, or not at all.

A line is the record's JSON (sorted keys) with one more key at the end,
`"check": "<length>-<crc32>"`, the byte length and CRC-32 of the JSON
before it (`{...}` without the check). So every line is still plain JSON
(`jq`, `pl.read_ndjson`), and a line that was torn, merged with another or
damaged is told apart from a good one. Lines without a check (stores written
before it existed) are read as they are.

`append_line` writes a line with a single `write` on an O_APPEND descriptor,
checks the length written and fsyncs; if anything fails it truncates the log
back to where it was, so a failed append leaves nothing behind. Before
appending, `heal_tail` cuts off a torn last line left by a crash (or, if that
line is a whole record that only lacks its newline, completes it).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import zlib
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_CHECK = b', "check": "'
_RECORD_START = b'{"bytes": '
"""How every record's sorted-key JSON begins: where a record merged onto a torn line starts."""


class CommitLineError(ValueError):
    """A commit-log line that is not a whole, intact record."""


def encode_line(record: dict[str, Any]) -> bytes:
    """One log line (with its newline) for `record`: sorted-key JSON plus its length and CRC-32."""
    body = json.dumps(record, sort_keys=True).encode("utf-8")
    return body[:-1] + _CHECK + f"{len(body)}-{zlib.crc32(body):08x}".encode() + b'"}\n'


def decode_line(line: bytes) -> dict[str, Any]:
    """The record of one log line (without its newline); raises CommitLineError if it is torn or damaged."""
    line = line.rstrip(b"\r\n")
    try:
        data = json.loads(line)
    except ValueError as error:
        raise CommitLineError(f"not JSON ({error}): {line[:80]!r}") from None
    if not isinstance(data, dict):
        raise CommitLineError(f"not a JSON object: {line[:80]!r}")
    check = data.pop("check", None)
    if check is None:
        return data  # written before lines carried a check
    at = line.rfind(_CHECK)
    body = line[:at] + b"}" if at >= 0 else b""
    expected = f"{len(body)}-{zlib.crc32(body):08x}"
    if at < 0 or check != expected:
        raise CommitLineError(f"checksum {check!r} does not match the line ({expected}): damaged")
    return data


def salvage_line(line: bytes) -> dict[str, Any] | None:
    """The last whole record inside a damaged line, if any.

    Before torn tails were cut off, the next commit was appended onto a torn
    line, making one unreadable line of a fragment and a whole record.
    """
    start = line.find(_RECORD_START, 1)
    found = None
    while start > 0:
        try:
            found = decode_line(line[start:])
        except CommitLineError:
            pass
        start = line.find(_RECORD_START, start + 1)
    return found


def heal_tail(fd: int, path: Path) -> int:
    """Make the log on `fd` end with a newline: complete a whole last record, or cut off a torn one.

    Returns the log's size after. Called under the run's lock, before each append.
    """
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return size
    # Find the start of the last line (read backwards in blocks; lines are a few hundred bytes).
    end, start = size, 0
    while end > 0:
        begin = max(0, end - 4096)
        block = os.pread(fd, end - begin, begin)
        cut = block.rfind(b"\n")
        if cut >= 0:
            start = begin + cut + 1
            break
        end = begin
    tail = os.pread(fd, size - start, start)
    try:
        decode_line(tail)
    except CommitLineError:
        logger.warning("%s: cutting off a torn last line of %d bytes (a crash or a full disk during an append)", path, len(tail))
        os.ftruncate(fd, start)
        os.fsync(fd)
        return start
    logger.warning("%s: completing a last record that lacked its newline", path)
    _write_all(fd, b"\n", path)
    os.fsync(fd)
    return size + 1


def _write_all(fd: int, data: bytes, path: Path) -> None:
    written = os.write(fd, data)
    if written != len(data):
        raise OSError(errno.ENOSPC, f"short write to {path}: {written} of {len(data)} bytes (disk full?)")


def append_line(path: Path, line: bytes) -> None:
    """Append one line durably: heal a torn tail, one write, fsync; on any failure the log is as it was.

    Raises OSError (with the path) if the line could not be made durable; raises
    `LogUncertain` if it could not even be taken back.
    """
    created = not path.exists()
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        start = heal_tail(fd, path)
        try:
            _write_all(fd, line, path)
            os.fsync(fd)
            if created:
                fsync_dir(path.parent)
        except OSError as error:
            try:
                os.ftruncate(fd, start)
                os.fsync(fd)
            except OSError as undo:
                raise LogUncertain(
                    f"appending to {path} failed ({error.strerror or error}) and the partial record could not be "
                    f"taken back ({undo.strerror or undo}); run `factory-store repair` once the disk is healthy"
                ) from error
            raise OSError(error.errno, error.strerror or str(error), str(path)) from error
    finally:
        os.close(fd)


class LogUncertain(OSError):
    """An append failed and could not be undone: the record may or may not be in the log."""


def fsync_dir(path: Path) -> None:
    """fsync a directory (makes the creation, rename or removal of an entry in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
