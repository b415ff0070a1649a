"""kernel_lib.search.llm against a local OpenAI-compatible server: each kind of reply gives a source or a recorded
error (never an exception), and the diff appliers (``patch`` and the pure-Python fallback) agree."""

from __future__ import annotations

import shutil
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kernel_lib.search import llm
from kernel_lib.search.llm import DiffError, LLMClient, LLMUnavailable, apply_diff, build_prompt, parse_reply
from kernel_lib.search.spec import parse_spec
from kernel_lib.search.variant import Variant

openai = pytest.importorskip("openai")  # an optional dependency (kernel_lib[search]); the client tests need it

SOURCE = """import triton
import triton.language as tl


@triton.jit
def scale_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(y_ptr + offs, x * 2.0, mask=mask)
"""
CG_LOAD = '    x = tl.load(x_ptr + offs, mask=mask, cache_modifier=".cg")'

GOOD_DIFF = """--- a/kernel_module.py
+++ b/kernel_module.py
@@ -9,3 +9,3 @@
     mask = offs < n
-    x = tl.load(x_ptr + offs, mask=mask)
+    x = tl.load(x_ptr + offs, mask=mask, cache_modifier=".cg")
     tl.store(y_ptr + offs, x * 2.0, mask=mask)
"""
STALE_DIFF = GOOD_DIFF.replace("offs < n\n", "offs < N_ELEMENTS\n")  # a context line the source no longer has


def make_spec(kind: str = "triton"):
    launch = {"grid": "(cdiv(n, BLOCK),)", "num_warps": 4, "constexprs": {"BLOCK": 128}}
    if kind == "cuda":
        launch.update(block="(BLOCK,)", args=["x", "y", "n"])
    return parse_spec(
        {
            "name": "scale",
            "kind": kind,
            "source": SOURCE,
            "entry": "scale_kernel",
            "sizes": {"n": 1000},
            "inputs": [{"name": "x", "shape": ["n"]}],
            "outputs": [{"name": "y", "shape": ["n"]}],
            "launch": launch,
            "reference": {"function": "torch.mul", "args": ["x"]},
        }
    )


SPEC = make_spec()
VARIANT = Variant.baseline(SPEC)
MEASUREMENTS = [
    {"id": VARIANT.id, "move": None, "status": "ok", "ms": 0.0123},
    {"id": "0123456789ab", "move": "change_block_sizes", "status": "wrong", "ms": None},
]


# --------------------------------------------------------------------------------------------------
# A local OpenAI-compatible endpoint: the ``endpoint`` fixture of tests/search/conftest.py
# --------------------------------------------------------------------------------------------------
@pytest.fixture
def client(endpoint):
    endpoint.requests.clear()
    return LLMClient("test-model", base_url=endpoint.url, api_key="none", timeout=1.0)


def reply(move: str | None, block: str | None, lang: str = "diff") -> str:
    text = "Streaming loads skip L1.\n"
    if move:
        text = f"MOVE: {move}\n" + text
    if block is not None:
        text += f"```{lang}\n{block}```\n"
    return text


FULL_SOURCE = SOURCE.replace("    x = tl.load(x_ptr + offs, mask=mask)", CG_LOAD)
SCENARIOS = [
    # (id, status, reply text, delay s, the error's words or None, a line the new source has)
    ("good diff applies", 200, reply("cache_policy_cg", GOOD_DIFF), 0, None, CG_LOAD),
    ("stale diff does not apply", 200, reply("cache_policy_cg", STALE_DIFF), 0, "does not apply", None),
    ("reply without a diff", 200, reply("cache_policy_cg", None), 0, "no diff or source block", None),
    ("reply naming no canonical move", 200, reply(None, GOOD_DIFF), 0, "no canonical move", None),
    ("reply naming a made-up move", 200, reply("make_it_fast", GOOD_DIFF), 0, "'make_it_fast' is not one", None),
    ("full source fallback accepted", 200, reply("cache_policy_cg", FULL_SOURCE, "python"), 0, None, CG_LOAD),
    ("full source unchanged", 200, reply("cache_policy_cg", SOURCE, "python"), 0, "changes nothing", None),
    ("endpoint times out", 200, reply("cache_policy_cg", GOOD_DIFF), 3.0, "timeout after 1 s", None),
    ("endpoint answers HTTP 500", 500, "model crashed", 0, "HTTP 500: model crashed", None),
]


