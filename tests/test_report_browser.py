"""report.html in a real browser: headless Chromium (Debian's) driven by Playwright.

The session fixture installs what is missing: `chromium` through apt (root only) and the `playwright` Python
package through pip into this interpreter. It never runs `playwright install` (that downloads a browser build;
we drive the system one through `executable_path`). The tests skip, with the reason, only when no browser can
be installed. A full-page screenshot lands in `test-artifacts/report.png` for a human to look at.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import IMG_ATTACK, SCRIPT_ATTACK, make_run
from vlmrl.report import write_report

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage"]  # a container's /dev/shm can be 64 MB: too small to render in
APT_PACKAGES = ["chromium", "fonts-liberation"]  # Chromium's recommended fonts: text renders on bare machines
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"

pytestmark = pytest.mark.slow


def _install_chromium() -> str | None:
    """Install Debian's chromium if absent; return why not when that is impossible."""
    if CHROMIUM.exists():
        return None
    if not shutil.which("apt-get"):
        return f"{CHROMIUM} is missing and there is no apt-get to install it"
    if os.geteuid() != 0:
        return f"{CHROMIUM} is missing; install it as root: apt-get install -y {' '.join(APT_PACKAGES)}"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    wait_for_lock = ["-o", "DPkg::Lock::Timeout=300"]  # another apt run (a parallel session) holds the lock
    for command in (["apt-get", *wait_for_lock, "update"],
                    ["apt-get", *wait_for_lock, "install", "-y", "--no-install-recommends", *APT_PACKAGES]):
        try:
            done = subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired:
            return f"`{' '.join(command)}` took more than 15 minutes"
        if done.returncode != 0:
            return f"`{' '.join(command)}` failed: {done.stderr.strip()[-600:]}"
    return None if CHROMIUM.exists() else f"apt installed {APT_PACKAGES} but {CHROMIUM} is still missing"


def _import_playwright():
    """playwright.sync_api, pip-installing the package into this interpreter when it is missing."""
    try:
        return importlib.import_module("playwright.sync_api")
    except ImportError:
        command = [sys.executable, "-m", "pip", "install", "--quiet", "playwright"]
        subprocess.run(command, check=False, timeout=900)
        importlib.invalidate_caches()
        try:
            return importlib.import_module("playwright.sync_api")
        except ImportError as exc:
            pytest.skip(f"the playwright package could not be installed: {exc}")


@pytest.fixture(scope="session")
def browser_context(tmp_path_factory):
    reason = _install_chromium()
    if reason:
        pytest.skip(f"no browser for the report test: {reason}")
    sync_api = _import_playwright()
    with sync_api.sync_playwright() as playwright:
        # A persistent context is how Playwright takes an explicit (fresh, empty) user-data-dir.
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=str(CHROMIUM), headless=True,
            args=CHROMIUM_ARGS, viewport={"width": 1360, "height": 900})
        yield context
        context.close()


@pytest.fixture(scope="module")
def report(browser_context, tmp_path_factory):
    """The full fake run's report, opened; with the console errors and network requests it caused."""
    run = make_run(tmp_path_factory.mktemp("browser"), n=12)
    path = write_report(run)
    page = browser_context.new_page()
    errors: list[str] = []
    requests: list[str] = []
    page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("request", lambda request: requests.append(request.url))
    page.goto(path.as_uri(), wait_until="load")
    yield page, errors, requests, run
    page.close()


def _visible_ids(page) -> list[str]:
    return page.eval_on_selector_all(".sample:not([hidden])", "cards => cards.map(c => c.dataset.id)")


def test_page_loads_without_console_errors_or_network(report):
    page, errors, requests, _ = report
    assert page.title().startswith("vlmrl report")
    assert errors == []
    assert [url for url in requests if not url.startswith(("file:", "data:"))] == []
    assert page.locator("#sample-count").inner_text() == "12 of 12 shown"  # our script ran


def test_filters_and_search_change_the_visible_rows(report):
    page, _, _, _ = report
    statuses = page.eval_on_selector_all(".sample", "cs => cs.map(c => [c.dataset.id, c.dataset.status])")
    improved = [i for i, s in statuses if s == "improved"]
    regressed = [i for i, s in statuses if s == "regressed"]
    assert improved and regressed
    page.click('[data-filter="improved"]')
    assert _visible_ids(page) == improved
    page.click('[data-filter="regressed"]')
    assert _visible_ids(page) == regressed
    page.click('[data-filter="format-broken"]')
    assert _visible_ids(page) == ["item-001"]  # the injection attempt
    page.click('[data-filter="all"]')
    page.fill("#sample-search", "item-007")
    assert _visible_ids(page) == ["item-007"]
    page.fill("#sample-search", "")
    assert len(_visible_ids(page)) == 12


def test_flip_link_reveals_its_sample_even_when_filtered_out(report):
    page, _, _, _ = report
    page.click('[data-filter="improved"]')
    page.click('#flips [data-goto="item-003"]')  # item-003 was right and is now wrong
    assert page.locator('.sample[data-id="item-003"]').is_visible()
    assert page.get_attribute('[data-filter="all"]', "aria-pressed") == "true"


def test_injected_markup_does_not_execute_and_shows_as_text(report):
    page, _, _, _ = report
    assert page.evaluate("typeof window.__pwned") == "undefined"
    card = page.locator('.sample[data-id="item-001"] .stage.after .completion')
    assert SCRIPT_ATTACK in card.inner_text() and IMG_ATTACK in card.inner_text()
    assert page.locator(".sample img:not(.thumb img)").count() == 0  # no <img> element came from model text


def test_full_page_screenshot(report):
    page, _, _, _ = report
    page.click('[data-filter="all"]')
    page.evaluate("document.querySelectorAll('.chosen').forEach(c => c.classList.remove('chosen'))")
    page.evaluate("window.scrollTo(0, 0)")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "report.png"), full_page=True)
    assert (ARTIFACTS / "report.png").stat().st_size > 50_000
