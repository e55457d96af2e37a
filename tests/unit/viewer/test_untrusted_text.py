"""Untrusted text and requests in the viewer: invisible characters marked, the bearer scheme in any case,
redirects that stay on this origin, and task labels from each env's own key format and difficulty column."""

from __future__ import annotations

import sys
import unicodedata

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from starlette.testclient import TestClient

from factory.store import ShardStore
from factory.viewer.app import ViewerConfig, create_app, same_origin_path
from factory.viewer.index import index_shard
from factory.viewer.render import INVISIBLE, environment, mark_invisible, reveal
from tests.unit.viewer.store_fixture import make_group, write_chunk

RLO = "\u202e"
SPOOF = f"harmless{RLO}txt.exe"


def test_every_format_character_but_the_joiners_is_marked():
    """Cross-checked against this Python's Unicode tables, so a missing range fails here."""
    missed = [hex(c) for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c)) in ("Cf", "Cc")
              and chr(c) not in "\t\n\r\u200c\u200d" and not INVISIBLE.match(chr(c))]
    assert missed == []
    for kept in ("a", "é", "\u200d", "\u200c", "\t", "\n", "\ufe0f", "👍", "مرحبا", "שלום"):
        assert not INVISIBLE.search(kept), repr(kept)
    for hidden in (RLO, "\u2066", "\u200b", "\ufeff", "\x1b", "\u00ad", "\U000e0041", "\U000e0100", "\u3164"):
        assert INVISIBLE.search(hidden), repr(hidden)


def test_markers_in_text_attributes_and_titles():
    assert mark_invisible(SPOOF) == "harmless⟨U+202E RLO⟩txt.exe"
    assert mark_invisible("tag\U000e0041") == "tag⟨U+E0041 TAG⟩" and mark_invisible(3) == 3
    html = str(reveal(f"<b>{RLO}</b>"))
    assert html == ('&lt;b&gt;<mark class="invisible" title="RIGHT-TO-LEFT OVERRIDE">⟨U+202E RLO⟩</mark>'
                    "&lt;/b&gt;")
    page = environment().from_string('<title>{{ t }}</title><input value="{{ t }}"><p>{{ t|reveal }}</p>').render(
        t=SPOOF + '"><script>')
    assert RLO not in page and "<script>" not in page
    assert '<input value="harmless⟨U+202E RLO⟩txt.exe&#34;&gt;&lt;script&gt;">' in page


@pytest.fixture
def spoofing_store(tmp_path):
    store = ShardStore(tmp_path / "store")
    groups = [make_group(i, "run-1", 0, text=f"run {SPOOF} \u200bnow\x1b[2J") for i in range(4)]
    write_chunk(store, "run-1", 0, groups)
    return store, groups


def test_pages_never_send_bidi_controls_raw(spoofing_store):
    store, groups = spoofing_store
    client = TestClient(create_app(ViewerConfig(store=str(store.root))))
    page = client.get(f"/run/run-1/group/{groups[0].group_id}").text
    assert RLO not in page and "\u200b" not in page and "\x1b" not in page
    assert '<mark class="invisible" title="RIGHT-TO-LEFT OVERRIDE">⟨U+202E RLO⟩</mark>' in page
    assert "⟨U+200B ZWSP⟩" in page and "⟨U+001B⟩" in page
    run_page = client.get("/run/run-1", params={"text": SPOOF}).text  # the query echoed in the search box
    assert RLO not in run_page and 'value="harmless⟨U+202E RLO⟩txt.exe"' in run_page


def test_bearer_scheme_is_case_insensitive(spoofing_store):
    store, _ = spoofing_store
    client = TestClient(create_app(ViewerConfig(store=str(store.root), token="s3cret")))
    for header in ("Bearer s3cret", "bearer s3cret", "BEARER s3cret", "bEaReR  s3cret "):
        assert client.get("/run/run-1", headers={"Authorization": header}).status_code == 200, header
    for header in ("Basic s3cret", "Bearer", "s3cret", "Bearers3cret", "Bearer s3cre", "Token s3cret"):
        assert client.get("/run/run-1", headers={"Authorization": header}).status_code == 401, header


@pytest.mark.parametrize("path, location", [
    ("//evil.example/", "/evil.example/"),
    ("///evil.example/x", "/evil.example/x"),
    ("/%5Cevil.example/", "/%5Cevil.example/"),
    ("/%5C%5Cevil.example/", "/%5C%5Cevil.example/"),
    ("/%09/evil.example/", "/%09/evil.example/"),
    ("/%0A/evil.example/", "/%0A/evil.example/"),
    ("/run/run-1", "/run/run-1"),
])
def test_token_redirect_stays_on_this_origin(spoofing_store, path, location):
    store, _ = spoofing_store
    client = TestClient(create_app(ViewerConfig(store=str(store.root), token="s3cret")))
    response = client.get("http://testserver" + path, params={"token": "s3cret", "env": "gsm8k"},
                          follow_redirects=False)  # the full URL: a bare "//host" would name the client's host
    assert response.status_code == 303
    assert response.headers["location"] == location + "?env=gsm8k"
    assert "s3cret" not in response.headers["location"]


@pytest.mark.parametrize("path", ["//evil.example", "/\\evil.example", "/\\/evil.example", "/\t/evil.example",
                                  "/ /evil.example", "/\r\n//evil.example", "https://evil.example", "javascript:x"])
def test_same_origin_path_never_names_another_host(path):
    location = same_origin_path(path)
    assert location.startswith("/") and not location.startswith(("//", "/\\"))
    assert all(ord(c) > 32 and c != "\\" for c in location), location


def test_labels_come_from_each_envs_own_key_format(tmp_path):
    """InternBootcamp keys carry family and difficulty; a blackjack or tool_calling key's numbers are seeds, not
    difficulties; code_exec's family is the problem; difficulty otherwise only from the column."""
    rows = [("intern_bootcamp", "cipher:2:7", None), ("blackjack", "blackjack:3:9", None),
            ("tool_calling", "tools:1:4", None), ("code_exec", "code:gcd:5", None),
            ("reasoning_gym", "rg:leg_counting:2:0:3", None), ("shape_count", "shapes:0:1", 4),
            ("gsm8k", "train-3", None), ("intern_bootcamp", "odd-key", None)]
    groups = [make_group(i, "run-1", 0).model_copy(update={"env": env, "item_key": key})
              for i, (env, key, _) in enumerate(rows)]
    store = ShardStore(tmp_path / "store")
    write_chunk(store, "run-1", 0, groups)
    shard = next((tmp_path / "store").rglob("*.parquet"))
    table = pq.read_table(shard)
    column = pa.array([d for _, _, d in rows], pa.int32())
    table = table.set_column(table.column_names.index("difficulty"), "difficulty", column) \
        if "difficulty" in table.column_names else table.append_column("difficulty", column)
    pq.write_table(table, tmp_path / "labels.parquet")
    frame = index_shard(tmp_path / "labels.parquet", 0)
    assert list(zip(frame["family"], frame["difficulty"])) == [
        ("cipher", 2), ("blackjack", None), ("tool_calling", None), ("gcd", None), ("leg_counting", 2),
        ("shape_count", 4), ("gsm8k", None), ("intern_bootcamp", None)]
