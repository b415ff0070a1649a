"""Check that every measured number in a notebook's prose comes from a cell of the same page (`make test` runs this).

    python tools/check_prose_numbers.py [notebooks/*.ipynb] [--allow tools/prose_numbers_allowed.txt]

A number with a unit or a ratio in a markdown cell (``1.13×``, ``0.699 ms``, ``4,218 GB/s``, ``57%``, ``2.1 GiB``)
passes when it is glued (``{glue:}`name``` and its variants: the value is the cell's) or when a cell output on the
same page prints a value that rounds to it at the prose's precision (``1.13`` for an output of 1.1342; commas
ignored). Code spans, code blocks, math and link targets are not prose. Numbers that are not measurements (a
hardware limit such as 228 KiB of shared memory, a threshold such as "within 10%") are listed with their reason in
the allow file, one ``notebook | number | reason`` a line; an entry whose number no longer appears on its page is
reported too, so the list only shrinks. Exits 1 on any problem.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

# a unit or a ratio right after the number (a space allowed before a word unit); not followed by a letter
UNIT = (r"(?:×|x(?![A-Za-z])|%|\s?(?:ms|µs|us|ns|s|GB/s|TB/s|GiB|MiB|KiB|MB|GB|KB|TFLOP/s|GFLOP/s|TFLOPS|GFLOP|"
        r"TFLOP|tokens/s|tok/s)(?![A-Za-z/]))")  # fmt: skip
PROSE_NUMBER = re.compile(r"(?<![\w.])(\d[\d,]*(?:\.\d+)?)" + UNIT)
OUTPUT_NUMBER = re.compile(r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?")
NOT_PROSE = [
    re.compile(r"```.*?```", re.S),  # code blocks
    re.compile(r"\{glue(?::\w+)?\}`[^`]*`"),  # glued values
    re.compile(r"`[^`]*`"),  # code spans
    re.compile(r"\$\$.*?\$\$", re.S),  # display math
    re.compile(r"\$[^$\n]*\$"),  # inline math
    re.compile(r"\]\([^)]*\)"),  # link targets
]


def prose(markdown: str) -> str:
    """The markdown with what is not prose blanked out."""
    for pattern in NOT_PROSE:
        markdown = pattern.sub(" ", markdown)
    return markdown


def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else str(value)


def output_text(notebook: dict) -> str:
    """Every code cell's printed and displayed text, glue outputs included."""
    parts = []
    for cell in notebook["cells"]:
        for output in cell.get("outputs", []) if cell["cell_type"] == "code" else []:
            if "text" in output:
                parts.append(_text(output["text"]))
            for kind, value in output.get("data", {}).items():
                if kind.startswith("text/"):
                    parts.append(_text(value))
    return "\n".join(parts)


def _decimals(number: str) -> int:
    return len(number.split(".")[1]) if "." in number else 0


def printed_values(text: str) -> set[tuple[int, float]]:
    """(decimals, value rounded to them) for every number in ``text``, at 0 to 4 decimals."""
    found = set()
    for match in OUTPUT_NUMBER.finditer(text):
        try:
            value = float(match.group(0).replace(",", ""))
        except ValueError:
            continue
        found.update((d, round(value, d)) for d in range(5))
    return found


def unsupported(notebook: dict) -> list[tuple[int, str]]:
    """(cell index, number with its unit) for each prose number no output on the page supports."""
    values = printed_values(output_text(notebook))
    problems = []
    for index, cell in enumerate(notebook["cells"]):
        if cell["cell_type"] != "markdown":
            continue
        for match in PROSE_NUMBER.finditer(prose(_text(cell["source"]))):
            number = match.group(1).replace(",", "")
            if (_decimals(number), round(float(number), _decimals(number))) not in values:
                problems.append((index, " ".join(match.group(0).split())))
    return problems


def read_allowed(path: str) -> dict[tuple[str, str], str]:
    """{(notebook stem, number with unit): reason} from the allow file; '#' starts a comment."""
    allowed = {}
    if not os.path.exists(path):
        return allowed
    with open(path, encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            fields = [f.strip() for f in line.split("|")]
            if len(fields) != 3 or not all(fields):
                raise ValueError(f"{path}:{line_no}: want 'notebook | number | reason', got {line!r}")
            allowed[(fields[0], fields[1])] = fields[2]
    return allowed


def check(paths: list[str], allowed: dict[tuple[str, str], str]) -> list[str]:
    """Every problem, as a line: unsupported prose numbers not in ``allowed``, and stale allow entries."""
    lines, seen = [], set()
    for path in paths:
        stem = os.path.splitext(os.path.basename(path))[0]
        with open(path, encoding="utf-8") as handle:
            notebook = json.load(handle)
        for index, number in unsupported(notebook):
            seen.add((stem, number))
            if (stem, number) not in allowed:
                lines.append(f"{stem}: markdown cell {index}: '{number}' is not glued and no output on the page "
                             f"prints it")  # fmt: skip
    checked = {os.path.splitext(os.path.basename(p))[0] for p in paths}
    for stem, number in sorted(set(allowed) - seen):
        if stem in checked:
            lines.append(f"{stem}: the allow file lists '{number}', which its prose no longer has unsupported")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", help="default: notebooks/*.ipynb")
    parser.add_argument("--allow", default=os.path.join("tools", "prose_numbers_allowed.txt"))
    args = parser.parse_args()
    paths = args.notebooks or sorted(glob.glob(os.path.join("notebooks", "*.ipynb")))
    problems = check(paths, read_allowed(args.allow))
    for line in problems:
        print(line)
    print(f"check_prose_numbers: {len(paths)} notebooks, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
