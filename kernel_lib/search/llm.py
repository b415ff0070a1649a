"""Language-model moves: ask an OpenAI-compatible endpoint for one canonical move, as a diff of the source.

The contract, one request per expansion and never retried in a loop:

* The prompt (``build_prompt``) names one canonical move (``moves.CANONICAL_MOVES``) with its description, and gives
  the variant's source as a file (``kernel_module.py`` for Triton, ``kernel.cu`` for CUDA), its launch configuration
  as JSON and the latest measurements.
* The reply must name exactly one canonical move on a line ``MOVE: <name>`` (a line holding only a canonical name is
  accepted too) and hold a unified diff against that file in a fenced ```diff block. A full source in a fenced
  ```python / ```cuda block is the fallback, used only when the reply holds no diff.
* The diff is applied with the ``patch`` program, or by a pure-Python applier where ``patch`` is absent
  (``apply_diff``); both need the context to match exactly, and both let a hunk float to where its context is.
* ``LLMClient.propose`` returns a ``Proposal``; a timeout, an endpoint error, a reply naming no canonical move, a
  diff that does not apply or changes nothing is recorded in ``Proposal.error``, never raised. A reply naming
  another canonical move than the one asked for is accepted, under the move it names.
* Whether the new source compiles and is right is not checked here: the evaluator does that, like for any variant.

The ``openai`` package is optional (``pip install 'kernel_lib[search]'``): it is imported when a client is built.
The endpoint is ``OPENAI_BASE_URL`` (default: OpenAI's), the key ``OPENAI_API_KEY`` (default ``"none"``, for local
servers without keys) and the model ``KERNEL_SEARCH_LLM_MODEL`` unless given.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Any

from .moves import CANONICAL_MOVES
from .spec import KernelSpec
from .variant import Variant

SOURCE_FILES = {"triton": "kernel_module.py", "cuda": "kernel.cu"}  # the file name the diff is written against
FENCE_LANGS = {"triton": "python", "cuda": "cuda"}
DIFF_TAGS = ("diff", "patch", "udiff")
SOURCE_TAGS = ("python", "py", "cuda", "cu", "cpp", "c++", "cxx", "c")
MAX_MEASUREMENTS = 12  # rows of the measurements table in the prompt: the latest ones


class LLMUnavailable(RuntimeError):
    """No language model can be used (the ``openai`` package is missing)."""


class DiffError(ValueError):
    """A diff that does not apply; the message says why in one line."""


@dataclass
class Proposal:
    """What one request gave: a new source for ``move``, or the reason it failed in ``error``."""

    move: str | None  # the canonical move the reply names (may differ from the one asked for)
    source: str | None  # the new full source, when one was obtained
    diff: str | None  # the reply's diff block, as written
    reply: str  # the raw reply text ("" when none came)
    error: str | None = None
    unanswered: bool = False  # the endpoint itself failed (no reply: unreachable, HTTP error, timeout)

    @property
    def ok(self) -> bool:
        return self.error is None and self.source is not None


# --------------------------------------------------------------------------------------------------
# The prompt
# --------------------------------------------------------------------------------------------------
def source_filename(spec: KernelSpec) -> str:
    return SOURCE_FILES[spec.kind]


def _system_message(spec: KernelSpec) -> str:
    filename, lang = source_filename(spec), FENCE_LANGS[spec.kind]
    moves = "\n".join(f"- {name}: {text}" for name, text in CANONICAL_MOVES.items())
    if spec.kind == "cuda":
        binding = "the kernel's parameters are passed in the order of the launch config's `args`"
    else:
        binding = (
            "arguments are bound by name (tensors, sizes, scalars and the launch config's constexprs), "
            "so every parameter keeps its name"
        )
    return (
        f"You optimize one {spec.kind} GPU kernel for speed without changing its results. Each request names one "
        "optimization (a canonical move); you apply it to the given source.\n\n"
        f"The canonical moves:\n{moves}\n\n"
        "Rules for your reply:\n"
        "1. Name exactly one canonical move, the one you applied, on a line of its own: `MOVE: <name>`.\n"
        f"2. Give the change as a unified diff against the file `{filename}` in one fenced ```diff block "
        f"(headers `--- a/{filename}` and `+++ b/{filename}`, hunks with exact context lines). Only if a diff is "
        f"impossible, give the full new source in one fenced ```{lang} block instead.\n"
        f"3. Keep the entry kernel `{spec.entry}` with its name and signature: {binding}.\n"
        "4. The launch config (shown as JSON) is fixed by the search; block sizes, warps and stages are other moves. "
        "Write the kernel so that it stays correct for the constexpr values given there.\n"
        "5. No other files, no tests, no prose beyond one short sentence of explanation."
    )


def _measurement_table(measurements: list[dict[str, Any]]) -> str:
    rows = measurements[-MAX_MEASUREMENTS:]
    if not rows:
        return "(none yet)"
    lines = [f"{'id':<14}{'move':<26}{'status':<10}ms"]
    for m in rows:
        ms = m.get("ms")
        ms_text = f"{ms:.4g}" if isinstance(ms, (int, float)) else "-"
        lines.append(
            f"{str(m.get('id', '')):<14}{str(m.get('move') or '-'):<26}{str(m.get('status', '')):<10}{ms_text}"
        )
    return "\n".join(lines)


def build_prompt(move: str, variant: Variant, spec: KernelSpec, measurements: list[dict[str, Any]]) -> list[dict]:
    """The chat messages asking for ``move`` at ``variant``: a system message with the rules, a user message with
    the move, the source, the launch config and the latest measurements (dicts with id, move, status, ms)."""
    filename, lang = source_filename(spec), FENCE_LANGS[spec.kind]
    description = CANONICAL_MOVES.get(move, "")
    launch = {k: v for k, v in variant.launch.items() if v is not None}  # unset CUDA fields of a Triton launch
    user = (
        f"Apply the canonical move `{move}`: {description}.\n\n"
        f"Kernel `{spec.name}`, entry `{spec.entry}`. The file `{filename}`:\n"
        f"```{lang}\n{variant.source.rstrip(chr(10))}\n```\n\n"
        f"Launch config (JSON):\n```json\n{json.dumps(launch, indent=2, sort_keys=True)}\n```\n\n"
        f"Latest measurements:\n```\n{_measurement_table(measurements)}\n```\n\n"
        f"Reply with `MOVE: {move}` (or the one canonical move you applied instead) and a ```diff block."
    )
    return [{"role": "system", "content": _system_message(spec)}, {"role": "user", "content": user}]


# --------------------------------------------------------------------------------------------------
# The reply
# --------------------------------------------------------------------------------------------------
_FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+.-]*)[^\n]*\n(.*?)(?:^[ \t]*```[ \t]*$|\Z)", re.MULTILINE | re.DOTALL)
_MOVE_LINE = re.compile(r"^[\s>*_#`-]*MOVE[\s*_`]*:[\s*_`'\"]*([A-Za-z_]\w*)", re.MULTILINE | re.IGNORECASE)


def _looks_like_diff(text: str) -> bool:
    return bool(re.search(r"^@@", text, re.MULTILINE)) and bool(re.search(r"^(---|\+\+\+) ", text, re.MULTILINE))


def parse_reply(text: str) -> tuple[str | None, str | None, str | None]:
    """(move, diff, full_source) of a reply. ``move`` is the name on the ``MOVE:`` line (canonical or not; the caller
    checks), else a line holding only a canonical name, else None. ``diff`` is the first ```diff block (or an untagged
    block that is a unified diff); ``full_source`` the first ```python / ```cuda / ```cpp block, only when no diff."""
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(text)]
    prose = _FENCE.sub("", text)  # a move named inside a code block is not the reply's choice
    found = _MOVE_LINE.search(prose)
    move = found.group(1).lower() if found else None
    if move is None:
        for line in prose.splitlines():
            name = line.strip().strip("*_`'\".:").strip()
            if name in CANONICAL_MOVES:
                move = name
                break
    diff = next((b for tag, b in blocks if tag in DIFF_TAGS or (not tag and _looks_like_diff(b))), None)
    full = None if diff is not None else next((b for tag, b in blocks if tag in SOURCE_TAGS), None)
    return move, diff, full


# --------------------------------------------------------------------------------------------------
# Applying a unified diff
# --------------------------------------------------------------------------------------------------
_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


@dataclass
class _Hunk:
    old_start: int | None  # 1-based, as in the header; None for a bare "@@" (placed by its context alone)
    lines: list[tuple[str, str]]  # (" " | "-" | "+", text)

    @property
    def old(self) -> list[str]:
        return [t for tag, t in self.lines if tag != "+"]

    @property
    def new(self) -> list[str]:
        return [t for tag, t in self.lines if tag != "-"]


def _parse_hunks(diff: str) -> list[_Hunk]:
    """The hunks of a one-file unified diff. Header counts are ignored (models miscount them): a hunk runs until the
    next hunk, file header or a line that is no diff line; a blank line is a blank context line."""
    lines = diff.splitlines()
    hunks: list[_Hunk] = []
    current: _Hunk | None = None
    for i, line in enumerate(lines):
        if line.startswith("@@"):
            m = _HUNK.match(line)
            current = _Hunk(int(m.group(1)) if m else None, [])
            hunks.append(current)
        elif current is None or line.startswith("\\"):
            continue  # file headers and prose before the first hunk; "\ No newline at end of file"
        elif line.startswith(("diff --git ", "Index: ")) or (
            line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ ")
        ):
            current = None
        elif line == "":
            current.lines.append((" ", ""))  # models drop the space of a blank context line
        elif line[0] in " -+":
            current.lines.append((line[0], line[1:]))
        else:
            current = None  # prose after the diff
    for h in hunks:
        while h.lines and h.lines[-1] == (" ", ""):  # a trailing blank line may be a separator, not context
            h.lines.pop()
    return [h for h in hunks if any(tag != " " for tag, _ in h.lines)]


def _symmetric(lines: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The same change with as many context lines before as after: ``patch`` reads unequal context as "this hunk
    is at the start (or end) of the file", which models do not mean. The extra context lines, next to the change,
    become removed and re-added lines, so they must still match exactly."""
    tags = [tag for tag, _ in lines]
    lead = next((i for i, t in enumerate(tags) if t != " "), len(tags))
    trail = next((i for i, t in enumerate(reversed(tags)) if t != " "), len(tags))
    k, end = min(lead, trail), len(lines)
    if lead == trail:
        return lines
    before, after = [t for _, t in lines[k:lead]], [t for _, t in lines[end - trail : end - k]]
    return (
        lines[:k]
        + [("-", t) for t in before]
        + [("+", t) for t in before]
        + lines[lead : end - trail]
        + [("-", t) for t in after]
        + [("+", t) for t in after]
        + lines[end - k :]
    )


