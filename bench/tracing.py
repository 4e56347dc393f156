"""What tracing costs: end-to-end CPU per photo with tracing off and at 100 % sampling.

    .venv/bin/python bench/tracing.py [--out docs/benchmarks.md] [--tiny 300] [--large 24]
                                      [--rounds 3]

Real `darkroom run --drain` workers (bench/e2e.py's rig) against a database of its own,
`darkroom_bench_tracing`, on tiny 64×48 PNGs (where a fixed per-photo cost shows most) and on
the corpus's large JPEGs. Off: no OTLP endpoint. On: every photo traced
(OTEL_TRACES_SAMPLER=always_on, its render stages too), exported to a loopback OTLP/HTTP
receiver in this process that reads each batch and discards it. Off and on alternate,
`--rounds` times each; the figure is CPU ms per photo of the worker, its forkserver and its
render processes (CPU, unlike photos/s, is not inflated by other load on a shared machine).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from e2e import PR_SET_CHILD_SUBREAPER, Rig, Run, large_jpegs, tiny_pngs
from report import machine, write_section

DATABASE = "darkroom_bench_tracing"


class TracingRig(Rig):
    """bench/e2e.py's rig on this script's own database (e2e.py may run beside it)."""

    def environ(self, stream: str, **extra: str) -> dict[str, str]:
        url = f"postgresql://postgres@127.0.0.1:5432/{DATABASE}"
        base = {k: v for k, v in super().environ(stream).items() if not k.startswith("OTEL_")}
        return base | {"DARKROOM_DATABASE_URL": url} | extra

    def setup(self) -> None:
        subprocess.run(["dropdb", "-h", "127.0.0.1", "-U", "postgres", "--if-exists", DATABASE],
                       check=True)  # fmt: skip
        self.cli("bench-tracing", "migrate")


class Discard(BaseHTTPRequestHandler):
    """An OTLP/HTTP receiver that reads each export and answers 200 with an empty reply."""

    exports = 0

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        Discard.exports += 1
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@contextmanager
def receiver() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Discard)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def traced(endpoint: str) -> dict[str, str]:
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_TRACES_SAMPLER": "always_on"}


def off_on(rig: Rig, paths: list[Path], rounds: int, endpoint: str) -> dict[str, list[Run]]:
    runs: dict[str, list[Run]] = {"off": [], "on": []}
    settings = {"off": {}, "on": traced(endpoint)}
    for i in range(rounds):
        for mode in ("off", "on") if i % 2 == 0 else ("on", "off"):
            runs[mode].append(rig.drain(paths, **settings[mode]))
            run = runs[mode][-1]
            print(f"  {mode}: {run.cpu_ms / run.photos:.1f} CPU ms/photo", file=sys.stderr)
    return runs


def row(name: str, runs: dict[str, list[Run]]) -> str:
    off, on = (statistics.median(r.cpu_ms / r.photos for r in runs[m]) for m in ("off", "on"))
    per_s = {m: statistics.median(r.per_s for r in runs[m]) for m in ("off", "on")}
    change = f"{on - off:+.1f} ({100 * (on - off) / off:+.1f} %)"
    return (f"| {name} | {runs['off'][0].photos} | {off:.1f} | {on:.1f} | {change} "
            f"| {per_s['off']:.1f} | {per_s['on']:.1f} |")  # fmt: skip


def report(results: dict[str, dict[str, list[Run]]], rounds: int, note: str) -> str:
    lines = [
        "## Tracing cost (bench/tracing.py)",
        "",
        f"- {machine()}",
        f"- one `darkroom run --drain` worker per drain; tracing off (no endpoint) and on "
        f"(100 % sampling, render stages too, exported to a loopback OTLP receiver that "
        f"discards) alternate, {rounds} drains each; medians. CPU is the worker's, its "
        f"forkserver's and its render processes' (a traced worker's start-up imports "
        f"included, spread over the drain's photos)",
    ]
    lines += [f"- {note}"] if note else []
    lines += ["", "| photos | count | CPU ms/photo off | on | difference | photos/s off | on |",
              "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    lines += [row(name, runs) for name, runs in results.items()]
    return "\n".join([*lines, ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the tracing section of this report")
    parser.add_argument("--tiny", type=int, default=300, help="tiny PNGs per drain")
    parser.add_argument("--large", type=int, default=24, help="large JPEGs per drain")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--note", default="", help="a line for the report (e.g. a smoke run)")
    args = parser.parse_args()
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1)  # count the render processes' CPU
    with tempfile.TemporaryDirectory(prefix="darkroom-bench-tracing-") as name, receiver() as url:
        rig = TracingRig(Path(name))
        rig.setup()
        inputs = {"tiny 64×48 PNG": tiny_pngs(Path(name) / "tiny", args.tiny),
                  "large JPEG (corpus, ≥ 8 MP)": large_jpegs(args.large)}  # fmt: skip
        results = {}
        for label, paths in inputs.items():
            print(label, file=sys.stderr)
            results[label] = off_on(rig, paths, args.rounds, url)
    if Discard.exports == 0:
        raise SystemExit("the traced workers exported nothing: tracing did not start")
    body = report(results, args.rounds, args.note)
    print(body)
    if args.out:
        write_section(args.out, "tracing", body)


if __name__ == "__main__":
    main()
