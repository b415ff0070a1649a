"""The book's plots and tables: one palette and style, throughput against a drawn ceiling, rooflines, speed-ups,
HTML tables, and :func:`glue`, which hands a measured number to the prose. matplotlib is imported inside the
functions that need it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# --------------------------------------------------------------------------------------------------
# Plots and tables: one style for the whole book
# --------------------------------------------------------------------------------------------------
# One colour per implementation, the same on every page; matched on the lowercased label, first hit wins.
PALETTE = (
    ("ceiling", "black"),
    ("kernel_lib", "#d62728"),  # ours: red everywhere
    ("ours", "#d62728"),
    ("triton", "#d62728"),
    ("cuda", "#9467bd"),
    ("compile", "#1f77b4"),
    ("inductor", "#1f77b4"),
    ("liger", "#2ca02c"),
    ("flash", "#ff7f0e"),
    ("fa2", "#ff7f0e"),
    ("sdpa", "#8c564b"),
    ("hf", "#e377c2"),
    ("hugging", "#e377c2"),
    ("naive", "#7f7f7f"),
    ("eager", "#17becf"),
    ("torch", "#17becf"),
    ("pytorch", "#17becf"),
)
_SPARE = ("#bcbd22", "#8c564b", "#e377c2", "#7f7f7f", "#aec7e8", "#ffbb78", "#98df8a", "#c5b0d5")
STYLE = {
    "figure.dpi": 90,
    "savefig.dpi": 90,
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.labelsize": 10,
    "xtick.labelsize": 9,
    "ytick.labelsize": 9,
    "legend.fontsize": 9,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "figure.constrained_layout.use": True,
}


def color(label: str) -> str:
    """The book's colour for an implementation, from its label (kernel_lib red, torch.compile blue, ...)."""
    low = str(label).lower()
    for key, value in PALETTE:
        if key in low:
            return value
    return _SPARE[sum(map(ord, low)) % len(_SPARE)]  # stable across processes, unlike hash()


def use_style() -> None:
    """Set matplotlib's defaults to the book's: readable font sizes, a light grid, room for outside legends."""
    import matplotlib as mpl

    mpl.rcParams.update(STYLE)


def legend_outside(ax, **kwargs):
    """The legend to the right of the axes, where it covers no data."""
    kwargs.setdefault("loc", "upper left")
    kwargs.setdefault("bbox_to_anchor", (1.01, 1.0))
    kwargs.setdefault("borderaxespad", 0.0)
    kwargs.setdefault("frameon", False)
    return ax.legend(**kwargs)


def draw_ceiling(ax, value: float, label: str = "measured ceiling", unit: str = "", horizontal: bool = True):
    """A labelled dashed line at a measured ceiling.

    A ceiling is a reference measured in the same run (the best simple copy, the best large matmul), not a law:
    a kernel that moves the same bytes with another access pattern, or timing noise of 1-3%, can pass it.
    """
    text = f"{label}: {value:,.0f}{(' ' + unit) if unit else ''}"
    if horizontal:
        ax.axhline(value, color="black", ls="--", lw=1, zorder=1)
        ax.annotate(text, (0.01, value), xycoords=("axes fraction", "data"), va="bottom", fontsize=8)
    else:
        ax.axvline(value, color="black", ls="--", lw=1, zorder=1)
        ax.annotate(text, (value, 0.01), xycoords=("data", "axes fraction"), rotation=90, ha="right", fontsize=8)


def _axes(ax):
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    use_style()
    _, ax = plt.subplots(figsize=(7.5, 4))
    return ax


def plot_throughput(
    frame,
    x: str,
    y: str,
    by: str,
    *,
    ceiling: float | None = None,
    ceiling_label: str = "measured ceiling",
    ax=None,
    logx: bool = True,
    xlabel: str | None = None,
    ylabel: str | None = None,
    title: str | None = None,
):
    """Lines of ``y`` against ``x`` for each value of ``by``, with the measured ceiling drawn and labelled."""
    ax = _axes(ax)
    for key, group in frame.groupby(by, sort=False):
        group = group.sort_values(x)
        ours = "kernel_lib" in str(key).lower()
        # ours on top and a touch wider, so a peer with the same numbers cannot hide it
        ax.plot(group[x], group[y], marker="o", ms=3, lw=2.0 if ours else 1.4, zorder=3 if ours else 2,
                color=color(key), label=str(key))  # fmt: skip
    if ceiling is not None:
        draw_ceiling(ax, ceiling, ceiling_label)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel or x)
    ax.set_ylabel(ylabel or y)
    if title:
        ax.set_title(title)
    legend_outside(ax)
    return ax


def plot_roofline(
    points: Sequence[dict],
    *,
    peak_tflops: float,
    peak_gbps: float,
    ax=None,
    title: str | None = None,
):
    """A roofline: min(peak_tflops, intensity × bandwidth) with measured points on it.

    Each point is a dict with ``name``, ``intensity`` (FLOP per byte moved) and ``tflops`` (achieved).
    """
    import numpy as np

    ax = _axes(ax)
    intensities = [p["intensity"] for p in points]
    lo = min(min(intensities) / 2, 0.05)
    hi = max(max(intensities) * 2, 4 * peak_tflops * 1e3 / peak_gbps)
    xs = np.logspace(np.log10(lo), np.log10(hi), 200)
    roof = np.minimum(peak_tflops, xs * peak_gbps / 1e3)
    ax.plot(xs, roof, color="black", lw=1.5, label="roofline (measured ceilings)")
    ridge = peak_tflops * 1e3 / peak_gbps
    ax.axvline(ridge, color="gray", ls=":", lw=1)
    ax.annotate(f"ridge {ridge:.0f} FLOP/B", (ridge, peak_tflops / 30), rotation=90, fontsize=8, ha="right")
    for key in dict.fromkeys(p.get("group", p["name"]) for p in points):
        group = [p for p in points if p.get("group", p["name"]) == key]
        xs_, ys_ = [p["intensity"] for p in group], [p["tflops"] for p in group]
        ax.scatter(xs_, ys_, s=18, label=key, zorder=3, color=color(key))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per byte of memory traffic)")
    ax.set_ylabel("TFLOP/s")
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    legend_outside(ax)
    return ax


