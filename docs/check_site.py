"""Open every page of the built documentation site in headless Chromium.

    python docs/check_site.py [--skip-without-browser] [SITE_DIR]   # default: site/

Serves SITE_DIR on localhost (http.server in a thread) and loads each of its HTML
pages in Chromium through Playwright: $CHROMIUM, else the first of `chromium`,
`chromium-browser`, `google-chrome`, `google-chrome-stable` on the PATH (no browser
is downloaded or installed). A page fails if it logs a console error or throws, if an
image did not load (naturalWidth == 0), or if a mermaid diagram is still source text
(a `mermaid` block with no <svg> in it). Prints one line per page and exits non-zero
if any page fails. Without a browser it says how to get one and exits 2, or 0 with
`--skip-without-browser`. `make docs` runs it that way after building the site.
"""

from __future__ import annotations

import functools
import http.server
import os
import pathlib
import shutil
import sys
import threading


BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
NO_BROWSER = (
    "No Chromium or Chrome found ($CHROMIUM unset; none of {names} on the PATH): the "
    "pages were not opened in a browser. To check them, install one (Debian/Ubuntu: "
    "sudo apt-get install chromium) or set CHROMIUM=/path/to/chrome, and run "
    "`make docs` (or `python docs/check_site.py site`) again."
).format(names=", ".join(BROWSERS))


def find_browser() -> str | None:
    """The Chromium or Chrome to drive: $CHROMIUM, else the first of `BROWSERS` on
    the PATH; None when there is none."""
    given = os.environ.get("CHROMIUM")
    if given:
        return given
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


# Run inside each page once it has loaded (and its images have settled).
_PAGE_CHECK = """
async () => {
  const imgs = Array.from(document.images);
  await Promise.all(imgs.map(img => img.complete ? null :
    new Promise(r => {
      img.addEventListener('load', r);
      img.addEventListener('error', r);
    })));
  const broken = imgs.filter(img => img.naturalWidth === 0)
                     .map(img => img.getAttribute('src'));
  const mermaid = Array.from(document.querySelectorAll(
      '.mermaid, pre.mermaid, code.language-mermaid, div.language-mermaid'))
    .filter(el => !el.querySelector('svg'))
    .map(el => el.textContent.trim().split('\\n')[0].slice(0, 60));
  return {broken, mermaid, images: imgs.length};
}
"""


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


class _Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        # A page closed while a request was still being served (the search index):
        # the browser's side, not a problem of the site.
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


def check_site(site: pathlib.Path, browser_path: str) -> list[str]:
    from playwright.sync_api import sync_playwright

    pages = sorted(p.relative_to(site).as_posix() for p in site.rglob("*.html"))
    if not pages:
        return [f"no HTML pages under {site}"]
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = _Server(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    failures = []
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(
                executable_path=browser_path, args=["--no-sandbox"], headless=True
            )
            for rel in pages:
                page = browser.new_page()
                errors = []
                page.on(
                    "console",
                    lambda m, errors=errors: (
                        errors.append(f"console: {m.text}")
                        if m.type == "error"
                        else None
                    ),
                )
                page.on("pageerror", lambda e, errors=errors: errors.append(f"js: {e}"))
                page.on(
                    "requestfailed",
                    lambda r, errors=errors: errors.append(
                        f"request failed: {r.url} ({r.failure})"
                    ),
                )
                response = page.goto(base + rel, wait_until="load", timeout=30_000)
                if response is None or not response.ok:
                    errors.append(f"HTTP {response.status if response else 'none'}")
                result = page.evaluate(_PAGE_CHECK)
                errors += [f"broken image: {src}" for src in result["broken"]]
                errors += [f"mermaid not rendered: {t!r}" for t in result["mermaid"]]
                page.close()
                status = "FAIL" if errors else "ok"
                print(f"{status:4} {rel} ({result['images']} images)")
                for e in errors:
                    print(f"       {e}")
                    failures.append(f"{rel}: {e}")
            browser.close()
    finally:
        server.shutdown()
    return failures


def main(argv: list[str]) -> int:
    args = argv[1:]
    skip = "--skip-without-browser" in args
    args = [a for a in args if a != "--skip-without-browser"]
    site = pathlib.Path(args[0] if args else "site")
    if not site.is_dir():
        print(f"{site} is not a directory: build the site first (mkdocs build)")
        return 2
    browser_path = find_browser()
    if browser_path is None:
        print(("skipped: " if skip else "") + NO_BROWSER)
        return 0 if skip else 2
    failures = check_site(site, browser_path)
    n = len(list(site.rglob("*.html")))
    if failures:
        print(f"{len(failures)} problem(s) on {n} page(s) of {site}")
        return 1
    print(f"all {n} pages of {site} load in Chromium without errors")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
