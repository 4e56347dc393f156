"""Where a traced worker's extra CPU goes, by thread: an off and an on worker drain the same
tiny PNGs side by side (each with a database of its own, as bench/pairs.py runs them), and
each one's threads are read from /proc/<pid>/task/<tid>/stat every 0.1 s (a thread's CPU is
kept at its highest reading, so a thread that ended before the process still counts). The
event loop runs on the main thread; the others are the storage and database threads (anyio's)
and, when on, the batch span processor's export thread. Prints, per round and as medians, the
CPU ms per photo of each worker's main thread and of its other threads.

    .venv/bin/python bench/threads.py [--tiny 1500] [--rounds 4]

A diagnostic (docs/tracing.md, "The targets, measured"), not part of `make bench`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from e2e import tiny_pngs
from report import ROOT
from tracing import DATABASE, TracingRig, traced

sys.path.insert(0, str(ROOT))

from tests.otlp import serving

TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def thread_cpu_s(pid: int) -> dict[int, float]:
    """Each thread's user + system CPU seconds now (none once the process is gone)."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) * TICK_S  # utime, stime
    return out


def drain_side_by_side(
    rigs: tuple[TracingRig, TracingRig], paths: list[Path], modes: tuple[str, str],
    endpoint: str, label: str,
) -> dict[str, tuple[float, float]]:  # fmt: skip
    """Both workers drain `paths` at once; per mode, (main thread, other threads) CPU s."""
    procs = {}
    for rig, mode in zip(rigs, modes, strict=True):
        stream = f"threads-{label}-{mode}"
        rig.cli(stream, "ingest", *map(str, paths), **rig.ingest_env)
        extra = traced(endpoint) if mode == "on" else {}
        env = rig.environ(stream, DARKROOM_CONSUMER=stream, **extra)
        procs[mode] = subprocess.Popen(
            [sys.executable, "-m", "darkroom", "run", "--drain"], env=env, cwd=rig.tmp,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
    highest: dict[str, dict[int, float]] = {mode: {} for mode in procs}
    while any(p.poll() is None for p in procs.values()):
        for mode, proc in procs.items():
            for tid, cpu_s in thread_cpu_s(proc.pid).items():
                highest[mode][tid] = max(cpu_s, highest[mode].get(tid, 0.0))
        time.sleep(0.1)
    for mode, proc in procs.items():
        if proc.returncode != 0:
            raise SystemExit(f"the {mode} worker exited {proc.returncode}")
    return {
        mode: (seen.get(procs[mode].pid, 0.0),
               sum(v for tid, v in seen.items() if tid != procs[mode].pid))
        for mode, seen in highest.items()
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", type=int, default=1500, help="tiny PNGs per drain")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    per_photo: dict[tuple[str, str], list[float]] = {}
    with (
        tempfile.TemporaryDirectory(prefix="darkroom-bench-threads-") as name,
        serving(keep=False) as got,
    ):
        rig = TracingRig(Path(name), ingest_env=traced(got.endpoint))
        beside = TracingRig(Path(name) / "beside", ingest_env=rig.ingest_env,
                            database=f"{DATABASE}_beside")  # fmt: skip
        beside.tmp.mkdir()
        rig.setup()
        beside.setup()
        paths = tiny_pngs(Path(name) / "tiny", args.tiny)
        for i in range(args.rounds):
            modes = ("off", "on") if i % 2 == 0 else ("on", "off")  # each on each rig in turn
            cpu = drain_side_by_side((rig, beside), paths, modes, got.endpoint, str(i))
            for mode, (main_s, rest_s) in cpu.items():
                per_photo.setdefault((mode, "main"), []).append(1000 * main_s / len(paths))
                per_photo.setdefault((mode, "other"), []).append(1000 * rest_s / len(paths))
            line = ", ".join(
                f"{m}: main {1000 * a / len(paths):.2f}, other {1000 * b / len(paths):.2f} ms"
                for m, (a, b) in cpu.items()
            )
            print(f"round {i + 1}: {line}", flush=True)
    for (mode, thread), values in sorted(per_photo.items()):
        rounds = ", ".join(f"{v:.2f}" for v in values)
        print(f"{mode} {thread}: median {statistics.median(values):.2f} ms/photo ({rounds})")
    for thread in ("main", "other"):
        more = [on - off for on, off in zip(per_photo[("on", thread)], per_photo[("off", thread)],
                                             strict=True)]  # fmt: skip
        print(f"on − off, {thread}: median {statistics.median(more):+.2f} ms/photo")


if __name__ == "__main__":
    main()
