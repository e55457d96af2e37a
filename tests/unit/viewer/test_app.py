"""The viewer's pages through Starlette's test client: content, filters, escaping, CSP, token, live counts."""

from __future__ import annotations

import json
import re
import time

import pytest
from starlette.testclient import TestClient

from factory.viewer.app import ViewerConfig, create_app, prefect_ui_url
from factory.viewer.cli import parse_args
from tests.unit.viewer.store_fixture import FLOW_RUN_ID, RED_PIXEL_PNG, make_group, make_viewer_store, write_chunk


@pytest.fixture
def store(tmp_path):
    return make_viewer_store(tmp_path / "store")


@pytest.fixture
def client(store):
    return TestClient(create_app(ViewerConfig(store=str(store.root), prefect_ui="http://prefect.test")))


def group_links(html: str) -> list[str]:
    return re.findall(r'href="(/run/run-1/group/[0-9a-f]+)"', html)


def test_runs_list_shows_counts_and_envs(client):
    deadline = time.monotonic() + 30
    while "indexing" in (page := client.get("/").text) and time.monotonic() < deadline:
        time.sleep(0.05)  # the runs list indexes runs in the background
    assert 'href="/run/run-1"' in page and ">60<" in page and ">3<" in page
    assert "gsm8k (12)" in page and "intern_bootcamp (48)" in page


def test_run_page_shows_counts_facets_drops_flow_run_and_plots(client):
    response = client.get("/run/run-1")
    assert response.status_code == 200
    page = response.text
    assert 'id="live-count"' in page and 'data-groups="60"' in page
    for family in ("arithmetic", "cipher", "sorting", "gsm8k"):
        assert f'<option value="{family}"' in page
    assert "equal_scores" in page and ">9<" in page  # dropped, summed over chunk stats
    assert f'href="http://prefect.test/runs/flow-run/{FLOW_RUN_ID}"' in page
    assert page.count("<svg") == 3 and "score per completion" in page and "reward over time" in page
    assert len(group_links(page)) == 50 and 'id="next"' in page
    assert "Question 59" in page  # newest first
    older = client.get("/run/run-1?offset=50").text
    assert len(group_links(older)) == 10 and "Question 0 " in older


def test_filters_narrow_the_groups(client):
    page = client.get("/run/run-1", params={"family": "cipher", "difficulty": "2", "policy_version": "0"}).text
    links = group_links(page)
    assert links and all("cipher" in row for row in re.findall(r'<tr class="group-row">.*?</tr>', page, re.S))
    assert "1 groups match" in page or f"{len(links)} groups match" in page
    page = client.get("/run/run-1", params={"score_min": "0.9"}).text
    assert "0 groups match" in page and "no group matches" in page
    page = client.get("/run/run-1", params={"env": "gsm8k"}).text
    assert len(group_links(page)) == 12
    page = client.get("/run/run-1", params={"score_min": "many"}).text
    assert 'id="filter-error"' in page and "score_min" in page


def test_text_search_finds_prompts_completions_and_keys(client):
    page = client.get("/run/run-1", params={"text": "question 42 ("}).text
    assert len(group_links(page)) == 1 and "Question 42" in page
    assert len(group_links(client.get("/run/run-1", params={"text": "WINDOW.__xss"}).text)) == 1
    assert len(group_links(client.get("/run/run-1", params={"text": "train-"}).text)) == 12
    assert "0 groups match" in client.get("/run/run-1", params={"text": "no such words"}).text


def test_group_page_shows_prompt_completions_scores_lengths_and_versions(client):
    page = client.get("/run/run-1", params={"text": "Question 44 ("}).text
    page = client.get(group_links(page)[0]).text
    assert "Question 44 (gsm8k)" in page and "The answer is 46." in page
    assert page.count('class="completion"') == 4
    assert "length 22 tokens" in page and "policy version 2" in page
    assert 'class="score">1<' in page
    assert "kept" in page


def test_model_text_is_escaped_and_csp_forbids_inline_script(client):
    page_response = client.get("/run/run-1", params={"text": "__xss"})
    link = group_links(page_response.text)[0]
    response = client.get(link)
    page = response.text
    assert "<script>window.__xss" not in page
    assert "&lt;script&gt;window.__xss = 1; document.title = &#39;pwned&#39;&lt;/script&gt;&lt;b&gt;bold?&lt;/b&gt;" in page
    csp = response.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "default-src 'none'" in csp
    assert response.headers["x-content-type-options"] == "nosniff"
    # the only script on any page is the same-origin live poller
    assert re.findall(r"<script[^>]*>", client.get("/run/run-1").text) == ['<script src="/static/live.js">']


