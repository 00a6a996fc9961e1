"""PNG plots of benchmark results (matplotlib, headless), one small helper per chart shape."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display on cluster nodes
    import matplotlib.pyplot as plt

    return plt


def _plain_numbers(axis) -> None:
    """Log axes tick at 1, 2, 5 x 10^k and label them as 200, not 2x10^2."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(FuncFormatter(lambda v, _: ""))


def _save(plt, fig, ax, path: Path, **legend: object) -> Path:
    ax.legend(fontsize=8, **legend)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def bars(
    path: Path,
    title: str,
    ylabel: str,
    categories: Sequence[str],
    series: Mapping[str, Sequence[float]],
    log: bool = False,
) -> Path:
    """Grouped bars: one group per category, one bar per series."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=90)
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [c + (i - (len(series) - 1) / 2) * width for c in range(len(categories))]
        ax.bar(xs, values, width, label=name)
    ax.set_xticks(range(len(categories)), list(categories))
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if log:
        ax.set_yscale("log")
        _plain_numbers(ax.yaxis)
    ax.grid(axis="y", alpha=0.3)
    return _save(plt, fig, ax, path)


def lines(
    path: Path,
    title: str,
    xlabel: str,
    ylabel: str,
    xs: Sequence[float],
    series: Mapping[str, Sequence[float]],
    logx: bool = False,
    logy: bool = False,
) -> Path:
    """One line (with markers) per series over shared x values."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=90)
    for name, values in series.items():
        ax.plot(xs, values, marker="o", label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if logx:
        ax.set_xscale("log")
        ax.set_xticks(list(xs), [f"{x:g}" for x in xs])
        ax.minorticks_off()
    if logy:
        ax.set_yscale("log")
        _plain_numbers(ax.yaxis)
    ax.grid(alpha=0.3)
    return _save(plt, fig, ax, path)


def stacked(
    path: Path,
    title: str,
    ylabel: str,
    categories: Sequence[str],
    series: Mapping[str, Sequence[float]],
) -> Path:
    """Stacked bars: one bar per category, one segment per series."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(7, 1.1 * len(categories)), 4.5), dpi=90)
    bottom = [0.0] * len(categories)
    for name, values in series.items():
        ax.bar(range(len(categories)), values, 0.6, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xticks(range(len(categories)), list(categories), fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    return _save(plt, fig, ax, path, loc="upper left", bbox_to_anchor=(1.0, 1.0))
