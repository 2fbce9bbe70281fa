"""A picture of a ``BisectReport``: one self-contained HTML page (``to_html``) or a PNG (``to_png``).

The table (``str(report)``) gives numbers; the picture shows where along the model an error
appears and how far over its budget it is. Each module call is one row, in call order (a
module after its submodules, as the report lists them), names on the left, and on the right
torch fp32's and JAX's error against float64 on one log10 axis with the row's budget as a tick.
A correct port is a column of dots left of their ticks; a bug is a dot far right of its tick at
the first divergent row (highlighted) and every row downstream.

Two values have no place on a log axis and must not look like agreement: an exact zero is drawn
in a band left of the axis labelled ``0``, NaN or inf in a band right of it labelled ``NaN/inf``.
A row that was not compared (covered by its parent, skipped) gets no dots, only its status.

The page needs no network and no JavaScript: inline CSS and SVG, a ``<title>`` per row for
the numbers on hover. Every row carries ``data-module="<path>"`` (gradients ``data-param``), the
first divergent ``data-first-divergent="true"`` and ``id="first-divergent"``, so a test or a
script can read the picture's structure.

The report is read duck-typed (rows, grad_rows, positions, summary()): ``bisect_report`` calls
this module, so it must not import ``bisect_report`` back (an import circle).
"""

from __future__ import annotations

import html
import io
import math
import textwrap

import numpy as np

ROW_H = 18  # px per row: fixed, so a 60-module model is a 60-row list, not a squeezed plot
CHAR_W = 7.3  # px per character of 12px monospace: the name columns are sized from the text
AXIS_W, BAND_W = 420, 46  # the log axis and each of the "0" and "NaN/inf" bands beside it

# colours: JAX within budget, JAX over it, torch fp32 (the reference's own rounding), budget tick
OK, BAD, TORCH, BUDGET = "#2a7d2a", "#c0262d", "#777", "#111"

_CSS = """body{font-family:sans-serif;margin:1.5em;color:#111}pre{background:#f4f4f4;padding:.6em;
white-space:pre-wrap}svg text{font-size:12px}.name{font-family:monospace}.axis{fill:#555;font-size:11px}
.band{fill:#eee}.grid{stroke:#ddd}.first{fill:#fff3b0;stroke:#c0262d}.stripe{fill:#f7f7f7}
h2{font-size:1.05em;margin:1.2em 0 .3em}.legend{font-size:.85em;color:#333}"""


def _short(status: str) -> str:
    """A status in a word or two for the row (the full text is in the row's tooltip)."""
    if status.startswith(("covered", "skipped")):
        return status.split(":")[0]
    return {"not finite in either framework": "NaN/inf both", "not finite in torch only": "NaN/inf torch"}.get(
        status, status)


def _not_compared(status: str) -> bool:
    return status.startswith(("covered", "skipped"))


def _fails(status: str) -> bool:
    return status in ("introduced", "inherited", "diverged") or status.startswith("not finite")


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2e}" if math.isfinite(x) else str(x)


class _LogAxis:
    """x of a value on a log10 axis from ``lo`` to ``hi`` (powers of ten) at ``x0``; zero and NaN/inf
    go to their bands, so no value is clipped into the axis where it would read as a number."""

    def __init__(self, values, x0: float, width: float = AXIS_W):
        pos = [v for v in values if v is not None and math.isfinite(v) and v > 0]
        lo = math.floor(math.log10(min(pos))) if pos else -8
        hi = math.ceil(math.log10(max(pos))) if pos else 0
        self.lo, self.hi = lo, max(hi, lo + 3)  # at least three decades: a flat axis misleads
        self.x0, self.width = x0, width

    def x(self, v) -> tuple[float, str] | None:
        if v is None:
            return None
        if not math.isfinite(v):
            return self.x0 + self.width + BAND_W / 2, "nonfinite"
        if v <= 0:
            return self.x0 - BAND_W / 2, "zero"
        return self.x0 + (math.log10(v) - self.lo) / (self.hi - self.lo) * self.width, "value"


