"""PNG figures for the experiments and bench scripts (matplotlib, Agg backend).

Every script that takes ``--plot PATH`` draws through :func:`line_chart` or
:func:`bar_chart` so the figures look alike. matplotlib is imported lazily (it
is in the ``bench`` extra, not a runtime dependency); a missing matplotlib is an
ImportError naming the extra.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("--plot needs matplotlib: pip install 'pagedserve[bench]'") from e
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def new_figure(ncols: int = 1, nrows: int = 1, width: float = 5.0, height: float = 3.6):
    """(figure, flat list of axes) for a grid of nrows x ncols panels, each width x height inches."""
    plt = _pyplot()
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)
    return fig, [ax for row in axes for ax in row]


def draw_lines(ax, x: Sequence[float], series: Mapping[str, Sequence[float]], *, xlabel: str, ylabel: str,
               title: str = "", logx: bool = False, logy: bool = False) -> None:
    """One line with markers per entry of series (label -> y values, same length as x)."""
    for label, ys in series.items():
        ax.plot(list(x), list(ys), marker="o", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")


def draw_bars(ax, groups: Sequence[str], series: Mapping[str, Sequence[float]], *, ylabel: str,
              title: str = "") -> None:
    """Grouped bars: one group per entry of groups, one bar per entry of series within each group."""
    n = max(1, len(series))
    width = 0.8 / n
    for i, (label, ys) in enumerate(series.items()):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, list(ys), width=width, label=label)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(list(groups))
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize="small")


def label_bars(ax, fmt: str | Callable[[float], str] = "{:.1f}") -> None:
    """Writes each bar's value above it, for every bar series drawn on ax; fmt is a
    format string ("{:.1f}") or a function of the value returning the label."""
    text = fmt if callable(fmt) else fmt.format
    for bars in ax.containers:
        ax.bar_label(bars, labels=[text(b.get_height()) for b in bars], fontsize="x-small", padding=2)
    ax.margins(y=0.12)  # room for the labels above the tallest bar


def legend_below(ax, ncols: int = 1) -> None:
    """Moves ax's legend under the panel, below its x tick labels and x label (one
    line of each), where it covers no data. Call it after setting the x label."""
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.24 if ax.get_xlabel() else -0.12),
              ncols=ncols, fontsize="small", frameon=False)


def save(fig, path: str, suptitle: str = "") -> str:
    """Writes the figure as PNG to path (parent folders created), closes it, returns path."""
    plt = _pyplot()
    if suptitle:
        fig.suptitle(suptitle)
    fig.tight_layout()
    fig.tight_layout()  # again: a legend anchored below a panel moves when the first pass resizes it
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
    return path


def line_chart(path: str, x: Sequence[float], series: Mapping[str, Sequence[float]], *, xlabel: str,
               ylabel: str, title: str = "", logx: bool = False, logy: bool = False) -> str:
    """A one-panel line chart written to path (PNG). Returns path."""
    fig, (ax,) = new_figure()
    draw_lines(ax, x, series, xlabel=xlabel, ylabel=ylabel, title=title, logx=logx, logy=logy)
    return save(fig, path)


def bar_chart(path: str, groups: Sequence[str], series: Mapping[str, Sequence[float]], *, ylabel: str,
              title: str = "") -> str:
    """A one-panel grouped bar chart written to path (PNG). Returns path."""
    fig, (ax,) = new_figure()
    draw_bars(ax, groups, series, ylabel=ylabel, title=title)
    return save(fig, path)


def require_writable(parser, path: str | None) -> None:
    """For --plot PATH: exits through parser.error (status 2, one line) before a
    long run, not after it, when PATH is a directory or cannot be written
    (parent folders are created; an empty file is left at PATH). None: no-op."""
    if path is None:
        return
    try:
        if os.path.isdir(path):
            raise IsADirectoryError(f"{path} is a directory: give a file name such as {os.path.join(path, 'fig.png')}")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "ab"):
            pass
    except OSError as e:
        parser.error(f"--plot: {e}")
