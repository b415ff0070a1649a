"""tools/check_html.py finds what a reader would see broken (needs Chromium; skipped without one)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import check_html  # noqa: E402

BROKEN = """<!DOCTYPE html><html><head><title>broken</title>
<script src="https://cdn.example.invalid/lib.js"></script></head>
<body><main><article>
<p>Raw TeX a reader would see: $$\\frac{a}{b}$$</p>
<p><img src="missing.png" alt="missing"></p>
<div class="cell_output"><script type="application/vnd.jupyter.widget-view+json">{"model_id": "abc"}</script></div>
<div class="output traceback"><pre>ZeroDivisionError: division by zero</pre></div>
<script>console.error("boom")</script>
<pre>{wide_code}</pre>
</article></main></body></html>""".replace("{wide_code}", "a line of code wider than any reading column " * 12)
CLEAN = "<!DOCTYPE html><html><body><main><article><p>" + "Plain text. " * 200 + "</p></article></main></body></html>"


@pytest.mark.skipif(check_html.find_chromium(None) is None, reason="no Chromium (make check-html installs it)")
def test_check_html_reports_each_kind_of_problem(tmp_path):
    html = tmp_path / "html"
    html.mkdir()
    (html / "index.html").write_text(CLEAN)
    (html / "broken.html").write_text(BROKEN)
    run = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "tools", "check_html.py"),
            "--html",
            str(html),
            "--screens",
            str(tmp_path / "screens"),
            "--timeout",
            "10",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    report = run.stdout
    assert "request to a non-local host: https://cdn.example.invalid/lib.js" in report
    assert "[math] raw TeX in text" in report
    assert "[image] image did not load" in report
    assert "[widget] widget output abc has no rendered view" in report
    assert "[output] stored error output" in report
    assert "console.error: boom" in report
    assert "1/2 pages without problems" in report
    assert "reading at 1280 px (reported, not failed on): 1 code blocks or tables wider than their column" in report
    assert (tmp_path / "screens" / "broken.png").stat().st_size > 0
