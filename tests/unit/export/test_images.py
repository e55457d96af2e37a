"""Multimodal groups: output.images exports them in TRL's vision layout, pictures byte for byte; else counted out."""

from __future__ import annotations

import base64
import random

import datasets
import pyarrow.parquet as pq
import pytest

from environments.groups import MASK_IGNORE, ScoredGroup
from environments.shape_count import draw, image_part
from factory.export import (
    DpoExportConfig,
    OutputConfig,
    SelectionConfig,
    SftExportConfig,
    SourceConfig,
    export_dpo,
    export_sft,
)
from factory.export.images import IMAGE_NOT_INLINE, MULTIMODAL_SKIPPED, vision_messages
from factory.export.render import Renderer, trl_layout_problem
from factory.export.source import group_from_wire
from factory.store import ShardStore

from .conftest import scored


def _png(seed: int) -> bytes:
    return draw(random.Random(seed), 64, 3)[0]


def shape_group(index: int, scores: list[float], *, in_messages: bool = True, run_id: str = "run-mm") -> ScoredGroup:
    """A group as shape_count stores it: the picture as a content part and in the group's images field."""
    png = _png(index)
    user_content = [image_part(png), {"type": "text", "text": f"How many shapes? ({index})"}] if in_messages \
        else f"How many shapes? ({index})"
    convo = [
        [{"role": "system", "content": "Count."}, {"role": "user", "content": user_content},
         {"role": "assistant", "content": f"<answer>{k}</answer>"}]
        for k in range(len(scores))
    ]
    tokens = [[1, 2, 3, 10 + k] for k in range(len(scores))]
    masks = [[MASK_IGNORE] * 3 + [10 + k] for k in range(len(scores))]
    return ScoredGroup(tokens=tokens, masks=masks, scores=scores, messages=convo, images=[base64.b64encode(png).decode()],
                       env="shape_count", run_id=run_id, item_key=f"shapes:0:{index}")


@pytest.fixture
def mixed_store(tmp_path):
    """Three multimodal groups (two with image parts, one with the picture only in `images`) and two text groups."""
    store = ShardStore(tmp_path / "store")
    groups = [shape_group(0, [1.0, 0.0]), shape_group(1, [1.0, 0.0]), shape_group(2, [1.0, 0.0], in_messages=False),
              scored([1.0, 0.0], index=7, run_id="run-mm"), scored([0.5, 0.0], index=8, run_id="run-mm")]
    store.commit("run-mm", "w0", 0, groups)
    return store


def _sft(store, path, images, **output):
    config = SftExportConfig(source=SourceConfig(store=str(store.root)), select=SelectionConfig(top_n_per_group=1),
                             output=OutputConfig(path=str(path), images=images, **output))
    return export_sft(config)


def test_sft_with_images_round_trips_the_picture_bytes_via_pyarrow(mixed_store, tmp_path):
    stats = _sft(mixed_store, tmp_path / "sft.parquet", images=True)
    assert stats.rows_out == 5 and not stats.dropped.get(MULTIMODAL_SKIPPED)
    table = pq.read_table(tmp_path / "sft.parquet")
    rows = table.to_pylist()
    assert [row["item_key"] for row in rows] == ["shapes:0:0", "shapes:0:1", "shapes:0:2", "math:7", "math:8"]
    for index in range(3):
        assert [image["bytes"] for image in rows[index]["images"]] == [_png(index)]  # exact bytes, both sources
        user = rows[index]["messages"][1]
        assert user["role"] == "user"
        assert user["content"] == [{"type": "image", "text": None}, {"type": "text", "text": f"How many shapes? ({index})"}]
        assert rows[index]["messages"][2]["content"] == [{"type": "text", "text": "<answer>0</answer>"}]
    assert rows[3]["images"] == [] and rows[3]["messages"][0]["content"] == [{"type": "text", "text": "q7"}]
    # the stored base64 string is recovered exactly too
    stored = next(mixed_store.iter_groups("run-mm")).images[0]
    assert base64.b64encode(rows[0]["images"][0]["bytes"]).decode() == stored
    assert trl_layout_problem(table.schema.names, "sft", images=True) is None


def test_sft_with_images_loads_in_datasets_as_pictures_with_the_same_bytes(mixed_store, tmp_path):
    _sft(mixed_store, tmp_path / "out", images=True, prompt_completion=True)
    dataset = datasets.load_dataset("parquet", data_files=str(tmp_path / "out" / "*.parquet"), split="train")
    assert dataset.features["images"].feature == datasets.Image()
    picture = dataset[0]["images"][0]  # decoded by datasets
    assert picture.size == (64, 64)
    raw = dataset.cast_column("images", datasets.Sequence(datasets.Image(decode=False)))
    assert [[image["bytes"] for image in row] for row in raw["images"]] == [[_png(0)], [_png(1)], [_png(2)], [], []]
    assert raw[0]["prompt"][1]["content"][0]["type"] == "image"
    assert raw[0]["completion"] == [{"role": "assistant", "content": [{"type": "text", "text": "<answer>0</answer>"}]}]


