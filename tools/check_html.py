"""Open every page of the built book in headless Chromium, offline, and fail on what a reader would see broken.

    python tools/check_html.py [--html _build/html] [--screens _build/screens] [--page notebooks/00_measure_your_gpu]

`make check-html` runs this on a fresh build (and `make test` runs it after the strict build). The book is served
from --html on 127.0.0.1; Chromium (Debian's ``chromium`` package, or any Chrome found on PATH, or $CHROMIUM) runs
headless with every host other than 127.0.0.1/localhost unreachable, so a page renders exactly as it would offline.
Chromium is driven through the DevTools protocol over ``--remote-debugging-pipe`` (standard library only, no
websocket package). Each page is loaded, MathJax and the ipywidgets manager are given time to finish, a full-page
screenshot is saved as <screens>/<page>.png, and the page fails on:

  network   any request to a host other than 127.0.0.1/localhost (the book must be offline-complete), or a local
            file that failed to load (404, ...)
  console   a console error or uncaught exception
  math      raw TeX left in the text after MathJax ran ($$, \\(, \\frac ... outside code), a math element MathJax did
            not typeset, or a TeX error MathJax rendered
  widget    a stored widget output (application/vnd.jupyter.widget-view+json) with no rendered view, or rendered blank
            (hidden or zero-size, e.g. a closed tqdm bar stored with visibility: hidden)
  image     an image that did not load (naturalWidth 0)
  output    a stored error output (a traceback) or a stderr output that holds a Traceback

It also measures what a reader at this window width sees, reported per page and in sum but not failed on (yet):
code blocks and tables wider than their column, images displayed under 70% of their natural width, the page's
height. It prints a table of pages with their counts and every problem, and exits 1 if there is any problem, 2 if
it could not run (no Chromium, no built book).
"""

from __future__ import annotations

import argparse
import base64
import functools
import http.server
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse

LOCAL_HOSTS = {"127.0.0.1", "localhost", "[::1]", "::1"}
CHROMIUM_NAMES = ["chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome"]
SCREEN_MAX_HEIGHT = 16000  # px; a longer page is captured down to here (Chromium's texture limit is about 16k)

# Runs in the page after its load event: waits for MathJax's first typeset, the widget manager's views, the
# images and fonts, up to %(timeout)d ms in all. Resolves to the milliseconds it waited.
SETTLE_JS = r"""
(async () => {
  const sleep = ms => new Promise(r => setTimeout(r, ms));
  const deadline = performance.now() + %(timeout)d;
  const left = () => Math.max(0, deadline - performance.now());
  const t0 = performance.now();
  if (document.querySelector('.math, script[src*="mathjax" i]')) {
    while (!(window.MathJax && MathJax.startup && MathJax.startup.promise) && left() > 0) await sleep(50);
    if (window.MathJax && MathJax.startup && MathJax.startup.promise)
      await Promise.race([MathJax.startup.promise.catch(() => 0), sleep(left())]);
  }
  const views = [...document.querySelectorAll('script[type="application/vnd.jupyter.widget-view+json"]')];
  const rendered = v => v.previousElementSibling && v.previousElementSibling.classList.contains('widget-subarea')
                        && v.previousElementSibling.querySelector('.jupyter-widgets');
  while (views.length && !views.every(rendered) && left() > 0) await sleep(100);
  for (const img of document.images) { if (img.loading === 'lazy') img.loading = 'eager'; }
  await Promise.race([
    Promise.all([...document.images].map(i => i.complete ? 0 : new Promise(r => { i.addEventListener('load', r);
                                                                                  i.addEventListener('error', r); }))),
    sleep(left())]);
  await Promise.race([document.fonts.ready, sleep(left())]);
  return Math.round(performance.now() - t0);
})()
"""

