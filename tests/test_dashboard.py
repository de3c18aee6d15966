"""The live dashboard (issue "Observability"), checked in a real headless Chromium driven by selenium.

Real parts throughout: a ``gpumgr manager`` process, a ``gpumgr agent`` on the Docker runtime with two
simulated 24 GiB GPUs, containers created through the REST API, and Debian's ``chromium`` with its
``chromium-driver``. The browser only ever talks to the manager on loopback.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.procs import AgentProc, ManagerProc, wait_for

pytestmark = pytest.mark.browser

GiB = 1 << 30
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
#: A container that ends promptly on SIGTERM, using ``$USE`` bytes of its (simulated) GPU.
POLITE = "echo $USE > /tmp/use; trap 'exit 0' TERM; while :; do sleep 1; done"
TOKEN = "dashboard-test-token-0123456789"
NODE = "dashboard-node"
#: How long the page may take to show a change (the issue asks for two seconds; polling is every second).
LIVE_TIMEOUT = 5.0


def _require(flag: str, reason: str) -> None:
    if os.environ.get(flag) == "1":
        pytest.fail(f"{reason}, and {flag}=1 forbids skipping")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def browser_paths() -> tuple[str, str]:
    """Debian's chromium and chromedriver; skips (or fails in CI) without them or without selenium."""
    chromium = CHROMIUM if os.access(CHROMIUM, os.X_OK) else shutil.which("chromium")
    driver = CHROMEDRIVER if os.access(CHROMEDRIVER, os.X_OK) else shutil.which("chromedriver")
    if not chromium or not driver:
        _require("GPUMGR_REQUIRE_BROWSER", "chromium and chromium-driver are not installed")
    try:
        import selenium  # noqa: F401
    except ImportError:
        _require("GPUMGR_REQUIRE_BROWSER", "selenium is not installed (pip install -e '.[test]')")
    return str(chromium), str(driver)


@pytest.fixture
def browser(browser_paths, tmp_path, monkeypatch) -> Iterator[Any]:
    """A headless Chromium that keeps its console log and reaches nothing but loopback."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    monkeypatch.setenv("SE_OFFLINE", "true")  # selenium-manager, should it run, downloads nothing
    chromium, chromedriver = browser_paths
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1366,900", "--no-first-run", "--no-default-browser-check",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-default-apps", "--disable-extensions", "--disable-domain-reliability",
                "--no-proxy-server", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1, EXCLUDE localhost",
                f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = Service(chromedriver, log_output=str(tmp_path / "chromedriver.log"))
    driver = webdriver.Chrome(options=options, service=service)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


# --- helpers -------------------------------------------------------------------------------------
def create(manager: ManagerProc, image: str, name: str, memory: str, use: int = 0) -> dict[str, Any]:
    """Start one container through the API (binpack: they share GPU 0), using ``use`` bytes."""
    answer = manager.post("/v1/containers", json={
        "image": image, "name": name, "gpu_memory": memory, "placement": "binpack",
        "env": {"GPUMGR_SIM_USAGE_FILE": "/tmp/use", "USE": str(use)}, "command": ["sh", "-c", POLITE],
    })
    assert answer.status_code == 201, answer.text
    return answer.json()


def dom(driver, script: str, *args: Any) -> Any:
    return driver.execute_script(script, *args)


def wait_dom(driver, script: str, *args: Any, timeout: float = 15.0, what: str = "the page") -> Any:
    """Poll the DOM (a JS expression returning something truthy) until it holds; say what the page showed if not."""
    try:
        return wait_for(lambda: dom(driver, script, *args), timeout, interval=0.1, what=what)
    except AssertionError as exc:
        text = dom(driver, "return document.body ? document.body.innerText : '';")
        raise AssertionError(f"{exc}\nconsole: {driver.get_log('browser')}\npage:\n{text}") from None


def shown(driver, selector: str) -> bool:
    """Whether an element matching ``selector`` is on the page and visible."""
    return bool(dom(driver, "const e = document.querySelector(arguments[0]);"
                            "return !!e && e.getClientRects().length > 0;", selector))


def severe(driver) -> list[dict[str, Any]]:
    """The browser console's SEVERE entries since the last call (reading the log empties it)."""
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def page_overflow(driver) -> tuple[int, int]:
    return tuple(dom(driver, "return [document.documentElement.scrollWidth, window.innerWidth];"))