@pytest.mark.parametrize(
    "status, text, delay, error, new_line", [s[1:] for s in SCENARIOS], ids=[s[0] for s in SCENARIOS]
)
def test_propose(endpoint, client, status, text, delay, error, new_line):
    endpoint.reply = (status, text, delay)
    start = time.perf_counter()
    proposal = client.propose("cache_policy_cg", VARIANT, SPEC, MEASUREMENTS)
    assert time.perf_counter() - start < 2.5  # the client's timeout holds; no retries
    assert len(endpoint.requests) == 1  # one request, never retried
    sent = endpoint.requests[0]["body"]
    assert sent["model"] == "test-model" and "cache_policy_cg" in sent["messages"][1]["content"]
    if error is None:
        assert proposal.error is None and proposal.ok
        assert proposal.move == "cache_policy_cg"
        assert new_line in proposal.source.splitlines()
        assert proposal.source.replace(CG_LOAD, "    x = tl.load(x_ptr + offs, mask=mask)") == SOURCE
    else:
        assert not proposal.ok and proposal.source is None
        assert error in proposal.error
        assert "\n" not in proposal.error
    if delay == 0 and status == 200:
        assert proposal.reply == text


def test_a_reply_naming_another_canonical_move_is_recorded_under_it(endpoint, client):
    endpoint.reply = (200, reply("vectorize_global_loads", GOOD_DIFF), 0)
    proposal = client.propose("cache_policy_cg", VARIANT, SPEC, [])
    assert proposal.ok and proposal.move == "vectorize_global_loads"


def test_a_diff_that_changes_nothing_is_an_error(endpoint, client):
    same = GOOD_DIFF.replace('cache_modifier=".cg")', "mask=mask)").replace("mask=mask, mask=mask)", "mask=mask)")
    assert "+    x = tl.load(x_ptr + offs, mask=mask)" in same  # removes a line and adds it back
    endpoint.reply = (200, reply("cache_policy_cg", same), 0)
    proposal = client.propose("cache_policy_cg", VARIANT, SPEC, [])
    assert proposal.source is None and proposal.error == "diff changes nothing"


def test_an_unreachable_endpoint_is_an_error_not_an_exception():
    with ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler) as closed:
        port = closed.server_address[1]  # bound, then closed: nothing listens there
    client = LLMClient("test-model", base_url=f"http://127.0.0.1:{port}/v1", timeout=1.0)
    proposal = client.propose("cache_policy_cg", VARIANT, SPEC, [])
    assert proposal.source is None and proposal.error.startswith("endpoint error:")


# --------------------------------------------------------------------------------------------------
# Parsing replies and building prompts
# --------------------------------------------------------------------------------------------------
def test_parse_reply_takes_the_move_line_and_the_first_diff():
    text = "**MOVE:** `softmax_math_fusion`\n```python\nx = 1\n```\n```diff\n" + GOOD_DIFF + "```\n```diff\nother\n```"
    move, diff, full = parse_reply(text)
    assert move == "softmax_math_fusion"
    assert diff == GOOD_DIFF and full is None


def test_parse_reply_accepts_a_bare_canonical_line_and_a_source_block():
    move, diff, full = parse_reply("I applied:\ncache_policy_cg\n\n```cuda\n__global__ void k() {}\n```\n")
    assert move == "cache_policy_cg" and diff is None and full == "__global__ void k() {}\n"


def test_parse_reply_ignores_move_names_inside_code():
    move, _, _ = parse_reply("```python\n# MOVE: cache_policy_cg\ncache_policy_cg\n```\n")
    assert move is None


def test_build_prompt_names_the_move_and_the_rules():
    messages = build_prompt("softmax_math_fusion", VARIANT, SPEC, MEASUREMENTS)
    assert [m["role"] for m in messages] == ["system", "user"]
    system, user = messages[0]["content"], messages[1]["content"]
    assert "MOVE: <name>" in system and "```diff" in system and "kernel_module.py" in system
    assert all(name in system for name in llm.CANONICAL_MOVES)
    assert "scale_kernel" in system
    assert "`softmax_math_fusion`" in user and llm.CANONICAL_MOVES["softmax_math_fusion"] in user
    assert SOURCE.strip() in user
    assert '"BLOCK": 128' in user  # the launch config as JSON
    assert VARIANT.id in user and "0.0123" in user and "change_block_sizes" in user  # the measurements table


def test_build_prompt_for_cuda_names_kernel_cu():
    spec = make_spec("cuda")
    system, user = (m["content"] for m in build_prompt("change_block_sizes", Variant.baseline(spec), spec, []))
    assert "kernel.cu" in system and "```cuda" in user and "(none yet)" in user