# Runs in the settled page: what a reader would see broken. Returns {"problems": [[kind, text], ...], "stats": {}}.
INSPECT_JS = r"""
(() => {
  const problems = [];
  const add = (kind, text) => problems.push([kind, text.replace(/\s+/g, ' ').trim().slice(0, 160)]);
  const root = document.querySelector('main article, article.bd-article, main, [role=main]') || document.body;

  // Raw TeX in the reader's text: outside code, scripts and what MathJax produced.
  const SKIP = 'pre, code, script, style, textarea, kbd, samp, mjx-container, mjx-assistive-mml, .MathJax, ' +
               '.highlight, .output, .cell_input, .jp-RenderedHTMLCommon pre';
  const TEX = new RegExp(String.raw`\$\$|\\[()\[\]]|\$[^$\s][^$]*[\\^_{][^$]*\$|\\(?:` +
    'frac|dfrac|tfrac|sum|prod|int|sqrt|mathrm|mathbf|mathcal|mathbb|text|textrm|operatorname|cdot|cdots|ldots|' +
    'times|leq?|geq?|approx|neq|begin|end|left|right|alpha|beta|gamma|delta|epsilon|lambda|mu|sigma|theta|infty|' +
    'partial|nabla|quad|qquad|log|exp|max|min)(?![A-Za-z])');
  const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT, {
    acceptNode: n => (n.parentElement && n.parentElement.closest(SKIP)) ? NodeFilter.FILTER_REJECT
                                                                        : NodeFilter.FILTER_ACCEPT});
  let texLeft = 0;
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    const m = n.textContent.match(TEX);
    if (m) {
      texLeft++;
      if (texLeft <= 5) {
        const i = Math.max(0, m.index - 30);
        add('math', 'raw TeX in text: "' + n.textContent.slice(i, m.index + 50) + '"');
      }
    }
  }
  if (texLeft > 5) add('math', (texLeft - 5) + ' more text nodes with raw TeX');
  const maths = [...root.querySelectorAll('.math')];
  const untypeset = maths.filter(e => !e.querySelector('mjx-container') && !e.closest('mjx-container'));
  if (untypeset.length)
    add('math', untypeset.length + ' of ' + maths.length + ' math elements not typeset by MathJax, first: ' +
                untypeset[0].textContent);
  for (const e of root.querySelectorAll('mjx-merror'))
    add('math', 'TeX error: ' + (e.getAttribute('data-mjx-error') || e.textContent));

  // Widgets: the manager inserts div.widget-subarea before each view script and renders the view into it.
  const views = [...document.querySelectorAll('script[type="application/vnd.jupyter.widget-view+json"]')];
  let widgetsOk = 0;
  for (const v of views) {
    let id = '?';
    try { id = JSON.parse(v.textContent).model_id; } catch (e) {}
    const area = v.previousElementSibling;
    const view = area && area.classList.contains('widget-subarea') ? area.querySelector('.jupyter-widgets') : null;
    if (!view) { add('widget', 'widget output ' + id + ' has no rendered view (blank area)'); continue; }
    const err = area.querySelector('.widget-error, .jupyter-widgets-error-widget');
    const box = area.getBoundingClientRect();
    const hidden = [...area.querySelectorAll('*')].every(e => getComputedStyle(e).visibility === 'hidden' ||
                                                            e.getBoundingClientRect().height === 0);
    if (err) add('widget', 'widget ' + id + ' rendered an error: ' + err.textContent);
    else if (box.height < 2 || hidden)
      add('widget', 'widget ' + id + ' rendered blank (' + (box.height < 2 ? 'zero height' : 'visibility: hidden') +
                    '): ' + (area.textContent || '').slice(0, 60));
    else widgetsOk++;
  }
  // Widget areas the theme shows that belong to no view script (a widget output whose state was not stored).
  for (const w of root.querySelectorAll('.jupyter-widgets')) {
    if (w.closest('.widget-subarea')) continue;
    if (!w.querySelector('*') && !w.textContent.trim()) add('widget', 'empty .jupyter-widgets element');
  }

  // Images.
  const images = [...document.images];
  for (const img of images)
    if (!img.naturalWidth) add('image', 'image did not load: ' + (img.currentSrc || img.src || img.alt));

  // Stored error outputs.
  for (const e of root.querySelectorAll('.output.error, .output.traceback, .cell_output .traceback'))
    add('output', 'stored error output: ' + e.textContent.trim().split('\n').slice(-1)[0]);
  for (const e of root.querySelectorAll('.output.stderr'))
    if (e.textContent.includes('Traceback')) add('output', 'stderr output with a Traceback: ' +
                                                            e.textContent.trim().split('\n').slice(-1)[0]);

  // Reading at this width (reported, not failed on): code blocks and tables wider than their column (a reader
  // scrolls sideways or loses the right edge), images shown under 70% of their natural width (their text shrinks).
  const wide = [...root.querySelectorAll('pre, table')].filter(e => e.tagName === 'PRE'
      ? e.scrollWidth > e.clientWidth + 1
      : e.scrollWidth > ((e.parentElement && e.parentElement.clientWidth) || e.scrollWidth) + 1).length;
  const shrunk = images.filter(img => img.naturalWidth &&
                               img.getBoundingClientRect().width < 0.7 * img.naturalWidth).length;
  return {problems, stats: {math: maths.length, widgets: views.length, widgets_ok: widgetsOk,
                            images: images.length, height: document.documentElement.scrollHeight, wide, shrunk}};
})()
"""


