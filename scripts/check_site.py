"""Opens every page of the built docs site in headless Chromium at a laptop's
width and fails if anything is clipped or too small to read:

- the page scrolls sideways (something wider than the window);
- a table, code block or figure is wider than the text column and not in a
  box that scrolls (mkdocs-material wraps tables in one);
- a figure's smallest text is shown below MIN_TEXT_PX high: the figure's
  ``smallest_text_px`` PNG field where it wrote one (our pipeline
  timelines), else matplotlib's default 10 pt at 100 dpi (13.9 px), times
  the scale the page shows it at.

Writes a screenshot of each whole page to --shots (what was checked).

    python scripts/check_site.py build/site [--shots build/site-shots] [--width 1280]

Needs Chromium and its driver (Debian: chromium, chromium-driver) and
selenium; scripts/setup.sh installs them.
"""

from __future__ import annotations

import argparse
import os
import sys

MIN_TEXT_PX = 7.0
DEFAULT_TEXT_PX = 10 * 100 / 72  # matplotlib's default font size and dpi

# Run in the page: what is clipped, each figure's scale, how far the page
# scrolls sideways.
MEASURE = """
const column = document.querySelector('.md-content__inner') || document.body;
const right = column.getBoundingClientRect().right;
const out = {sideways: document.documentElement.scrollWidth - window.innerWidth,
             clipped: [], figures: []};
const name = el => el.tagName.toLowerCase() + (el.getAttribute('src') ? ' ' + el.getAttribute('src')
    : ': ' + (el.innerText || '').trim().split('\\n')[0].slice(0, 60));
for (const el of column.querySelectorAll('table, pre, img')) {
  let a = el.parentElement, scrolls = false;
  while (a && a !== column) {
    const x = getComputedStyle(a).overflowX;
    if (x === 'auto' || x === 'scroll') { scrolls = true; break; }
    a = a.parentElement;
  }
  if (!scrolls && el.getBoundingClientRect().right > right + 1) out.clipped.push(name(el));
  if (el.tagName === 'IMG' && el.naturalWidth)
    out.figures.push([el.currentSrc, el.getBoundingClientRect().width / el.naturalWidth]);
}
return out;
"""


def too_small(figure: tuple[str, float]) -> str | None:
    """What is wrong with a figure shown at ``scale`` (from its src URL), or None."""
    from urllib.parse import unquote, urlparse

    from PIL import Image

    src, scale = figure
    with Image.open(unquote(urlparse(src).path)) as im:
        text_px = float(getattr(im, "text", {}).get("smallest_text_px", DEFAULT_TEXT_PX))
    if scale * text_px >= MIN_TEXT_PX:
        return None
    name = os.path.basename(urlparse(src).path)
    return f"figure {name} shown at {scale:.2f}: its text {scale * text_px:.1f} px high"


def pages(site: str) -> list[str]:
    out = []
    for d, _, files in os.walk(site):
        for f in files:
            path = os.path.join(d, f)
            if f == "index.html" and "/assets/" not in path and "/search/" not in path:
                out.append(path)
    return sorted(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("site")
    ap.add_argument("--shots", default="build/site-shots")
    ap.add_argument("--width", type=int, default=1280)
    args = ap.parse_args(argv)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--hide-scrollbars",
    ):
        opts.add_argument(flag)
    opts.add_argument(f"--window-size={args.width},900")
    # The distribution's driver: selenium would otherwise try to download one.
    driver = webdriver.Chrome(options=opts, service=Service("/usr/bin/chromedriver"))
    os.makedirs(args.shots, exist_ok=True)
    failures = []
    try:
        found = pages(args.site)
        for path in found:
            page = os.path.relpath(path, args.site)
            driver.set_window_size(args.width, 900)
            driver.get("file://" + os.path.abspath(path))
            driver.execute_script("return document.fonts.ready")
            got = driver.execute_script(MEASURE)
            if got["sideways"] > 0:
                failures.append(f"{page}: the page scrolls sideways by {got['sideways']} px")
            failures += [f"{page}: clipped, wider than the column: {x}" for x in got["clipped"]]
            failures += [f"{page}: {x}" for x in map(too_small, got["figures"]) if x]
            height = driver.execute_script("return document.documentElement.scrollHeight")
            driver.set_window_size(args.width, min(height, 16000))
            name = os.path.dirname(page).replace("/", "_") or "home"
            driver.save_screenshot(os.path.join(args.shots, name + ".png"))
    finally:
        driver.quit()
    for f in failures:
        print(f)
    print(f"check_site: {len(found)} pages at {args.width} px, {len(failures)} problems")
    return 1 if failures or not found else 0


if __name__ == "__main__":
    sys.exit(main())