def _normalized_diff(hunks: list[_Hunk], filename: str) -> str:
    """The hunks rewritten with fresh headers, counts and symmetric context, so that ``patch`` reads them as we do."""
    out = [f"--- a/{filename}", f"+++ b/{filename}"]
    shift = 0
    for h in hunks:
        old, new = h.old, h.new
        start = h.old_start if h.old_start is not None else 1  # patch floats the hunk to its context
        new_start = start + shift + (1 if not old else -1 if not new else 0)  # a count of 0 names the line before
        out.append(f"@@ -{start},{len(old)} +{max(new_start, 0)},{len(new)} @@")
        out += [tag + text for tag, text in _symmetric(h.lines)]
        shift += len(new) - len(old)
    return "\n".join(out) + "\n"


def _find(lines: list[str], block: list[str], hint: int, floor: int) -> int | None:
    """Where ``block`` occurs in ``lines`` at or after ``floor``, nearest to ``hint`` first."""
    last = len(lines) - len(block)
    hint = min(max(hint, floor), max(last, floor))
    for distance in range(max(last - floor, 0) + 1):
        for at in (hint - distance, hint + distance) if distance else (hint,):
            if floor <= at <= last and lines[at : at + len(block)] == block:
                return at
    return None


def _apply_python(source: str, hunks: list[_Hunk]) -> str:
    lines = source.splitlines()
    shift, floor = 0, 0  # shift: where earlier hunks moved the text; floor: hunks apply in order, never overlap
    for k, h in enumerate(hunks, 1):
        old, new = h.old, h.new
        if h.old_start is None:
            expected = floor
        else:
            expected = (h.old_start - 1 if old else h.old_start) + shift
        if old:
            at = _find(lines, old, expected, floor)
            if at is None:
                raise DiffError(f"hunk {k} of {len(hunks)} FAILED: its context is not in the file")
        else:
            at = min(max(expected, floor), len(lines))
        lines[at : at + len(old)] = new
        shift += (at - expected) + len(new) - len(old)
        floor = at + len(new)
    return "\n".join(lines) + ("\n" if source.endswith("\n") and lines else "")


