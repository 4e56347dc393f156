"""How many workers one Redis primary and one PostgreSQL primary serve: measured costs per photo.

    .venv/bin/python bench/capacity.py [--out docs/capacity.md] [--photos 300]

A dedicated redis-server on a free loopback port (so `INFO commandstats` holds darkroom's
commands alone) and a dedicated database `darkroom_capacity` (so `pg_stat_database` holds
its transactions alone). Tiny PNGs are ingested, then drained by one real worker; the deltas
around each step, the CPU of the database sessions, and a redis-benchmark of XADD on the same
server give the table of docs/capacity.md. A short tiny drain (a quarter of --photos) comes
first: PostgreSQL's figures at steady state are the difference between the two drains.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import asyncpg
import ceiling
import e2e
import redis
from e2e import PR_SET_CHILD_SUBREAPER, Rig, _done_times, _reap_orphans, large_jpegs, tiny_pngs
from report import machine, write_section

DATABASE = "darkroom_capacity"
PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
PG_COUNTERS = ("xact_commit", "xact_rollback", "tup_returned", "tup_fetched", "tup_inserted",
               "tup_updated", "tup_deleted", "blks_hit", "blks_read")  # fmt: skip
TICK_S = os.sysconf("SC_CLK_TCK")
SCRIPTED = {"xack", "xdel"}  # the worker runs them in ACK_LUA (queue/streams/scripts.py) only


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_redis(port: int, folder: Path) -> redis.Redis:
    """A daemonised server, so it is not this subreaper's child (reaping waits for all)."""
    command = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "no", "--dir", str(folder), "--daemonize", "yes",
               "--pidfile", str(folder / "redis.pid"),
               "--logfile", str(folder / "redis.log")]  # fmt: skip
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            return client
        except redis.ConnectionError:
            time.sleep(0.05)
    raise SystemExit("the dedicated redis-server did not start")


def commandstats(client: redis.Redis) -> dict[str, tuple[int, float]]:
    """calls and total server µs per command."""
    stats = client.info("commandstats")
    return {k.removeprefix("cmdstat_"): (v["calls"], v["usec"]) for k, v in stats.items()}


def redis_bytes(client: redis.Redis) -> tuple[int, int]:
    stats = client.info("stats")
    return stats["total_net_input_bytes"], stats["total_net_output_bytes"]


def pg_counters() -> dict[str, int]:
    async def read() -> dict[str, int]:
        conn = await asyncpg.connect(PG_ADMIN)
        try:
            await conn.execute("SELECT pg_stat_clear_snapshot()")
            row = await conn.fetchrow(f"SELECT {', '.join(PG_COUNTERS)} FROM pg_stat_database "
                                      "WHERE datname = $1", DATABASE)  # fmt: skip
            return dict(row) if row else {}
        finally:
            await conn.close()

    time.sleep(1.2)  # backends report their counters at most once a second (PG 15)
    return asyncio.run(read())


class SessionCpu:
    """CPU seconds of every PostgreSQL backend connected to the database, sampled until stop."""

    def __init__(self) -> None:
        self.seen: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return sum(self.seen.values())

    async def _run(self) -> None:
        conn = await asyncpg.connect(PG_ADMIN)
        query = "SELECT pid FROM pg_stat_activity WHERE datname = $1"
        try:
            while not self._stop.wait(0.1):
                for row in await conn.fetch(query, DATABASE):
                    pid = row["pid"]
                    self.seen[pid] = max(self.seen.get(pid, 0.0), _cpu_s(pid))
        finally:
            await conn.close()


def _cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK_S


def delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    keys = set(after) | set(before)
    if all(isinstance(v, tuple) for v in after.values()):
        zero = (0, 0.0)
        return {k: tuple(a - b for a, b in zip(after.get(k, zero), before.get(k, zero),
                                               strict=True)) for k in keys}  # fmt: skip
    return {k: after.get(k, 0) - before.get(k, 0) for k in keys}


