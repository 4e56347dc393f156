"""In-process tests of `image.renderer.RenderPool`: warm processes, their limits and ends."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from darkroom.errors import (
    CorruptImageError,
    RenderCrashedError,
    RenderOutOfMemoryError,
    RenderTimeoutError,
)
from darkroom.image.pipeline import render
from darkroom.image.renderer import RenderPool, vips_threads_for
from darkroom.image.renderproc import IDLE_TRIM_S
from darkroom.settings import DEFAULT_RENDITIONS, Settings, parse_renditions
from tests.conftest import PHOTOS

DEFAULTS = parse_renditions(DEFAULT_RENDITIONS)
HEIC = (PHOTOS / "iphone_13_pro_max.HEIC").read_bytes()  # about a second to render
SMALL = (PHOTOS / "animated-loop-3.gif").read_bytes()
JPEG = (PHOTOS / "Landscape_6.jpg").read_bytes()


def pool(slots: int = 1, **options: Any) -> RenderPool:
    settings = {"max_pixels": Settings().max_pixels, "timeout_s": 120.0, "memory_mb": 2048,
                "renders_per_process": 100, "max_rss_mb": 512,
                "keep_mb": Settings().render_keep_mb} | options  # fmt: skip
    return RenderPool(slots, **settings)


def gone(pid: int) -> bool:
    """The process has exited and been reaped (no zombie left behind)."""
    return not Path(f"/proc/{pid}").exists()


async def test_a_warm_process_renders_what_the_pipeline_renders() -> None:
    """The pool's result equals an in-process render, and the process stays for the next photo."""
    async with pool() as renderer:
        [pid] = renderer.pids()
        result = await renderer.render(JPEG, DEFAULTS)
        assert renderer.pids() == [pid]
    expected = render(JPEG, DEFAULTS, Settings().max_pixels)
    assert result.facts == expected.facts
    assert [(r.name, r.format, r.width, r.height) for r in result.renditions] == [
        (r.name, r.format, r.width, r.height) for r in expected.renditions
    ]
    assert result.peak_rss_mb > 0
    assert gone(pid), "close ends the idle processes"


async def test_a_process_is_replaced_after_renders_per_process_photos() -> None:
    """renders_per_process=2: the third photo runs in a new process; the old one has exited."""
    async with pool(renders_per_process=2) as renderer:
        [first] = renderer.pids()
        for _ in range(2):
            await renderer.render(SMALL, DEFAULTS)
        assert renderer.pids() == [] and gone(first)
        await renderer.render(SMALL, DEFAULTS)
        assert renderer.pids() != [first]
        assert (renderer.started, renderer.retired["renders"]) == (2, 1)


async def test_a_process_over_its_rss_bound_is_replaced() -> None:
    """A process whose resident memory after a photo passes max_rss_mb is retired."""
    async with pool(max_rss_mb=1) as renderer:
        [first] = renderer.pids()
        await renderer.render(SMALL, DEFAULTS)
        assert renderer.retired["rss"] == 1 and gone(first)


def _rss_mb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    raise AssertionError(f"no VmRSS for {pid}")