def _depths(paths: list[str]) -> list[int]:
    """Nesting depth of each call path (as ``report.tree()`` indents): how many called paths contain it."""
    called = {p.split("#")[0] for p in paths}
    return [sum(1 for c in called if c != p.split("#")[0] and (not c or p.startswith(c + "."))) for p in paths]


def _highlighted(report) -> str | None:
    """The row path of the first divergent module (the model's own row is path "")."""
    return report.first_divergent_path


def _rows_svg(items, attr: str, first: str | None, title: str) -> str:
    """One panel: ``items`` are (key, label, depth, kind, status, torch_err, jax_err, budget, extra)."""
    labels = ["  " * depth + label for _, label, depth, *_ in items]
    name_w = CHAR_W * max(map(len, labels + ["module"])) + 12
    kind_w = CHAR_W * max(len(it[3]) for it in items) + 12 if any(it[3] for it in items) else 0
    status_w = CHAR_W * 13 + 8
    axis = _LogAxis([v for it in items for v in it[5:8]], name_w + kind_w + status_w + BAND_W)
    right = axis.x0 + axis.width + BAND_W + 8
    width, top = right + CHAR_W * 28, 40
    height = top + ROW_H * len(items) + 6
    out = [f'<svg width="{width:.0f}" height="{height}" role="img" aria-label="{html.escape(title)}">']
    # the axis: a band for exact zeros, decades, a band for NaN/inf; labelled, so neither reads as a value
    out.append(f'<rect class="band" x="{axis.x0 - BAND_W}" y="{top - 4}" width="{BAND_W - 4}" '
               f'height="{height - top}"/><text class="axis" x="{axis.x0 - BAND_W / 2}" y="{top - 22}" '
               'text-anchor="middle">0</text>')
    out.append(f'<rect class="band" x="{axis.x0 + axis.width + 4}" y="{top - 4}" width="{BAND_W - 4}" '
               f'height="{height - top}"/><text class="axis" x="{axis.x0 + axis.width + BAND_W / 2 + 2}" '
               f'y="{top - 22}" text-anchor="middle">NaN/inf</text>')
    for d in range(axis.lo, axis.hi + 1):
        x = axis.x(10.0 ** d)[0]
        out.append(f'<line class="grid" x1="{x:.1f}" x2="{x:.1f}" y1="{top - 4}" y2="{height}"/>'
                   f'<text class="axis" x="{x:.1f}" y="{top - 8}" text-anchor="middle">1e{d}</text>')
    head = [(6, {"data-module": "module", "data-expert": "expert"}.get(attr, "parameter")), (name_w + 6, "class" if kind_w else ""),
            (name_w + kind_w + 6, "status"), (right, "JAX / budget")]
    out += [f'<text x="{x:.0f}" y="12" font-weight="bold">{t}</text>' for x, t in head if t]
    for i, ((key, label, _, kind, status, t_err, j_err, limit, extra), text) in enumerate(zip(items, labels)):
        y = top + i * ROW_H
        mid = y + ROW_H / 2
        is_first = key == first
        mark = ' data-first-divergent="true" id="first-divergent"' if is_first else ""
        tip = (f"{label} [{kind}]: JAX {_fmt(j_err)}, torch fp32 {_fmt(t_err)}, budget {_fmt(limit)} "
               f"against float64; {status}{extra}")
        drawn = "none" if _not_compared(status) or j_err is None else axis.x(j_err)[1]  # value, zero or nonfinite
        out.append(f'<g {attr}="{html.escape(key)}" data-status="{html.escape(status)}" data-jax="{drawn}"{mark}>'
                   f'<title>{html.escape(tip)}</title>')
        cls = "first" if is_first else "stripe" if i % 2 else ""
        if cls:
            out.append(f'<rect class="{cls}" x="1" y="{y}" width="{width - 2:.0f}" height="{ROW_H}"/>')
        color = BAD if _fails(status) else "#888" if _not_compared(status) else OK
        weight = ' font-weight="bold"' if status == "introduced" else ""
        out.append(f'<text class="name" x="6" y="{mid + 4}" xml:space="preserve">{html.escape(text)}</text>')
        if kind_w:
            out.append(f'<text class="name" x="{name_w + 6:.0f}" y="{mid + 4}" fill="#555">{html.escape(kind)}</text>')
        out.append(f'<text x="{name_w + kind_w + 6:.0f}" y="{mid + 4}" fill="{color}"{weight}>'
                   f'{html.escape(_short(status))}</text>')
        if _not_compared(status):
            out.append(f'<text x="{axis.x0 + 4:.0f}" y="{mid + 4}" fill="#888" font-style="italic">not compared'
                       '</text></g>')
            continue
        out.append(_row_marks(axis, mid, t_err, j_err, limit, status))
        ratio = "" if not limit or j_err is None else (
            f"{j_err / limit:.2g}×" if math.isfinite(j_err) else "NaN/inf")
        out.append(f'<text x="{right:.0f}" y="{mid + 4}" fill="{color}">{ratio}{" ◀ first divergent" if is_first else ""}'
                   f'{html.escape(extra)}</text></g>')
    out.append("</svg>")
    return "".join(out)