def test_dpo_with_images_keeps_the_prompt_pictures(mixed_store, tmp_path):
    config = DpoExportConfig(source=SourceConfig(store=str(mixed_store.root)),
                             output=OutputConfig(path=str(tmp_path / "dpo.parquet"), images=True))
    stats = export_dpo(config)
    rows = pq.read_table(tmp_path / "dpo.parquet").to_pylist()
    assert stats.rows_out == 4  # 3 multimodal + the text group with a 1.0/0.0 gap
    assert [[image["bytes"] for image in row["images"]] for row in rows[:3]] == [[_png(0)], [_png(1)], [_png(2)]]
    assert rows[0]["chosen"] == [{"role": "assistant", "content": [{"type": "text", "text": "<answer>0</answer>"}]}]
    assert rows[0]["rejected"] == [{"role": "assistant", "content": [{"type": "text", "text": "<answer>1</answer>"}]}]


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_without_images_multimodal_sequences_are_counted_out_and_text_rows_stay(mixed_store, tmp_path, caplog, kind):
    if kind == "sft":
        stats = _sft(mixed_store, tmp_path / "out.parquet", images=False)
        assert stats.dropped[MULTIMODAL_SKIPPED] == 3  # the best sequence of each multimodal group
        assert stats.rows_out == 2
    else:
        config = DpoExportConfig(source=SourceConfig(store=str(mixed_store.root)),
                                 output=OutputConfig(path=str(tmp_path / "out.parquet")))
        stats = export_dpo(config)
        assert stats.dropped[MULTIMODAL_SKIPPED] == 6  # both sides of each multimodal pair
        assert stats.rows_out == 1
    table = pq.read_table(tmp_path / "out.parquet")
    assert "images" not in table.schema.names
    assert set(table.column("env").to_pylist()) == {"math"}
    assert "multimodal sequences" in caplog.text and "--keep-images" in caplog.text
    assert MULTIMODAL_SKIPPED in stats.markdown()


def test_text_groups_render_the_same_rows_with_or_without_the_option_but_for_the_layout():
    group = group_from_wire(scored([1.0, 0.0]).model_dump())
    plain = Renderer("sft", OutputConfig(path="x")).sft_row(group, 0)
    assert plain["messages"] == [{"role": "user", "content": "q0"}, {"role": "assistant", "content": "a0-0"}]
    vision = Renderer("sft", OutputConfig(path="x", images=True)).sft_row(group, 0)
    assert vision["messages"][1] == {"role": "assistant", "content": [{"type": "text", "text": "a0-0"}]}


def test_wire_groups_keep_their_images_and_dedup_sees_the_picture():
    a = group_from_wire(shape_group(0, [1.0, 0.0]).model_dump())
    b = group_from_wire(shape_group(1, [1.0, 0.0]).model_dump())
    renderer = Renderer("sft", OutputConfig(path="x", images=True))
    row_a = renderer.sft_row(a, 0)
    assert row_a["images"] == [{"bytes": _png(0), "path": None}]
    same_text = dict(row_a, images=renderer.sft_row(b, 0)["images"])
    assert renderer.content_hash(same_text) != renderer.content_hash(row_a)


def test_pictures_that_are_not_inline_are_counted_not_fetched():
    remote = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]
    with pytest.raises(Exception) as error:
        vision_messages(remote, None)
    assert error.value.reason == IMAGE_NOT_INLINE
    messages, pictures = vision_messages([{"role": "user", "content": "hi"}], ["data:image/png;base64," +
                                                                          base64.b64encode(b"\x89PNG").decode()])
    assert pictures == [b"\x89PNG"] and messages[0]["content"][0] == {"type": "image", "text": None}


def test_images_option_needs_parquet_and_message_lists(tiny_tokenizer_dir):
    with pytest.raises(ValueError, match="Parquet"):
        OutputConfig(path="x.jsonl", images=True)
    with pytest.raises(ValueError, match="conversational"):
        OutputConfig(path="x", images=True, style="text", tokenizer=str(tiny_tokenizer_dir))


def test_cli_keep_images_writes_the_vision_layout(mixed_store, tmp_path, capsys):
    from factory.export.cli import main

    out = tmp_path / "dpo"
    assert main("dpo", [str(out), "--store", str(mixed_store.root), "--keep-images", "--tokenizer", "tok", "--quiet"]) == 0
    rows = pq.read_table(out).to_pylist()
    assert [image["bytes"] for image in rows[0]["images"]] == [_png(0)]
    assert main("sft", [str(tmp_path / "x.jsonl"), "--store", str(mixed_store.root), "--keep-images"]) == 2
    assert "Parquet" in capsys.readouterr().err
