"""tools/: notebook execution with recorded metadata, and the table-of-contents check of the built book."""

import os
import sys

import nbformat
import pytest

from tools import check_book, execute_notebooks  # tools/ is a namespace package on pytest's pythonpath

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_execute_records_device_and_versions(tmp_path):
    path = tmp_path / "tiny.ipynb"
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(6 * 7)")])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, path)
    execute_notebooks.execute(str(path), timeout=120)
    done = nbformat.read(path, as_version=4)
    assert done.cells[0].outputs[0]["text"] == "42\n"
    meta = done.metadata["kernel_course"]
    assert {"device", "torch", "triton", "cuda", "executed", "execution_seconds"} <= set(meta)


def test_execute_leaves_a_failing_notebook_untouched(tmp_path):
    from nbclient.exceptions import CellExecutionError

    path = tmp_path / "broken.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 / 0")]), path)
    before = path.read_text()
    with pytest.raises(CellExecutionError):
        execute_notebooks.execute(str(path), timeout=120)
    assert path.read_text() == before


def test_check_book_finds_missing_pages(tmp_path, monkeypatch, capsys):
    (tmp_path / "book").mkdir()
    for name in ("intro", "present", "absent"):
        (tmp_path / "book" / f"{name}.md").write_text(f"# {name}\n")
    (tmp_path / "_toc.yml").write_text(
        "format: jb-book\nroot: book/intro\nchapters:\n  - file: book/present\n  - file: book/absent\n"
    )
    html = tmp_path / "_build" / "html" / "book"
    html.mkdir(parents=True)
    for name in ("intro", "present"):
        (html / f"{name}.html").write_text("x" * 5000)
    assert check_book.toc_files(
        {"root": "a", "parts": [{"chapters": [{"file": "b", "sections": [{"file": "c"}]}]}]}
    ) == [
        "a",
        "b",
        "c",
    ]
    monkeypatch.setattr(
        sys, "argv", ["check_book", "--toc", str(tmp_path / "_toc.yml"), "--html", str(tmp_path / "_build" / "html")]
    )
    assert check_book.main() == 1
    out = capsys.readouterr().out
    assert "book/absent: no page" in out and "2/3" in out