def _row_marks(axis: _LogAxis, mid: float, t_err, j_err, limit, status: str) -> str:
    """Budget tick, torch fp32's hollow grey diamond, JAX's dot: filled where this call made the
    error (introduced, or over budget with no rerun), hollow where it only received it (inherited)."""
    marks = []
    b = axis.x(limit)
    if b is not None:
        marks.append(f'<line x1="{b[0]:.1f}" x2="{b[0]:.1f}" y1="{mid - 7}" y2="{mid + 7}" stroke="{BUDGET}" '
                     'stroke-width="2"/>')
    t, j = axis.x(t_err), axis.x(j_err)
    if t is not None and j is not None and t[1] == j[1] == "value":  # how far JAX is from torch's own error
        marks.append(f'<line x1="{t[0]:.1f}" x2="{j[0]:.1f}" y1="{mid}" y2="{mid}" stroke="#bbb"/>')
    if t is not None:
        marks.append(f'<path d="M{t[0]:.1f} {mid - 5}l5 5l-5 5l-5 -5z" fill="white" stroke="{TORCH}" '
                     'stroke-width="1.5"/>')
    if j is not None:
        color = BAD if _fails(status) else OK
        fill = "white" if status == "inherited" else color
        marks.append(f'<circle cx="{j[0]:.1f}" cy="{mid}" r="4.5" fill="{fill}" stroke="{color}" stroke-width="2"/>')
    return "".join(marks)


def _module_items(report) -> list[tuple]:
    rows = report.rows
    items = []
    for r, depth in zip(rows, _depths([r.path for r in rows])):
        extra = "".join(f"; {n} values NaN/inf {side}" for n, side in (
            (r.nonfinite_jax, "in JAX only"), (r.nonfinite_torch, "in torch only"), (r.nonfinite_both, "in both"))
            if n)
        items.append((r.path, r.path or "(model)", depth, r.kind,
                      r.status, r.torch_err, r.jax_err, r.budget, extra))
    return items


def _grad_items(report) -> list[tuple]:
    return [(g.name, g.name, 0, "", g.status, g.torch_err, g.jax_err, g.budget,
             f"; {g.note}" if g.note else "") for g in report.grad_rows]