class CDPError(RuntimeError):
    pass


class Chromium:
    """Headless Chromium driven over --remote-debugging-pipe: JSON messages ending in NUL on fds 3 (in) and 4 (out)."""

    def __init__(self, executable: str, profile: str, width: int, height: int):
        to_r, self._to_w = os.pipe()
        self._from_r, from_w = os.pipe()

        def child_fds():  # runs in the child between fork and exec: our pipe ends become its fds 3 and 4
            a, b = os.dup(to_r), os.dup(from_w)
            os.dup2(a, 3)
            os.dup2(b, 4)
            os.set_inheritable(3, True)
            os.set_inheritable(4, True)

        args = [
            executable,
            "--headless=new",
            "--remote-debugging-pipe",
            f"--user-data-dir={profile}",
            f"--window-size={width},{height}",
            "--hide-scrollbars",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--disable-extensions",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-default-apps",
            "--disable-features=Translate,MediaRouter,OptimizationHints",
            "--mute-audio",
            "--metrics-recording-only",
            # Offline: every host but the loopback goes to a proxy that is not there and resolves to nothing.
            # Requests still show up in the Network events, which is how they are found and reported.
            "--proxy-server=http://127.0.0.1:9",
            "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE localhost, EXCLUDE 127.0.0.1",
            "about:blank",
        ]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            args.insert(1, "--no-sandbox")  # Chromium refuses to run as root with its sandbox
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=child_fds,
            close_fds=False,
        )
        os.close(to_r)
        os.close(from_w)
        self._next_id = 0
        self._lock = threading.Lock()
        self._waiting: dict[int, queue.Queue] = {}
        self.events: queue.Queue = queue.Queue()
        self._stderr: list[bytes] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._drain_stderr, daemon=True).start()

    def _drain_stderr(self):
        for line in self.proc.stderr:
            self._stderr = (self._stderr + [line])[-30:]

    def _read(self):
        buffer = b""
        while True:
            try:
                chunk = os.read(self._from_r, 1 << 20)
            except OSError:
                chunk = b""
            if not chunk:
                for waiter in list(self._waiting.values()):
                    waiter.put({"error": {"message": "Chromium closed the DevTools pipe"}})
                self.events.put(None)
                return
            buffer += chunk
            *messages, buffer = buffer.split(b"\0")
            for raw in messages:
                message = json.loads(raw)
                if "id" in message:
                    waiter = self._waiting.pop(message["id"], None)
                    if waiter:
                        waiter.put(message)
                else:
                    self.events.put(message)

    def send(self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 30):
        with self._lock:
            self._next_id += 1
            mid = self._next_id
            waiter: queue.Queue = queue.Queue()
            self._waiting[mid] = waiter
            message = {"id": mid, "method": method, "params": params or {}}
            if session:
                message["sessionId"] = session
            os.write(self._to_w, json.dumps(message).encode() + b"\0")
        try:
            reply = waiter.get(timeout=timeout)
        except queue.Empty:
            self._waiting.pop(mid, None)
            raise CDPError(f"{method}: no reply in {timeout:.0f} s") from None
        if "error" in reply:
            raise CDPError(f"{method}: {reply['error'].get('message')}")
        return reply.get("result", {})

    def stderr_tail(self) -> str:
        return b"".join(self._stderr).decode(errors="replace")

    def close(self):
        try:
            self.send("Browser.close", timeout=5)
        except Exception:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._to_w, self._from_r):
            try:
                os.close(fd)
            except OSError:
                pass


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass


