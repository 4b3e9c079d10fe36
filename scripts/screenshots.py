"""The README's studio screenshots from a running studio: `python scripts/screenshots.py http://127.0.0.1:7860/`.

Each is taken while an answer streams (masked and committed cells together): assets/screenshot.png (light,
1440 px), assets/screenshot_dark.png (dark, 1440 px), assets/screenshot_phone.png (390 × 844). Needs playwright
and Debian's chromium (CHROMIUM overrides the path), as tests/test_browser.py does.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from playwright.sync_api import sync_playwright

ASSETS = Path(__file__).resolve().parent.parent / "assets"
PROMPT = "Explain in two sentences why the sky is blue."


def shoot(browser, url: str, out: Path, width: int, height: int, theme: str, committed: int) -> None:
    pg = browser.new_page(viewport={"width": width, "height": height})
    pg.goto(f"{url}?__theme={theme}")
    pg.wait_for_selector(".fd-live-root .fd-legend", timeout=60_000)
    pg.fill("#fd-msg textarea", PROMPT)
    pg.keyboard.press("Enter")
    pg.wait_for_function(f"document.querySelectorAll('#fd-live .fd-cell.fd-done').length >= {committed}",
                         timeout=300_000)
    if width < 600:  # a phone: the answer and the live view together
        pg.evaluate("document.querySelector('#fd-chat').scrollIntoView()")
    else:
        pg.evaluate("window.scrollTo(0, 0)")
    pg.wait_for_timeout(300)
    pg.screenshot(path=str(out))
    pg.click("#fd-stop")
    pg.wait_for_selector("#fd-live .fd-badge-stopped, #fd-live .fd-badge-done, #fd-live .fd-badge-unfinished, "
                         "#fd-live .fd-badge-looping", timeout=60_000)
    pg.close()
    print(out)


def main(url: str) -> None:
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=os.environ.get("CHROMIUM", "/usr/bin/chromium"),
                                    args=["--no-sandbox"])
        shoot(browser, url, ASSETS / "screenshot.png", 1440, 1000, "light", 30)
        shoot(browser, url, ASSETS / "screenshot_dark.png", 1440, 1000, "dark", 30)
        shoot(browser, url, ASSETS / "screenshot_phone.png", 390, 844, "light", 12)
        browser.close()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:7860/")
