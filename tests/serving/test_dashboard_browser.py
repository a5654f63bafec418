"""The dashboard in a real browser: headless Chromium (Debian's `chromium`, which `make setup-dev`
installs through scripts/install_chromium.sh where it can) driven by Playwright, against the server on a
tiny model whose steps are slowed down so that requests last long enough to watch.

The page loads whole from the server (no request leaves it, no console error), with the key given in
its URL; its grid has a cell per physical block; while a long request runs its count of used blocks
equals /metrics' and comes back to zero once the request ends; a busy pool shows shared blocks, a
waiting queue and a picked sequence's page table. The busy page's screenshot is saved (also to
$PAGED_JAX_DASHBOARD_SCREENSHOT when set: that is how docs/figures/dashboard.png is made).
"""

import os
import shutil
import threading
import time

import httpx
import pytest
from playwright.sync_api import sync_playwright

from conftest import running_server, slow_steps
from paged_jax import EngineConfig, LLMEngine
from paged_jax.serving.server import ServerConfig, build_app
from server_client import TIMEOUT, metrics, wait_until_ready

KEY = "sk-dashboard"
AUTH = {"Authorization": f"Bearer {KEY}"}
STEP_DELAY_S = 0.05
CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium")
USED = 'paged_jax:num_kv_cache_blocks{state="used"}'


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.fail("chromium is not installed: run `make setup-dev` as root (scripts/install_chromium.sh), "
                    "`apt-get install chromium`, or set CHROMIUM to a Chromium binary")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    engine = LLMEngine(tiny_chat_model.model, tiny_chat_model.config, tiny_chat_model.tokenizer,
                       EngineConfig(block_size=16, num_blocks=128, max_num_seqs=4, max_num_batched_tokens=256))
    slow_steps(engine, STEP_DELAY_S)
    with running_server(build_app(engine, ServerConfig(served_model_name="tiny", api_key=KEY))) as url:
        wait_until_ready(url)
        yield url, engine


@pytest.fixture
def page(server, browser):
    """The dashboard, open and live; fails the test on any console error or request to elsewhere."""
    url, _ = server
    page = browser.new_page(viewport={"width": 1440, "height": 1000})
    page.set_default_timeout(1000 * TIMEOUT)  # every wait below, in ms (Playwright's own default is 30 s)
    errors, foreign = [], []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: None if r.url.startswith((url, "data:")) else foreign.append(r.url))
    page.goto(f"{url}/dashboard?key={KEY}")
    page.wait_for_selector("body[data-updates]")
    yield page
    page.close()
    assert errors == [] and foreign == []


def post_in_thread(url: str, bodies: list[dict]) -> list[threading.Thread]:
    def post(body):
        r = httpx.post(f"{url}/v1/completions", headers=AUTH, json=body, timeout=TIMEOUT)
        assert r.status_code == 200, r.text

    threads = [threading.Thread(target=post, args=(b,)) for b in bodies]
    for t in threads:
        t.start()
    return threads


def used_on_page(page) -> int:
    return int(page.inner_text("#used-blocks"))


def test_the_page_wants_the_key_and_shows_every_block_live(server, page):
    url, engine = server
    assert httpx.get(f"{url}/dashboard", timeout=TIMEOUT).status_code == 401
    assert httpx.get(f"{url}/dashboard/events", timeout=TIMEOUT).status_code == 401
    assert httpx.get(f"{url}/dashboard", headers=AUTH, timeout=TIMEOUT).status_code == 200
    page.wait_for_selector("#grid .cell")  # the first event may come before the first pool snapshot
    assert page.locator("#grid .cell").count() == engine.blocks.num_blocks
    # At least two updates a second, across the stream's reconnections.
    start, before = time.monotonic(), int(page.get_attribute("body", "data-updates"))
    page.wait_for_timeout(6000)
    rate = (int(page.get_attribute("body", "data-updates")) - before) / (time.monotonic() - start)
    assert rate >= 2


def test_used_blocks_follow_the_metrics_and_return_to_zero(server, page):
    url, _ = server
    [request] = post_in_thread(url, [dict(prompt=[7] * 20, max_tokens=150, ignore_eos=True, temperature=0)])
    agreed = set()
    while request.is_alive():
        shown = used_on_page(page)
        held = page.locator('#grid .cell[data-state="held"], #grid .cell[data-state="shared"]').count()
        if shown == metrics(url)[USED] > 0 and held == shown:
            agreed.add(shown)
        page.wait_for_timeout(100)
    request.join()
    # The request grew by a block every 16 tokens, and the page kept up.
    assert len(agreed) >= 3, agreed
    page.wait_for_function("document.getElementById('used-blocks').textContent === '0'")
    assert metrics(url)[USED] == 0


def test_a_busy_pool_with_shared_prefixes_and_a_page_table(server, page, tmp_path):
    url, _ = server
    shared = list(range(200, 248))  # three blocks every request below opens with
    bodies = [dict(prompt=shared + [300 + i] * (5 + 7 * i), max_tokens=90 + 10 * i, ignore_eos=True) for i in range(5)]
    bodies.append(dict(prompt=[400 + j for j in range(30)], n=2, max_tokens=80, ignore_eos=True))
    threads = post_in_thread(url, bodies)
    page.wait_for_function("""() => {
        const [running, waiting] = document.getElementById('queue-counts').textContent.split(' / ').map(Number);
        return running === 4 && waiting >= 1 && document.querySelector('#grid .cell[data-state="shared"]');
    }""")
    page.wait_for_timeout(2000)  # for the picture: the running sequences grow, the queue still waits
    page.click("#running tbody tr")
    # Read in one go, between two renders: the page table's physical blocks and the grid's highlighted cells.
    physical, selected = page.evaluate("""() => [
        [...document.querySelectorAll('#page-table .page')].map(p => Number(p.textContent.split('#')[1].split(' ')[0])),
        [...document.querySelectorAll('#grid .cell.selected')].map(c => Number(c.dataset.block))]""")
    assert len(physical) >= 4  # the shared prefix alone fills three blocks
    assert sorted(physical) == sorted(selected)
    shot = tmp_path / "dashboard.png"
    page.screenshot(path=shot, full_page=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("PAGED_JAX_DASHBOARD_SCREENSHOT"):
        shutil.copy(shot, os.environ["PAGED_JAX_DASHBOARD_SCREENSHOT"])
    for t in threads:
        t.join()
    page.wait_for_function("document.getElementById('used-blocks').textContent === '0'")