# --------------------------------------------------------------------------------------------------
# apply_diff with patch and with the pure-Python fallback
# --------------------------------------------------------------------------------------------------
@pytest.fixture(params=["patch", "python"])
def applier(request, monkeypatch):
    if request.param == "patch" and shutil.which("patch") is None:
        pytest.skip("no patch program")
    if request.param == "python":
        monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    return request.param


def _headers(diff: str, old: str, new: str) -> str:
    return diff.replace("--- a/kernel_module.py", f"--- {old}").replace("+++ b/kernel_module.py", f"+++ {new}")


DIFF_FORMS = {
    "a/ b/ prefixes": GOOD_DIFF,
    "bare filenames": _headers(GOOD_DIFF, "kernel_module.py", "kernel_module.py"),
    "other filename": _headers(GOOD_DIFF, "a/scale.py", "b/scale.py"),
    "no file headers": GOOD_DIFF.split("\n", 2)[2],
    "wrong line numbers": GOOD_DIFF.replace("@@ -9,3 +9,3 @@", "@@ -2,3 +2,3 @@"),
    "wrong counts": GOOD_DIFF.replace("@@ -9,3 +9,3 @@", "@@ -9,7 +9,9 @@"),
    "trailing prose": GOOD_DIFF + "\nThis streams x.\n",
}


@pytest.mark.parametrize("diff", DIFF_FORMS.values(), ids=DIFF_FORMS.keys())
def test_apply_diff_forms(applier, diff):
    new = apply_diff(SOURCE, diff, "kernel_module.py")
    assert new.splitlines()[9] == CG_LOAD
    assert new == FULL_SOURCE


def test_apply_diff_several_hunks_insert_and_delete(applier):
    diff = """--- a/kernel_module.py
+++ b/kernel_module.py
@@ -1,2 +1,3 @@
 import triton
+import math
 import triton.language as tl
@@ -7,4 +8,3 @@
     pid = tl.program_id(0)
     offs = pid * BLOCK + tl.arange(0, BLOCK)
-    mask = offs < n
-    x = tl.load(x_ptr + offs, mask=mask)
+    x = tl.load(x_ptr + offs, mask=offs < n)
"""
    lines = apply_diff(SOURCE, diff, "kernel_module.py").splitlines()
    assert lines[:3] == ["import triton", "import math", "import triton.language as tl"]
    assert lines[9] == "    x = tl.load(x_ptr + offs, mask=offs < n)"
    assert "    mask = offs < n" not in lines and len(lines) == len(SOURCE.splitlines())


def test_apply_diff_refuses_a_stale_context(applier):
    with pytest.raises(DiffError, match="FAILED"):
        apply_diff(SOURCE, STALE_DIFF, "kernel_module.py")


def test_apply_diff_refuses_a_diff_already_applied(applier):
    with pytest.raises(DiffError):
        apply_diff(FULL_SOURCE, GOOD_DIFF, "kernel_module.py")


def test_apply_diff_without_hunks():
    with pytest.raises(DiffError, match="no hunks"):
        apply_diff(SOURCE, "just some words\n", "kernel_module.py")


# --------------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------------
def test_client_from_settings(monkeypatch):
    monkeypatch.delenv("KERNEL_SEARCH_LLM_MODEL", raising=False)
    assert llm.client_from_settings(None, no_llm=False) is None
    assert llm.client_from_settings("some-model", no_llm=True) is None
    monkeypatch.setenv("KERNEL_SEARCH_LLM_MODEL", "env-model")
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    client = llm.client_from_settings(None, no_llm=False)
    assert client is not None and client.model == "env-model" and client.base_url == "http://127.0.0.1:9/v1"


def test_missing_openai_is_one_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "openai", None)  # makes `import openai` raise ImportError
    with pytest.raises(LLMUnavailable, match=r"pip install 'kernel_lib\[search\]'"):
        LLMClient("some-model")


def test_apply_diff_insertion_with_context_on_one_side_only(applier):
    diff = "@@ -3,1 +3,2 @@\n     pid = tl.program_id(0)\n+    tl.static_assert(BLOCK >= 16)\n"
    lines = apply_diff(SOURCE, diff, "kernel_module.py").splitlines()
    assert lines[6:8] == ["    pid = tl.program_id(0)", "    tl.static_assert(BLOCK >= 16)"]
    assert len(lines) == len(SOURCE.splitlines()) + 1