def _expert_items(report) -> list[tuple]:
    """A mixture of experts: each expert of each experts call run alone, with the tokens the batch sent it."""
    loads = {r.path: r.load for r in getattr(report.routing, "routers", ())}
    items = []
    for label, rows in getattr(report, "experts", {}).items():
        load = loads.get(label.replace(".experts", ".gate"), ())
        for r in rows:
            chosen = f"; chosen {load[r.expert]} times in this batch" if r.expert < len(load) else ""
            items.append((f"{label}[{r.expert}]", f"{label} expert {r.expert}", 0, "expert",
                          "ok" if r.passed else "diverged", r.torch_err, r.jax_err, r.budget, chosen))
    return items


def _positions_svg(path: str, found) -> str:
    """JAX's and torch fp32's error per position of one call, its budget and onset (log y axis;
    zeros in a band below, NaN/inf in a band above, as in the rows)."""
    w, h, left, top = 420, 170, 52, 22
    axis = _LogAxis([float(v) for v in np.concatenate([found.jax, found.torch])] + [found.budget], 0.0)
    n = len(found.jax)
    px = lambda p: left + 8 + p * (w - left - 16) / max(n - 1, 1)  # noqa: E731
    py = lambda v: h - 20 - (math.log10(v) - axis.lo) / (axis.hi - axis.lo) * (h - top - 40)  # noqa: E731

    def y_of(v):  # zeros in the band at the bottom, NaN/inf in the one at the top
        v = float(v)
        return top + 4 if not math.isfinite(v) else h - 6 if v <= 0 else py(v)

    name = f"{path or '(model)'}: positions 0 to {n - 1}" + ("" if found.onset is None else f", onset {found.onset}")
    out = [f'<svg width="{w}" height="{h + 4}" data-positions="{html.escape(path)}">',
           f'<text x="{left}" y="12" font-weight="bold">{html.escape(name)}</text>',
           f'<rect class="band" x="{left}" y="{top - 4}" width="{w - left}" height="14"/>'
           f'<rect class="band" x="{left}" y="{h - 12}" width="{w - left}" height="12"/>'
           f'<text class="axis" x="{left - 4}" y="{top + 8}" text-anchor="end">NaN/inf</text>'
           f'<text class="axis" x="{left - 4}" y="{h - 2}" text-anchor="end">0</text>']
    for d in range(axis.lo, axis.hi + 1):
        y = py(10.0 ** d)
        out.append(f'<line class="grid" x1="{left}" x2="{w}" y1="{y:.1f}" y2="{y:.1f}"/>'
                   f'<text class="axis" x="{left - 4}" y="{y + 4:.1f}" text-anchor="end">1e{d}</text>')
    y = y_of(found.budget)
    out.append(f'<line x1="{left}" x2="{w}" y1="{y:.1f}" y2="{y:.1f}" stroke="{BUDGET}" stroke-dasharray="5 3"/>')
    if found.onset is not None:
        out.append(f'<line x1="{px(found.onset):.1f}" x2="{px(found.onset):.1f}" y1="{top}" y2="{h}" stroke="{BAD}" '
                   f'opacity="0.5"/>')
    for series, color, dash in ((found.torch, TORCH, ' stroke-dasharray="2 2"'), (found.jax, BAD, "")):
        pts = " ".join(f"{px(p):.1f},{y_of(v):.1f}" for p, v in enumerate(series))
        out.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="1.5"{dash}/>')
    out.append("</svg>")
    return "".join(out)


def _position_paths(report) -> list[str]:
    """Whose positions are drawn: the first divergent call's and the model output's (as the JSON keeps)."""
    first = _highlighted(report)
    return [p for p in dict.fromkeys([first, ""]) if p is not None and p in report.positions]


