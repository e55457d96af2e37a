"""view-run in a real headless Chromium: open a run, filter, open a group, see escaping, images and live counts.

Uses Debian's /usr/bin/chromium and /usr/bin/chromedriver through Selenium
(no browser downloads; `scripts/setup.sh` installs both). Screenshots go to
$FACTORY_TEST_ARTIFACTS (default `test-artifacts/`)/viewer/.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.unit.viewer.store_fixture import make_group, make_viewer_store, write_chunk

pytestmark = [pytest.mark.integration, pytest.mark.browser]

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("FACTORY_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("FACTORY_CHROMEDRIVER", shutil.which("chromedriver") or "/usr/bin/chromedriver")
TOKEN = "browser-test-token"
ARTIFACTS = Path(os.environ.get("FACTORY_TEST_ARTIFACTS", REPO / "test-artifacts")) / "viewer"


@pytest.fixture(scope="module")
def viewer(tmp_path_factory):
    """`python -m factory.viewer` (the view-run CLI) on a small store, with a token; yields (url, store)."""
    store = make_viewer_store(tmp_path_factory.mktemp("viewer") / "store")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "FACTORY_API_TOKEN": TOKEN}
    log = open(store.root.parent / "view-run.log", "w")
    process = subprocess.Popen([sys.executable, "-m", "factory.viewer", "--store", str(store.root), "--port", str(port),
                                "--prefect-ui", "http://prefect.test"], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            request = urllib.request.Request(f"{url}/", headers={"Authorization": f"Bearer {TOKEN}"})
            with urllib.request.urlopen(request, timeout=2):
                break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"view-run did not start: {(store.root.parent / 'view-run.log').read_text()}")
            time.sleep(0.2)
    yield url, store
    process.terminate()
    process.wait(timeout=10)
    log.close()


@pytest.fixture(scope="module")
def browser():
    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        pytest.skip(f"needs Debian's chromium at {CHROMIUM} and chromedriver at {CHROMEDRIVER} "
                    "(apt-get install chromium chromium-driver; scripts/setup.sh does)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,1600"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    yield driver
    driver.quit()


def wait_for(predicate, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_open_run_filter_open_group_escape_images_and_live(viewer, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    url, store = viewer
    browser.get(f"{url}/?token={TOKEN}")  # sets the cookie, then the runs list
    wait_for(lambda: "intern_bootcamp (48)" in browser.find_element(By.ID, "runs").text
             or browser.refresh(), what="the runs list with env counts")
    browser.find_element(By.LINK_TEXT, "run-1").click()

    assert browser.find_element(By.ID, "live-count").text == "60"
    assert "gsm8k" in browser.find_element(By.ID, "envs").text
    assert "equal_scores" in browser.find_element(By.ID, "drops").text
    assert len(browser.find_elements(By.CSS_SELECTOR, "svg.plot")) == 3
    link = browser.find_element(By.CSS_SELECTOR, "#flow-runs a")
    assert link.get_attribute("href").startswith("http://prefect.test/runs/flow-run/")
    browser.save_screenshot(str(ARTIFACTS / "run.png"))

    # filter: task family cipher, difficulty 2, mean score >= -0.2
    Select(browser.find_element(By.NAME, "family")).select_by_value("cipher")
    Select(browser.find_element(By.NAME, "difficulty")).select_by_value("2")
    browser.find_element(By.NAME, "score_min").send_keys("-0.2")
    browser.find_element(By.ID, "apply").click()
    wait_for(lambda: "family=cipher" in browser.current_url, what="the filtered page")
    rows = browser.find_elements(By.CSS_SELECTOR, "tr.group-row")
    assert rows, "the filter should leave some groups"
    for row in rows:
        cells = [cell.text for cell in row.find_elements(By.TAG_NAME, "td")]
        assert cells[2] == "cipher" and cells[3] == "2"
    assert f"{len(rows)} groups match" in browser.find_element(By.ID, "matches").text
    browser.save_screenshot(str(ARTIFACTS / "filtered.png"))

    # open a group
    rows[0].find_element(By.TAG_NAME, "a").click()
    group = wait_for(lambda: browser.find_elements(By.ID, "group"), what="the group page")[0]
    assert "Question" in group.text and "(cipher)" in group.text
    assert len(browser.find_elements(By.CSS_SELECTOR, ".completion")) == 4
    assert "policy version" in group.text and "score" in group.text
    browser.save_screenshot(str(ARTIFACTS / "group.png"))

    # a completion holding <script> is shown as text and never runs
    browser.get(f"{url}/run/run-1?text=__xss")
    browser.find_element(By.CSS_SELECTOR, "tr.group-row a").click()
    wait_for(lambda: browser.find_elements(By.ID, "group"), what="the script group's page")
    assert "<script>window.__xss = 1;" in browser.find_element(By.ID, "group").text
    assert browser.execute_script("return window.__xss === undefined") is True
    assert browser.title != "pwned"

    # the multimodal group's image is drawn
    browser.get(f"{url}/run/run-1?text=Question+11+%28")
    browser.find_element(By.CSS_SELECTOR, "tr.group-row a").click()
    image = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "img.group-image"), what="the image")[0]
    assert browser.execute_script("return arguments[0].complete && arguments[0].naturalWidth", image) == 1
    browser.save_screenshot(str(ARTIFACTS / "image-group.png"))

    # live: a shard committed while the page is open shows up without reloading the server or the page
    browser.get(f"{url}/run/run-1")
    write_chunk(store, "run-1", 3, [make_group(300 + i, "run-1", 3) for i in range(5)])
    wait_for(lambda: browser.find_element(By.ID, "live-count").text == "65", timeout=20, what="the live count")
    assert "5 new groups" in browser.find_element(By.ID, "live-new").text
    browser.refresh()
    assert "Question 304" in browser.find_element(By.ID, "groups").text
    browser.save_screenshot(str(ARTIFACTS / "live.png"))


def test_without_the_token_the_browser_gets_401(viewer):
    url, _ = viewer
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(f"{url}/run/run-1", timeout=5)
    assert error.value.code == 401


def test_bidi_controls_are_marked_and_the_token_redirect_stays_here(viewer, browser):
    """A completion with RIGHT-TO-LEFT OVERRIDE shows a marker, not reordered text; `?token=` on `//host` or
    `/\\host` paths lands on this origin."""
    from selenium.webdriver.common.by import By

    url, store = viewer
    spoof = "invoice\u202egpj.exe and \u200bzero width"
    write_chunk(store, "spoof", 0, [make_group(400 + i, "spoof", 0, text=spoof) for i in range(2)], producer="spoof")
    browser.get(f"{url}/run/spoof?token={TOKEN}")
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "tr.group-row a") or browser.refresh(),
             what="the spoof run's groups")[0].click()
    group = wait_for(lambda: browser.find_elements(By.ID, "group"), what="the group page")[0]
    assert "invoice⟨U+202E RLO⟩gpj.exe and ⟨U+200B ZWSP⟩zero width" in group.text
    marks = browser.find_elements(By.CSS_SELECTOR, "mark.invisible")
    assert marks and marks[0].get_attribute("title") == "RIGHT-TO-LEFT OVERRIDE"
    assert "\u202e" not in browser.page_source
    browser.save_screenshot(str(ARTIFACTS / "bidi.png"))
    origin = url + "/"
    for path in ("//evil.example/", "/%5Cevil.example/", "/%09/evil.example/"):
        browser.get(f"{url}{path}?token={TOKEN}")
        assert browser.current_url.startswith(origin), (path, browser.current_url)
