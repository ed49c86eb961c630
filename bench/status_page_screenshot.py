"""Screenshot of the live status page under load (the picture in docs/STATUS_PAGE.md).

Starts 4 emulated engines and ``prefixroute serve`` (PREFIX_AWARE, a low
ConcurrencyThreshold so that overflow shows), drives chat completions over 40 shared
documents with 12 concurrent clients, kills one engine part-way (its errors and DOWN
state show), and saves the page as Debian's headless Chromium renders it at a laptop's
size.

Needs the ``browser`` extra and Debian's ``chromium``::

    python bench/status_page_screenshot.py --out docs/status-page.png
"""

from __future__ import annotations

import argparse
import asyncio
import random

import aiohttp

from prefixroute.demo.processes import ProcessGroup

CHROMIUM = "/usr/bin/chromium"
MODEL = "meta-llama/Llama-3.1-70B-Instruct"  # what `prefixroute emulate` serves by default
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


async def _client(url: str, stop: asyncio.Event, rng: random.Random, docs: list[str]) -> None:
    async with aiohttp.ClientSession() as http:
        while not stop.is_set():
            body = {"model": MODEL, "max_tokens": 16, "messages": [
                {"role": "system", "content": rng.choice(docs)},
                {"role": "user", "content": f"question {rng.random()}"}]}
            try:
                async with http.post(url + "/v1/chat/completions", json=body) as r:
                    await r.read()
            except aiohttp.ClientError:
                await asyncio.sleep(0.05)


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="docs/status-page.png", help="PNG to write (default: %(default)s)")
    p.add_argument("--width", type=int, default=1440)
    p.add_argument("--height", type=int, default=900)
    args = p.parse_args()
    from playwright.async_api import async_playwright

    docs = [f"Document {d}: " + "lorem ipsum dolor sit amet " * 80 for d in range(40)]
    with ProcessGroup() as group:
        engines = [group.start(f"engine{i}", ["emulate", "--port", "0", "--time-scale", "0.05",
                                              "--log-level", "error"]) for i in range(4)]
        router = group.start("router", ["serve", "--port", "0", *[a for e in engines for a in ("--backend", e.url)],
                                        "--strategy", "prefix-aware", "--prefix-length", "2048",
                                        "--concurrency-threshold", "3", "--health-check-interval", "1",
                                        "--metrics-scrape-interval", "1", "--log-level", "error"], ready_lines=2)
        admin = next(iter(router.extra_urls.values()))
        stop = asyncio.Event()
        rng = random.Random(7)
        clients = [asyncio.create_task(_client(router.url, stop, random.Random(rng.random()), docs))
                   for _ in range(12)]
        try:
            async with async_playwright() as pw:
                browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                page = await browser.new_page(viewport={"width": args.width, "height": args.height})
                await page.goto(f"{admin}/admin/status")
                await asyncio.sleep(12)
                engines[3].proc.kill()  # an engine dies under load
                await asyncio.sleep(6)
                await page.evaluate("document.querySelector('details.errors').open = true")
                await asyncio.sleep(1.2)
                await page.screenshot(path=args.out)
                await browser.close()
        finally:
            stop.set()
            await asyncio.gather(*clients, return_exceptions=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    asyncio.run(main())
