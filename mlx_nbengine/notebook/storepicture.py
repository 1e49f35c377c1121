"""The store view as HTML: what the block store holds and how requests used it.

Terms:

- *view* (`store_html`): the engine's `cache_view()` dict: blocks and bytes held against
  the budget, running totals of blocks restored, computed and evicted, records by kind
  and the latest evictions.
- *figure* (`FIGURES`): one number with a word label and a detail line.
- *chart*: the history as step lines, one equal *band* per request (x), the running
  totals of blocks (y), one *series* per total (`SERIES`), each with its own dash.

The same HTML serves the static picture (after a ``<style>`` block) and the live widget.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mlx_nbengine.notebook.pictures import escape, style
from mlx_nbengine.notebook.words import format_bytes, plural, seconds

__all__ = ["FIGURES", "SERIES", "request_ticks", "store_html"]

# Store view figures: (data-name, label). Labels are words, never the dict's keys.
FIGURES: tuple[tuple[str, str], ...] = (
    ("blocks_held", "blocks held"),
    ("bytes_held", "bytes held"),
    ("file_size", "scratch file"),
    ("blocks_restored", "blocks restored"),
    ("blocks_computed", "blocks computed"),
    ("blocks_evicted", "blocks evicted"),
    ("requests", "requests"),
)

CHART_W, CHART_H = 480, 146
# The plot's margins inside the chart: left, bottom, top, right.
LEFT, BOTTOM, TOP, RIGHT = 44, 34, 8, 10
# The request axis labels every request up to ALL_TICKS of them, else about AXIS_TICKS.
ALL_TICKS = 12
AXIS_TICKS = 6
# Series of the chart: (history key, label, SVG dash pattern); blocks.css colours each by
# its key (``data-series``). The dash patterns tell the lines apart without colour; the
# legend draws the same ones.
SERIES = (
    ("restored", "restored", ""),
    ("computed", "computed", "7 3"),
    ("evicted", "evicted", "2 2"),
)


def _bytes(n: int | float | None) -> str:
    return format_bytes(n or 0)


def _svg_number(v: float) -> str:
    """A chart coordinate, with one decimal."""
    return f"{v:.1f}"


def _figure_value(name: str, view: Mapping[str, Any]) -> tuple[str, str]:
    """(value, detail) of one store figure."""

    def num(key: str) -> int:
        return int(view.get(key) or 0)

    if name == "bytes_held":
        budget = num("budget_bytes")
        detail = f"of {_bytes(budget)} budget" if budget else "no disk budget"
        return _bytes(num("bytes_held")), detail
    if name == "file_size":
        # free_bytes: free extents inside the scratch file, which later writes reuse first.
        return _bytes(num("file_size")), f"{_bytes(num('free_bytes'))} free for reuse"
    details = {
        "blocks_restored": f"{num('tokens_restored'):,} tokens",
        "blocks_computed": f"{num('tokens_computed'):,} tokens",
        "blocks_evicted": plural(num("records_evicted"), "record"),
        "blocks_held": plural(num("records"), "record"),
    }
    return f"{num(name):,}", details.get(name, "")


def request_ticks(n: int) -> list[int]:
    """The requests (numbered from 1) that the chart's x axis labels, of `n`.

    Every one up to `ALL_TICKS`; beyond, the first, the last and the multiples of a round
    step between them: the smallest step (1, 2, 2.5 or 5 times a power of ten, a whole
    number) that makes at most ``AXIS_TICKS + 1`` labels. A multiple within half a step
    of the first or the last is left out, so that no two labels crowd each other.
    """
    if n <= ALL_TICKS:
        return list(range(1, n + 1))
    scale = 1
    while True:
        for m in (1, 2, 2.5, 5):
            step = m * scale
            if step != int(step):
                continue
            inner = [r for r in range(int(step), n, int(step)) if r - 1 > step / 2]
            ticks = [1, *(r for r in inner if n - r > step / 2), n]
            if len(ticks) <= AXIS_TICKS + 1:
                return ticks
        scale *= 10


class _Plot:
    """Where a chart of `n` requests and totals up to `y_max` puts things."""

    def __init__(self, n: int, y_max: int) -> None:
        self.n, self.y_max = n, y_max
        self.width = CHART_W - LEFT - RIGHT
        self.height = CHART_H - TOP - BOTTOM

    def x(self, i: float) -> float:
        return LEFT + self.width * i / self.n

    def y(self, v: float) -> float:
        return TOP + self.height * (1 - v / self.y_max)


def _axes(plot: _Plot) -> str:
    """The grid lines, the y labels, the request labels and the axis title."""
    y0, y1, right = _svg_number(plot.y(0)), _svg_number(plot.y(plot.y_max)), CHART_W - RIGHT
    # Each label under the middle of its request's band; the axis title on a line below.
    tick_y = TOP + plot.height + 13
    ticks = "".join(
        f'<text class="mnb-axis mnb-tick" data-request="{r}" x="{_svg_number(plot.x(r - 0.5))}" '
        f'y="{tick_y}" text-anchor="middle">{r:,}</text>'
        for r in request_ticks(plot.n)
    )
    label_x = LEFT - 6
    return (
        f'<line class="mnb-grid" x1="{LEFT}" y1="{y0}" x2="{right}" y2="{y0}"/>'
        f'<line class="mnb-grid" x1="{LEFT}" y1="{y1}" x2="{right}" y2="{y1}"/>'
        f'<text class="mnb-axis" x="{label_x}" y="{_svg_number(plot.y(0) + 4)}" '
        'text-anchor="end">0</text>'
        f'<text class="mnb-axis" x="{label_x}" y="{_svg_number(plot.y(plot.y_max) + 4)}" '
        f'text-anchor="end">{plot.y_max:,}</text>'
        # The y axis title runs along the axis, clear of its labels (0 and the top).
        f'<text class="mnb-axis mnb-axis-y" transform="rotate(-90)" '
        f'x="{_svg_number(-(TOP + plot.height / 2))}" y="12" '
        f'text-anchor="middle">blocks</text>{ticks}'
        f'<text class="mnb-axis mnb-axis-title" x="{_svg_number(LEFT + plot.width / 2)}" '
        f'y="{CHART_H - 4}" text-anchor="middle">requests</text>'
    )


def _bands(plot: _Plot, points: Sequence[Mapping[str, Any]]) -> str:
    """One hover target per request: its totals in words."""
    out = []
    for i, p in enumerate(points):
        totals = " · ".join(f"{int(p.get(k) or 0):,} {label}" for k, label, *_ in SERIES)
        out.append(
            f'<rect class="mnb-band" x="{_svg_number(plot.x(i))}" y="{TOP}" '
            f'width="{_svg_number(plot.x(i + 1) - plot.x(i))}" height="{plot.height}" '
            f'fill="transparent"><title>request {i + 1}: {totals}</title></rect>'
        )
    return "".join(out)


def _series(plot: _Plot, points: Sequence[Mapping[str, Any]]) -> str:
    """One step line per series: each band draws its point's total across its width."""
    out = []
    for key, label, dash in SERIES:
        coords = []
        for i, p in enumerate(points):
            v = _svg_number(plot.y(int(p.get(key) or 0)))
            coords += [f"{_svg_number(plot.x(i))},{v}", f"{_svg_number(plot.x(i + 1))},{v}"]
        last = int(points[-1].get(key) or 0)
        dashes = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(
            f'<polyline class="mnb-series" data-series="{key}" fill="none" '
            f'stroke-width="2"{dashes} points="{" ".join(coords)}">'
            f"<title>{label}: {last:,} blocks</title></polyline>"
        )
    return "".join(out)


