from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random two-layer Qwen2 policy with a trained BPE tokenizer (about a second to build)."""
    from factory.inference.tiny_model import make_tiny_policy

    return make_tiny_policy(tmp_path_factory.mktemp("tiny-policy") / "model")
