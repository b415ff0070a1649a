"""Wrap notebook code lines to the book's column (75 characters at 1280 px) where ``ruff format --line-length 75``
cannot: comment blocks reflowed as paragraphs, a trailing comment moved above its line, long string literals split
into adjacent literals inside brackets (and joined with a following lone literal when they fit). Each change is kept
only if the cell's AST is unchanged (comments and adjacent literals leave no trace in it), so what a cell does and
prints cannot change; what cannot be wrapped that way (docstrings, long code) is left for a person.

    python tools/wrap_notebook_code.py notebooks/*.ipynb           rewrite in place, print cells changed per file
    python tools/wrap_notebook_code.py --check notebooks/*.ipynb   list the code lines still wider than the column
"""

import ast
import io
import json
import sys
import textwrap
import tokenize

WIDTH = 75


def wrap_comment(line: str) -> list[str]:
    indent = line[: len(line) - len(line.lstrip())]
    text = line.strip().lstrip("#").strip()
    return [indent + "# " + part for part in textwrap.wrap(text, WIDTH - len(indent) - 2, break_long_words=False)]


def split_point(body: str, is_f: bool, limit: int) -> int:
    """Index in body after which to split (a space kept on the left), the last before limit outside braces."""
    depth, best, i = 0, -1, 0
    while i < len(body) and i < limit:
        ch = body[i]
        if is_f and ch in "{}" and body[i : i + 2] in ("{{", "}}"):
            i += 2
            continue
        if is_f and ch == "{":
            depth += 1
        elif is_f and ch == "}":
            depth -= 1
        elif ch == " " and depth == 0 and i > 0 and body[i - 1] != "\\":
            best = i
        i += 1
    return best


def wrap_line(line: str) -> list[str] | None:
    """The line as several, or None when it cannot be wrapped safely here."""
    stripped = line.strip()
    if stripped.startswith("#"):
        return wrap_comment(line)
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(line + "\n").readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        tokens = None
    if tokens:  # a trailing comment goes above the line
        comments = [t for t in tokens if t.type == tokenize.COMMENT]
        if comments and comments[0].start[1] > len(line) - len(line.lstrip()):
            col = comments[0].start[1]
            code = line[:col].rstrip()
            indent = line[: len(line) - len(line.lstrip())]
            return wrap_comment(indent + comments[0].string) + (wrap_line(code) or [code])
    for tok in tokens or []:
        if tok.type != tokenize.STRING or tok.start[1] >= WIDTH - 8 or tok.end[1] <= WIDTH:
            continue
        s = tok.string
        prefix = s[: len(s) - len(s.lstrip("rbfuRBFU"))]
        quote = s[len(prefix)]
        if s[len(prefix) : len(prefix) + 3] in ('"""', "'''"):
            continue
        body = s[len(prefix) + 1 : -1]
        start = tok.start[1]
        limit = WIDTH - start - len(prefix) - 2  # room for prefix and both quotes
        cut = split_point(body, "f" in prefix.lower(), limit)
        if cut <= 0:
            continue
        left, right = body[: cut + 1], body[cut + 1 :]
        head = line[:start] + prefix + quote + left + quote
        tail_prefix = (
            prefix if ("f" not in prefix.lower() or "{" in right) else prefix.replace("f", "").replace("F", "")
        )
        tail = " " * start + tail_prefix + quote + right + quote + line[tok.end[1] :]
        rest = wrap_line(tail) if len(tail) > WIDTH else [tail]
        return [head] + (rest or [tail])
    return None


def _dump(lines: list[str]) -> str:
    """The AST of a cell, IPython's magics (% and ! lines) read as pass."""
    py = [l[: len(l) - len(l.lstrip())] + "pass" if l.lstrip().startswith(("%", "!")) else l for l in lines]
    return ast.dump(ast.parse("\n".join(py)))


def _is_comment(line: str) -> bool:
    text = line.strip()
    return text.startswith("#") and text.strip("#").strip() != "" and not text.startswith("#!")


def _comment_block(lines: list[str], i: int) -> tuple[int, int]:
    """[start, end) of the run of comment lines around i with i's indentation: reflowed as one paragraph."""
    indent = len(lines[i]) - len(lines[i].lstrip())
    same = lambda j: _is_comment(lines[j]) and len(lines[j]) - len(lines[j].lstrip()) == indent  # noqa: E731
    start, end = i, i + 1
    while start > 0 and same(start - 1):
        start -= 1
    while end < len(lines) and same(end):
        end += 1
    return start, end


