"""What tracing costs: end-to-end CPU per photo with tracing off and at 100 % sampling.

    .venv/bin/python bench/tracing.py [--out docs/benchmarks.md] [--tiny 300] [--large 24]
                                      [--rounds 4]

Real `darkroom run --drain` workers (bench/e2e.py's rig) against a database of its own,
`darkroom_bench_tracing`, on the same photos each drain: tiny 64×48 PNGs (where a fixed
per-photo cost shows most) and the corpus's large JPEGs. Off: no OTEL_* variable at all. On:
every photo traced (OTEL_TRACES_SAMPLER=always_on, its render stages too), exported over
OTLP/HTTP to a loopback receiver in this process that decodes every batch's protobuf
(tests/otlp.py), as a collector would. Off and on alternate (off, on, on, off, off, on...),
`--rounds` drains each; the figures are medians of CPU ms per photo of the worker, its
forkserver and its render processes (CPU, unlike photos/s, is barely inflated by other load
on a shared machine), with photos/s beside. The off drains split in two interleaved halves
(1st, 3rd... against 2nd, 4th...) give an off-against-off difference: the noise floor, what
the bench cannot resolve. What off adds over no tracing at all is measured apart: the
adapter's no-op calls a delivery makes, timed in this process, and the trace SDK modules a
worker that drained off imported (none).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from e2e import PR_SET_CHILD_SUBREAPER, Rig, Run, large_jpegs, tiny_pngs
from pairs import Drained, side_by_side
from report import ROOT, machine, write_section

sys.path.insert(0, str(ROOT))

from tests.otlp import Receiver, serving

DATABASE = "darkroom_bench_tracing"
PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
SDK_MODULES = ("opentelemetry.sdk.trace", "opentelemetry.exporter", "opentelemetry.propagat")


@dataclass
class TracingRig(Rig):
    """bench/e2e.py's rig on this script's own database (e2e.py may run beside it)."""

    database: str = DATABASE

    def environ(self, stream: str, **extra: str) -> dict[str, str]:
        url = f"postgresql://postgres@127.0.0.1:5432/{self.database}"
        base = {k: v for k, v in super().environ(stream).items() if not k.startswith("OTEL_")}
        return base | {"DARKROOM_DATABASE_URL": url} | extra

    def setup(self) -> None:
        subprocess.run(["dropdb", "-h", "127.0.0.1", "-U", "postgres", "--if-exists",
                        self.database], check=True)  # fmt: skip
        self.cli("bench-tracing", "migrate")


def traced(endpoint: str) -> dict[str, str]:
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_TRACES_SAMPLER": "always_on"}


def off_on(
    rig: Rig, paths: list[Path], rounds: int, got: Receiver, short: int = 0
) -> dict[str, list[Run]]:
    """ABBA order: each mode goes first in half the pairs, so a drift in load favours neither.
    With `short`, each drain is followed by one of the first `short` photos alone (its runs
    under "off short", "on short"), for the steady state: what the rest of the photos cost
    beyond it has no start-up and no exit in it."""
    runs: dict[str, list[Run]] = {"off": [], "on": [], "off short": [], "on short": []}
    settings = {"off": {}, "on": traced(got.endpoint)}
    for i in range(rounds):
        for mode in ("off", "on") if i % 2 == 0 else ("on", "off"):
            if short:
                runs[f"{mode} short"].append(rig.drain(paths[:short], **settings[mode]))
            before = got.exports, got.export_bytes
            run = rig.drain(paths, **settings[mode])
            runs[mode].append(run)
            kb = (got.export_bytes - before[1]) / 1024 / run.photos
            exports = got.exports - before[0]
            print(f"  {mode}: {run.cpu_ms / run.photos:.1f} CPU ms/photo, {run.per_s:.1f}/s, "
                  f"{exports} exports, {kb:.1f} KiB/photo", file=sys.stderr)  # fmt: skip
    return runs


def paired(
    rigs: tuple[Rig, Rig], paths: list[Path], rounds: int, got: Receiver, short: int
) -> list[str]:
    """Off and on drain side by side (pairs.py), each with a database of its own (so that
    each worker holds its own duties: the events relay of both photos' events in one worker
    made identical workers differ by 5 %), first the `short` photos, then all, each
    round; a control pair of two off workers beside them. Per round, the other worker's CPU
    per photo against the off one's, as a share of the off one's CPU per photo (all its
    processes) over the same photos: beyond
    the short drain (the steady state) in all, in the worker's own process and in its render
    processes apart (tracing adds nothing there but the stages' clock readings, so their
    difference is the noise of sharing the cores), and over whole drains. The rows give the
    median and every round's figure."""
    settings = {"off": {}, "on": traced(got.endpoint)}
    rows = ("steady state, all processes", "steady state, the worker's process",
            "steady state, the render processes", "whole drains, all processes")  # fmt: skip
    changes: dict[str, dict[str, list[float]]] = {r: {"on": [], "control": []} for r in rows}
    for i in range(rounds):
        for name, modes in (("on", ("off", "on")), ("control", ("off", "off"))):
            first, second = modes if i % 2 == 0 else modes[::-1]
            short_pair, full_pair = (side_by_side(rigs, p, settings[first], settings[second])
                                     for p in (paths[:short], paths))  # fmt: skip
            order = (0, 1) if i % 2 == 0 else (1, 0)  # the off worker, the other
            base, other = ([full_pair[k], short_pair[k]] for k in order)
            between = len(paths) - short
            off_ms = (base[0].cpu_ms - base[1].cpu_ms) / between

            for row, part in zip(rows[:3], ("cpu_ms", "worker_ms", "rest_ms"), strict=True):
                more = _beyond(other, part) - _beyond(base, part)
                changes[row][name].append(100 * more / between / off_ms)
            whole_off = base[0].cpu_ms_per_photo
            changes[rows[3]][name].append(100 * (other[0].cpu_ms_per_photo - whole_off) / whole_off)
            print(
                f"  round {i + 1} {name}: steady {off_ms:.2f} ms off, "
                + ", ".join(f"{r} {changes[r][name][-1]:+.1f} %" for r in rows),
                file=sys.stderr,
            )
    return [_paired_row(row, changes[row]) for row in rows]