def test_images_are_shown_as_data_urls_and_remote_urls_as_text(client):
    page = client.get("/run/run-1", params={"text": "Question 11 ("}).text
    page = client.get(group_links(page)[0]).text
    assert f'src="data:image/png;base64,{RED_PIXEL_PNG}"' in page
    assert "https://evil.example/x.png" in page and 'src="https://evil' not in page


def test_status_api_sees_new_shards_without_restart(client, store):
    assert client.get("/api/run/run-1/status").json()["groups"] == 60
    write_chunk(store, "run-1", 3, [make_group(200 + i, "run-1", 3) for i in range(7)])
    assert client.get("/api/run/run-1/status").json() == {"run": "run-1", "groups": 67, "shards": 4, "pending_shards": 0,
                                                          "problems": 0}
    assert "Question 206" in client.get("/run/run-1").text


def test_trainer_metrics_add_a_reward_curve(client, store):
    path = store.run_dir("run-1") / "train" / "metrics.jsonl"
    path.parent.mkdir()
    path.write_text("".join(json.dumps({"step": s, "reward_mean": s / 10}) + "\n" for s in range(1, 6)))
    page = client.get("/run/run-1").text
    assert page.count("<svg") == 4 and "trainer reward curve" in page and "<polyline" in page


def test_unknown_run_and_group_are_404(client):
    assert client.get("/run/nope").status_code == 404
    assert client.get("/run/run-1/group/abc").status_code == 404
    assert client.get("/run/..%2Fetc").status_code == 404


def test_token_is_required_when_set(store):
    client = TestClient(create_app(ViewerConfig(store=str(store.root), token="s3cret")))
    assert client.get("/run/run-1").status_code == 401
    assert client.get("/run/run-1", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/run/run-1", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert client.get("/static/viewer.css").status_code == 401
    response = client.get("/run/run-1?token=s3cret&env=gsm8k", follow_redirects=False)
    assert response.status_code == 303 and response.headers["location"] == "/run/run-1?env=gsm8k"
    assert "httponly" in response.headers["set-cookie"].lower()
    assert client.get("/run/run-1?env=gsm8k").status_code == 200  # the cookie now
    stranger = TestClient(create_app(ViewerConfig(store=str(store.root), token="s3cret")))
    assert stranger.get("/run/run-1", headers={"cookie": "view_run_token=nope"}).status_code == 401


def test_cli_binds_localhost_and_needs_a_token_to_expose(monkeypatch):
    monkeypatch.delenv("FACTORY_API_TOKEN", raising=False)
    assert parse_args([]).host == "127.0.0.1"
    with pytest.raises(SystemExit):
        parse_args(["--host", "0.0.0.0"])
    assert parse_args(["--host", "0.0.0.0", "--token", "t"]).token == "t"
    monkeypatch.setenv("FACTORY_API_TOKEN", "from-env")
    assert parse_args(["--host", "0.0.0.0"]).token == "from-env"


def test_prefect_ui_url_lookup(monkeypatch):
    monkeypatch.delenv("PREFECT_UI_URL", raising=False)
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4321/api")
    assert prefect_ui_url() == "http://127.0.0.1:4321"
    monkeypatch.setenv("PREFECT_UI_URL", "https://ui.example/")
    assert prefect_ui_url() == "https://ui.example"
    assert prefect_ui_url("http://x:1/") == "http://x:1"


def test_a_big_unindexed_run_answers_within_the_budget_and_finishes_in_the_background(store):
    client = TestClient(create_app(ViewerConfig(store=str(store.root), index_budget_s=0.0, background_index=False)))
    page = client.get("/run/run-1").text
    assert 'id="indexing"' in page and "1 of 3 shards indexed" in page and 'data-groups="20"' in page
    assert "2 of 3 shards indexed" in client.get("/run/run-1").text
    client = TestClient(create_app(ViewerConfig(store=str(store.root), index_budget_s=0.0)))
    client.get("/run/run-1")
    viewer = client.app.viewer
    deadline = time.monotonic() + 30
    while viewer.index.indexed("run-1").pending and time.monotonic() < deadline:
        time.sleep(0.05)
    page = client.get("/run/run-1").text
    assert 'id="indexing"' not in page and 'data-groups="60"' in page