async def test_an_idle_process_gives_freed_memory_back_a_busy_one_keeps_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Right after a photo the process keeps the memory it freed (the next photo reuses it
    without page faults); with no photo for IDLE_TRIM_S it returns it to the system."""
    reported: list[int] = []
    seen = RenderPool._retirement

    def spy(self: RenderPool, child: Any, value: Any, rss_mb: int, peak_mb: int) -> str | None:
        reported.append(rss_mb)
        return seen(self, child, value, rss_mb, peak_mb)

    monkeypatch.setattr(RenderPool, "_retirement", spy)
    async with pool(keep_mb=512) as renderer:  # above any photo here: only idleness trims
        [pid] = renderer.pids()
        await renderer.render(HEIC, DEFAULTS)
        # "busy" is what the process read of itself as it answered: reading /proc from here
        # could come after the idle trim on a loaded machine
        [busy] = reported
        idle = busy
        for _ in range(100):  # the trim comes IDLE_TRIM_S after the answer, later under load
            await anyio.sleep(IDLE_TRIM_S)
            if (idle := _rss_mb(pid)) <= busy - 5:
                break
        assert renderer.pids() == [pid]
    # this machine: 104 MB right after, 57 MB idle when quiet; 67 and 52 under load (less
    # freed memory kept when fewer libvips threads ran at once)
    assert busy >= idle + 5, (busy, idle)


async def test_keep_mb_0_returns_freed_memory_after_every_photo() -> None:
    """DARKROOM_RENDER_KEEP_MB=0: the process gives freed memory back before it answers."""
    async with pool(keep_mb=0) as renderer:
        [pid] = renderer.pids()
        await renderer.render(HEIC, DEFAULTS)
        right_after = _rss_mb(pid)
        await anyio.sleep(IDLE_TRIM_S + 1.0)
        idle = _rss_mb(pid)
    assert right_after <= idle + 5, (right_after, idle)


def test_keep_mb_comes_from_the_settings_and_never_passes_max_rss_mb() -> None:
    assert RenderPool.from_settings(Settings(render_keep_mb=64)).keep_mb == 64
    capped = Settings(render_keep_mb=1024, render_max_rss_mb=300)
    assert RenderPool.from_settings(capped).keep_mb == 300


async def test_a_process_whose_address_space_neared_its_limit_is_replaced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """VmPeak never goes down: once a photo took a process within the margin of its limit,
    the next photo's failed allocation could pass for a corrupt image, so it is retired
    and the next photo starts in a fresh process."""
    peaks: list[int] = []
    seen = RenderPool._retirement

    def spy(self: RenderPool, child: Any, value: Any, rss_mb: int, peak_mb: int) -> str | None:
        peaks.append(peak_mb)
        return seen(self, child, value, rss_mb, peak_mb)

    monkeypatch.setattr(RenderPool, "_retirement", spy)
    async with pool(memory_mb=2048) as renderer:  # this machine's address-space peak
        await renderer.render(SMALL, DEFAULTS)
        assert renderer.retired["address_space"] == 0
    # a limit 32 MB above that peak: the photo fits, and its peak is within the margin
    async with pool(memory_mb=peaks[0] + 32) as renderer:
        [first] = renderer.pids()
        await renderer.render(SMALL, DEFAULTS)
        assert renderer.retired["address_space"] == 1 and gone(first)
        await renderer.render(JPEG, DEFAULTS)


def open_sockets() -> int:
    """This process's open sockets: each render process's pipe to the pool is a socket pair."""
    links = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # the listing's own descriptor
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
    return sum(1 for link in links if link.startswith("socket:"))


async def test_a_timeout_kills_the_process_and_the_next_photo_renders() -> None:
    """A render slower than timeout_s is killed (code timeout); a fresh process takes the
    next, and the dead one's pipe is closed (no descriptor left behind by any timeout)."""
    async with pool(timeout_s=0.05) as renderer:
        [pid] = renderer.pids()
        before = open_sockets()
        with pytest.raises(RenderTimeoutError) as caught:
            await renderer.render(HEIC, DEFAULTS)
        assert caught.value.code == "timeout" and caught.value.retryable
        assert gone(pid) and renderer.retired["killed"] == 1
        renderer.timeout_s = 120
        again = await renderer.render(JPEG, DEFAULTS)
        assert open_sockets() == before  # one process's pipe end, as before the timeout
    assert (again.facts.width, again.facts.height) == (1800, 1200)


async def test_a_crash_costs_only_its_photo() -> None:
    """A render process dying mid-photo (SIGSEGV) is render_crashed; the pool carries on."""
    async with pool() as renderer:
        [pid] = renderer.pids()
        async with anyio.create_task_group() as group:
            group.start_soon(_signal_later, pid, signal.SIGSEGV)
            with pytest.raises(RenderCrashedError, match="SIGSEGV"):
                await renderer.render(HEIC, DEFAULTS)
        assert gone(pid) and renderer.retired["crashed"] == 1
        assert (await renderer.render(SMALL, DEFAULTS)).facts.format == "gif"


async def _signal_later(pid: int, signum: int) -> None:
    await anyio.sleep(0.3)
    os.kill(pid, signum)