# -- one measured run ------------------------------------------------------------------------


class Probe:
    """Counters of the dedicated Redis and the dedicated database, read around a step."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def read(self) -> dict[str, Any]:
        return {"cmd": commandstats(self.client), "net": redis_bytes(self.client),
                "pg": pg_counters()}  # fmt: skip

    def since(self, before: dict[str, Any]) -> dict[str, Any]:
        after = self.read()
        net = [a - b for a, b in zip(after["net"], before["net"], strict=True)]
        return {"cmd": delta(after["cmd"], before["cmd"]), "net": net,
                "pg": delta(after["pg"], before["pg"])}  # fmt: skip


def produce(rig: Rig, probe: Probe, stream: str, paths: list[Path]) -> dict[str, Any]:
    before = probe.read()
    rig.cli(stream, "ingest", *map(str, paths))
    return probe.since(before)


def consume(rig: Rig, probe: Probe, stream: str, photos: int) -> dict[str, Any]:
    before, cpu_before = probe.read(), e2e._children_cpu_s()
    sessions = SessionCpu()
    worker = rig._worker(stream, 0, None, {})
    log = worker.communicate()[1]
    pg_cpu_s = sessions.stop()
    _reap_orphans()
    done = sorted(_done_times([log]))
    if worker.returncode != 0 or len(done) != photos:
        raise SystemExit(
            f"worker exited {worker.returncode}, {len(done)} of {photos}:\n{log[-3000:]}"
        )
    used = probe.since(before)
    used["worker_cpu_s"] = e2e._children_cpu_s() - cpu_before
    used["pg_cpu_s"] = pg_cpu_s
    used["per_s"] = (photos - 1) / (done[-1] - done[0])
    return used


def redis_benchmark(port: int) -> float:
    """XADD requests/s the dedicated server answers (50 clients, no pipelining)."""
    command = ["redis-benchmark", "-p", str(port), "-n", "100000", "-c", "50", "-q", "--csv",
               "XADD", "{capacity}:bench", "MAXLEN", "~", "1000", "*", "photo_id",
               "00000000-0000-0000-0000-000000000000"]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return float(out.strip().splitlines()[-1].split(",")[1].strip('"'))


# -- the report -------------------------------------------------------------------------------


def per_photo(used: dict[str, Any], photos: int) -> dict[str, float]:
    return {k: v[0] / photos for k, v in sorted(used["cmd"].items()) if v[0]}


def redis_table(
    made: dict[str, Any], drained: dict[str, Any], photos: int
) -> tuple[str, float, float]:
    """Per command; XACK and XDEL run inside ACK_LUA's EVALSHA, whose time includes theirs."""
    lines = ["| side | command | calls per photo | server µs per call |", "|---|---|---:|---:|"]
    calls = usec = 0.0
    for side, used in (("producer (`darkroom ingest`)", made), ("worker", drained)):
        for name, (count, total_us) in sorted(used["cmd"].items()):
            if not count:
                continue
            inner = side == "worker" and name in SCRIPTED
            lines.append(f"| {side} | {name.upper()}{' (inside EVALSHA)' if inner else ''} | "
                         f"{count / photos:.2f} | {total_us / count:.1f} |")  # fmt: skip
            if not inner:
                calls, usec = calls + count / photos, usec + total_us / photos
    net = [(a + b) / photos for a, b in zip(made["net"], drained["net"], strict=True)]
    lines.append(f"| both | **round trips** | **{calls:.2f}** | {usec / calls:.1f} (mean) |")
    lines.append(f"\nBytes per photo on the wire (both sides): {net[0]:,.0f} in, "
                 f"{net[1]:,.0f} out. Server CPU per photo (commandstats, commands inside a "
                 f"script counted once, in EVALSHA): **{usec:.0f} µs**.")  # fmt: skip
    return "\n".join(lines), calls, usec


