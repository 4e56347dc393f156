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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from e2e import REDIS_URL, Rig, _done_times

# Runs one worker as a child subreaper, so the worker's forkserver and render processes are
# reaped by it, and prints the CPU seconds of that whole tree.
_COUNTED = """
import ctypes, os, resource, subprocess, sys
ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
code = subprocess.call(sys.argv[1:], stdout=subprocess.DEVNULL)
while True:
    try:
        os.wait()
    except ChildProcessError:
        break
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
print(usage.ru_utime + usage.ru_stime)
sys.exit(code)
"""


@dataclass
class Drained:
    photos: int
    cpu_ms: float  # the worker's, its forkserver's and its render processes'

    @property
    def cpu_ms_per_photo(self) -> float:
        return self.cpu_ms / self.photos


def side_by_side(rig: Rig, paths: list[Path], first: dict[str, str],
                 second: dict[str, str]) -> tuple[Drained, Drained]:  # fmt: skip
    """Both workers (`first`'s and `second`'s extra environment) drain `paths` at once, each
    from its own stream."""
    streams = []
    for _ in (first, second):
        rig.runs += 1
        streams.append(f"bench-{os.getpid()}-{rig.runs}")
        rig.cli(streams[-1], "ingest", *map(str, paths))
    procs = [_start(rig, name, extra) for name, extra in zip(streams, (first, second), strict=True)]
    outs = [p.communicate() for p in procs]
    drained = []
    for proc, (out, log), stream in zip(procs, outs, streams, strict=True):
        done = list(_done_times([log]))
        if proc.returncode != 0 or len(done) != len(paths):
            raise SystemExit(f"worker exited {proc.returncode}, {len(done)} of {len(paths)} "
                             f"photos finished:\n{log[-3000:]}")  # fmt: skip
        drained.append(Drained(len(paths), float(out.strip()) * 1000))
        redis.Redis.from_url(REDIS_URL).delete(f"{{{stream}}}:photos", f"{{{stream}}}:dead")
    return drained[0], drained[1]


def _start(rig: Rig, stream: str, extra: dict[str, str]) -> Any:
    worker = [sys.executable, "-m", "darkroom", "run", "--drain"]
    env = rig.environ(stream, DARKROOM_CONSUMER=f"bench-{stream}", **extra)
    return subprocess.Popen([sys.executable, "-c", _COUNTED, *worker], env=env, cwd=rig.tmp,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