def _chart(history: Sequence[Mapping[str, Any]]) -> str:
    """The history as step lines: x is the request (each history point gets an equal
    band, in order), y the running total of blocks restored, computed and evicted.

    Not seconds since load: loading the model takes most of that time, which would
    squeeze every request into the right edge. Each band draws its point's totals across
    its whole width, so a single request is a visible line, not a lone corner.
    """
    points = [p for p in history if isinstance(p, Mapping)]
    label = 'role="img" aria-label="blocks restored, computed and evicted, by request"'
    if not points:
        # A one-line chart: no empty plot area before the first request.
        return (
            f'<svg class="mnb-chart" data-empty="true" viewBox="0 0 {CHART_W} 24" {label}>'
            '<text class="mnb-axis" x="0" y="16">no requests yet</text></svg>'
        )
    y_max = max(max(int(p.get(k) or 0) for k, *_ in SERIES) for p in points) or 1
    plot = _Plot(len(points), y_max)
    return (
        f'<svg class="mnb-chart" data-x="requests" data-points="{len(points)}" '
        f'viewBox="0 0 {CHART_W} {CHART_H}" {label}>'
        f"{_axes(plot)}{_bands(plot, points)}{_series(plot, points)}</svg>"
    )


def _chart_legend() -> str:
    # Each key draws a piece of its series' line: the same colour and dash pattern.
    items = []
    for key, label, dash in SERIES:
        dashes = f' stroke-dasharray="{dash}"' if dash else ""
        items.append(
            f'<span class="mnb-key" data-series="{key}"><svg class="mnb-line" '
            f'viewBox="0 0 20 4" aria-hidden="true"><line x1="0" y1="2" x2="20" y2="2" '
            f'stroke-width="2"{dashes}/></svg>{label}</span>'
        )
    return f'<div class="mnb-legend">{"".join(items)}</div>'