def _beyond(pair: list[Drained], part: str) -> float:
    """CPU ms of `part` in the full drain beyond the short one."""
    return float(getattr(pair[0], part) - getattr(pair[1], part))


def _paired_row(name: str, changes: dict[str, list[float]]) -> str:
    rounds = {k: ", ".join(f"{c:+.1f}" for c in v) for k, v in changes.items()}
    return (
        f"| {name} | **{statistics.median(changes['on']):+.1f} %** ({rounds['on']}) "
        f"| {statistics.median(changes['control']):+.1f} % ({rounds['control']}) |"
    )


def cpu_per_photo(runs: list[Run]) -> float:
    return statistics.median(r.cpu_ms / r.photos for r in runs)


def percent(a: float, b: float) -> str:
    return f"{b - a:+.1f} ({100 * (b - a) / a:+.1f} %)"


def steady_ms(full: list[Run], short: list[Run]) -> float:
    """The median over rounds of the CPU per photo beyond the short drain of the same round."""
    return statistics.median((f.cpu_ms - s.cpu_ms) / (f.photos - s.photos)
                             for f, s in zip(full, short, strict=True))  # fmt: skip


def steady_row(name: str, runs: dict[str, list[Run]]) -> str:
    """Steady state: per round, (CPU of the full drain − CPU of the short one) ÷ the photos
    between them; the noise floor from the off rounds' odd against even halves."""
    off = steady_ms(runs["off"], runs["off short"])
    on = steady_ms(runs["on"], runs["on short"])
    floor = percent(steady_ms(runs["off"][0::2], runs["off short"][0::2]),
                    steady_ms(runs["off"][1::2], runs["off short"][1::2]))  # fmt: skip
    between = runs["off"][0].photos - runs["off short"][0].photos
    return (f"| {name}, steady state (photos {runs['off short'][0].photos + 1}–"
            f"{runs['off'][0].photos}) | {between} | {off:.1f} | {on:.1f} | {percent(off, on)} "
            f"| {floor} | | | |")  # fmt: skip


def row(name: str, runs: dict[str, list[Run]]) -> str:
    off, on = cpu_per_photo(runs["off"]), cpu_per_photo(runs["on"])
    floor = percent(cpu_per_photo(runs["off"][0::2]), cpu_per_photo(runs["off"][1::2]))
    per_s = {m: statistics.median(r.per_s for r in runs[m]) for m in ("off", "on")}
    return (f"| {name} | {runs['off'][0].photos} | {off:.1f} | {on:.1f} | {percent(off, on)} "
            f"| {floor} | {per_s['off']:.1f} | {per_s['on']:.1f} "
            f"| {percent(per_s['off'], per_s['on']).split(' ', 1)[1]} |")  # fmt: skip


