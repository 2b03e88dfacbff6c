"""The in-flight plot: requests per server over time, one panel per run.

matplotlib is not a fleetgen dependency, so the plot is a small hand-written SVG; with
matplotlib installed a PNG is written as well.

    write_plot(path_stem, [Panel("fleetgen", lines, slots=40, window=(0.6, 58.9))])
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from html import escape
from pathlib import Path

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")
WIDTH, PANEL_HEIGHT, MARGIN = 960, 240, 48


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


def write_plot(stem: Path, panels: list[Panel]) -> list[Path]:
    """Write `stem`.svg (always) and `stem`.png (if matplotlib is importable)."""
    svg = stem.with_suffix(".svg")
    svg.write_text(render_svg(panels))
    written = [svg]
    with contextlib.suppress(ImportError):
        written.append(_png(stem.with_suffix(".png"), panels))
    return written


def render_svg(panels: list[Panel]) -> str:
    x_max = max((x for p in panels for ln in p.lines for x, _ in ln.points), default=1.0) or 1.0
    height = PANEL_HEIGHT * len(panels) + MARGIN
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
             'font-family="sans-serif" font-size="11">',
             f'<rect width="{WIDTH}" height="{height}" fill="white"/>']
    for i, panel in enumerate(panels):
        parts += _panel(panel, i * PANEL_HEIGHT, x_max)
    parts.append("</svg>")
    return "\n".join(parts)


def _panel(panel: Panel, top: float, x_max: float) -> list[str]:
    y_max = max([panel.slots * 1.25] + [y for ln in panel.lines for _, y in ln.points])
    left, right = MARGIN + 10, WIDTH - 150
    bottom, upper = top + PANEL_HEIGHT - 30, top + 30

    def sx(x: float) -> float:
        return left + (right - left) * x / x_max

    def sy(y: float) -> float:
        return bottom - (bottom - upper) * y / y_max

    out = [f'<text x="{left}" y="{top + 20}" font-size="13" font-weight="bold">'
           f'{escape(panel.title)}</text>']
    if panel.window:
        x0, x1 = (sx(v) for v in panel.window)
        out.append(f'<rect x="{x0:.1f}" y="{upper}" width="{max(0.0, x1 - x0):.1f}" '
                   f'height="{bottom - upper}" fill="#f0f0f0"/>')
    out.append(f'<line x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="black"/>')
    out.append(f'<line x1="{left}" y1="{upper}" x2="{left}" y2="{bottom}" stroke="black"/>')
    for tick in range(0, int(x_max) + 1, max(1, int(x_max // 10))):
        out.append(f'<text x="{sx(tick):.1f}" y="{bottom + 14}" text-anchor="middle">'
                   f'{tick}s</text>')
    for value in (0, panel.slots, int(y_max)):
        out.append(f'<text x="{left - 4}" y="{sy(value) + 4:.1f}" text-anchor="end">'
                   f'{value}</text>')
    out.append(f'<line x1="{left}" y1="{sy(panel.slots):.1f}" x2="{right}" '
               f'y2="{sy(panel.slots):.1f}" stroke="#999" stroke-dasharray="2,3"/>')
    for n, line in enumerate(panel.lines):
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in line.points)
        style = 'stroke-dasharray="4,3" stroke-opacity="0.5"' if line.dashed else ""
        out.append(f'<polyline points="{path}" fill="none" stroke="{line.color}" '
                   f'stroke-width="1.2" {style}/>')
        out.append(f'<text x="{right + 8}" y="{upper + 14 * n + 8}" fill="{line.color}">'
                   f'{escape(line.label)}</text>')
    for n, note in enumerate(panel.notes):
        out.append(f'<text x="{right + 8}" y="{upper + 14 * (len(panel.lines) + n + 1) + 8}" '
                   f'fill="#555">{escape(note)}</text>')
    return out


def _png(path: Path, panels: list[Panel]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 3 * len(panels)), squeeze=False)
    for ax, panel in zip(axes[:, 0], panels, strict=False):
        for line in panel.lines:
            xs, ys = zip(*line.points, strict=False) if line.points else ((), ())
            ax.plot(xs, ys, color=line.color, lw=1, ls="--" if line.dashed else "-",
                    alpha=0.5 if line.dashed else 1.0, label=line.label)
        ax.axhline(panel.slots, color="#999", ls=":")
        if panel.window:
            ax.axvspan(*panel.window, color="#f0f0f0")
        ax.set_title(panel.title, loc="left")
        ax.set_ylabel(panel.y_label)
        ax.legend(loc="upper right", fontsize=7)
    axes[-1, 0].set_xlabel("seconds since the run started")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
