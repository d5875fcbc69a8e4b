"""The report page: one self-contained HTML file (figures embedded as base64 PNG, no script, no network),
with the PNGs also written beside it, and `build_report` that makes both from run directories."""

from __future__ import annotations

import base64
import datetime
import html
from dataclasses import dataclass
from pathlib import Path

from klppo.report.figures import COLORS, DrawnFigure, FigureSpec, draw_all, write_pngs
from klppo.report.runs import RunData
from klppo.report.summary import summary_lines

PAGE_NAME = "report.html"
PNG_DIR = "report"

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1450px; color: #222; }
h1 { margin-bottom: 0.2em; } h2 { margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.9em; margin: 0.5em 0; }
td, th { border: 1px solid #ddd; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
.swatch { display: inline-block; width: 0.9em; height: 0.9em; border-radius: 2px; margin-right: 0.4em; }
.caption { color: #555; font-size: 0.9em; } .note { color: #a60; }
img { max-width: 100%; } nav a { margin-right: 0.8em; }
ul.summary { margin: 0; padding-left: 1.1em; }
"""


@dataclass
class Report:
    page: Path
    pngs: list[Path]
    figures: list[DrawnFigure]
    missing: list[FigureSpec]


def render_page(runs: list[RunData], figures: list[DrawnFigure], missing: list[FigureSpec]) -> str:
    """The HTML text (see the module docstring)."""
    esc = html.escape
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>klppo report: {esc(', '.join(r.name for r in runs))}</title>",
        f"<style>{_STYLE}</style></head><body>",
        "<h1>klppo run report</h1>",
        f'<p class="caption">{len(runs)} run{"s" if len(runs) != 1 else ""}; made {now} by '
        "<code>klppo report</code>.</p>",
        "<nav>" + "".join(f'<a href="#{f.spec.slug}">{esc(f.spec.title)}</a>' for f in figures) + "</nav>",
        "<h2>Runs</h2>",
        "<table><tr><th>run</th><th>summary</th></tr>",
    ]
    for index, run in enumerate(runs):
        color = COLORS[index % len(COLORS)]
        lines = summary_lines(run)[1:-1]  # header and checkpoint line left out: the page is about curves
        if run.num_bad_lines:
            lines.append(f"{run.num_bad_lines} unreadable line(s) skipped")
        items = "".join(f"<li>{esc(line)}</li>" for line in lines)
        path = f"<br><code>{esc(str(run.path))}</code>" if run.path is not None else ""
        out.append(
            f'<tr><td><span class="swatch" style="background:{color}"></span>{esc(run.name)}{path}</td>'
            f'<td><ul class="summary">{items}</ul></td></tr>'
        )
    out.append("</table>")
    events = [(run, e) for run in runs for e in run.events]
    if events:
        out += [
            "<h2>Monitor events</h2>",
            "<table><tr><th>run</th><th>step</th><th>kind</th><th>message</th></tr>",
        ]
        out += [
            f"<tr><td>{esc(run.name)}</td><td>{e.step}</td><td>{esc(e.kind)}</td><td>{esc(e.message)}</td></tr>"
            for run, e in events
        ]
        out.append("</table>")
    for figure in figures:
        data = base64.b64encode(figure.png).decode("ascii")
        out += [
            f'<h2 id="{figure.spec.slug}">{esc(figure.spec.title)}</h2>',
            f'<p class="caption">{esc(figure.spec.caption)}</p>',
            f'<img alt="{esc(figure.spec.title)}: {esc(", ".join(figure.keys))}" '
            f'data-figure="{figure.spec.slug}" src="data:image/png;base64,{data}">',
        ]
    if missing:
        names = ", ".join(f"{s.title} ({', '.join(s.patterns)})" for s in missing)
        out.append(f'<p class="note">Not logged by these runs: {esc(names)}.</p>')
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def build_report(runs: list[RunData], out_dir: str | Path, *, dpi: int = 100) -> Report:
    """Draw every figure, write ``<out_dir>/report.html`` and ``<out_dir>/report/<figure>.png``.

    Raises ImportError (one line, with the install command) when matplotlib is missing."""
    if not runs:
        raise ValueError("build_report: no runs given")
    figures, missing = draw_all(runs, dpi=dpi)
    out_dir = Path(out_dir)
    pngs = write_pngs(figures, out_dir / PNG_DIR)
    page = out_dir / PAGE_NAME
    tmp = page.with_name(f".{PAGE_NAME}.tmp")
    tmp.write_text(render_page(runs, figures, missing), encoding="utf-8")
    tmp.replace(page)
    return Report(page=page, pngs=pngs, figures=figures, missing=missing)
