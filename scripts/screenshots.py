"""The README's studio screenshots from a running studio: `python scripts/screenshots.py http://127.0.0.1:7860/`.

Each is taken while an answer streams (masked and committed cells together): assets/screenshot.png (light,
1440 px), assets/screenshot_dark.png (dark, 1440 px), assets/screenshot_phone.png (390 × 844); then
assets/screenshot_race.png: the Race tab after one race of the haiku prompt at the studio's defaults (its headline
says which side finished; tokens/s is compared only when both did). Needs playwright
and Debian's chromium (CHROMIUM overrides the path), as tests/test_browser.py does.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from playwright.sync_api import sync_playwright

ASSETS = Path(__file__).resolve().parent.parent / "assets"
PROMPT = "List three uses for a paperclip."
ENDED = "#fd-live .fd-badge-stopped, #fd-live .fd-badge-done, #fd-live .fd-badge-unfinished, #fd-live .fd-badge-looping"


def shoot(browser, url: str, out: Path, width: int, height: int, theme: str, committed: int) -> None:
    pg = browser.new_page(viewport={"width": width, "height": height})
    pg.goto(f"{url}?__theme={theme}")
    pg.wait_for_selector(".fd-live-root .fd-legend", timeout=60_000)
    pg.fill("#fd-msg textarea", PROMPT)
    pg.keyboard.press("Enter")
    # `committed` tokens in (mid-stream), or the answer ended first (a short one): then its end state is shown
    pg.wait_for_function(f"document.querySelectorAll('#fd-live .fd-cell.fd-done').length >= {committed} || "
                         f"document.querySelector({ENDED!r})", timeout=300_000)
    if width < 600:  # a phone: the answer and the live view together
        pg.evaluate("document.querySelector('#fd-chat').scrollIntoView()")
    else:
        pg.evaluate("window.scrollTo(0, 0)")
    pg.wait_for_timeout(300)
    pg.screenshot(path=str(out))
    pg.evaluate("document.querySelector('#fd-stop').click()")  # a no-op when the answer has already ended
    pg.wait_for_selector(ENDED, timeout=60_000)
    pg.close()
    print(out)


def shoot_race(browser, url: str, out: Path) -> None:
    pg = browser.new_page(viewport={"width": 1440, "height": 1000})
    pg.goto(f"{url}?__theme=light")
    pg.wait_for_selector(".fd-live-root .fd-legend", timeout=60_000)
    pg.get_by_role("tab", name="Race").click()
    reps = pg.locator("#fd-race-reps input[type=number]")
    reps.fill("1")
    reps.press("Enter")
    pg.click("#fd-race")
    pg.wait_for_selector("#fd-race-meters .fd-verdict", timeout=600_000)
    pg.wait_for_function("!document.querySelector('#fd-race').disabled", timeout=60_000)
    pg.wait_for_timeout(500)
    pg.locator("#fd-tabs").screenshot(path=str(out))
    pg.close()
    print(out)


def main(url: str) -> None:
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=os.environ.get("CHROMIUM", "/usr/bin/chromium"),
                                    args=["--no-sandbox"])
        shoot(browser, url, ASSETS / "screenshot.png", 1440, 1000, "light", 30)
        shoot(browser, url, ASSETS / "screenshot_dark.png", 1440, 1000, "dark", 30)
        shoot(browser, url, ASSETS / "screenshot_phone.png", 390, 844, "light", 12)
        shoot_race(browser, url, ASSETS / "screenshot_race.png")
        browser.close()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:7860/")
