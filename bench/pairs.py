"""Two workers draining side by side: the same photos in two streams, both workers started
together, each one's CPU counted apart (its own process tree). On a shared machine whose
speed moves from minute to minute, a figure measured in one drain and its baseline in the
next compare two moments; two drains at once share the moment, and a pair of identical
workers gives the noise that is left.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from e2e import REDIS_URL, Rig, _done_times

# Runs one worker as a child subreaper, so the worker's forkserver and render processes are
# reaped by it, and prints the CPU seconds of the worker's process and of the rest of its tree.
_COUNTED = """
import ctypes, os, subprocess, sys
ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
worker = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL)
_, status, usage = os.wait4(worker.pid, 0)
cpu, rest = usage.ru_utime + usage.ru_stime, 0.0
while True:
    try:
        _, _, usage = os.wait4(-1, 0)
    except ChildProcessError:
        break
    rest += usage.ru_utime + usage.ru_stime
print(cpu, rest)
sys.exit(os.waitstatus_to_exitcode(status))
"""


@dataclass
class Drained:
    photos: int
    worker_ms: float  # CPU of the worker's own process (its event loop and threads)
    rest_ms: float  # of its forkserver and render processes

    @property
    def cpu_ms(self) -> float:
        return self.worker_ms + self.rest_ms

    @property
    def cpu_ms_per_photo(self) -> float:
        return self.cpu_ms / self.photos


def side_by_side(rigs: tuple[Rig, Rig], paths: list[Path], first: dict[str, str],
                 second: dict[str, str]) -> tuple[Drained, Drained]:  # fmt: skip
    """Both workers (`first`'s and `second`'s extra environment) drain `paths` at once, each
    from its own stream of its own rig (give each rig a database of its own, or one worker
    holds the duties, such as the events relay, for both)."""
    streams = []
    for rig in rigs:
        rig.runs += 1
        streams.append(f"bench-{os.getpid()}-{id(rig)}-{rig.runs}")
        rig.cli(streams[-1], "ingest", *map(str, paths), **rig.ingest_env)
    # Each worker's log to a file of its own: a pipe read after the other worker's would fill
    # (64 KiB, about 210 photos' lines) and stop its worker until the other had finished.
    with tempfile.TemporaryFile("w+") as log_a, tempfile.TemporaryFile("w+") as log_b:
        started = zip(rigs, streams, (first, second), (log_a, log_b), strict=True)
        procs = [_start(*each) for each in started]
        outs = [p.communicate()[0] for p in procs]
        logs = []
        for log_file in (log_a, log_b):
            log_file.seek(0)
            logs.append(log_file.read())
    drained = []
    for proc, out, log, stream in zip(procs, outs, logs, streams, strict=True):
        done = list(_done_times([log]))
        if proc.returncode != 0 or len(done) != len(paths):
            raise SystemExit(f"worker exited {proc.returncode}, {len(done)} of {len(paths)} "
                             f"photos finished:\n{log[-3000:]}")  # fmt: skip
        worker_s, rest_s = map(float, out.split())
        drained.append(Drained(len(paths), worker_s * 1000, rest_s * 1000))
        redis.Redis.from_url(REDIS_URL).delete(f"{{{stream}}}:photos", f"{{{stream}}}:dead")
    return drained[0], drained[1]


def _start(rig: Rig, stream: str, extra: dict[str, str], log: Any) -> Any:
    worker = [sys.executable, "-m", "darkroom", "run", "--drain"]
    env = rig.environ(stream, DARKROOM_CONSUMER=f"bench-{stream}", **extra)
    return subprocess.Popen([sys.executable, "-c", _COUNTED, *worker], env=env, cwd=rig.tmp,
                            stdout=subprocess.PIPE, stderr=log, text=True)  # fmt: skip
