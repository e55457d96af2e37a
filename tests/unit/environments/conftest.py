"""Fixtures for environment tests: the starter policy's real tokenizer (chat template included)."""

from __future__ import annotations

import pytest

from tests.unit.environments.scripted import STARTER


@pytest.fixture(scope="session")
def tokenizer():
    from tasks.generate import load_tokenizer

    return load_tokenizer(str(STARTER))