def _apply_patch(patch: str, source: str, diff: str, filename: str) -> str:
    with tempfile.TemporaryDirectory(prefix="kernel-search-diff-") as tmp:
        target, change = os.path.join(tmp, filename), os.path.join(tmp, "change.diff")
        with open(target, "w") as f:
            f.write(source)
        with open(change, "w") as f:
            f.write(diff)
        # --fuzz=0: context must match exactly, like the Python applier; offsets (floating hunks) are still found.
        # The file named on the command line is the one patched, and the headers were rewritten as a/ b/: -p1.
        args = [patch, "--batch", "--forward", "--silent", "--fuzz=0", "--no-backup-if-mismatch", "--reject-file=-"]
        args += ["-p1", "-d", tmp, "-i", change, filename]
        dry = subprocess.run([*args[:1], "--dry-run", *args[1:]], capture_output=True, text=True, timeout=30)
        if dry.returncode == 0:
            subprocess.run(args, capture_output=True, text=True, timeout=30, check=True)
            with open(target) as f:
                return f.read()
        said = [ln.strip() for ln in (dry.stdout + "\n" + dry.stderr).splitlines() if ln.strip()]
        raise DiffError(said[0] if said else f"patch exited with status {dry.returncode}")


def apply_diff(source: str, diff: str, filename: str) -> str:
    """``source`` (the text of ``filename``) with the unified ``diff`` applied; DiffError when it does not apply.

    Headers may name ``a/file``, ``file`` or another name, or be missing: the hunks are re-headed for ``filename``.
    Context must match exactly; a hunk whose line numbers are off floats to where its context is."""
    hunks = _parse_hunks(diff)
    if not hunks:
        raise DiffError("no hunks in the diff")
    for k, h in enumerate(hunks, 1):
        if h.old_start is None and not h.old:
            raise DiffError(f"hunk {k} has neither line numbers nor context: it cannot be placed")
    filename = os.path.basename(filename)
    patch = shutil.which("patch")
    if patch is None:
        return _apply_python(source, hunks)
    return _apply_patch(patch, source, _normalized_diff(hunks, filename), filename)


