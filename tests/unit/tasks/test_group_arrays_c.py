"""factory/group_arrays.c against the Python path it stands in for (GroupColumns.add_shared_prompt's arrays).

The rows both paths write are compared in test_group_columns.py, which runs every test on each path.
"""

from __future__ import annotations

import os
import subprocess
import sys
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from factory import group_columns

pytestmark = pytest.mark.skipif(group_columns._native is None,
                                reason="factory/group_arrays.c was not built (no C compiler at install time)")


class _Index:
    """An id that is an int only through __index__ (as numpy's integers are)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


def _python_sequences(prompt, outputs, logprobs):
    """What add_shared_prompt's Python path appends, as bytes, or "refused" (TypeError or OverflowError: it then
    returns False, whichever value it met first)."""
    try:
        tokens, masks = array("i"), array("i")
        for output in outputs:
            ids = array("i", output)
            tokens += array("i", prompt) + ids
            masks += array("i", [-100] * len(prompt)) + ids
        floats = None
        if logprobs is not None:
            floats = array("d")
            for values in logprobs:
                floats += array("d", [1.0] * len(prompt))
                floats.extend(values)
        lengths = array("i", [len(prompt) + len(output) for output in outputs])
    except (TypeError, OverflowError):
        return "refused"
    return tokens.tobytes(), masks.tobytes(), lengths.tobytes(), None if floats is None else floats.tobytes()


def _native_sequences(prompt, outputs, logprobs):
    try:
        return group_columns._native.shared_prompt_sequences(prompt, outputs, logprobs)
    except (TypeError, OverflowError):
        return "refused"


_ID = st.one_of(st.integers(-(2**31), 2**31 - 1), st.booleans(), st.integers(0, 9).map(_Index))
_NOT_AN_ID = st.one_of(st.integers(2**31, 2**70), st.integers(-(2**70), -(2**31) - 1), st.floats(), st.just("7"),
                       st.none())


@settings(max_examples=300, deadline=None)
@given(st.lists(_ID, min_size=1, max_size=6), st.lists(st.lists(_ID, min_size=1, max_size=6), min_size=1, max_size=4),
       st.booleans(), st.data())
def test_group_arrays_c_gives_the_python_paths_bytes_and_refusals(prompt, outputs, with_logprobs, data):
    logprobs = None
    if with_logprobs:
        value = st.one_of(st.floats(), st.integers(-5, 5))
        logprobs = [data.draw(st.lists(value, min_size=len(o), max_size=len(o))) for o in outputs]
    if data.draw(st.booleans()):  # half the cases: one value either path refuses, somewhere
        where = data.draw(st.sampled_from(["prompt", "output"] + (["logprob"] if logprobs else [])))
        target = prompt if where == "prompt" else data.draw(st.sampled_from(outputs if where == "output" else logprobs))
        target[data.draw(st.integers(0, len(target) - 1))] = data.draw(
            st.just("x") if where == "logprob" else _NOT_AN_ID)
        assert _python_sequences(prompt, outputs, logprobs) == "refused"
    assert _native_sequences(prompt, outputs, logprobs) == _python_sequences(prompt, outputs, logprobs)  # bytes: NaNs too


def test_factory_native_groups_0_turns_the_c_path_off():
    code = "from factory import group_columns; print(group_columns._native is None)"
    off = subprocess.run([sys.executable, "-c", code], env={**os.environ, "FACTORY_NATIVE_GROUPS": "0"},
                         capture_output=True, text=True, check=True)
    assert off.stdout.strip() == "True"