def to_html(report) -> str:
    """The report as one self-contained HTML page (no script, no network): see the module docstring."""
    first, rule = _highlighted(report), report.rule
    parts = [f"<!doctype html><html><head><meta charset=\"utf-8\"><title>bisect: "
             f"{html.escape(report.summary().splitlines()[-1])}</title><style>{_CSS}</style></head><body>",
             f"<h1 style=\"font-size:1.2em\">bisect: {'PASSED' if report.passed else 'FAILED'}</h1>",
             f"<pre>{html.escape(report.summary())}</pre>",
             '<p class="legend">Error against float64, log scale: <span style="color:#777">◇ torch fp32</span>, '
             f'<span style="color:{OK}">● JAX within budget</span>, <span style="color:{BAD}">● JAX over budget, '
             'introduced here</span>, <span style="color:#c0262d">○ inherited (correct on the right input)</span>, '
             f'| budget = max({rule.slack:g} × torch fp32, {rule.floor_ulps:g} {rule.name} step(s) of the output). '
             'Exact zeros sit in the band '
             'labelled 0, NaN or inf in the band labelled NaN/inf. The highlighted row is the first divergent '
             'module; hover a row for its numbers.</p>',
             f"<h2>module outputs, in call order ({len(report.rows)} calls)</h2>",
             _rows_svg(_module_items(report), "data-module", first, "module outputs")]
    if report.grad_rows:
        parts += [f"<h2>gradients by parameter ({len(report.grad_rows)}; one budget for the model)</h2>",
                  _rows_svg(_grad_items(report), "data-param", report.first_divergent_grad, "gradients")]
    experts = _expert_items(report)
    if experts:
        parts += [f"<h2>experts, each run alone on its layer's tokens ({len(experts)})</h2>",
                  _rows_svg(experts, "data-expert", None, "experts")]
    shown = _position_paths(report)
    if shown:
        parts += ["<h2>error per position (JAX red, torch fp32 grey dotted, budget dashed)</h2><div>",
                  *(_positions_svg(p, report.positions[p]) for p in shown), "</div>"]
    page = "\n".join(parts + ["</body></html>\n"])
    # a bf16 model's report: torch ran in bf16 (``precision.py``), and every label says so
    return page if rule.short == "fp32" else page.replace("torch fp32", f"torch {rule.short}")


def to_png(report, *, dpi: int = 100) -> bytes:
    """The same picture as a PNG, drawn with matplotlib's Agg canvas (no display, no pyplot state)."""
    from matplotlib.figure import Figure

    panels = [("module outputs, in call order", _module_items(report), _highlighted(report))]
    if report.grad_rows:
        panels.append(("gradients by parameter", _grad_items(report), report.first_divergent_grad))
    if _expert_items(report):
        panels.append(("experts, each run alone", _expert_items(report), None))
    shown = _position_paths(report)
    heights = [max(len(items), 3) * 0.19 + 0.6 for _, items, _ in panels] + ([2.2] if shown else [])
    summary = "\n".join(textwrap.fill(line, 150, subsequent_indent="    ") for line in report.summary().splitlines())
    head = 0.15 + 0.14 * (summary.count("\n") + 1)  # inches for the verdict above the panels
    fig = Figure(figsize=(11, sum(heights) + head))
    grid = fig.add_gridspec(len(heights), max(len(shown), 1), height_ratios=heights)
    for k, (title, items, first) in enumerate(panels):
        _draw_rows(fig.add_subplot(grid[k, :]), title, items, first, f"torch {report.rule.short}")
    for k, path in enumerate(shown):
        _draw_positions(fig.add_subplot(grid[len(panels), k]), path, report.positions[path],
                        f"torch {report.rule.short}")
    fig.suptitle(summary, fontsize=8, x=0.01, y=0.995, ha="left", va="top", family="monospace")
    fig.tight_layout(rect=(0, 0, 1, 1 - head / (sum(heights) + head)))
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    # a few flat colours: a palette PNG is a third of the size, small enough for docs and reports
    from PIL import Image

    small = io.BytesIO()
    Image.open(io.BytesIO(buf.getvalue())).convert("RGB").quantize(colors=64).save(small, format="png", optimize=True)
    return small.getvalue()


