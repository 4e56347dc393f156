"""A photo's trace as a waterfall, drawn from the spans its worker exported over OTLP: the
picture of docs/tracing.md (no Jaeger binary runs here; compose.yaml's `tracing` profile
gives the real viewer).

    .venv/bin/python bench/trace_view.py --spans trace.json [--png docs/img/trace.png]

`--spans`: a JSON list of spans as tests/otlp.py decodes them (tests/chaos/test_trace_chaos.py
writes every span of its run to `trace-spans.json`); `--trace`: the trace to draw, else the
published photo whose publishing delivery came latest in its count (a redelivery after a kill).
Writes an HTML page beside the PNG and screenshots it with Debian's Chromium (Playwright).
"""

from __future__ import annotations

import argparse
import html
import json
from pathlib import Path
from typing import Any

CHROMIUM = "/usr/bin/chromium"
WIDTH_PX, LABEL_PX, ROW_PX = 1100, 380, 22
COLOURS = {"darkroom.ingest": "#6b7fd7", "darkroom.process": "#3b9c6e"}
SHOWN = ("darkroom.attempt", "darkroom.delivery_count", "darkroom.outcome", "error.type",
         "darkroom.rendition")  # fmt: skip


def ordered(spans: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """Depth-first from the roots (spans whose parent is not among them), children by start."""
    ids = {s["span_id"] for s in spans}
    children: dict[str, list[dict[str, Any]]] = {}
    for s in spans:
        children.setdefault(s["parent_id"] if s["parent_id"] in ids else "", []).append(s)
    out: list[tuple[int, dict[str, Any]]] = []

    def walk(parent: str, depth: int) -> None:
        for s in sorted(children.get(parent, []), key=lambda x: x["start_ns"]):
            out.append((depth, s))
            walk(s["span_id"], depth + 1)

    walk("", 0)
    return out


def chosen(spans: list[dict[str, Any]]) -> str:
    """The trace of the published delivery with the highest delivery count."""
    published = [s for s in spans if s["name"] == "darkroom.process"
                 and s["attributes"].get("darkroom.outcome") == "published"]  # fmt: skip
    best = max(published, key=lambda s: (s["attributes"].get("darkroom.delivery_count", 0),
                                         -s["start_ns"]))  # fmt: skip
    return str(best["trace_id"])


def label(span: dict[str, Any]) -> str:
    shown = [f"{k.split('.', 1)[1]}={span['attributes'][k]}" for k in SHOWN
             if k in span["attributes"]]  # fmt: skip
    return span["name"].removeprefix("darkroom.") + (f" ({', '.join(shown)})" if shown else "")


def page(spans: list[dict[str, Any]]) -> str:
    rows, ids = ordered(spans), {s["span_id"] for s in spans}
    t0 = min(s["start_ns"] for s in spans)
    total = max(s["end_ns"] for s in spans) - t0 or 1
    scale = (WIDTH_PX - LABEL_PX) / total
    bars = []
    for i, (depth, s) in enumerate(rows):
        left, width = (s["start_ns"] - t0) * scale, max(2.0, (s["end_ns"] - s["start_ns"]) * scale)
        colour = "#d0443e" if s["status"] == 2 else COLOURS.get(s["name"], "#e0a43a")
        ms = (s["end_ns"] - s["start_ns"]) / 1e6
        orphan = bool(s["parent_id"]) and s["parent_id"] not in ids
        name = html.escape(label(s) + (" ← its delivery's span never came (SIGKILL)" * orphan))
        bars.append(
            f'<div class="row" style="top:{i * ROW_PX}px">'
            f'<span class="name" style="padding-left:{depth * 12}px">{name}</span>'
            f'<span class="bar" style="left:{LABEL_PX + left:.1f}px;width:{width:.1f}px;'
            f'background:{colour}"></span>'
            f'<span class="ms" style="left:{LABEL_PX + left + width + 4:.1f}px">{ms:.1f} ms</span>'
            "</div>"
        )
    trace_id = spans[0]["trace_id"]
    return f"""<!doctype html><meta charset="utf-8"><style>
body {{ font: 12px system-ui, sans-serif; margin: 12px; width: {WIDTH_PX + 80}px }}
h1 {{ font-size: 14px; margin: 0 0 8px }} .sub {{ color: #555; margin-bottom: 10px }}
.rows {{ position: relative; height: {len(rows) * ROW_PX}px }}
.row {{ position: absolute; left: 0; right: 0; height: {ROW_PX}px; line-height: {ROW_PX}px;
        border-bottom: 1px solid #eee }}
.name {{ position: absolute; width: {LABEL_PX - 8}px; overflow: hidden; white-space: nowrap;
         text-overflow: ellipsis }}
.bar {{ position: absolute; top: 5px; height: 12px; border-radius: 2px }}
.ms {{ position: absolute; color: #444; white-space: nowrap }}
</style><h1>trace {trace_id}</h1>
<div class="sub">{len(spans)} spans, {total / 1e6:.0f} ms, as the OTLP receiver decoded them
(service {html.escape(spans[0]["service"])}); red: status ERROR</div>
<div class="rows">{"".join(bars)}</div>"""


def screenshot(page_path: Path, png: Path) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        tab = browser.new_page(viewport={"width": WIDTH_PX + 110, "height": 200})
        tab.goto(page_path.resolve().as_uri())
        tab.screenshot(path=str(png), full_page=True)
        browser.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=Path, required=True)
    parser.add_argument("--png", type=Path, default=Path("docs/img/trace.png"))
    parser.add_argument("--trace", help="a trace id (32 hex digits)")
    args = parser.parse_args()
    every = json.loads(args.spans.read_text())
    trace_id = args.trace or chosen(every)
    spans = [s for s in every if s["trace_id"] == trace_id]
    args.png.parent.mkdir(parents=True, exist_ok=True)
    page_path = args.png.with_suffix(".html")
    page_path.write_text(page(spans))
    screenshot(page_path, args.png)
    page_path.unlink()
    print(f"{args.png}: {len(spans)} spans")


if __name__ == "__main__":
    main()