def _merge_next(wrapped: list[str], following: str) -> list[str] | None:
    """The wrapped line's last piece joined with the next line when that line is a lone string literal of the
    same kind (e.g. the rest of a sentence) and the two fit: fewer, fuller lines."""
    last = wrapped[-1]
    try:
        a = [t for t in tokenize.generate_tokens(io.StringIO(last.strip() + "\n").readline) if t.string.strip()]
        b = [t for t in tokenize.generate_tokens(io.StringIO(following.strip() + "\n").readline) if t.string.strip()]
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return None
    if len(a) != 1 or a[0].type != tokenize.STRING or not b or b[0].type != tokenize.STRING:
        return None
    if len(b) > 2 or (len(b) == 2 and b[1].string not in (",", ")")):
        return None
    sa, sb = a[0].string, b[0].string
    pa, pb = sa[: len(sa) - len(sa.lstrip("rbfuRBFU"))], sb[: len(sb) - len(sb.lstrip("rbfuRBFU"))]
    if pa.lower().replace("f", "") != pb.lower().replace("f", "") or sa[len(pa)] != sb[len(pb)]:
        return None
    prefix = pa if "f" in pa.lower() else pb
    merged = last[: len(last) - len(last.lstrip())] + prefix + sa[len(pa) : -1] + sb[len(pb) + 1 :]
    merged += "".join(t.string for t in b[1:])
    if "f" not in prefix.lower() and "{" in merged:
        return None
    return wrapped[:-1] + [merged] if len(merged) <= WIDTH else None


def wrap_cell(source: str) -> str:
    """Each long line wrapped in turn, kept only if the cell's AST stays the same."""
    try:
        before = _dump(source.split("\n"))
    except SyntaxError:
        return source
    lines = source.split("\n")
    i = 0
    while i < len(lines):
        if len(lines[i]) > WIDTH and not lines[i].lstrip().startswith(("%", "!")):
            start, end = i, i + 1
            if _is_comment(lines[i]):
                start, end = _comment_block(lines, i)
                indent = lines[start][: len(lines[start]) - len(lines[start].lstrip())]
                text = " ".join(l.strip().lstrip("#").strip() for l in lines[start:end])
                wrapped = wrap_comment(indent + "# " + text)
            else:
                wrapped = wrap_line(lines[i])
                if wrapped and end < len(lines):
                    merged = _merge_next(wrapped, lines[end])
                    if merged is not None:
                        wrapped, end = merged, end + 1
            if wrapped:
                trial = lines[:start] + wrapped + lines[end:]
                try:
                    same = _dump(trial) == before
                except SyntaxError:
                    same = False
                if same:
                    lines = trial
                    i = start + len(wrapped)
                    continue
        i += 1
    return "\n".join(lines)


def long_lines(path: str) -> list[tuple[int, str]]:
    """(code cell number, line) for each code line wider than WIDTH."""
    cells = [c for c in json.load(open(path))["cells"] if c["cell_type"] == "code"]
    return [(n, line) for n, c in enumerate(cells) for line in "".join(c["source"]).splitlines() if len(line) > WIDTH]


def main(argv: list[str]) -> int:
    check = "--check" in argv
    paths = [a for a in argv if a != "--check"]
    if not paths or "--help" in argv or "-h" in argv:
        print(__doc__)
        return 0 if paths or "--help" in argv or "-h" in argv else 2
    for path in paths:
        if check:
            for n, line in long_lines(path):
                print(f"{path}: code cell {n}: {len(line)} characters: {line.strip()[:60]}")
            continue
        raw = open(path).read()
        nb = json.loads(raw)
        changed = 0
        for cell in nb["cells"]:
            if cell["cell_type"] != "code":
                continue
            src = "".join(cell["source"])
            new = wrap_cell(src)
            if new != src:
                changed += 1
                cell["source"] = new.splitlines(keepends=True)
        if changed:  # the notebooks' own JSON style: one-space indent, UTF-8 as is
            open(path, "w").write(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
        print(f"{path}: {changed} cells rewrapped")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