def find_chromium(explicit: str | None) -> str | None:
    for candidate in [explicit, os.environ.get("CHROMIUM")]:
        if candidate:
            return shutil.which(candidate) or (candidate if os.path.exists(candidate) else None)
    if os.path.exists("/usr/lib/chromium/chromium"):  # Debian's binary, without the launcher script
        return "/usr/lib/chromium/chromium"
    for name in CHROMIUM_NAMES:
        if shutil.which(name):
            return shutil.which(name)
    return None


def find_pages(html: str) -> list[str]:
    """Every HTML page of the book, relative to html, without redirect stubs (index.html -> the root page)."""
    pages = []
    for folder, dirs, files in os.walk(html):
        dirs[:] = sorted(d for d in dirs if not d.startswith("_"))  # _static, _sources, _images
        for name in sorted(files):
            if not name.endswith(".html"):
                continue
            path = os.path.join(folder, name)
            if os.path.getsize(path) < 4000:
                with open(path, errors="replace") as handle:
                    if 'http-equiv="refresh"' in handle.read().lower():
                        continue
            pages.append(os.path.relpath(path, html).replace(os.sep, "/"))
    return pages


def is_local(url: str) -> bool:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme in ("data", "blob", "about", "chrome", "devtools", "chrome-extension"):
        return True
    return (parts.hostname or "") in LOCAL_HOSTS


