"""Sphinx extension: a notebook stored with an error output fails the book build.

The book renders stored outputs without executing (``execute_notebooks: off``), and MyST-NB then renders an
error output as an ordinary traceback, without a warning. This extension warns for every error output whose
cell is not tagged ``raises-exception``, so ``jupyter-book build -W`` fails on it.
"""

import json

from sphinx.util import logging

logger = logging.getLogger(__name__)


def warn_on_stored_errors(app, docname, source):
    path = app.env.doc2path(docname)
    if not str(path).endswith(".ipynb"):
        return
    try:
        notebook = json.loads(source[0])
    except ValueError:
        return  # not JSON: MyST-NB reports that itself
    for index, cell in enumerate(notebook.get("cells", [])):
        if cell.get("cell_type") != "code" or "raises-exception" in cell.get("metadata", {}).get("tags", []):
            continue
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                logger.warning(
                    "code cell %d stores an error output (%s: %s); fix the cell or tag it raises-exception",
                    index,
                    output.get("ename"),
                    output.get("evalue"),
                    location=docname,
                    type="stored_errors",
                )


def setup(app):
    app.connect("source-read", warn_on_stored_errors)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
