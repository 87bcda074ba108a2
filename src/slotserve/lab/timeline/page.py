"""The HTML page around the SVG panels: template, hatch patterns, legend, hover script."""

from __future__ import annotations

from slotserve.lab.timeline.colours import IDLE_COLOR, PALETTE, SHADES_HEX
from slotserve.lab.timeline.grid import PREFILL, STALLED, WAITING


def html_legend() -> str:
    p = PALETTE[0]
    items = [
        (f'fill="{p}"', "decode"),
        (f'fill="{SHADES_HEX[0, PREFILL]}"', "prefill"),
        (f'fill="{SHADES_HEX[0, STALLED]}"', "stalled"),
        (f'fill="{IDLE_COLOR}"', "idle slot"),
        (f'fill="{SHADES_HEX[0, WAITING]}"', "waiting (Gantt)"),
    ]
    marks = {"prefill": "hatch-prefill", "stalled": "hatch-stalled"}
    out = []
    for fill, name in items:
        mark = (f'<rect width="14" height="14" fill="url(#{marks[name]})"/>'
                if name in marks else "")
        out.append(f'<span><svg width="14" height="14"><rect width="14" height="14" {fill}/>'
                   f"{mark}</svg> {name}</span>")
    return " ".join(out) + " <span>(color = request)</span>"


SVG_DEFS = (
    '<svg width="0" height="0" style="position:absolute"><defs>'
    '<pattern id="hatch-prefill" width="5" height="5" patternUnits="userSpaceOnUse" '
    'patternTransform="rotate(45)"><line x1="0" y1="0" x2="0" y2="5" '
    'stroke="#ffffff" stroke-width="1.6" stroke-opacity="0.9"/></pattern>'
    '<pattern id="hatch-stalled" width="6" height="6" patternUnits="userSpaceOnUse">'
    '<path d="M0 0 L6 6 M6 0 L0 6" stroke="#ffffff" stroke-width="1" '
    'stroke-opacity="0.8"/></pattern></defs></svg>'
)

PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font: 13px system-ui, sans-serif; margin: 16px; color: #222; }}
.panels {{ display: flex; gap: 24px; align-items: flex-start; flex-wrap: wrap; }}
.panel {{ overflow-x: auto; max-width: 100%; }}
h2 {{ margin: 0 0 2px; font-size: 16px; }} h3 {{ margin: 8px 0 2px; font-size: 13px; }}
.meta {{ margin: 0 0 6px; color: #555; }}
.gantt {{ max-height: 640px; overflow-y: auto; }}
svg text {{ font-size: 10px; dominant-baseline: middle; }}
.rowlabel {{ text-anchor: end; fill: #555; }}
.tick {{ text-anchor: middle; fill: #555; }}
.celllabel {{ text-anchor: middle; fill: #fff; pointer-events: none; }}
.celllabel.prefill {{ fill: #222; }}
.mark {{ pointer-events: none; }}
.cell:hover, .span:hover {{ stroke: #000; stroke-width: 1; }}
.utilbg {{ fill: #f6f6f6; }}
.utilline {{ fill: none; stroke: #333; stroke-width: 1.5; }}
.utilmean {{ stroke: #d62728; stroke-dasharray: 4 3; }}
.utiltext {{ fill: #d62728; }}
.legend span {{ margin-right: 14px; white-space: nowrap; }}
.legend svg {{ vertical-align: middle; }}
#info {{ min-height: 1.4em; margin: 6px 0; font-family: ui-monospace, monospace; }}
</style></head><body>
{defs}
<h1 style="font-size:18px;margin:0 0 8px">{title}</h1>
<div class="legend">{legend}</div>
<div id="info">hover a cell</div>
<div class="panels">
{panels}
</div>
<script>
const info = document.getElementById("info");
document.addEventListener("mouseover", (e) => {{
  const d = e.target.dataset;
  if (!d || !d.kind) return;
  info.textContent = d.slot !== undefined
    ? `slot ${{d.slot}} · iteration ${{d.iteration}} · ${{d.request || "-"}} · ${{d.kind}}`
    : `${{d.request}} · ${{d.kind}} · iterations ${{d.from}}–${{d.to}}`;
}});
</script>
</body></html>
"""
