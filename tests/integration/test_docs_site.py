"""The documentation site as a reader gets it: built strictly by MkDocs, opened in Debian's headless Chromium.

The site is built once into a temporary directory and served on loopback. Chromium opens the front page and follows
every internal link it renders (navigation, page bodies, the table of contents), breadth first: each page must load
with no script error, each link must reach a page the server has, and each link with a fragment must name an
element that page has. The generated reference pages are checked against the code they are generated from (every
setting key, metric family and record field appears in the rendered table), and the front page and the settings
reference are screenshotted into ``.cache/screenshots/``.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import struct
import subprocess
import threading
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urldefrag, urljoin, urlparse

import pytest

from flow_exporter.metrics import catalogue
from flow_exporter.settings import SETTINGS
from tests.support.browser import Browser
from tests.support.paths import REPO

SCREENSHOTS = REPO / ".cache" / "screenshots"


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The site built strictly (as `make docs` builds it) and served on loopback; its base URL."""
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    r = subprocess.run(
        [str(REPO / ".venv" / "bin" / "mkdocs"), "build", "--strict", "--site-dir", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(out)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with Browser() as b:
        yield b


# Every link a page renders, resolved by the browser; every id in the page (a fragment's target).
LINKS_JS = "Array.from(document.querySelectorAll('a[href]'), a => a.href)"
IDS_JS = "Array.from(document.querySelectorAll('[id]'), e => e.id)"


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def test_every_internal_link_reaches_a_page_and_its_anchor(site: str, browser: Browser) -> None:
    pages: dict[str, set[str]] = {}  # page URL -> its element ids
    wanted: dict[str, set[str]] = {}  # page URL -> fragments linked to it
    linked_from: dict[str, str] = {}
    queue = [site]
    files_ok: set[str] = set()
    while queue:
        url = queue.pop(0)
        if url in pages:
            continue
        browser.open(url)
        assert browser.evaluate("document.title"), url
        pages[url] = set(browser.evaluate(IDS_JS))
        for href in browser.evaluate(LINKS_JS):
            target, fragment = urldefrag(href)
            if urlparse(target).netloc != urlparse(site).netloc:
                continue  # an external link (none is followed: this machine has no network)
            linked_from.setdefault(target, url)
            if target.endswith("/") or target.endswith(".html"):
                if fragment:
                    wanted.setdefault(target, set()).add(fragment)
                if target not in pages and target not in queue:
                    queue.append(target)
            elif target not in files_ok:  # an image, the JSON beside a plot, a stylesheet
                assert _status(target) == 200, f"{target} (linked from {linked_from[target]})"
                files_ok.add(target)
    assert browser.console_errors == []
    missing = {
        f"{page}#{fragment}": linked_from.get(page)
        for page, fragments in wanted.items()
        for fragment in fragments
        if fragment not in pages[page]
    }
    assert missing == {}
    # Every page MkDocs wrote is reachable from the front page by links a reader can click.
    built = {urljoin(site, p["location"]) for p in _search_index(site)["docs"] if "#" not in p["location"]}
    assert set(pages) == built


def _search_index(site: str) -> dict[str, object]:
    with urllib.request.urlopen(urljoin(site, "search/search_index.json"), timeout=10) as r:
        loaded: dict[str, object] = json.load(r)
        return loaded


def _table_codes(browser: Browser) -> list[str]:
    """The text of each table row's first cell's code element, as rendered."""
    return list(
        browser.evaluate(
            "Array.from(document.querySelectorAll('article table tbody tr td:first-child code'), c => c.textContent)"
        )
    )


def test_reference_pages_hold_what_the_code_declares(site: str, browser: Browser) -> None:
    browser.open(urljoin(site, "reference/settings/"))
    assert _table_codes(browser) == [s.key for s in SETTINGS]
    browser.open(urljoin(site, "reference/metrics/"))
    assert _table_codes(browser) == [name for name, *_ in catalogue()]
    browser.open(urljoin(site, "reference/records/"))
    schema = json.loads((REPO / "schemas" / "flow_record.avsc").read_text())
    assert _table_codes(browser) == [f["name"] for f in schema["fields"]]
    browser.open(urljoin(site, "reference/streams/"))
    fields = []
    for name in ("completeness_marker", "conntrack_health"):
        fields += [f["name"] for f in json.loads((REPO / "schemas" / f"{name}.avsc").read_text())["fields"]]
    assert _table_codes(browser) == fields


def _png_size_and_variety(path: Path) -> tuple[int, int, int]:
    """Width, height, and how many distinct 3-byte runs the first 200 rows' filtered pixel data holds: a blank
    page filters to (almost) all zeros, so a handful; a rendered page, thousands."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height, depth, colour = struct.unpack(">IIBB", data[16:26])
    assert depth == 8 and colour in (2, 6)
    idat = b""
    pos = 8
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        if kind == b"IDAT":
            idat += data[pos + 8 : pos + 8 + length]
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * (3 if colour == 2 else 4) + 1
    sample = {
        raw[i : i + 3] for row in range(0, min(height, 200)) for i in range(row * stride + 1, (row + 1) * stride, 3)
    }
    return width, height, len(sample)


def test_front_page_and_a_reference_page_screenshots(site: str, browser: Browser) -> None:
    browser.open(site)
    h1 = browser.evaluate("document.querySelector('article h1').textContent")
    assert h1.strip().startswith("flow-exporter")
    nav = browser.evaluate("Array.from(document.querySelectorAll('.md-nav__link'), a => a.textContent.trim())")
    for section in ("Getting started", "Concepts", "Operations", "Reference", "Performance"):
        assert section in nav
    front = browser.screenshot(SCREENSHOTS / "docs-front-page.png")
    browser.open(urljoin(site, "reference/settings/"))
    settings = browser.screenshot(SCREENSHOTS / "docs-reference-settings.png")
    for shot in (front, settings):
        width, height, variety = _png_size_and_variety(shot)
        assert (width, height) == (1280, 900)
        assert variety > 20, f"{shot.name}: a blank page ({variety} distinct runs)"
