"""tools/: notebook execution with recorded metadata, and the table-of-contents check of the built book."""

import json
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


def _bar(state, mid, desc, value, total, right, hidden=False):
    """A tqdm notebook bar as ipywidgets stores it: an HBox of HTML, FloatProgress, HTML, with a layout."""
    for suffix, name, widget_state in (
        ("l", "HTMLModel", {"value": desc}),
        ("p", "FloatProgressModel", {"value": value, "max": total}),
        ("r", "HTMLModel", {"value": right}),
        ("y", "LayoutModel", {"visibility": "hidden"} if hidden else {}),
    ):
        state[mid + suffix] = {"model_name": name, "state": widget_state}
    children = [f"IPY_MODEL_{mid}{s}" for s in "lpr"]
    state[mid] = {"model_name": "HBoxModel", "state": {"children": children, "layout": f"IPY_MODEL_{mid}y"}}
    return nbformat.v4.new_output("display_data", data={execute_notebooks.WIDGET_VIEW: {"model_id": mid}})


def test_progress_bars_are_stored_as_text():
    state = {"f0": {"model_name": "DropdownModel", "state": {}}}  # a real widget, which stays
    shown = _bar(state, "aa", "softmax: 100%", 6, 6, "6/6 [00:05&lt;00:00]")
    hidden = _bar(state, "bb", "inner: 100%", 3, 3, "3/3", hidden=True)
    form = nbformat.v4.new_output("display_data", data={execute_notebooks.WIDGET_VIEW: {"model_id": "f0"}})
    cell = nbformat.v4.new_code_cell("...", outputs=[shown, hidden, form])
    notebook = nbformat.v4.new_notebook(cells=[cell])
    notebook.metadata["widgets"] = {execute_notebooks.WIDGET_STATE: {"state": state}}
    assert execute_notebooks.progress_bars_as_text(notebook) == 2
    outputs = notebook.cells[0].outputs
    assert [o["output_type"] for o in outputs] == ["stream", "display_data"]
    assert outputs[0]["text"] == "softmax: 100% 6/6 [00:05<00:00]\n"
    assert set(notebook.metadata["widgets"][execute_notebooks.WIDGET_STATE]["state"]) == {"f0"}


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


# --------------------------------------------------------------------------------------------------
# check_prose_numbers: measured numbers in prose come from a cell of the page
# --------------------------------------------------------------------------------------------------
def _page(markdown: str, printed: str = "", glued: str = "") -> dict:
    cells = [nbformat.v4.new_markdown_cell(markdown)]
    code = nbformat.v4.new_code_cell("pass")
    code.outputs = [nbformat.v4.new_output("stream", name="stdout", text=printed)]
    if glued:
        code.outputs.append(nbformat.v4.new_output("display_data", data={"text/plain": glued}))
    return {"cells": [*cells, code]}


@pytest.mark.parametrize(
    "markdown, printed, problems",
    [
        ("ours is 1.13× faster", "ratio 1.1342", []),  # rounds to the prose's precision
        ("ours is 1.13× faster", "ratio 1.1392", ["1.13×"]),  # rounds to 1.14: not this number
        ("it reads 4,218 GB/s", "4218.4 GB/s", []),  # commas ignored
        ("took 0.699 ms and 57%", "0.699", ["57%"]),
        ("see `1.5×` and $2.5\\times$", "", []),  # code spans and math are not prose
        ("glued {glue:text}`speedup` × and 3 steps", "", []),  # glued values; a count without a unit
        ("costs 2.3 GiB", "", ["2.3 GiB"]),
    ],
)
def test_prose_numbers_need_an_output_on_the_page(markdown, printed, problems):
    from tools import check_prose_numbers as check

    assert [number for _, number in check.unsupported(_page(markdown, printed))] == problems


def test_prose_numbers_allow_file_only_shrinks(tmp_path):
    from tools import check_prose_numbers as check

    page = tmp_path / "01_page.ipynb"
    page.write_text(json.dumps(_page("costs 2.3 GiB of 80 GB")))
    allow = tmp_path / "allowed.txt"
    allow.write_text("01_page | 2.3 GiB | a size computed in the text\n01_page | 80 GB | hardware\n")
    assert check.check([str(page)], check.read_allowed(str(allow))) == []
    allow.write_text("01_page | 2.3 GiB | a size\n01_page | 80 GB | hardware\n01_page | 9 ms | gone\n")
    assert check.check([str(page)], check.read_allowed(str(allow))) == [
        "01_page: the allow file lists '9 ms', which its prose no longer has unsupported"
    ]
    allow.write_text("01_page | 2.3 GiB\n")
    with pytest.raises(ValueError, match="want 'notebook | number | reason'"):
        check.read_allowed(str(allow))


def test_the_course_s_prose_numbers_pass():
    from tools import check_prose_numbers as check

    notebooks = sorted(os.path.join(ROOT, "notebooks", n) for n in os.listdir(os.path.join(ROOT, "notebooks")))
    allowed = check.read_allowed(os.path.join(ROOT, "tools", "prose_numbers_allowed.txt"))
    assert check.check([n for n in notebooks if n.endswith(".ipynb")], allowed) == []


def test_wrap_notebook_code_fits_the_column_and_changes_nothing_a_cell_does(capsys):
    from tools import wrap_notebook_code as wrap

    x = 41
    source = (
        "# a comment block that runs on and on past the book's column of seventy-five characters, and\n"
        "# goes on for a second line too\n"
        "%config InlineBackend.figure_format = 'png'\n"
        "y = x + 1  # a trailing comment that also runs well past the column of seventy-five chars\n"
        "print(\n"
        '    f"the answer is {y} and the question is long enough to pass the column {x!r} "\n'
        '    "and more."\n'
        ")\n"
    )
    wrapped = wrap.wrap_cell(source)
    assert all(len(line) <= wrap.WIDTH for line in wrapped.splitlines())
    assert wrap._dump(wrapped.split("\n")) == wrap._dump(source.split("\n"))  # the same program
    run = lambda src: exec("\n".join(l for l in src.splitlines() if not l.startswith("%")), {"x": x})  # noqa: E731
    run(source)
    before = capsys.readouterr().out
    run(wrapped)
    assert (
        capsys.readouterr().out
        == before
        == "the answer is 42 and the question is long enough to pass the column 41 and more.\n"
    )
    assert wrap.wrap_cell(wrapped) == wrapped  # a second pass finds nothing to do
