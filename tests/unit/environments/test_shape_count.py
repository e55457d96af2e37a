"""Multimodal shape counting: scoring, and pictures kept byte for byte in messages, the group, the store, the
batching API's /batch body and groups.jsonl; text-only templates see an <image> placeholder."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import orjson
import pytest

from environments.base import Rollout, text_messages
from environments.shape_count import ShapeCountConfig, ShapeCountEnv
from tasks.generate import prompt_ids
from tasks.group import build_group
from tests.unit.environments.scripted import ScriptedSampler


@pytest.fixture(scope="module")
def env() -> ShapeCountEnv:
    return ShapeCountEnv(ShapeCountConfig(group_size=2))


def png_of(item) -> bytes:
    part = item.messages[-1]["content"][0]
    return base64.b64decode(part["image_url"]["url"].removeprefix("data:image/png;base64,"))


def test_pictures_are_real_pngs_fixed_by_seed_and_answers_match(env):
    from PIL import Image

    item = env.get_item(0)
    png = png_of(item)
    assert png.startswith(b"\x89PNG") and Image.open(io.BytesIO(png)).size == (128, 128)
    assert base64.b64decode(item.info["images"][0]) == png == png_of(ShapeCountEnv(ShapeCountConfig()).get_item(0))
    assert png != png_of(env.get_item(1))
    assert 1 <= item.answer <= 6 and item.messages[-1]["content"][1]["type"] == "text"


def test_right_wrong_and_malformed_answers(env):
    item = env.get_item(2)
    assert env.score(item, f"<answer>{item.answer}</answer>") == 1.0
    assert env.score(item, f"<answer>{item.answer + 1}</answer>") == 0.0
    assert env.score(item, f"{item.answer}") == 0.0 and env.score(item, "<answer>three</answer>") == 0.0


def test_text_only_template_sees_a_placeholder(env, tokenizer):
    item = env.get_item(0)
    flat = text_messages(item.messages)
    assert flat[-1]["content"] == "<image>" + item.info["question"] and item.messages[-1]["content"][0]["type"]
    assert "<image>" in tokenizer.decode(prompt_ids(tokenizer, item.messages))


def test_images_survive_group_store_batch_api_and_jsonl_byte_for_byte(env, tokenizer, tmp_path):
    from factory.serve.payload import PayloadReader, batch_json, encode_groups
    from factory.store import ShardStore
    from flows.datagen_cli import write_groups_jsonl

    item = env.get_item(0)
    rollouts = asyncio.run(env.collect_trajectories(item, ScriptedSampler(tokenizer, ["<answer>1</answer>", "2"])))
    for r in rollouts:
        r.score = env.score(item, r.text)
    group = build_group("shape_count", item, rollouts, group_size=2, max_token_length=4096,
                        ensure_scores_are_not_same=False)
    png = png_of(item)
    assert [base64.b64decode(x) for x in group.images] == [png]
    assert group.messages[0][-2]["content"][0] == item.messages[-1]["content"][0]  # the content part, as sent

    store = ShardStore(tmp_path)
    store.commit("mm", "p", 0, [group])
    [stored] = list(store.iter_groups("mm"))
    assert base64.b64decode(stored.images[0]) == png and stored.messages == group.messages

    body = batch_json(encode_groups(PayloadReader(1 << 20).read([(store.shard_paths("mm")[0], 0)])))
    [served] = orjson.loads(body)["batch"]
    assert base64.b64decode(served["images"][0]) == png
    url = served["messages"][0][-2]["content"][0]["image_url"]["url"]
    assert base64.b64decode(url.split(",", 1)[1]) == png

    write_groups_jsonl(store, "mm", tmp_path / "groups.jsonl")
    line = json.loads((tmp_path / "groups.jsonl").read_text())
    assert base64.b64decode(line["images"][0]) == png


def test_rollout_without_images_keeps_images_none():
    from environments.base import Item

    item = Item("k", [{"role": "user", "content": "hi"}])
    r = Rollout("k", "x", [1], [2], None, "stop", 0, score=1.0)
    assert build_group("e", item, [r], group_size=1, max_token_length=8).images is None