def one_delivery() -> Any:
    """The adapter's calls one tiny photo's delivery makes: its process span, the stage
    spans (the claim's span id among them), the render process's stages (a tiny PNG's:
    decode, three encodes, two resizes, the facts), the notes, an exemplar and a log
    line's ids."""
    from darkroom import tracing
    from darkroom.image.stagetimes import Stage
    from darkroom.queue.messages import Entry

    entry = Entry("1-0", {"photo_id": "p", "traceparent": PARENT})
    stages = [Stage(n, 1, 2, r) for n, r in (("decode", ""), ("encode", "large"),
              ("resize", "medium"), ("encode", "medium"), ("resize", "thumb"),
              ("encode", "thumb"), ("facts", ""))]  # fmt: skip

    def delivery() -> None:
        with tracing.delivery(entry, 1, "s", "g"):
            for name in ("claim", "download", "render", "upload", "publish", "ack"):
                with tracing.span(name):
                    if name == "claim":  # the span id the claim keeps on the attempt row
                        tracing.delivery_span_id()
                    tracing.note(attempt=1)
                    if name == "render":
                        tracing.rendered(stages)
            tracing.note(outcome="published")
            tracing.exemplar()
            tracing.log_ids(None, "info", {})

    return delivery


def per_delivery_us(delivery: Any, runs: int = 5_000) -> float:
    return min(timeit.repeat(delivery, number=runs, repeat=5, timer=time.process_time)) / runs * 1e6


def on_path_us() -> tuple[float, float]:
    """With the SDK on, in this process: CPU µs a delivery's spans take to make, and to
    encode as darkroom's exporter does (OTLP protobuf, otlpwire.py), without the HTTP round
    trip. The spans go to memory (no export thread to count or miss). Tracing's switch is set
    by hand: `start` would install the batch exporter this measure leaves out."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from darkroom import otlpwire, tracing

    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=tracing._hashed(Resource.create()))
    processor = SimpleSpanProcessor(memory)
    provider.add_span_processor(processor)
    tracing.use(provider, processor)
    try:
        made = per_delivery_us(one_delivery(), runs=2_000)
    finally:
        tracing.use(None, None)
    spans = memory.get_finished_spans()[-15:]  # one delivery's
    encoded = per_delivery_us(lambda: otlpwire.request(spans), runs=2_000)
    return made, encoded


def off_path_us() -> float:
    """The same calls with tracing off, in µs: what off adds to a worker over one without
    the adapter."""
    from darkroom import tracing

    assert not tracing.on()
    return per_delivery_us(one_delivery(), runs=20_000)


def sdk_imported_off(rig: TracingRig, paths: list[Path]) -> list[str]:
    """The trace SDK's modules a worker draining with tracing off imported (`-X importtime`)."""
    rig.runs += 1
    stream = f"bench-tracing-imports-{rig.runs}"
    rig.cli(stream, "ingest", *map(str, paths), **rig.ingest_env)
    command = [sys.executable, "-X", "importtime", "-m", "darkroom", "run", "--drain"]
    result = subprocess.run(command, env=rig.environ(stream), cwd=rig.tmp, capture_output=True,
                            text=True, check=True)  # fmt: skip
    names = [line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()
             if line.startswith("import time:")]  # fmt: skip
    assert "darkroom.tracing" in names, "-X importtime listed no module: its format changed?"
    return sorted({n for n in names if n.startswith(SDK_MODULES)})


def whole_path_us() -> float:
    """bench/tracing_path.py's figure, in a process of its own."""
    script = Path(__file__).with_name("tracing_path.py")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            check=True)  # fmt: skip
    return float(result.stdout.split()[-1])