def _figures(view: Mapping[str, Any]) -> str:
    figures = []
    for name, label in FIGURES:
        value, detail = _figure_value(name, view)
        detail_html = f'<span class="mnb-detail">{escape(detail)}</span>' if detail else ""
        figures.append(
            f'<div class="mnb-figure" data-name="{name}"><span class="mnb-label">{label}</span>'
            f'<span class="mnb-value">{escape(value)}</span>{detail_html}</div>'
        )
    return f'<div class="mnb-figures">{"".join(figures)}</div>'


def _bar_width(share: float) -> int:
    """The held share of the budget bar's 1,000 units; a store holding anything shows."""
    return 0 if share <= 0 else max(4, round(share * 1000))


def _budget_bar(view: Mapping[str, Any]) -> str:
    held, budget = int(view.get("bytes_held") or 0), int(view.get("budget_bytes") or 0)
    if not budget:
        return ""
    share = min(1.0, held / budget)
    return (
        f'<div class="mnb-bar" data-share="{share:.4f}" title="bytes held: {_bytes(held)} of '
        f'{_bytes(budget)}"><svg class="mnb-bar-fill" viewBox="0 0 1000 1" '
        f'preserveAspectRatio="none" aria-hidden="true"><rect width="{_bar_width(share)}" '
        'height="1"/></svg>'
        f'</div><div class="mnb-bar-label">{_bytes(held)} held of {_bytes(budget)} budget '
        f"({share * 100:.1f} %)</div>"
    )


def _kinds(view: Mapping[str, Any]) -> str:
    rows = "".join(
        f'<tr data-record="{escape(k)}"><td>{escape(k)}</td><td class="mnb-num">'
        f"{int(v.get('records') or 0):,}</td>"
        f'<td class="mnb-num">{_bytes(v.get("bytes"))}</td></tr>'
        for k, v in (view.get("by_kind") or {}).items()
        if isinstance(v, Mapping) and (v.get("records") or v.get("bytes"))
    )
    if not rows:
        return '<p class="mnb-empty">no records held</p>'
    return (
        '<table class="mnb-table mnb-kinds"><thead><tr><th>record kind</th>'
        f'<th class="mnb-num">records</th><th class="mnb-num">bytes</th></tr></thead>'
        f"<tbody>{rows}</tbody></table>"
    )


def _evictions(view: Mapping[str, Any]) -> str:
    evictions = [e for e in view.get("recent_evictions") or () if isinstance(e, Mapping)]
    items = "".join(
        f'<li data-record="{escape(e.get("kind", ""))}"><span class="mnb-num mnb-time">'
        f"{seconds(float(e.get('t') or 0.0))}</span>"
        f'<span class="mnb-rec" data-read="true">{escape(e.get("kind", ""))}</span>'
        f'<span class="mnb-num">{_bytes(e.get("bytes"))}</span>'
        f'<q class="mnb-head">{escape(e.get("text") or "")}</q></li>'
        for e in evictions
    )
    if not items:
        return '<p class="mnb-empty">no evictions yet</p>'
    return f'<ul class="mnb-evictions">{items}</ul>'


def store_html(view: Mapping[str, Any], *, live: bool = False) -> str:
    """The store view: figures, the budget bar, chart, kinds, evictions. `live` leaves
    out the ``<style>`` block (a widget has its CSS)."""
    view = view or {}
    title = "Block store"
    if view.get("model"):
        title += f" · {escape(view['model'])}"
    if view.get("block_size"):
        title += f" · blocks of {int(view['block_size']):,} tokens"
    backend = str(view.get("backend") or "")
    if backend == "off":
        backend = "no block store: every block is computed"
    sub = f'<div class="mnb-sub">{escape(backend)}</div>' if backend else ""
    history = [p for p in view.get("history") or () if isinstance(p, Mapping)]
    return (
        f'{"" if live else style()}<div class="mnb-root mnb-store">'
        f'<div class="mnb-title">{title}</div>{sub}{_figures(view)}{_budget_bar(view)}'
        f'<div class="mnb-panels"><div class="mnb-panel"><div class="mnb-subtitle">'
        f"blocks by request (running totals)</div>{_chart(history)}"
        f"{_chart_legend() if history else ''}</div>"
        f'<div class="mnb-panel"><div class="mnb-subtitle">records by kind</div>{_kinds(view)}'
        f'<div class="mnb-subtitle">latest evictions</div>{_evictions(view)}</div></div></div>'
    )
