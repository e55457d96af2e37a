"""The saved decoder (factory/export/decode_cache.py): the same text as transformers' decode, and used only while
the tokenizer dir and the installed packages are unchanged."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from factory.export import decode_cache
from factory.export.atropos import load_decode_tokenizer

STARTER = Path(__file__).resolve().parents[3] / "models" / "starter-policy"


def _copy(source: Path, tmp_path: Path) -> Path:
    target = tmp_path / "tok"
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.safetensors"))
    return target


def test_a_second_load_decodes_the_same_without_transformers(tmp_path):
    directory = _copy(STARTER, tmp_path)
    first = load_decode_tokenizer(str(directory))
    assert not isinstance(first, decode_cache.BackendDecoder)  # loaded through transformers, then saved
    second = load_decode_tokenizer(str(directory))
    assert isinstance(second, decode_cache.BackendDecoder)
    samples = [list(range(0, 400)), [first.convert_tokens_to_ids("<|im_end|>"), 5, 17], [], list(range(300, 330))]
    for ids in samples:
        assert second.decode(ids) == first.decode(ids)


def test_a_fresh_process_does_not_import_transformers_on_a_saved_decoder(tmp_path):
    directory = _copy(STARTER, tmp_path)
    load_decode_tokenizer(str(directory))
    code = ("import sys; from factory.export.atropos import load_decode_tokenizer as load; "
            f"t = load({str(directory)!r}); print(type(t).__name__, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["BackendDecoder", "False"]


def test_a_changed_file_or_the_cache_off_goes_through_transformers(tmp_path, monkeypatch):
    directory = _copy(STARTER, tmp_path)
    load_decode_tokenizer(str(directory))
    assert isinstance(decode_cache.load(str(directory)), decode_cache.BackendDecoder)
    config = directory / "tokenizer_config.json"
    config.write_text(config.read_text() + "\n")
    assert decode_cache.load(str(directory)) is None
    monkeypatch.setenv(decode_cache.ENV, "off")
    load_decode_tokenizer(str(directory))
    assert decode_cache.load(str(directory)) is None


def test_a_corrupt_saved_decoder_is_ignored(tmp_path, tiny_tokenizer_dir):
    directory = _copy(tiny_tokenizer_dir, tmp_path)
    load_decode_tokenizer(str(directory))
    saved = list(decode_cache.cache_dir().glob("*.json"))
    assert len(saved) == 1
    saved[0].write_text("{not json")
    tokenizer = load_decode_tokenizer(str(directory))
    assert not isinstance(tokenizer, decode_cache.BackendDecoder)
    assert tokenizer.decode([5, 6, 7]) == tokenizer.backend_tokenizer.decode([5, 6, 7])
    assert decode_cache.load(str(directory)).decode([5, 6, 7]) == tokenizer.decode([5, 6, 7])  # saved again


def test_hub_ids_are_not_saved(tmp_path):
    assert decode_cache.load("NousResearch/DeepHermes-3-Llama-3-8B-Preview") is None
    decode_cache.save("not/a-dir", object())
    assert not decode_cache.cache_dir().exists()