def check_page(browser: Chromium, session: str, base: str, page: str, screens: str | None, timeout: float) -> dict:
    """Load one page, let it settle, inspect it; returns {"page", "problems": [(kind, text)], "stats", "seconds"}."""
    start = time.perf_counter()
    while True:  # drop what earlier pages left behind
        try:
            browser.events.get_nowait()
        except queue.Empty:
            break
    url = f"{base}/{page}"
    problems: list[tuple[str, str]] = []
    requests: dict[str, str] = {}
    inflight: set[str] = set()
    nonlocal_hosts: dict[str, int] = {}
    loaded = False

    def handle(event):
        nonlocal loaded
        if event is None:
            raise CDPError("Chromium exited")
        if event.get("sessionId") != session:
            return
        method, params = event["method"], event.get("params", {})
        if method == "Page.loadEventFired":
            loaded = True
        elif method == "Network.requestWillBeSent":
            req_url = params["request"]["url"]
            requests[params["requestId"]] = req_url
            inflight.add(params["requestId"])
            if not is_local(req_url):
                key = req_url if len(req_url) < 120 else req_url[:117] + "..."
                nonlocal_hosts[key] = nonlocal_hosts.get(key, 0) + 1
        elif method == "Network.loadingFinished":
            inflight.discard(params["requestId"])
        elif method == "Network.loadingFailed":
            inflight.discard(params["requestId"])
            req_url = requests.get(params["requestId"], "?")
            if is_local(req_url) and not params.get("canceled"):
                problems.append(("network", f"failed to load {short(req_url, base)}: {params.get('errorText')}"))
        elif method == "Network.responseReceived":
            status = params["response"].get("status", 0)
            if status >= 400 and is_local(params["response"]["url"]):
                if not params["response"]["url"].endswith("/favicon.ico"):
                    problems.append(("network", f"HTTP {status} for {short(params['response']['url'], base)}"))
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
            problems.append(("console", f"console.{params['type']}: {text}"))
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            text = details.get("exception", {}).get("description") or details.get("text", "")
            where = short(details.get("url", ""), base)
            problems.append(("console", f"uncaught exception{' in ' + where if where else ''}: {text.splitlines()[0]}"))
        elif method == "Log.entryAdded":
            entry = params.get("entry", {})
            if entry.get("level") == "error" and entry.get("source") != "network":  # network: reported above
                problems.append(("console", f"{entry.get('source')}: {entry.get('text')}"))

    def pump(until, limit):
        end = time.monotonic() + limit
        while not until() and time.monotonic() < end:
            try:
                handle(browser.events.get(timeout=min(0.1, max(0.01, end - time.monotonic()))))
            except queue.Empty:
                pass

    browser.send("Page.navigate", {"url": url}, session)
    pump(lambda: loaded, timeout)
    if not loaded:
        problems.append(("network", f"the page did not finish loading in {timeout:.0f} s"))
    settle = browser.send(
        "Runtime.evaluate",
        {"expression": SETTLE_JS % {"timeout": int(timeout * 1000)}, "awaitPromise": True, "returnByValue": True},
        session,
        timeout=timeout + 10,
    )
    quiet_since = [time.monotonic()]

    def idle():  # no request in flight for 300 ms
        if inflight:
            quiet_since[0] = time.monotonic()
        return not inflight and time.monotonic() - quiet_since[0] > 0.3

    pump(idle, 5)
    found = browser.send("Runtime.evaluate", {"expression": INSPECT_JS, "returnByValue": True}, session)
    if "exceptionDetails" in found:
        raise CDPError(f"inspecting {page}: {found['exceptionDetails'].get('text')}")
    result = found["result"]["value"]
    pump(lambda: False, 0.05)  # events the inspection itself caused
    problems += [tuple(p) for p in result["problems"]]
    for req_url, count in nonlocal_hosts.items():
        problems.append(("network", f"request to a non-local host: {req_url}" + (f" (x{count})" if count > 1 else "")))
    if screens:
        path = os.path.join(screens, os.path.splitext(page)[0] + ".png")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        metrics = browser.send("Page.getLayoutMetrics", {}, session)
        size = metrics.get("cssContentSize") or metrics["contentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": min(size["height"], SCREEN_MAX_HEIGHT), "scale": 1}
        shot = browser.send(
            "Page.captureScreenshot",
            {"format": "png", "captureBeyondViewport": True, "clip": clip},
            session,
            timeout=60,
        )
        with open(path, "wb") as handle:
            handle.write(base64.b64decode(shot["data"]))
    stats = dict(result["stats"], requests=len(requests), settle_ms=settle.get("result", {}).get("value"))
    return {"page": page, "problems": problems, "stats": stats, "seconds": time.perf_counter() - start}


def short(url: str, base: str) -> str:
    return url[len(base) + 1 :] if url.startswith(base + "/") else url


TALL = 20_000  # px: a page longer than this is reported (reading measures are reported, not failed on)


