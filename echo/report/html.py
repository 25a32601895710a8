"""Look at Snakemake's HTML report the way a reader does: in a headless Chromium.

The report (``snakemake --report report.html``) is one self-contained page (a React app with
every figure inlined as a data URI) that shows a figure only after a click in its menu. To see
the figures without a person, ``view_page`` writes a copy of the page with a few lines of script
that, once the page has loaded, open a given result the way its menu entry does
(``app.setView({content: "img", ...})``); ``screenshot`` renders a page with Chromium's
``--headless --screenshot``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    """A headless-capable Chromium on PATH (``ECHO_CHROMIUM`` overrides), or None."""
    if os.environ.get("ECHO_CHROMIUM"):
        return os.environ["ECHO_CHROMIUM"]
    return next((p for name in CHROMIUM_NAMES if (p := shutil.which(name))), None)


def report_results(report_html: Path | str) -> dict[str, dict]:
    """The report's results (path -> {name, labels, mime_type, caption, data_uri, ...})."""
    text = Path(report_html).read_text()
    m = re.search(r'<script id="results">\s*var results = (\{.*?\});?\s*</script>', text, re.S)
    if not m:
        raise ValueError(f"{report_html}: no results found (not a Snakemake HTML report?)")
    return json.loads(m.group(1))


_OPEN = """<script>
window.addEventListener("load", function () {{
  setTimeout(function () {{
    var path = {path};
    var entry = results[path];
    app.setView({{navbarMode: "resultinfo", content: "img", contentPath: entry.data_uri, resultPath: path}});
    document.title = "echo-view-ready";
  }}, 200);
}});
</script>
"""


def view_page(report_html: Path | str, result: str, out: Path | str) -> Path:
    """A copy of the report that opens ``result`` (a path as the report lists it, or its unique
    ending) once loaded."""
    paths = [p for p in report_results(report_html) if p == result or p.endswith(result)]
    if len(paths) != 1:
        raise ValueError(f"{result!r} names {len(paths)} results of {report_html}")
    text = Path(report_html).read_text()
    out = Path(out)
    head, body_end, tail = text.rpartition("</body>")  # the page's own (scripts inline "</body>" too)
    if not body_end:
        raise ValueError(f"{report_html}: no </body>")
    out.write_text(head + _OPEN.format(path=json.dumps(paths[0])) + body_end + tail)
    return out


def screenshot(page: Path | str, png: Path | str, chromium: str | None = None, size: tuple[int, int] = (1500, 1000),
               timeout: float = 120) -> Path:
    """Render ``page`` in headless Chromium and write a PNG screenshot; returns its path."""
    chromium = chromium or find_chromium()
    if not chromium:
        raise FileNotFoundError("no chromium on PATH (apt-get install chromium)")
    png = Path(png).resolve()
    png.parent.mkdir(parents=True, exist_ok=True)
    png.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="echo-chromium-") as profile:
        cmd = [chromium, "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars",
               f"--user-data-dir={profile}", f"--window-size={size[0]},{size[1]}", "--virtual-time-budget=8000",
               f"--screenshot={png}", Path(page).resolve().as_uri()]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if not png.is_file():
        raise RuntimeError(f"chromium wrote no screenshot (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return png


# Figures to look at in a report, by the ending of their path (the first match of each).
VIEWS = ("step_breakdown.svg", "gantt.svg", "memory.svg", "heatmap.svg", "predicted_vs_measured.svg")


def screenshots(report_html: Path | str, out_dir: Path | str, views: tuple[str, ...] = VIEWS) -> list[Path]:
    """The report's landing page and each figure of ``views`` it holds, as PNG screenshots."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shots = [screenshot(report_html, out_dir / "report.png")]
    results = report_results(report_html)
    for view in views:
        path = next((p for p in sorted(results) if p.endswith(view)), None)
        if path is None:
            continue
        page = view_page(report_html, path, out_dir / f".view-{Path(view).stem}.html")
        shots.append(screenshot(page, out_dir / f"{Path(view).stem}.png"))
        page.unlink()
    return shots


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3:
        sys.exit("usage: python -m echo.report.html REPORT.html OUT_DIR  (screenshots of the report in headless Chromium)")
    for shot in screenshots(sys.argv[1], sys.argv[2]):
        print(shot)