# --------------------------------------------------------------------------------------------------
# The client
# --------------------------------------------------------------------------------------------------
def _one_line(text: str, limit: int = 200) -> str:
    first = next((ln.strip() for ln in str(text).splitlines() if ln.strip()), "")
    return first[:limit] or "(no message)"


class LLMClient:
    """One OpenAI-compatible Chat Completions endpoint and model; ``propose`` makes one request per call."""

    def __init__(self, model: str, base_url: str | None = None, api_key: str | None = None, timeout: float = 60.0):
        try:
            import openai
        except ImportError:
            raise LLMUnavailable("the openai package is missing: pip install 'kernel_lib[search]'") from None
        self.model = model
        self.base_url = base_url or os.environ.get("OPENAI_BASE_URL") or None  # None: the openai package's default
        self.timeout = timeout
        key = api_key or os.environ.get("OPENAI_API_KEY") or "none"  # local servers take any key
        self._openai = openai
        # max_retries=0: a failed request is a failed expansion; the search goes on with other moves
        self._client = openai.OpenAI(base_url=self.base_url, api_key=key, timeout=timeout, max_retries=0)

    def __repr__(self) -> str:
        return f"LLMClient(model={self.model!r}, base_url={self.base_url!r}, timeout={self.timeout})"

    def _ask(self, messages: list[dict]) -> tuple[str, str | None]:
        """(reply text, error): one request; the error is one line, and nothing is raised."""
        openai = self._openai
        try:
            response = self._client.chat.completions.create(model=self.model, messages=messages)
        except openai.APITimeoutError:
            return "", f"no reply (timeout after {self.timeout:g} s)"
        except openai.APIStatusError as exc:
            said = re.sub(r"^Error code: \d+ - ", "", _one_line(exc.message))  # the status is said once
            return "", f"endpoint error: HTTP {exc.status_code}: {said}"
        except Exception as exc:  # whatever the endpoint does fails this expansion, never the search
            return "", f"endpoint error: {type(exc).__name__}: {_one_line(str(exc))}"
        if not response.choices:
            return "", "endpoint error: the reply has no choices"
        return response.choices[0].message.content or "", None

    def propose(
        self, move: str, variant: Variant, spec: KernelSpec, measurements: list[dict[str, Any]] | None = None
    ) -> Proposal:
        """Ask for ``move`` at ``variant``: a Proposal with the new source, or with the reason it failed."""
        text, error = self._ask(build_prompt(move, variant, spec, list(measurements or [])))
        if error:
            return Proposal(None, None, None, text, error, unanswered=True)
        named, diff, full = parse_reply(text)
        if named is None or named not in CANONICAL_MOVES:
            why = "reply names no canonical move" + (f" ({named!r} is not one)" if named else "")
            return Proposal(None, None, diff, text, why)
        if diff is not None:
            try:
                source = apply_diff(variant.source, diff, source_filename(spec))
            except DiffError as exc:
                return Proposal(named, None, diff, text, f"diff does not apply: {_one_line(str(exc))}")
            except (OSError, subprocess.SubprocessError) as exc:  # patch itself failed to run
                return Proposal(named, None, diff, text, f"diff does not apply: {_one_line(str(exc))}")
            if source == variant.source:
                return Proposal(named, None, diff, text, "diff changes nothing")
            return Proposal(named, source, diff, text)
        if full is not None:
            source = full if full.endswith("\n") or not variant.source.endswith("\n") else full + "\n"
            if source == variant.source:
                return Proposal(named, None, None, text, "full source changes nothing")
            return Proposal(named, source, None, text)
        return Proposal(named, None, None, text, "reply holds no diff or source block")


def client_from_settings(model: str | None, no_llm: bool) -> LLMClient | None:
    """The client a search uses: None with ``--no-llm`` or when no model is named (``--llm-model`` or the
    environment's KERNEL_SEARCH_LLM_MODEL), so that rule moves alone run, with no error."""
    if no_llm:
        return None
    model = model or os.environ.get("KERNEL_SEARCH_LLM_MODEL")
    if not model:
        return None
    return LLMClient(model)
