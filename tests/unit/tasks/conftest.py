"""Tokenizers the tasks' tests compare on: a tiny random policy's and the committed starter policy's."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.generate import load_tokenizer

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from factory.inference.tiny_model import make_tiny_policy

    path = tmp_path_factory.mktemp("policy") / "tiny"
    make_tiny_policy(path)
    return path


@pytest.fixture(scope="module", params=["tiny", "starter"])
def tokenizer(request, tiny):
    return load_tokenizer(str(tiny if request.param == "tiny" else REPO / "models" / "starter-policy"))
