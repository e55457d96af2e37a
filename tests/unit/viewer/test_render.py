"""Templates shared with `process` mode, image handling, and the SVG plots."""

from __future__ import annotations

import json

from factory.viewer import plots
from factory.viewer.render import group_view, image_sources, render_static_groups
from flows.datagen_cli import write_groups_html
from tests.unit.viewer.store_fixture import RED_PIXEL_PNG, SCRIPT, make_group


def test_process_mode_page_uses_the_viewer_templates_and_escapes(tmp_path):
    jsonl = tmp_path / "groups.jsonl"
    groups = [make_group(i, "run-1", 0, text=SCRIPT if i == 2 else None) for i in range(5)]
    jsonl.write_text("".join(g.model_dump_json() + "\n" for g in groups))
    out = tmp_path / "groups.html"
    write_groups_html(jsonl, out, title="demo <run>", limit=3)
    page = out.read_text()
    assert "<title>demo &lt;run&gt;</title>" in page
    assert page.count('<details class="group">') == 3 and 'class="completion"' in page  # the shared macro
    assert "&lt;script&gt;window.__xss" in page and "<script" not in page
    assert "only the first 3 groups are shown; see groups.jsonl" in page
    assert "<style>" in page and 'rel="stylesheet"' not in page  # self-contained


def test_group_view_splits_prompt_and_completions():
    group = make_group(3, "run-1", 2).model_dump(mode="json")
    view = group_view(group)
    assert [m["role"] for m in view["prompt"]] == ["user"]
    assert [c["messages"][0]["content"] for c in view["completions"]] == [f"The answer is {3 + k}." for k in range(4)]
    assert view["completions"][0]["length"] == len(group["tokens"][0])
    assert view["completions"][0]["completion_tokens"] == sum(1 for m in group["masks"][0] if m != -100)
    stored = {**group, "messages": json.dumps(group["messages"])}  # as a shard row holds it
    assert group_view(stored)["prompt"] == view["prompt"]


def test_image_sources_accept_only_image_bytes():
    got = image_sources(json.dumps([
        f"data:image/png;base64,{RED_PIXEL_PNG}", RED_PIXEL_PNG, "https://x.example/a.png",
        "data:image/svg+xml;base64,PHN2Zz48L3N2Zz4=", {"url": f"data:image/png;base64,{RED_PIXEL_PNG}"},
        "data:image/png;base64,bm90IGEgcG5nIGF0IGFsbCwganVzdCB0ZXh0",
    ]))
    assert [("src" in g) for g in got] == [True, True, False, False, True, False]
    assert got[1]["src"] == f"data:image/png;base64,{RED_PIXEL_PNG}"
    assert image_sources(None) == [] and len(image_sources([RED_PIXEL_PNG] * 40)) == 16


def test_plots_escape_labels_and_handle_empty_data():
    svg = plots.histogram([1, 3, 0], [0.0, 1.0, 2.0, 3.0], "a <b> & c", "x")
    assert "a &lt;b&gt; &amp; c" in svg and svg.count("<rect") == 3 and "style=" not in svg
    assert "no data" in plots.histogram([], [0.0], "t")
    line = plots.lines({"r<1>": ([0, 1, 2], [0.5, float("nan"), 1.0])}, "curve")
    assert "r&lt;1&gt;" in line and line.count(",") >= 2
    assert "no data" in plots.lines({"r": ([], [])}, "curve")