async def test_out_of_memory_fails_its_photo_and_replaces_the_process() -> None:
    """Past memory_mb the photo fails out_of_memory (or crashed in native code), the process
    is replaced, and a small photo still renders under the same limit."""
    async with pool(memory_mb=200) as renderer:
        [pid] = renderer.pids()
        with pytest.raises((RenderOutOfMemoryError, RenderCrashedError)):
            await renderer.render(HEIC, DEFAULTS)
        assert gone(pid)
        assert (await renderer.render(SMALL, DEFAULTS)).facts.format == "gif"


async def test_a_raw_decode_past_the_memory_limit_fails_out_of_memory() -> None:
    """LibRaw decoding a 12 MP sensor whole under a 300 MB address-space limit: the photo
    fails out_of_memory (its buffers refused), never corrupt_image, and the next renders."""
    from tests import rawcraft

    data = rawcraft.bayer_dng(rawcraft.quadrants(4000, 3000))
    whole = parse_renditions("large:4000:jpeg:85")  # more than half the sensor: no half size
    async with pool(memory_mb=300) as renderer:
        with pytest.raises(RenderOutOfMemoryError):
            await renderer.render(data, whole)
        assert (await renderer.render(SMALL, DEFAULTS)).facts.format == "gif"


async def test_a_cancelled_render_kills_and_reaps_its_process() -> None:
    """Cancelling the awaiting task kills the render process and waits for it to be reaped."""
    async with pool() as renderer:
        [pid] = renderer.pids()
        before = open_sockets()
        with anyio.move_on_after(0.3) as scope:
            await renderer.render(HEIC, DEFAULTS)
        assert scope.cancelled_caught
        assert gone(pid) and renderer.retired["killed"] == 1
        assert (await renderer.render(SMALL, DEFAULTS)).facts.format == "gif"
        assert open_sockets() == before  # the killed process's pipe end was closed


async def test_a_photo_error_keeps_the_process() -> None:
    """A permanent error of the photo itself (corrupt data) is raised; the process stays warm."""
    async with pool() as renderer:
        [pid] = renderer.pids()
        with pytest.raises(CorruptImageError):
            await renderer.render(JPEG[: len(JPEG) // 2], DEFAULTS)
        assert renderer.pids() == [pid]


async def test_slots_bound_concurrent_renders() -> None:
    """Two slots: four photos at once never run more than two processes."""
    async with pool(slots=2) as renderer:
        assert len(renderer.pids()) == 2
        async with anyio.create_task_group() as group:
            for _ in range(4):
                group.start_soon(renderer.render, JPEG, DEFAULTS)
        assert renderer.started == 2 and len(renderer.pids()) == 2


def test_libvips_threads_share_the_cores_between_slots() -> None:
    """processes × libvips threads never exceeds the usable cores (at least one thread each)."""
    cores = len(os.sched_getaffinity(0))
    assert vips_threads_for(1) == cores
    assert vips_threads_for(cores) == 1
    assert vips_threads_for(cores * 4) == 1


def test_render_processes_exit_when_their_worker_is_killed() -> None:
    """A SIGKILLed worker leaves no render process behind: each sees EOF on its pipe."""
    script = (
        "import anyio, sys\n"
        "from tests.test_renderer import pool\n"
        "async def main():\n"
        "    async with pool(slots=2) as renderer:\n"
        "        print(*renderer.pids(), flush=True)\n"
        "        await anyio.sleep(60)\n"
        "anyio.run(main)\n"
    )
    root = Path(__file__).parents[1]
    worker = subprocess.Popen([sys.executable, "-c", script], cwd=root, stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    assert worker.stdout is not None
    pids = [int(pid) for pid in worker.stdout.readline().split()]
    assert len(pids) == 2 and not any(stopped(pid) for pid in pids)
    worker.kill()
    worker.communicate()
    deadline = time.monotonic() + 10
    while not all(stopped(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(stopped(pid) for pid in pids)


def stopped(pid: int) -> bool:
    """Exited: gone, or a zombie waiting for a reaper that is not ours."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