def pg_table(
    made: dict[str, Any], drained: dict[str, Any], photos: int, short: dict[str, Any], few: int
) -> tuple[str, float]:
    """Per photo over the whole drain (start-up included), and per photo at steady state:
    the difference between this drain and the short one, over the photos it adds."""
    lines = ["| counter (`pg_stat_database`) | producer, per photo | worker, per photo (whole "
             "drain) | worker, per photo (steady state) |", "|---|---:|---:|---:|"]  # fmt: skip
    extra = photos - few
    for name in PG_COUNTERS:
        steady = (drained["pg"][name] - short["pg"][name]) / extra
        lines.append(f"| {name} | {made['pg'][name] / photos:.2f} | "
                     f"{drained['pg'][name] / photos:.2f} | {steady:.2f} |")  # fmt: skip
    whole_ms = drained["pg_cpu_s"] * 1000 / photos
    cpu_ms = (drained["pg_cpu_s"] - short["pg_cpu_s"]) * 1000 / extra
    lines.append(
        f"\nCPU of the worker's database sessions (utime + stime from /proc of every backend "
        f"on the database, sampled every 0.1 s; the producer's INSERT is not in it): "
        f"**{cpu_ms:.2f} ms per photo** at steady state (the {photos}-photo drain less the "
        f"{few}-photo one, over the {extra} photos between them); {whole_ms:.2f} ms per photo "
        f"over the whole {photos}-photo drain, the worker's start-up included (its sessions' "
        "connections and catalog caches, the probe's PREPAREs)."
    )
    return "\n".join(lines), cpu_ms


def capacity_table(runs: dict[str, dict[str, Any]], photos: dict[str, int], calls: float,
                   usec: float, xadd_per_s: float, pg_ms: float) -> str:  # fmt: skip
    redis_cap = min(xadd_per_s / calls, 1e6 / usec)
    pg_cap = 1000 / pg_ms
    lines = ["| workload | worker CPU ms per photo | photos/s per core | photos/s per 2-core "
             "worker | workers one Redis primary serves | workers per PostgreSQL core |",
             "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, used in runs.items():
        cpu_ms = used["worker_cpu_s"] * 1000 / photos[name]
        per_worker = 2 * 1000 / cpu_ms
        lines.append(f"| {name} | {cpu_ms:.1f} | {1000 / cpu_ms:.1f} | {per_worker:.1f} | "
                     f"{redis_cap / per_worker:,.0f} | {pg_cap / per_worker:,.1f} |")  # fmt: skip
    lines.append(f"\nRedis primary ceiling: min(XADD {xadd_per_s:,.0f}/s ÷ {calls:.2f} "
                 f"commands, 10⁶ µs ÷ {usec:.0f} µs) = **{redis_cap:,.0f} photos/s**. "
                 f"PostgreSQL: 1000 ÷ {pg_ms:.2f} ms = **{pg_cap:,.0f} photos/s per core** "
                 "of the database server.")  # fmt: skip
    return "\n".join(lines)


def measure(rig: Rig, probe: Probe, tmp: Path, count: int, tiny_only: bool) -> dict[str, Any]:
    """A short tiny drain first: the PostgreSQL figures per photo are the difference of the
    two tiny drains, so each worker's start-up (connections, the probe's PREPAREs, catalog
    caches) is not charged to its photos; the whole-drain figures are given beside them."""
    small = max(1, count // 4)
    workloads = {f"{count} tiny PNGs (64×48)": tiny_pngs(tmp / "tiny", count)}
    if not tiny_only:  # the large run changes only the worker's CPU row
        workloads["24 large camera JPEGs (8–12 MP)"] = large_jpegs()
    print(f"  {small} tiny PNGs (the short drain)", file=sys.stderr)
    produce(rig, probe, "capacity-short", tiny_pngs(tmp / "short", small))
    out: dict[str, Any] = {"made": {}, "drained": {}, "photos": {}, "short_photos": small,
                           "short": consume(rig, probe, "capacity-short", small)}  # fmt: skip
    for i, (name, paths) in enumerate(workloads.items()):
        print(f"  {name}", file=sys.stderr)
        stream = f"capacity-{i}"
        out["made"][name] = produce(rig, probe, stream, paths)
        out["drained"][name] = consume(rig, probe, stream, len(paths))
        out["photos"][name] = len(paths)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="the benchmarks report: capacity.md beside it")
    parser.add_argument("--photos", type=int, default=300)
    parser.add_argument(
        "--tiny-only",
        action="store_true",
        help="skip the large JPEGs (quicker; they only add their row to the capacity table)",
    )
    parser.add_argument("--ceiling-photos", type=int, default=2000)
    parser.add_argument(
        "--ceiling-tasks",
        type=int,
        default=8,
        help="concurrent claim → publish → ack loops of the ceiling run",
    )
    args = parser.parse_args()
    port = free_port()
    e2e.REDIS_URL = f"redis://127.0.0.1:{port}/0"
    e2e.DATABASE_URL = f"postgresql://postgres@127.0.0.1:5432/{DATABASE}"
    with tempfile.TemporaryDirectory(prefix="darkroom-capacity-") as name:
        tmp, head = Path(name), machine()
        client = start_redis(port, tmp)
        ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1)  # after the daemon left
        try:
            subprocess.run(["dropdb", "-h", "127.0.0.1", "-U", "postgres", "--if-exists",
                            DATABASE], check=True)  # fmt: skip
            rig = Rig(tmp)
            rig.cli("capacity-setup", "migrate")
            found = measure(rig, Probe(client), tmp, args.photos, args.tiny_only)
            found["ceiling"] = ceiling.measure(Probe(client), SessionCpu, e2e.DATABASE_URL,
                                               e2e.REDIS_URL, args.ceiling_photos,
                                               args.ceiling_tasks)  # fmt: skip
            xadd_per_s = redis_benchmark(port)
        finally:
            client.shutdown(nosave=True)
    text = report(head, found, xadd_per_s)
    print(text)
    if args.out:
        write_section(args.out.with_name("capacity.md"), "capacity", text)
        print(f"wrote {args.out.with_name('capacity.md')}", file=sys.stderr)