# --- the map, live -------------------------------------------------------------------------------
@pytest.fixture
def dash_agent(tmp_path, manager, test_image, cleanup_containers) -> Iterator[AgentProc]:
    """Like conftest's ``docker_agent`` (Docker runtime, two simulated 24 GiB GPUs), under a node name of its own.

    Test sessions that share one Docker engine each clean up (and re-adopt) the containers of their
    node names; a name no other test uses keeps a concurrent session's ``node-a`` off this page.
    """
    proc = AgentProc(tmp_path, manager, NODE, gpus="sim:2x24GiB")
    yield proc
    proc.stop()


def test_dashboard_shows_the_map_live(manager, dash_agent, test_image, browser, tmp_path):
    first = create(manager, test_image, "dash-first", "4GiB", use=int(3.8 * GiB))
    browser.get(manager.url + "/")

    # the node, both GPUs and the container
    wait_dom(browser, "return document.querySelector('[data-node=\"dashboard-node\"] [data-node-state=\"ready\"]');",
             what="the node shown ready")
    gpus = manager.node(NODE)["gpus"]
    assert len(gpus) == 2
    for gpu in gpus:
        wait_dom(browser, "return document.querySelector(`[data-gpu=\"${arguments[0]}\"]`);", gpu["uuid"],
                 what=f"GPU {gpu['uuid']}")
    wait_dom(browser, "return document.querySelector(`tr[data-container=\"${arguments[0]}\"]`);", first["id"],
             what="the first container's row")
    row = browser.find_element("css selector", f"tr[data-container='{first['id']}']").text
    assert "dash-first" in row and NODE in row and "4 GiB" in row, row
    assert "last seen" in browser.find_element("css selector", f"[data-node='{NODE}']").text
    assert not shown(browser, "#accounts-section"), "no accounts are configured: no accounts panel"
    # its usage (3.8 of 4 GiB, sampled by the agent) earns the near-grant mark
    wait_dom(browser, "return document.querySelector(`tr[data-container=\"${arguments[0]}\"] [data-mark=\"near\"]`);",
             first["id"], what="the near-grant mark")

    # a second container appears without a reload
    dom(browser, "window.__sameDocument = true;")
    second = create(manager, test_image, "dash-second", "2GiB", use=GiB)
    began = time.monotonic()
    wait_dom(browser, "return document.querySelector(`tr[data-container=\"${arguments[0]}\"]`);", second["id"],
             timeout=LIVE_TIMEOUT, what="the second container to appear without a reload")
    appeared = time.monotonic() - began
    assert dom(browser, "return window.__sameDocument === true;"), "the page reloaded"
    # the map after the first read came as changes only (?since=), merged into what the page held
    asked = dom(browser, "return performance.getEntriesByType('resource').map(e => e.name)"
                         ".filter(n => n.includes('/v1/nodes'));")
    assert asked and "?since=" not in asked[0] and any("/v1/nodes?since=" in n for n in asked[1:]), asked

    # one GPU holds both grants: its bar has a segment per container, sized by the grant
    assert first["gpus"][0]["uuid"] == second["gpus"][0]["uuid"], "binpack put them on one GPU"
    uuid = first["gpus"][0]["uuid"]
    segment = "return document.querySelector(`[data-gpu=\"${arguments[0]}\"] [data-grant=\"${arguments[1]}\"]`);"
    wait_dom(browser, segment, uuid, second["id"], timeout=LIVE_TIMEOUT, what="the second container's segment")
    segments = dom(browser, """
        const bar = document.querySelector(`[data-gpu="${arguments[0]}"] .bar`);
        return [...bar.querySelectorAll('[data-grant]')].map(s => [s.dataset.grant, s.textContent, s.offsetWidth]);
    """, uuid)
    by_id = {grant: (label, width) for grant, label, width in segments}
    assert set(by_id) == {first["id"], second["id"]}, segments
    assert by_id[first["id"]][0] == "dash-first" and by_id[second["id"]][0] == "dash-second"
    assert by_id[first["id"]][1] > by_id[second["id"]][1] > 0, "a 4 GiB grant is drawn wider than a 2 GiB one"

    # a container that outgrows its grant is killed; the event shows the figure that killed it
    greedy = create(manager, test_image, "dash-greedy", "1GiB", use=2 * GiB)
    wait_for(lambda: manager.get(f"/v1/containers/{greedy['id']}").json()["state"] == "killed", 20,
             what="the greedy container to be killed")
    killed = wait_dom(browser, """
        const e = document.querySelector('#events [data-type="killed"].bad .efigure');
        return e && e.textContent;
    """, timeout=LIVE_TIMEOUT, what="the killed event with its figure")
    assert killed == "observed 2 GiB of grant 1 GiB", killed
    assert dom(browser, "return window.__sameDocument === true;"), "the page reloaded"

    # a request that cannot fit yet waits in the queue, and the queue table shows it
    waiting = manager.post("/v1/containers", json={
        "image": test_image, "name": "dash-waiting", "gpu_memory": "20GiB", "gpus": 2, "queue": True,
        "command": ["sh", "-c", POLITE]})
    assert waiting.status_code == 202, waiting.text
    queued = wait_dom(browser, "const r = document.querySelector(`tr[data-queued=\"${arguments[0]}\"]`);"
                               "return r && r.innerText;", waiting.json()["id"], timeout=LIVE_TIMEOUT,
                      what="the queued request")
    assert "dash-waiting" in queued and "20 GiB × 2" in queued, queued
    assert "making room" not in queued, "nothing is preemptible: no room is being made"
    summary = wait_dom(browser, "const s = document.getElementById('summary').innerText;"
                                "return /QUEUED\\s+1/i.test(s) && s;", what="the summary")
    assert "1 / 1" in summary and "6 GiB / 48 GiB" in summary, summary

    time.sleep(0.5)  # let the last poll's rendering settle before the pictures
    browser.save_screenshot(str(tmp_path / "dashboard.png"))
    assert not severe(browser), "console errors on the dashboard"

    # a phone-width window: no horizontal page overflow, the bars still drawn
    browser.set_window_size(390, 844)
    wait_dom(browser, "return window.innerWidth <= 400;", what="the narrow window")
    time.sleep(1.2)  # one more poll renders at this width
    width, inner = page_overflow(browser)
    assert width <= inner, f"the page overflows a phone-width window: {width} > {inner}"
    bar_width = dom(browser, "return document.querySelector(`[data-gpu=\"${arguments[0]}\"] .bar`).offsetWidth;", uuid)
    assert 250 <= bar_width <= inner, bar_width
    browser.save_screenshot(str(tmp_path / "dashboard-phone.png"))
    assert not severe(browser), "console errors on the dashboard at phone width"
    assert (tmp_path / "dashboard.png").stat().st_size > 0 and (tmp_path / "dashboard-phone.png").stat().st_size > 0
    print(f"dashboard: second container shown {appeared:.2f}s after its 201; screenshots in {tmp_path}")


