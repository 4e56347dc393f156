"""Shared by the bench scripts: the corpus, the machine line, and one section of a report.

Several scripts write into one docs/benchmarks.md: each owns the text between
`<!-- bench:NAME -->` and `<!-- /bench:NAME -->` and leaves the rest of the file alone.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORPORA = ("../shared/corpus", "tests/photos")  # relative to the repository
TITLE = "# Benchmarks\n\nMade by `make bench` (bench/README.md). Each section says its script.\n"


def corpus(suffixes: tuple[str, ...] = (".jpg", ".jpeg")) -> tuple[str, list[Path]]:
    """The team corpus beside the repository when it exists, else the bundled samples."""
    for rel in CORPORA:
        folder = ROOT / rel
        if folder.is_dir():
            photos = sorted(p for p in folder.iterdir() if p.suffix.lower() in suffixes)
            if photos:
                return rel, photos
    raise SystemExit(f"no {'/'.join(suffixes)} files found in {', '.join(CORPORA)}")


def cpu_name() -> str:
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.machine()


def machine() -> str:
    import pyvips

    vips = ".".join(str(pyvips.version(i)) for i in range(3))
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"{dt.date.today().isoformat()}, {os.cpu_count()} CPUs ({cpu_name()}), "
        f"Python {platform.python_version()}, libvips {vips}; load average at start {load}"
    )


def write_section(path: Path, name: str, body: str) -> None:
    """Replace this script's section of the report (appended if it has none yet)."""
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    block = f"{start}\n{body.strip()}\n{end}"
    text = path.read_text() if path.exists() else TITLE
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else f"{text}\n{block}\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