def _draw_rows(ax, title: str, items, first, torch_name: str = "torch fp32") -> None:
    axis = _LogAxis([v for it in items for v in it[5:8]], 0.0)
    lo, hi = 10.0 ** axis.lo, 10.0 ** axis.hi
    zero, nonfinite = lo / 10 ** 0.8, hi * 10 ** 0.8  # the bands, as in the page
    place = lambda v: None if v is None else nonfinite if not math.isfinite(v) else zero if v <= 0 else v  # noqa: E731
    ax.set_xscale("log")
    ax.set_xlim(lo / 10 ** 1.6, hi * 10 ** 1.6)
    ax.axvspan(lo / 10 ** 1.6, lo / 10 ** 0.1, color="#eee")
    ax.axvspan(hi * 10 ** 0.1, hi * 10 ** 1.6, color="#eee")
    labels = []
    for i, (key, label, _, kind, status, t_err, j_err, limit, _) in enumerate(items):
        labels.append(("first divergent ▶ " if key == first else "") + label
                      + (f" [{kind}]" if kind else "") + f"  {_short(status)}")
        if key == first:
            ax.axhspan(i - 0.5, i + 0.5, color="#fff3b0", zorder=0)
        if _not_compared(status):
            continue
        color = BAD if _fails(status) else OK
        if limit is not None:
            ax.plot([place(limit)], [i], "|", color=BUDGET, ms=9, mew=2)
        if t_err is not None:
            ax.plot([place(t_err)], [i], "D", mfc="white", mec=TORCH, ms=5)
        if j_err is not None:
            ax.plot([place(j_err)], [i], "o", ms=6, mec=color, mfc="white" if status == "inherited" else color)
    ax.set_yticks(range(len(items)), labels, fontsize=7, family="monospace")
    for tick, it in zip(ax.get_yticklabels(), items):
        tick.set_color(BAD if _fails(it[4]) else "#888" if _not_compared(it[4]) else "#111")
        if it[0] == first:
            tick.set_fontweight("bold")
    ax.set_ylim(len(items) - 0.5, -0.5)
    ax.set_xticks([zero] + [10.0 ** d for d in range(axis.lo, axis.hi + 1)] + [nonfinite],
                  ["0"] + [f"1e{d}" for d in range(axis.lo, axis.hi + 1)] + ["NaN/inf"], fontsize=7)
    ax.minorticks_off()
    ax.grid(axis="x", color="#ddd")
    hollow = " (○ inherited)" if title.startswith("module") else ""
    ax.set_title(f"{title}: ◇ {torch_name}  ● JAX{hollow}  | budget  (error against float64)", fontsize=8, loc="left")


def _draw_positions(ax, path: str, found, torch_name: str = "torch fp32") -> None:
    floor = min([float(v) for v in np.concatenate([found.jax, found.torch]) if np.isfinite(v) and v > 0]
                + [found.budget]) / 10  # exact zeros drawn here, and said so in the legend
    x = np.arange(len(found.jax))
    for series, color, style, name in ((found.torch, TORCH, "x:", torch_name), (found.jax, BAD, "o-", "JAX")):
        y = np.where(np.asarray(series) > 0, series, floor)
        ax.plot(x, np.nan_to_num(y, nan=np.inf, posinf=np.inf), style, color=color, ms=3, label=name)
        bad = ~np.isfinite(series)
        if bad.any():  # NaN/inf: a marker on the top edge, named
            ax.plot(x[bad], np.full(bad.sum(), 1.0), "^", color=BAD, ms=6, transform=ax.get_xaxis_transform(),
                    clip_on=False, label=f"{name} NaN/inf")
    ax.axhline(found.budget, color=BUDGET, ls="--", lw=0.8, label="budget")
    if found.onset is not None:
        ax.axvline(found.onset, color=BAD, lw=0.6, alpha=0.6)
    ax.set_yscale("log")
    ax.set_title(f"{path or '(model)'}: error per position (zeros at {floor:.0e})", fontsize=8)
    ax.set_xlabel("position", fontsize=7)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=6)
