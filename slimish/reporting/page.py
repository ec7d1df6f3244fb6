"""Write `report.html` (every figure inlined as a PNG data URI: it opens with no network and no other file) and
the PNGs beside it, into RUN_DIR/report/."""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path

import matplotlib.pyplot as plt

from slimish.reporting.figures import draw
from slimish.run_layout import read_metrics_lines


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl: give the run directory (runs/<run.name>)")
    records = read_metrics_lines(path).records  # a line it cannot read: a ValueError naming the file and line
    if not records:
        raise ValueError(f"{path} is empty: the run has not finished a step yet")
    return records


def write_report(run_dir: str | Path) -> Path:
    """RUN_DIR/report/report.html and one PNG per figure; returns the page's path."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    out = run_dir / "report"
    out.mkdir(exist_ok=True)
    sections = []
    for stem, title, fig in draw(records):
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png")
        plt.close(fig)
        png = buffer.getvalue()
        (out / f"{stem}.png").write_bytes(png)
        data = base64.b64encode(png).decode()
        sections.append(f'<section><h2>{html.escape(title)}</h2>'
                        f'<img class="plot" alt="{html.escape(title)}" src="data:image/png;base64,{data}"></section>')
    last = records[-1]
    summary = (f"{len(records)} steps; last step: reward {last.get('reward_mean', float('nan')):.3f}, "
               f"{last.get('time_step_s', float('nan')):.1f} s")
    page = out / "report.html"
    page.write_text(f"""<!doctype html>
<html><head><meta charset="utf-8"><title>slimish run {html.escape(run_dir.name)}</title>
<style>body {{ font-family: sans-serif; max-width: 900px; margin: 2em auto; }} img {{ max-width: 100%; }}</style>
</head><body><h1>Run {html.escape(run_dir.name)}</h1><p>{html.escape(summary)}</p>
{''.join(sections)}
<script>
// How many plots the browser decoded (data-plots-drawn on <body>), for a reader's or a test's check.
addEventListener("load", () => {{
  document.body.dataset.plotsDrawn = [...document.images].filter(i => i.complete && i.naturalWidth > 0).length;
}});
</script>
</body></html>
""")
    return page
