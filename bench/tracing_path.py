"""The whole in-process cost of a traced delivery, printed in CPU µs: its spans made, queued
to the batch processor, encoded, POSTed over OTLP/HTTP to a receiver in another process, and
their delivery confirmed; the export thread's CPU included (process time counts every thread).
Run by bench/tracing.py in a process of its own, since `tracing.start` installs the SDK once
per process.

    .venv/bin/python bench/tracing_path.py [--deliveries 3000]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from report import ROOT

sys.path.insert(0, str(ROOT))

RECEIVER = """
import sys, time
sys.path.insert(0, sys.argv[1])
from tests.otlp import serving
with serving(keep=False) as got:
    print(got.endpoint, flush=True)
    time.sleep(3600)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deliveries", type=int, default=3000)
    count = parser.parse_args().deliveries
    receiver = subprocess.Popen([sys.executable, "-c", RECEIVER, str(ROOT)],
                                stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert receiver.stdout is not None
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.stdout.readline().strip()
        os.environ["OTEL_TRACES_SAMPLER"] = "always_on"
        from tracing import one_delivery

        from darkroom import tracing

        delivery = one_delivery()
        assert tracing.start(), "tracing did not start"
        rounds = []
        for _ in range(4):  # the first warms up
            started = time.process_time()
            for i in range(count):
                delivery()
                if i % 100 == 99:  # under the queue's 2,048 spans: none dropped
                    assert tracing.flush(), "the receiver did not take the spans"
            assert tracing.flush(), "the receiver did not take the spans"
            rounds.append((time.process_time() - started) / count * 1e6)
        print(f"{min(rounds[1:]):.0f}")
    finally:
        receiver.kill()


if __name__ == "__main__":
    main()