def test_dashboard_shows_each_accounts_allocation_against_its_fair_share(tmp_path, browser):
    """With accounts configured, a row per account: its quota, fair share and allocation, and a bar of the one
    against the other (the operator's requests are counted in ``default``; host processes, no containers)."""
    config = tmp_path / "manager.yaml"
    config.write_text(yaml.safe_dump({"accounts": {
        "default": {"quota": {"gpu_memory": "8GiB"}},
        "research": {"quota": {"gpu_memory": "8GiB"}, "over_quota_weight": 3},
        "prod": {"quota": {"gpu_memory": "4GiB"}}}}))
    manager = ManagerProc(tmp_path, "--config", str(config))
    agent = AgentProc(tmp_path, manager, "dash-accounts", gpus="sim:2x24GiB", runtime="process")
    try:
        made = manager.post("/v1/containers", json={"gpu_memory": "4GiB", "command": ["sleep", "300"]})
        assert made.status_code == 201 and made.json()["account"] == "default", made.text
        browser.get(manager.url + "/")
        rows = wait_dom(browser, """
            const rows = [...document.querySelectorAll('#accounts-body tr[data-account]')];
            return rows.length === 3 && rows.some(r => r.querySelector('[data-allocated]').dataset.allocated !== '0')
              && rows.map(r => [r.dataset.account, [...r.cells].map(c => c.innerText),
                                r.querySelector('.seg.grant').offsetWidth, r.querySelector('.share-bar').offsetWidth]);
        """, what="a row per account, default's allocation shown")
        assert shown(browser, "#accounts-section")
        by_name = {name: (cells, fill, width) for name, cells, fill, width in rows}
        assert list(by_name) == ["default", "prod", "research"]
        # default asks for 4 GiB and gets it as its fair share; the others ask for nothing, so their share is 0
        cells, fill, width = by_name["default"]
        assert [cells[i] for i in (0, 1, 2, 3, 5)] == ["default", "8 GiB", "4 GiB", "4 GiB", "0 B"], cells
        assert fill > 0 and abs(fill - width) <= 2, "allocated equals the fair share: the bar is full"
        cells, fill, _ = by_name["research"]
        assert [cells[i] for i in (1, 2, 3)] == ["8 GiB", "0 B", "0 B"] and fill == 0, cells
        assert not severe(browser), "console errors on the accounts panel"
        browser.save_screenshot(str(tmp_path / "dashboard-accounts.png"))
        manager.delete(f"/v1/containers/{made.json()['id']}")
    finally:
        agent.stop()
        manager.stop()