def report(
    results: dict[str, dict[str, list[Run]]], rounds: int, extra: list[str], pairs: list[str]
) -> str:
    lines = [
        "## Tracing cost (bench/tracing.py)",
        "",
        f"- {machine()}",
        f"- one `darkroom run --drain` worker per drain, the same photos each time; tracing off "
        f"(no OTEL_* variable) and on (100 % sampling, render stages too, exported over "
        f"OTLP/HTTP to a loopback receiver that decodes every batch) alternate ABBA, {rounds} "
        f"drains each; medians. CPU is the worker's, its forkserver's and its render "
        f"processes' (a traced worker's start-up imports included, spread over the drain's "
        f"photos; the receiver's decoding, a collector's work, is not). Noise floor: the off "
        f"drains' odd against even ones. Steady state: each tiny drain is paired with a short "
        f"one of its first photos in the same mode; the CPU of the photos beyond it, with no "
        f"start-up or exit in it, per photo",
        *[f"- {line}" for line in extra],
        "",
        "| photos | count | CPU ms/photo off | on | on − off | noise floor (off − off) "
        "| photos/s off | on | change |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [row(name, runs) for name, runs in results.items()]
    lines += [steady_row(name, runs) for name, runs in results.items() if runs["off short"]]
    if pairs:
        lines += [
            "",
            "Side by side (bench/pairs.py): in each round an off worker and an on worker drain "
            "the same tiny PNGs at the same time from two streams, each one's CPU counted "
            "apart (its own process, and its forkserver and render processes), first the short "
            "drain, then the whole one; a control pair of two off workers beside them. Each "
            "figure is the on worker's CPU per photo less the off one's of the same round, as "
            "a share of the off one's CPU per photo over the same photos (all its processes); "
            "the control's is the noise that sharing a moment leaves.",
            "",
            "| tiny 64×48 PNGs | on against off, median (each round) | control: off against off |",
            "|---|---:|---:|",
            *pairs,
        ]
    return "\n".join([*lines, ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the tracing section of this report")
    parser.add_argument("--tiny", type=int, default=300, help="tiny PNGs per drain")
    parser.add_argument("--large", type=int, default=24, help="large JPEGs per drain")
    parser.add_argument("--rounds", type=int, default=4, help="drains per mode and workload")
    parser.add_argument("--note", default="", help="a line for the report (e.g. a smoke run)")
    parser.add_argument(
        "--pairs", type=int, default=4, help="rounds of tiny drains side by side (0: none)"
    )
    parser.add_argument(
        "--short",
        type=int,
        default=50,
        help="tiny PNGs of each short drain, for the steady state (0: none)",
    )
    args = parser.parse_args()
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1)  # count the render processes' CPU
    with (
        tempfile.TemporaryDirectory(prefix="darkroom-bench-tracing-") as name,
        serving(keep=False) as got,
    ):
        # The photos carry a traced producer's context, as they would from one: an on worker
        # keeps its spans' ids on the attempt rows and marks what its exports confirm.
        rig = TracingRig(Path(name), ingest_env=traced(got.endpoint))
        rig.setup()
        inputs = {"tiny 64×48 PNG": tiny_pngs(Path(name) / "tiny", args.tiny),
                  "large JPEG (corpus, ≥ 8 MP)": large_jpegs(args.large)}  # fmt: skip
        results = {}
        for label, paths in inputs.items():
            print(label, file=sys.stderr)
            short = args.short if label.startswith("tiny") else 0
            results[label] = off_on(rig, paths, args.rounds, got, short)
        tiny = inputs["tiny 64×48 PNG"]
        beside = TracingRig(Path(name) / "beside", ingest_env=rig.ingest_env,
                            database=f"{DATABASE}_beside")  # fmt: skip
        pairs = []
        if args.pairs and 0 < args.short < len(tiny):  # the steady state needs a short drain
            beside.tmp.mkdir()
            beside.setup()
            pairs = paired((rig, beside), tiny, args.pairs, got, args.short)
        imported = sdk_imported_off(rig, tiny[:5])
    if got.exports == 0:
        raise SystemExit("the traced workers exported nothing: tracing did not start")
    tiny_off = cpu_per_photo(results["tiny 64×48 PNG"]["off"])
    us = off_path_us()
    made, encoded = on_path_us()
    whole = whole_path_us()
    extra = [
        f"off against no tracing at all: a delivery's no-op calls into the adapter take "
        f"{us:.1f} µs of CPU ({100 * us / 1000 / tiny_off:.3f} % of a tiny photo's "
        f"{tiny_off:.1f} ms); a worker that drained off imported "
        f"{', '.join(imported) or 'no module'} of the trace SDK, exporter or propagator",
        f"at 100 %, in-process: a tiny photo's delivery's 15 spans take {made:.0f} µs of CPU to "
        f"make and {encoded:.0f} µs to encode as OTLP protobuf "
        f"({100 * (made + encoded) / 1000 / tiny_off:.1f} % of its {tiny_off:.1f} ms; the HTTP "
        f"round trip per batch and the start-up imports aside); the whole path in-process "
        f"(bench/tracing_path.py: made, batched, encoded, POSTed, confirmed, the export "
        f"thread's CPU included) {whole:.0f} µs ({100 * whole / 1000 / tiny_off:.1f} %)",
        f"on exported {got.exports} batches, {got.export_bytes / 1024:.0f} KiB of protobuf",
    ]
    body = report(results, args.rounds, extra + ([args.note] if args.note else []), pairs)
    print(body)
    if args.out:
        write_section(args.out, "tracing", body)


if __name__ == "__main__":
    main()
