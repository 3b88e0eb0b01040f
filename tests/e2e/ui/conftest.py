"""Browser fixtures: one mesh and one headless Debian Chromium per module, a fresh page per test."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from playwright.async_api import Browser, Page, async_playwright

from tests.conftest import CI

CHROMIUM = Path(os.environ.get("CHROMIUM", "/usr/bin/chromium"))
# The UI's npm libraries, copied there by `make setup` (gitignored).
VENDOR = Path(__file__).resolve().parents[3] / "gateway" / "static" / "ui" / "vendor"
VENDOR_FILES = ("marked.esm.js", "purify.es.mjs", "highlight.min.js")
# axe-core (an npm devDependency, never served to users) for the accessibility checks.
AXE = Path(__file__).resolve().parents[3] / "node_modules" / "axe-core" / "axe.min.js"
HAVE_CHROMIUM = CHROMIUM.exists()
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

pytestmark = pytest.mark.browser
README_SHOTS = Path(__file__).parent / "screenshots"  # the README's pictures


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    """Where a test saves its screenshots: the README's folder under `make screenshots`
    (AGENTMESH_SCREENSHOTS=1), the test's own temporary folder otherwise (a test run changes no file)."""
    return README_SHOTS if os.environ.get("AGENTMESH_SCREENSHOTS") else tmp_path


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Browser]:
    if not HAVE_CHROMIUM:
        if CI:
            pytest.fail(f"no Chromium at {CHROMIUM} (CI=true: a missing browser fails the run)")
        pytest.skip(f"no Chromium at {CHROMIUM}")
    missing = [name for name in VENDOR_FILES if not (VENDOR / name).exists()]
    if missing:
        pytest.fail(f"the UI's libraries are missing from {VENDOR} ({', '.join(missing)}): run `make setup`")
    if not AXE.exists():
        pytest.fail(f"axe-core is missing ({AXE}): run `make setup`")
    async with async_playwright() as pw:
        b = await pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield b
        await b.close()


@pytest.fixture
async def page(browser: Browser) -> AsyncIterator[Page]:
    """A 1280x800 en-US page in UTC in its own context (own localStorage); fails the test on any script
    error."""
    context = await browser.new_context(
        viewport={"width": 1280, "height": 800}, locale="en-US", timezone_id="UTC"
    )
    p = await context.new_page()
    errors: list[str] = []
    p.on("pageerror", lambda exc: errors.append(str(exc)))
    yield p
    await context.close()
    assert not errors, f"script errors on the page: {errors}"
