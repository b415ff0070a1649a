"""Check that every entry of _toc.yml became an HTML page of the built book (`make test` runs this).

python tools/check_book.py [--toc _toc.yml] [--html _build/html]
"""

from __future__ import annotations

import argparse
import os
import sys

import yaml


def toc_files(node) -> list[str]:
    """Every ``file:`` (and the root) in a Jupyter Book 1 table of contents, in order."""
    found: list[str] = []
    if isinstance(node, dict):
        for key in ("root", "file"):
            if key in node:
                found.append(str(node[key]))
        for value in node.values():
            if isinstance(value, (dict, list)):
                found += toc_files(value)
    elif isinstance(node, list):
        for item in node:
            found += toc_files(item)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--toc", default="_toc.yml")
    parser.add_argument("--html", default=os.path.join("_build", "html"))
    args = parser.parse_args()
    with open(args.toc) as handle:
        entries = toc_files(yaml.safe_load(handle))
    root = os.path.dirname(os.path.abspath(args.toc))
    problems: list[str] = []
    bad: set[str] = set()
    for entry in entries:
        before = len(problems)
        stem = os.path.splitext(entry)[0]
        if not any(os.path.exists(os.path.join(root, stem + ext)) for ext in (".md", ".ipynb", ".rst")):
            problems.append(f"{entry}: listed in {args.toc} but no .md/.ipynb/.rst source exists")
        page = os.path.join(args.html, stem + ".html")
        if not os.path.exists(page):
            problems.append(f"{entry}: no page at {page}")
        elif os.path.getsize(page) < 2000:
            problems.append(f"{entry}: {page} is suspiciously small ({os.path.getsize(page)} bytes)")
        if len(problems) > before:
            bad.add(entry)
    for line in problems:
        print(f"check_book: {line}")
    print(f"check_book: {len(entries) - len(bad)}/{len(entries)} table-of-contents entries became pages")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