# --- the token -----------------------------------------------------------------------------------
@pytest.fixture
def token_stack(tmp_path) -> Iterator[ManagerProc]:
    """A manager with a token and one agent (host processes: no container is started here)."""
    manager = ManagerProc(tmp_path, "--token", TOKEN)
    manager.http.headers["Authorization"] = f"Bearer {TOKEN}"
    agent = AgentProc(tmp_path, manager, "node-token", gpus="sim:2x24GiB", runtime="process")
    yield manager
    agent.stop()
    manager.stop()


def _only_unauthorized(entries: list[dict[str, Any]]) -> bool:
    """Chromium logs a 401 answer to fetch() as a console error; after a wrong token that one is expected."""
    return all("401" in e["message"] and "/v1/nodes" in e["message"] for e in entries)


def test_dashboard_asks_for_the_token_once(token_stack, browser, tmp_path):
    manager = token_stack
    browser.get(manager.url + "/")
    wait_dom(browser, "const e = document.getElementById('login'); return e && !e.hidden;", what="the token form")
    assert not shown(browser, "#content")
    assert not severe(browser), "the page asks /healthz first: no call is refused before the form shows"

    # a wrong token is refused and the form stays
    browser.find_element("id", "token-input").send_keys("not-the-token-at-all")
    browser.find_element("id", "token-submit").click()
    wait_dom(browser, "return !document.getElementById('login-error').hidden;", what="the refusal")
    assert shown(browser, "#login")
    assert _only_unauthorized(severe(browser))

    # the right one opens the map
    browser.find_element("id", "token-input").send_keys(TOKEN)
    browser.find_element("id", "token-submit").click()
    wait_dom(browser, "return document.querySelectorAll('[data-node=\"node-token\"] [data-gpu]').length === 2;",
             what="the map behind the token")
    assert not shown(browser, "#login") and shown(browser, "#forget-token")
    assert dom(browser, "return sessionStorage.getItem('gpumgr.token');") == TOKEN
    assert _only_unauthorized(severe(browser))
    browser.save_screenshot(str(tmp_path / "dashboard-token.png"))

    # a reload keeps the token for the session: no form, no 401
    browser.refresh()
    wait_dom(browser, "return document.querySelectorAll('[data-node=\"node-token\"] [data-gpu]').length === 2;",
             what="the map after a reload")
    assert not shown(browser, "#login")
    time.sleep(1.2)  # another poll or two, still with the kept token
    assert not shown(browser, "#login")
    assert not severe(browser), "a reload with the kept token met a 401 or another error"

    # forgetting it asks again
    browser.find_element("id", "forget-token").click()
    wait_dom(browser, "const e = document.getElementById('login'); return e && !e.hidden;", what="the form again")
    assert dom(browser, "return sessionStorage.getItem('gpumgr.token');") is None
    assert not severe(browser)


