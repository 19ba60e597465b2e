"""The dashboard page in a real browser: Debian's headless Chromium, driven by selenium through chromedriver,
opens /dashboard on a real server with two tenants (--api-keys-file), logs in with tenant A's key and watches
A's shared-prefix requests arrive: the tree shows the shared prefix with its hit count, the usage chart has
points, a slow request appears in the request table and then leaves, tenant B's prefix never shows, and the
browser console holds no JavaScript error. The screenshot is kept under pytest's tmp dir (its path printed).

Skips, naming what is missing, only where chromium, chromedriver or selenium cannot be found (`make test`
installs Debian's `chromium` and `chromium-driver` when it runs as root)."""

from __future__ import annotations

import shutil
import threading
import time
import uuid
from pathlib import Path

import pytest
import requests

from tests.e2e.server_utils import HTTP_TIMEOUT_S, ServerProcess
from tests.e2e.test_dashboard import REPEATS, shared_prefix

KEYS = {"A": "browser-tenant-a-91d2", "B": "browser-tenant-b-04ee"}
CHROME_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    # without these it stalls on a closed network, reaching for Google's services
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1500,1250",
]
SLOW_TOKENS = 384  # the request that must be seen running: ignore_eos, streamed


def _browser_paths() -> tuple[str, str]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    driver = shutil.which("chromedriver")
    missing = [name for name, path in (("chromium", chromium), ("chromedriver", driver)) if path is None]
    if missing:
        pytest.skip(
            f"{' and '.join(missing)} not found: install Debian's chromium and chromium-driver "
            "(`apt-get install chromium chromium-driver`; `make test` does as root)"
        )
    return chromium, driver


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    chromium, driver_path = _browser_paths()
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (the test extra)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in CHROME_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def srv(tmp_path_factory) -> ServerProcess:
    keys_file = Path(tmp_path_factory.mktemp("dashboard-browser")) / "keys"
    keys_file.write_text(f"{KEYS['A']} A\n{KEYS['B']} B\n")
    keys_file.chmod(0o600)
    with ServerProcess(extra_args=["--api-keys-file", str(keys_file)]) as server:
        yield server


def wait_for(what: str, probe, timeout: float = 60.0, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def tree_nodes(driver) -> list[dict]:
    return driver.execute_script(
        "return [...document.querySelectorAll('#tree rect[data-node]')].map(r => ({"
        "text: r.dataset.text, hits: Number(r.dataset.hits), tokens: Number(r.dataset.tokens),"
        "tier: r.dataset.tier}))"
    )


def request_rows(driver) -> list[dict]:
    return driver.execute_script(
        "return [...document.querySelectorAll('#requests tbody tr[data-rid]')].map(tr => ({"
        "rid: tr.dataset.rid, state: tr.dataset.state, text: tr.textContent}))"
    )


def test_the_page_shows_the_cache_live_to_its_tenant_only(browser, srv, tmp_path):  # no server without one
    driver = browser
    driver.get(srv.url + "/dashboard")
    driver.find_element("id", "api-key").send_keys(KEYS["A"])
    driver.find_element("id", "connect").click()
    wait_for("the page to connect", lambda: driver.execute_script("return document.body.dataset.updated"))
    assert driver.find_element("id", "main").is_displayed()
    wait_for("the live stream", lambda: driver.find_element("id", "status").text == "live")

    a_marker, b_marker = f"Q{uuid.uuid4().hex[:6]}", f"W{uuid.uuid4().hex[:6]}"
    metas = _run_as(srv, "A", a_marker)
    _run_as(srv, "B", b_marker)
    assert all(m["cached_tokens"] > 0 for m in metas[1:]), metas

    def shared_node():
        return [n for n in tree_nodes(driver) if a_marker in n["text"] and n["hits"] == REPEATS - 1]

    node = wait_for(f"a tree node with {a_marker!r} and {REPEATS - 1} hits", shared_node)[0]
    assert node["tier"] == "device" and node["tokens"] == min(m["cached_tokens"] for m in metas[1:])
    # the hit count is also what the node's label says
    labels = driver.execute_script(
        "return [...document.querySelectorAll('#tree text')].map(t => t.textContent)"
    )
    assert any(label.startswith(f"{REPEATS - 1}× ") and a_marker[:4] in label for label in labels), labels

    points = wait_for(
        "the usage chart's points",
        lambda: (
            (n := int(driver.find_element("id", "usage-chart").get_attribute("data-points") or 0)) >= 3 and n
        ),
    )
    polygons = driver.find_elements("css selector", "#usage-chart polygon[data-series]")
    assert points >= 3 and len(polygons) == 4

    # a slow request appears with its progress, then leaves when it finishes
    slow_rid = f"slow-{uuid.uuid4().hex[:8]}"
    done = threading.Event()
    result: dict = {}

    def slow():
        body = {
            "text": f"{a_marker} count slowly:",
            "rid": slow_rid,
            "sampling_params": {"max_new_tokens": SLOW_TOKENS, "ignore_eos": True},
        }
        r = requests.post(
            srv.url + "/generate", json=body, headers={"Authorization": f"Bearer {KEYS['A']}"}, timeout=600
        )
        result["status"], result["meta"] = r.status_code, r.json().get("meta_info")
        done.set()

    thread = threading.Thread(target=slow, daemon=True)
    thread.start()
    row = wait_for(
        "the slow request's row",
        lambda: [
            r for r in request_rows(driver) if f"/ {SLOW_TOKENS}" in r["text"] and r["state"] == "running"
        ],
        timeout=120,
    )[0]
    assert row["rid"] == slow_rid, row  # the client's rid, as the table shows it
    wait_for("the slow request to finish", done.is_set, timeout=600)
    assert result["status"] == 200 and result["meta"]["completion_tokens"] == SLOW_TOKENS, result
    wait_for("its row to leave", lambda: not [r for r in request_rows(driver) if r["rid"] == slow_rid])

    # tenant B's prefix is in the cache, but not on A's page
    assert not [n for n in tree_nodes(driver) if b_marker in n["text"]]
    assert b_marker not in driver.find_element("tag name", "body").text

    shot = tmp_path / "dashboard.png"
    driver.save_screenshot(str(shot))
    print(f"\ndashboard screenshot: {shot}")
    assert shot.stat().st_size > 10_000

    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors


def _run_as(srv, who: str, marker: str) -> list[dict]:
    headers = {"Authorization": f"Bearer {KEYS[who]}"}
    metas = []
    for i in range(REPEATS):
        body = {
            "text": f"{shared_prefix(marker)} Question {i}: what is item {i}?",
            "sampling_params": {"max_new_tokens": 3},
        }
        r = requests.post(srv.url + "/generate", json=body, headers=headers, timeout=HTTP_TIMEOUT_S)
        assert r.status_code == 200, r.text
        metas.append(r.json()["meta_info"])
    return metas
