"""The notebook form: tick the fixes to apply, press the button, see the result.

The form lists the fixes that passed validation alone, with their measured speedups, all ticked; pressing
*Apply selected* combines the ticked ones (``OptimizationResult.apply``) and shows the updated report.
"""

from __future__ import annotations


def choose(result):
    """Show the form for ``result`` (needs ipywidgets); returns the widget."""
    try:
        import ipywidgets as widgets
        from IPython.display import display
    except ImportError as exc:
        raise ImportError("interactive=True needs ipywidgets and IPython: pip install ipywidgets") from exc
    options = [o for o in result.optimization_opportunities if o.validated and o.estimated_speedup]
    boxes = [
        widgets.Checkbox(
            value=True,
            description=f"{o.technique}: {o.estimated_speedup:.2f}x alone ({o.location})",
            layout=widgets.Layout(width="auto"),
            style={"description_width": "initial"},
        )
        for o in options
    ]
    button = widgets.Button(description="Apply selected", button_style="primary")
    out = widgets.Output()

    def on_click(_):
        with out:
            out.clear_output()
            chosen = [o.technique for o, box in zip(options, boxes, strict=True) if box.value]
            result.apply(chosen)
            display(result)

    button.on_click(on_click)
    header = widgets.HTML(
        f"<b>{len(options)} validated fix(es)</b>; untick what you do not want, then apply."
        if options
        else "<b>No fix passed validation and measurement.</b>"
    )
    form = widgets.VBox([header, *boxes, button, out])
    display(form)
    return form