def test_dashboard_assets_ship_in_the_package():
    """Everything the page loads is in manager/api/static and refers to nothing off this manager."""
    static = Path(__file__).resolve().parent.parent / "manager" / "api" / "static"
    names = {p.name for p in static.iterdir()}
    assert {"index.html", "dashboard.js", "dashboard.css"} <= names
    for name in ("index.html", "dashboard.js", "dashboard.css"):
        text = (static / name).read_text()
        assert "http://" not in text and "https://" not in text and "//cdn" not in text, name
        assert "@import" not in text and "url(" not in text, name
    assert ".innerHTML" not in (static / "dashboard.js").read_text()


def test_dashboard_marks_an_unhealthy_gpu_and_shows_node_labels(manager, test_image, browser, tmp_path,
                                                                cleanup_containers):  # issue 23
    health = tmp_path / "health"
    agent = AgentProc(tmp_path, manager, "p23-dash", gpus=f"sim:2x24GiB;health={health}", extra=["--label=zone=a"])
    try:
        browser.get(manager.url + "/")
        wait_dom(browser, "return [...document.querySelectorAll('[data-node=\"p23-dash\"] .label')]"
                          ".some(e => e.textContent === 'zone=a');", what="the node's label")
        assert not shown(browser, "[data-gpu-health]")
        health.write_text("1 fatal Xid 79 in the test\n")
        text = wait_dom(browser, "const e = document.querySelector('[data-gpu-health]');"
                                 "return e && e.closest('.gpu').querySelector('.gpu-name').textContent + '|' + "
                                 "e.textContent;", what="the unhealthy badge")
        assert text.startswith("GPU 1") and text.endswith("unhealthy: fatal Xid 79 in the test")
        health.write_text("")
        wait_dom(browser, "return !document.querySelector('[data-gpu-health]');", what="the badge to go")
        assert not severe(browser)
    finally:
        agent.stop()


def test_dashboard_shows_compute_shares(manager, test_image, browser, tmp_path, cleanup_containers):  # issue 36
    pipes = tmp_path / "mps"
    pipes.mkdir()
    config = tmp_path / "mps.yaml"
    config.write_text(yaml.safe_dump({"mps": True, "mps_pipe_directory": str(pipes)}))
    agent = AgentProc(tmp_path, manager, "s36-dash", gpus="sim:1x24GiB", extra=["--config", str(config)])
    try:
        answer = manager.post("/v1/containers", json={"image": test_image, "name": "shared", "gpu_memory": "1GiB",
                                                      "compute_share": 30, "command": ["sh", "-c", POLITE]})
        assert answer.status_code == 201, answer.text
        browser.get(manager.url + "/")
        cell = wait_dom(browser, "const e = document.querySelector('[data-container] [data-compute-share=\"30\"]');"
                                 "return e && e.textContent;", what="the container's SM share")
        gpu = wait_dom(browser, "const e = document.querySelector('[data-compute-shares]');"
                                "return e && e.textContent;", what="the GPU's SM shares")
        assert cell == "30%" and gpu == "SM shares 30%"
        assert not severe(browser)
    finally:
        agent.stop()