def report(head: str, found: dict[str, Any], xadd_per_s: float) -> str:
    tiny = next(iter(found["photos"]))
    photos = found["photos"][tiny]
    made, drained = found["made"][tiny], found["drained"][tiny]
    redis_md, calls, usec = redis_table(made, drained, photos)
    pg_md, pg_ms = pg_table(made, drained, photos, found["short"], found["short_photos"])
    cap = capacity_table(found["drained"], found["photos"], calls, usec, xadd_per_s, pg_ms)
    return "\n".join([
        "## Measured (bench/capacity.py)", "",
        f"- {head}",
        f"- a dedicated redis-server on a free loopback port and a dedicated database "
        f"`{DATABASE}`; one `darkroom run --drain` worker, default settings, local-folder "
        f"storage; the Redis and PostgreSQL counts are from the {tiny} run", "",
        "### Redis per photo", "", redis_md, "",
        "### PostgreSQL per photo", "", pg_md, "",
        "### PostgreSQL at its ceiling", "",
        f"The photo's path without rendering (bench/ceiling.py: {found['ceiling']['slots']} "
        "tasks, each XREADGROUP → `leases.claim` → `publishing.publish` with a fixed "
        "renditions payload → the ack script, the real events relay and a feeder's listener "
        "beside them), "
        f"{found['ceiling']['full']['photos']} photos after a run of "
        f"{found['ceiling']['short']['photos']}; per photo at steady state, beside the "
        "render-bound drain above. The driver shares the machine's cores with PostgreSQL.", "",
        ceiling.table(({**drained, "photos": photos},
                       {**found["short"], "photos": found["short_photos"]}), found["ceiling"]),
        "",
        "### Capacity", "", cap, "",
    ])  # fmt: skip


if __name__ == "__main__":
    main()
