"""Small server-side SVG plots (histogram, line): no JavaScript, no external assets, CSP-clean (no style attributes).

Every text that goes into the markup is escaped here, invisible characters
(bidi controls, ...) as markers; numbers are formatted by Python, so the
returned `Markup` is safe to insert into a template.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape as _html_escape

from markupsafe import Markup

from factory.viewer.render import mark_invisible

WIDTH, HEIGHT = 420, 180
LEFT, RIGHT, TOP, BOTTOM = 44, 10, 22, 30
COLORS = ("#3366cc", "#dc3912", "#109618", "#ff9900", "#990099")


def escape(text: str) -> str:
    return _html_escape(mark_invisible(text))


def _fmt(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1000 or abs(value) < 0.01:
        return f"{value:.3g}"
    return f"{value:.2f}".rstrip("0").rstrip(".")


def _frame(title: str, x_range: tuple[float, float], y_range: tuple[float, float], body: list[str],
           x_label: str = "") -> Markup:
    (x0, x1), (y0, y1) = x_range, y_range
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    parts = [
        f'<svg class="plot" role="img" aria-label="{escape(title)}" xmlns="http://www.w3.org/2000/svg" '
        f'width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}">',
        f"<title>{escape(title)}</title>",
        f'<text x="{LEFT}" y="14" font-size="12" font-weight="bold">{escape(title)}</text>',
        f'<line x1="{LEFT}" y1="{TOP + plot_h}" x2="{LEFT + plot_w}" y2="{TOP + plot_h}" stroke="#888"/>',
        f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{TOP + plot_h}" stroke="#888"/>',
        f'<text x="{LEFT - 4}" y="{TOP + 8}" font-size="10" text-anchor="end">{_fmt(y1)}</text>',
        f'<text x="{LEFT - 4}" y="{TOP + plot_h}" font-size="10" text-anchor="end">{_fmt(y0)}</text>',
        f'<text x="{LEFT}" y="{HEIGHT - 14}" font-size="10">{_fmt(x0)}</text>',
        f'<text x="{LEFT + plot_w}" y="{HEIGHT - 14}" font-size="10" text-anchor="end">{_fmt(x1)}</text>',
        f'<text x="{LEFT + plot_w / 2:.1f}" y="{HEIGHT - 3}" font-size="10" text-anchor="middle">'
        f"{escape(x_label)}</text>",
        *body,
        "</svg>",
    ]
    return Markup("".join(parts))


def empty_plot(title: str, message: str = "no data") -> Markup:
    return _frame(title, (0, 1), (0, 1), [
        f'<text x="{WIDTH / 2:.0f}" y="{HEIGHT / 2:.0f}" font-size="12" text-anchor="middle" fill="#888">'
        f"{escape(message)}</text>"
    ])


def histogram(counts: Sequence[int], edges: Sequence[float], title: str, x_label: str = "") -> Markup:
    """Bars of `counts` between consecutive `edges` (len(edges) == len(counts) + 1)."""
    if not counts or sum(counts) == 0:
        return empty_plot(title)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    top = max(counts)
    bar_w = plot_w / len(counts)
    body = []
    for i, count in enumerate(counts):
        height = plot_h * count / top
        body.append(
            f'<rect x="{LEFT + i * bar_w + 0.5:.1f}" y="{TOP + plot_h - height:.1f}" width="{max(bar_w - 1, 0.5):.1f}" '
            f'height="{height:.1f}" fill="{COLORS[0]}">'
            f"<title>{_fmt(edges[i])} to {_fmt(edges[i + 1])}: {count}</title></rect>"
        )
    return _frame(title, (edges[0], edges[-1]), (0, top), body, x_label)


def lines(series: dict[str, tuple[Sequence[float], Sequence[float]]], title: str, x_label: str = "") -> Markup:
    """One polyline per named (xs, ys) series, with a legend; non-finite points are skipped."""
    points = {name: [(x, y) for x, y in zip(xs, ys) if math.isfinite(x) and math.isfinite(y)]
              for name, (xs, ys) in series.items()}
    points = {name: p for name, p in points.items() if p}
    if not points:
        return empty_plot(title)
    all_x = [x for p in points.values() for x, _ in p]
    all_y = [y for p in points.values() for _, y in p]
    x0, x1 = min(all_x), max(all_x)
    y0, y1 = min(all_y), max(all_y)
    if x1 == x0:
        x0, x1 = x0 - 0.5, x1 + 0.5
    if y1 == y0:
        y0, y1 = y0 - 0.5, y1 + 0.5
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    body = []
    for number, (name, p) in enumerate(points.items()):
        color = COLORS[number % len(COLORS)]
        coords = " ".join(f"{LEFT + plot_w * (x - x0) / (x1 - x0):.1f},{TOP + plot_h * (1 - (y - y0) / (y1 - y0)):.1f}"
                          for x, y in p)
        body.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        if len(p) == 1:
            cx, cy = coords.split(",")
            body.append(f'<circle cx="{cx}" cy="{cy}" r="2.5" fill="{color}"/>')
        body.append(f'<text x="{WIDTH - RIGHT - 4}" y="{TOP + 10 + 12 * number}" font-size="10" text-anchor="end" '
                    f'fill="{color}">{escape(name)}</text>')
    return _frame(title, (x0, x1), (y0, y1), body, x_label)