def test_dashboard_shows_a_bursters_limit_and_the_gpus_burst(manager, test_image, browser, tmp_path,
                                                             cleanup_containers):  # issue 36
    agent = AgentProc(tmp_path, manager, "s36-burst", gpus="sim:1x24GiB")
    try:
        answer = manager.post("/v1/containers", json={
            "image": test_image, "name": "burster", "gpu_memory": "4GiB", "gpu_memory_limit": "12GiB",
            "env": {"GPUMGR_SIM_USAGE_FILE": "/tmp/use", "USE": str(10 * GiB)}, "command": ["sh", "-c", POLITE]})
        assert answer.status_code == 201, answer.text
        browser.get(manager.url + "/")
        limit = wait_dom(browser, "const e = document.querySelector('[data-container] [data-limit]:not("
                                  "[data-limit=\"0\"])'); return e && [e.dataset.limit, e.textContent];",
                         what="the container's limit")
        burst = wait_dom(browser, "const e = document.querySelector('[data-memory-burst]');"
                                  "return e && Number(e.dataset.memoryBurst);", what="the GPU's burst")
        mark = wait_dom(browser, "const e = document.querySelector('[data-mark]'); return e && e.dataset.mark;",
                        what="the burster's mark")
        assert limit[0] == str(12 * GiB) and limit[1].startswith("4") and limit[1].endswith("↑ 12 GiB"), limit
        assert burst == 6 * GiB and mark == "burst"  # above its grant, within its limit: not "over"
        assert browser.execute_script("return document.querySelectorAll('.seg.burst').length") == 1
        assert not severe(browser)
    finally:
        agent.stop()


def test_dashboard_shows_room_held_for_a_waiting_gang_and_each_members_rank(tmp_path, test_image, browser,
                                                                            cleanup_containers):  # issue 35
    manager = ManagerProc(tmp_path, env={"GPUMGR_GANG_RESERVE_AFTER": "0"})  # room is held at once
    agent = AgentProc(tmp_path, manager, "s35-dash", gpus="sim:2x8GiB")
    try:
        busy = manager.post("/v1/containers", json={"image": test_image, "name": "busy", "gpu_memory": "4GiB",
                                                    "command": ["sh", "-c", POLITE]})
        assert busy.status_code == 201, busy.text
        waiting = manager.post("/v1/gangs", json={"image": test_image, "gpu_memory": "6GiB", "replicas": 2,
                                                  "one_per_node": False, "queue": True,
                                                  "command": ["sh", "-c", POLITE]})
        assert waiting.status_code == 202, waiting.text
        browser.get(manager.url + "/")
        # 6 GiB of the free GPU, and the 4 GiB the busy one leaves: the bars draw them, the figures say them
        held = wait_dom(browser, "const h = [...document.querySelectorAll('[data-memory-reserved-for-gang]')]"
                                 ".map((e) => Number(e.dataset.memoryReservedForGang)).sort();"
                                 "return h.length === 2 && h;", what="the room held for the gang")
        assert held == [4 * GiB, 6 * GiB]
        assert browser.execute_script("return document.querySelectorAll('.seg.gang-hold').length") == 2
        manager.delete(f"/v1/containers/{busy.json()['id']}")
        ranks = wait_dom(browser, "const m = [...document.querySelectorAll('[data-gang]')];"
                                  "return m.length === 2 && m.map((e) => [e.dataset.gang, e.textContent]);",
                         what="the gang's members")
        gid = waiting.json()["id"]
        assert sorted(ranks) == [[gid, f"gang {gid[:12]} · rank {r}"] for r in (0, 1)], ranks
        wait_dom(browser, "return !document.querySelector('[data-memory-reserved-for-gang]');",
                 what="the held room released once the gang is placed")
        assert not severe(browser)
    finally:
        agent.stop()
        manager.stop()
