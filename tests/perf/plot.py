"""The in-flight plot: requests per server over time, one panel per run (matplotlib, `perf` extra).

    write_plot(path.with_suffix(".png"), [Panel("fleetgen", lines, slots=40, window=(0.6, 58.9))])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

# A Figure of its own, not pyplot: no global figure state, no GUI backend, nothing to close.
from matplotlib.figure import Figure

# matplotlib's own cycle, named so one server's two lines share a colour.
COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")


@dataclass(frozen=True)
class Line:
    """One series: (x, y) points; dashed lines are drawn lighter."""

    label: str
    points: list[tuple[float, float]]
    color: str
    dashed: bool = False


@dataclass(frozen=True)
class Panel:
    title: str
    lines: list[Line]
    slots: int
    window: tuple[float, float] | None = None
    y_label: str = "requests"
    notes: list[str] = field(default_factory=list)


def write_plot(path: Path, panels: list[Panel]) -> Path:
    """Draw the panels one above the other, sharing the time axis, into `path` (PNG, SVG, ...)."""
    fig = Figure(figsize=(11, 3 * len(panels)), layout="tight")
    axes = fig.subplots(len(panels), 1, squeeze=False, sharex=True)
    for ax, panel in zip(axes[:, 0], panels, strict=True):
        if panel.window:
            ax.axvspan(*panel.window, color="0.94", label="steady window")
        ax.axhline(panel.slots, color="0.6", ls=":", lw=1)
        for line in panel.lines:
            xs = [x for x, _ in line.points]
            ys = [y for _, y in line.points]
            ax.plot(xs, ys, color=line.color, lw=1, ls="--" if line.dashed else "-",
                    alpha=0.5 if line.dashed else 1.0, label=line.label)
        if panel.notes:
            ax.text(1.01, 0.0, "\n".join(panel.notes), transform=ax.transAxes, fontsize=8,
                    color="0.3", va="bottom")
        ax.set_title(panel.title, loc="left", fontsize=10)
        ax.set_ylabel(panel.y_label)
        ax.set_ylim(bottom=0)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    axes[-1, 0].set_xlabel("seconds since the run started")
    fig.savefig(path, dpi=100)
    return path
