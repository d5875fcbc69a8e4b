"""The report page opened in a real headless browser; ``KLPPO_UPDATE_SCREENSHOT=1`` saves the screenshot to
``docs/img/report.png`` (otherwise the test leaves the tracked file alone).

Drives Chromium through playwright or selenium when one is installed with its browser, else the
``chromium`` binary's own ``--headless --screenshot``; skipped when no browser is found (CI installs none).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

# the runs of the session fixture tiny_runs (conftest.py) are trained once, by the one xdist worker of the
# group
pytestmark = pytest.mark.xdist_group("report_runs")

SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "img" / "report.png"
WIDTH, HEIGHT = 1400, 1800
BINARIES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def _with_playwright(url: str, out: Path) -> bool:
    try:
        from playwright.sync_api import Error, sync_playwright
    except ImportError:
        return False
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch()
            page = browser.new_page(viewport={"width": WIDTH, "height": HEIGHT})
            page.goto(url)
            assert page.evaluate("[...document.images].every(i => i.complete && i.naturalWidth > 0)")
            page.screenshot(path=str(out))
            browser.close()
        return True
    except Error:  # no browser downloaded for playwright
        return False


def _with_selenium(url: str, out: Path) -> bool:
    try:
        from selenium import webdriver
        from selenium.common.exceptions import WebDriverException
    except ImportError:
        return False
    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", f"--window-size={WIDTH},{HEIGHT}"):
        options.add_argument(arg)
    try:
        driver = webdriver.Chrome(options=options)
    except WebDriverException:
        return False
    try:
        driver.get(url)
        assert driver.execute_script(
            "return [...document.images].every(i => i.complete && i.naturalWidth > 0)"
        )
        driver.save_screenshot(str(out))
    finally:
        driver.quit()
    return True


def _with_binary(url: str, out: Path, tmp: Path) -> bool:
    binary = next((b for b in map(shutil.which, BINARIES) if b), None)
    if binary is None:
        return False
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--user-data-dir={tmp}"]
    subprocess.run(
        [binary, *flags, f"--window-size={WIDTH},{HEIGHT}", f"--screenshot={out}", url],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return out.is_file()


@pytest.mark.browser
def test_page_in_headless_browser(tiny_runs, tmp_path):
    from matplotlib.image import imread

    from klppo.report import build_report, load_run
    from klppo.report.figures import COLORS

    run_a, run_b, _ = tiny_runs
    report = build_report([load_run(run_a, name="gae"), load_run(run_b, name="grpo")], tmp_path / "page")
    url = report.page.resolve().as_uri()
    shot = tmp_path / "shot.png"
    if not (
        _with_playwright(url, shot)
        or _with_selenium(url, shot)
        or _with_binary(url, shot, tmp_path / "profile")
    ):
        pytest.skip("no headless browser found (playwright, selenium or a chromium binary)")
    pixels = imread(shot)[..., :3]
    assert pixels.shape[:2] == (HEIGHT, WIDTH)
    # the figures were decoded and drawn: both runs' line colours are on screen, below the runs table
    for color in COLORS[:2]:
        rgb = [int(color[i : i + 2], 16) / 255 for i in (1, 3, 5)]
        assert ((abs(pixels - rgb) < 0.02).all(axis=-1)).sum() > 200, color
    if os.environ.get("KLPPO_UPDATE_SCREENSHOT") == "1":
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, SCREENSHOT)