def plot_speedup(
    labels: Sequence[str],
    speedups: Sequence[float],
    *,
    ax=None,
    title: str | None = None,
    baseline: str = "baseline",
):
    """Horizontal bars of speed-up over ``baseline`` (1.0 drawn as a line), each bar in its implementation's colour."""
    ax = _axes(ax)
    bars = ax.barh(list(labels), list(speedups), color=[color(label) for label in labels])
    ax.axvline(1.0, color="black", lw=1)
    for bar, value in zip(bars, speedups, strict=True):
        ax.annotate(
            f"{value:.2f}×",
            (bar.get_width(), bar.get_y() + bar.get_height() / 2),
            va="center",
            fontsize=8,
            xytext=(3, 0),
            textcoords="offset points",
        )
    ax.set_xlabel(f"speed-up over {baseline}")
    if title:
        ax.set_title(title)
    ax.invert_yaxis()
    return ax


def _format_cell(value, fmt: str | None) -> str:
    """One table cell as text: "—" for a missing value, thousands separators, no trailing noise digits."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if fmt is not None:
        return format(value, fmt)
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return f"{int(value):,}"
    if isinstance(value, float):
        mag = abs(value)
        if mag >= 100:
            return f"{value:,.0f}"
        if mag >= 10:
            return f"{value:.1f}"
        if mag >= 0.01 or mag == 0:
            return f"{value:.2f}"
        return f"{value:.2e}"
    return str(value)


@dataclass
class Table:
    """A formatted table: HTML in a notebook (so the book wraps nothing), aligned text elsewhere."""

    columns: list[str]
    rows: list[list[str]]
    caption: str | None = None

    def __repr__(self) -> str:
        widths = [
            max(len(c), *(len(r[i]) for r in self.rows)) if self.rows else len(c) for i, c in enumerate(self.columns)
        ]
        lines = ["  ".join(c.ljust(w) for c, w in zip(self.columns, widths, strict=True))]
        lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in self.rows]
        return "\n".join(([self.caption] if self.caption else []) + lines)

    def _repr_html_(self) -> str:
        import html

        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.columns)
        body = "".join(
            "<tr>" + "".join(f'<td style="text-align:right">{html.escape(v)}</td>' for v in r) + "</tr>"
            for r in self.rows
        )
        cap = f"<caption>{html.escape(self.caption)}</caption>" if self.caption else ""
        return f'<table class="kernel-course-table">{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def table(
    data, columns: Sequence[str] | None = None, formats: dict[str, str] | None = None, caption: str | None = None
):
    """The columns a text needs from a DataFrame or a list of dicts, numbers formatted for reading.

    ``columns`` picks and orders them (``{"old name": "shown name"}`` renames); ``formats`` maps a column to a
    format spec (``{"GB/s": ",.0f", "% of ceiling": ".1f"}``); missing values show as "—".
    """
    records = data.to_dict("records") if hasattr(data, "to_dict") else [dict(r) for r in data]
    if columns is None:
        columns = list(records[0]) if records else []
    names = dict(columns) if isinstance(columns, dict) else {c: c for c in columns}
    formats = formats or {}
    rows = [
        [_format_cell(rec.get(src), formats.get(shown, formats.get(src))) for src, shown in names.items()]
        for rec in records
    ]
    return Table(list(names.values()), rows, caption)


# --------------------------------------------------------------------------------------------------
# Notebooks: hand a measured number to the book's prose
# --------------------------------------------------------------------------------------------------
def glue(name: str, value, display: bool = False) -> None:
    """Store ``value`` in the running notebook's outputs under ``name``.

    The book's prose quotes it with MyST-NB's role ``{glue:text}`name:,.0f``` (from another page:
    ``{glue:text}`path/to/notebook.ipynb::name:,.0f```), so a number in a sentence is always the number
    the executed cell measured. This writes the scrapbook record that ``myst_nb.glue`` writes, without
    needing myst-nb in the kernel's environment; outside IPython it does nothing.
    """
    try:
        from IPython import get_ipython
        from IPython.core.formatters import format_display_data
        from IPython.display import display as ipy_display
    except ImportError:
        return
    if get_ipython() is None:
        return
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:  # numpy / torch scalar: store the plain number
        value = value.item()
    bundle, metadata = format_display_data(value)
    prefix = "" if display else "application/papermill.record/"
    metadata["scrapbook"] = {"name": name, "mime_prefix": prefix}
    ipy_display({prefix + k: v for k, v in bundle.items()}, raw=True, metadata=metadata)


def show_source(obj) -> None:
    """Print the source of a function or of a Triton kernel (jitted, autotuned or interpreted)."""
    import inspect

    while hasattr(obj, "fn"):  # autotuner -> jit function -> Python function
        obj = obj.fn
    print(inspect.getsource(obj))
