"""The live status page in a real headless Chromium (Debian's ``chromium``), driven by Playwright.

Three emulated engines (``prefixroute emulate``) and ``prefixroute serve`` run as real
processes; a load generator sends chat completions while the browser watches the page:

* the page loads with no console error and no failed request;
* its numbers change while the load runs, without a reload;
* an engine killed (SIGKILL) shows as DOWN within one health round.

Needs the ``browser`` extra (Playwright's Python package) and ``/usr/bin/chromium``; never
downloads a browser. Without them the test is skipped locally and fails in CI (``CI``
set), so CI never passes without running it.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import time
from pathlib import Path

import aiohttp
import pytest

from prefixroute.demo.processes import ProcessGroup

CHROMIUM = "/usr/bin/chromium"
MODEL = "meta-llama/Llama-3.1-70B-Instruct"  # what `prefixroute emulate` serves by default
#: Flags for Chromium on a machine without a display, a sandbox or internet access.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
HEALTH_INTERVAL_S = 1.0
HEALTH_TIMEOUT_S = 0.5
POLL_S = 0.5  # the page's ?interval


def _need_browser() -> None:
    missing = []
    try:
        import playwright.async_api  # noqa: F401
    except ImportError:
        missing.append("the Python package playwright (pip install -e '.[browser]')")
    if not (os.path.exists(CHROMIUM) or shutil.which("chromium")):
        missing.append(f"{CHROMIUM} (apt-get install chromium)")
    if missing:
        msg = "the status page browser test needs " + " and ".join(missing)
        if os.environ.get("CI"):
            pytest.fail("CI must run the browser test: " + msg)
        pytest.skip(msg)


async def _load(url: str, stop: asyncio.Event, sent: list[int]) -> None:
    """Closed-loop chat completions over 30 documents (shared prefixes: with 30 keys,
    every one of 3 instances owns some but with odds of 1 in 60,000) until ``stop``."""
    docs = [f"Document {d}: " + "lorem ipsum dolor sit amet " * 60 for d in range(30)]
    rng = random.Random(1)
    async with aiohttp.ClientSession() as http:
        while not stop.is_set():
            body = {"model": MODEL, "max_tokens": 8, "messages": [
                {"role": "system", "content": rng.choice(docs)},
                {"role": "user", "content": f"question {rng.random()}"}]}
            try:
                async with http.post(url + "/v1/chat/completions", json=body) as r:
                    await r.read()
                    sent[0] += 1
            except aiohttp.ClientError:
                await asyncio.sleep(0.05)


async def test_status_page_is_live_in_chromium(data_plane: str, tmp_path: Path) -> None:
    _need_browser()
    from playwright.async_api import async_playwright

    with ProcessGroup() as group:
        engines = [group.start(f"engine{i}", ["emulate", "--port", "0", "--time-scale", "0.02",
                                              "--log-level", "warning"]) for i in range(3)]
        router = group.start("router", ["serve", "--port", "0", "--data-plane", data_plane,
                                        *[a for e in engines for a in ("--backend", e.url)],
                                        "--strategy", "prefix-aware", "--prefix-length", "1024",
                                        "--concurrency-threshold", "8",
                                        "--health-check-interval", str(HEALTH_INTERVAL_S),
                                        "--health-check-timeout", str(HEALTH_TIMEOUT_S),
                                        "--unhealthy-threshold", "1", "--metrics-scrape-interval", "1"],
                             ready_lines=2)
        admin = next(iter(router.extra_urls.values()))
        stop = asyncio.Event()
        sent = [0]
        load = [asyncio.create_task(_load(router.url, stop, sent)) for _ in range(4)]
        try:
            async with async_playwright() as pw:
                browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                try:
                    page = await browser.new_page(viewport={"width": 1600, "height": 900})
                    problems: list[str] = []
                    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}")
                            if m.type in ("error", "warning") else None)
                    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
                    page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url}"))
                    await page.goto(f"{admin}/admin/status?interval={POLL_S}")
                    await page.wait_for_function("document.getElementById('health').textContent === 'ok'",
                                                 timeout=10_000)
                    variant = page.locator('tr.variant[data-variant="default/AllTraffic"]')
                    total = variant.locator('td[data-field="requests"]')
                    before = int((await total.text_content() or "0").replace(",", ""))
                    await asyncio.sleep(3)
                    after = int((await total.text_content() or "0").replace(",", ""))
                    assert after > before, (before, after)  # live, without a reload
                    rate = await variant.locator('td[data-field="rate"]').text_content()
                    assert rate not in (None, "–") and float(rate) > 0
                    instance_rows = page.locator("tr.instance")
                    assert await instance_rows.count() == 3
                    for i in range(3):  # every instance took a share and has TTFT figures
                        row = instance_rows.nth(i)
                        assert (await row.locator('td[data-field="state"]').text_content()) == "UP"
                        assert int((await row.locator('td[data-field="requests"]').text_content() or "0")
                                   .replace(",", "")) > 0
                        assert (await row.locator('td[data-field="p50"]').text_content()) != "–"
                    for field in ("d_affinity", "r_2xx"):  # routed by affinity, answered 200
                        assert int((await variant.locator(f'td[data-field="{field}"]').text_content() or "0")
                                   .replace(",", "")) > 0, field
                    await page.screenshot(path=str(tmp_path / "status.png"), full_page=True)
                    assert (tmp_path / "status.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

                    # The load stops, then an engine dies: only the health checks can see it.
                    stop.set()
                    await asyncio.gather(*load)
                    victim = engines[1]
                    victim.proc.kill()
                    killed = time.monotonic()
                    state = page.locator(f'tr.instance[data-instance="{victim.url}"] td[data-field="state"]')
                    await page.wait_for_function(
                        "url => document.querySelector(`tr.instance[data-instance=\"${url}\"] "
                        "td[data-field=\"state\"]`).textContent === 'DOWN'", arg=victim.url, timeout=10_000)
                    seen_down = time.monotonic() - killed
                    # One round: at most an interval until it starts, its timeout, and a poll of the page.
                    assert seen_down <= HEALTH_INTERVAL_S + HEALTH_TIMEOUT_S + POLL_S + 1.0, seen_down
                    assert await state.get_attribute("class") == "state down"
                    assert (await page.locator("#health").text_content()) == "ok"  # 2 of 3 up: the variant serves
                    assert problems == []
                finally:
                    await browser.close()
        finally:
            stop.set()
            await asyncio.gather(*load, return_exceptions=True)
    assert sent[0] > 0