def print_report(results: list[dict], seconds: float, window: int = 1280) -> int:
    kinds = ["network", "console", "math", "widget", "image", "output"]
    width = max([len(r["page"]) for r in results] + [4])
    header = (
        f"{'page':<{width}}  {'math':>5} {'widgets':>8} {'images':>6} {'reqs':>5} {'s':>5}  "
        + " ".join(f"{k:>7}" for k in kinds)
        + f"  {'wide':>5} {'shrunk':>6} {'height':>7}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        s = r["stats"]
        counts = {k: sum(1 for kind, _ in r["problems"] if kind == k) for k in kinds}
        widgets = f"{s.get('widgets_ok', 0)}/{s.get('widgets', 0)}"
        print(
            f"{r['page']:<{width}}  {s.get('math', 0):>5} {widgets:>8} {s.get('images', 0):>6} "
            f"{s.get('requests', 0):>5} {r['seconds']:>5.1f}  "
            + " ".join(f"{counts[k] or '.':>7}" for k in kinds)
            + f"  {s.get('wide', 0) or '.':>5} {s.get('shrunk', 0) or '.':>6} {s.get('height', 0):>7,}"
        )
    bad = [r for r in results if r["problems"]]
    total = sum(len(r["problems"]) for r in results)
    if bad:
        print()
        for r in bad:
            print(f"{r['page']}:")
            for kind, text in r["problems"]:
                print(f"  [{kind}] {text}")
    print()
    wide = sum(r["stats"].get("wide", 0) for r in results)
    shrunk = sum(r["stats"].get("shrunk", 0) for r in results)
    tall = sum(1 for r in results if r["stats"].get("height", 0) > TALL)
    print(
        f"reading at {window} px (reported, not failed on): {wide} code blocks or tables wider than their column, "
        f"{shrunk} images shown under 70% of their width, {tall} pages taller than {TALL:,} px"
    )
    print(
        f"check_html: {len(results) - len(bad)}/{len(results)} pages without problems, {total} problems "
        f"({seconds:.0f} s)"
    )
    return 1 if bad else 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=__doc__.split("\n", 2)[2],
        formatter_class=argparse.RawTextHelpFormatter,
    )
    parser.add_argument("--html", default=os.path.join("_build", "html"), help="the built book (default _build/html)")
    parser.add_argument(
        "--screens", default=os.path.join("_build", "screens"), help="where page screenshots go ('' for none)"
    )
    parser.add_argument(
        "--page", action="append", help="check only this page (path under --html, .html optional); repeatable"
    )
    parser.add_argument("--chromium", help="the Chromium/Chrome executable (default: $CHROMIUM, then PATH)")
    parser.add_argument("--timeout", type=float, default=30, help="seconds a page may take to load and settle")
    parser.add_argument("--width", type=int, default=1280, help="window width in CSS pixels (default 1280)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    args = parser.parse_args()

    if not os.path.exists(os.path.join(args.html, "index.html")):
        print(f"check_html: no built book at {args.html} (run make book)", file=sys.stderr)
        return 2
    executable = find_chromium(args.chromium)
    if not executable:
        print("check_html: no Chromium found (apt-get install chromium, or pass --chromium)", file=sys.stderr)
        return 2
    pages = find_pages(args.html)
    if args.page:
        wanted = {p if p.endswith(".html") else p + ".html" for p in args.page}
        missing = wanted - set(pages)
        if missing:
            print(f"check_html: no such page: {', '.join(sorted(missing))}", file=sys.stderr)
            return 2
        pages = [p for p in pages if p in wanted]
    if args.screens:
        if not args.page:
            shutil.rmtree(args.screens, ignore_errors=True)
        os.makedirs(args.screens, exist_ok=True)

    start = time.perf_counter()
    handler = functools.partial(QuietHandler, directory=os.path.abspath(args.html))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    profile = tempfile.mkdtemp(prefix="check_html_")
    browser = Chromium(executable, profile, args.width, 900)
    results = []
    try:
        try:
            version = browser.send("Browser.getVersion", timeout=60)
        except CDPError as error:
            print(f"check_html: {executable} did not start: {error}\n{browser.stderr_tail()}", file=sys.stderr)
            return 2
        print(f"check_html: {len(pages)} pages of {args.html} served at {base}, {version.get('product')} offline")
        target = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = browser.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Network", "Log"):
            browser.send(f"{domain}.enable", {}, session)
        for page in pages:
            try:
                results.append(check_page(browser, session, base, page, args.screens or None, args.timeout))
            except CDPError as error:
                results.append(
                    {"page": page, "problems": [("console", f"check failed: {error}")], "stats": {}, "seconds": 0.0}
                )
                if browser.proc.poll() is not None:
                    print(f"check_html: Chromium exited\n{browser.stderr_tail()}", file=sys.stderr)
                    break
    finally:
        browser.close()
        server.shutdown()
        shutil.rmtree(profile, ignore_errors=True)
    seconds = time.perf_counter() - start
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    status = print_report(results, seconds, args.width)
    if args.screens:
        print(f"check_html: screenshots in {args.screens}/")
    return status


if __name__ == "__main__":
    sys.exit(main())
