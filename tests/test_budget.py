"""The render slots' memory budget, through a real render pool: two large decodes never run
at once while small photos still overlap, a photo over the whole budget renders alone,
waiters are admitted in their order; and the header sizes the estimate reads."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
import pyvips

from darkroom.image import budget, footprint
from darkroom.image.renderer import RenderPool
from darkroom.settings import DEFAULT_RENDITIONS, Settings, parse_renditions
from tests.conftest import PHOTOS

DEFAULTS = parse_renditions(DEFAULT_RENDITIONS)
BIG = (PHOTOS / "iphone_hdr_NO.jpg").read_bytes()  # 8 MP
SMALL = (PHOTOS / "Landscape_6.jpg").read_bytes()  # 2 MP
TINY = (PHOTOS / "animated-loop-3.gif").read_bytes()  # 370×285: outside the budget
BIG_MB, SMALL_MB = footprint.estimate_mb(BIG), footprint.estimate_mb(SMALL)


def pool(slots: int, budget_mb: int, **options: Any) -> RenderPool:
    settings = {"max_pixels": Settings().max_pixels, "timeout_s": 120.0, "memory_mb": 2048,
                "renders_per_process": 100, "max_rss_mb": 512, "keep_mb": 128}  # fmt: skip
    settings |= options
    return RenderPool(slots, budget_mb=budget_mb, **settings)


class Starts:
    """Each photo's admission, as the pool calls `started`: its name and the shares the
    budget held at that moment (its own included)."""

    def __init__(self, renderer: RenderPool) -> None:
        self.renderer = renderer
        self.seen: list[tuple[str, list[int]]] = []

    def render(
        self,
        name: str,
        data: bytes,
        interactive: bool = False,
        then: Callable[[], object] | None = None,
    ) -> Callable[[], Awaitable]:
        def started() -> None:
            self.seen.append((name, list(self.renderer.budget.held_mb)))
            if then is not None:
                then()

        async def run() -> None:
            await self.renderer.render(data, DEFAULTS, interactive=interactive, started=started)

        return run

    @property
    def order(self) -> list[str]:
        return [name for name, _ in self.seen]


async def until(condition: Callable[[], bool]) -> None:
    """Wait for the pool's state to say so (no time limit: the test's own timeout is it)."""
    while not condition():  # noqa: ASYNC110 - the pool's state has no event to wait on
        await anyio.sleep(0.005)


def test_a_large_heif_is_estimated_far_above_a_jpeg_of_the_same_pixels() -> None:
    avif = footprint.estimate_mb((PHOTOS / "avif-orientation-6.avif").read_bytes())
    heic = footprint.estimate_mb((PHOTOS / "iphone_13_pro_max.HEIC").read_bytes())
    jpeg = footprint.estimate_mb(BIG)  # 8 MP; the AVIF and the HEIC are 12 MP
    assert (
        avif > heic > 2 * jpeg > jpeg > SMALL_MB > budget.OUTSIDE_MB >= footprint.estimate_mb(TINY)
    )


@pytest.mark.parametrize("path", sorted(p for p in PHOTOS.iterdir() if p.suffix != ".md"))
def test_the_header_read_gives_the_size_the_decoder_sees(path: Any) -> None:
    data = path.read_bytes()
    width, height, _ = footprint._size(data, footprint.sniff(data))  # type: ignore[misc]
    header = pyvips.Image.new_from_buffer(data, "")
    assert sorted((width, height)) == sorted((header.width, header.height))


def test_a_raw_is_estimated_by_what_will_decode_it() -> None:
    """A RAW whose preview covers the default list renders that JPEG: a JPEG's estimate of
    the preview's size. One that LibRaw decodes is estimated by its sensor: a 24 MP sensor
    at half size (it covers 2,048 px) below a 6 MP one decoded whole, per megapixel."""
    from tests import rawcraft

    covered = rawcraft.tiff_raw("Canon", layout="dng", sensor=(6000, 4000),
                                jpeg=rawcraft.preview(3000, 2000))  # fmt: skip
    assert footprint.estimate_mb(covered) == footprint._mb(6.0, "jpeg")
    half = rawcraft.tiff_raw("Canon", layout="dng", sensor=(6000, 4000),
                             jpeg=rawcraft.preview(160, 120))  # fmt: skip
    whole = rawcraft.tiff_raw("Canon", layout="dng", sensor=(3000, 2000),
                              jpeg=rawcraft.preview(160, 120))  # fmt: skip
    assert footprint.estimate_mb(half) == footprint._mb(24.0, "raw_half")
    assert footprint.estimate_mb(whole) == footprint._mb(6.0, "raw_full")
    # a CR3's sensor size is not read: an APS-C camera's at half size, far above the floor
    assumed = footprint._mb(footprint.ASSUMED_RAW_MP, "raw_half")
    assert footprint.estimate_mb(rawcraft.cr3()) == assumed > 5 * footprint.FLOOR_MB


def test_a_header_that_does_not_read_is_estimated_at_the_floor() -> None:
    assert footprint.estimate_mb(b"not an image") == footprint.FLOOR_MB
    assert footprint.estimate_mb(BIG[:200]) == footprint.FLOOR_MB  # cut before its frame


async def test_two_big_photos_never_render_at_once_while_small_ones_overlap() -> None:
    """Budget: a big and a small photo fit together, two big ones do not, two small do (the
    first two, both admitted before either can finish)."""
    assert BIG_MB > SMALL_MB
    async with pool(2, BIG_MB + SMALL_MB) as renderer:
        starts = Starts(renderer)
        async with anyio.create_task_group() as tasks:
            for i, data in enumerate([SMALL, SMALL, BIG, BIG, SMALL, BIG]):
                tasks.start_soon(starts.render(f"photo {i}", data))
        assert renderer.budget.in_use_mb == 0 and renderer.budget.waiting == 0
    held = [shares for _, shares in starts.seen]
    assert len(held) == 6
    assert all(shares.count(BIG_MB) <= 1 for shares in held), held
    assert any(shares.count(SMALL_MB) == 2 for shares in held), "small photos overlapped"


async def test_a_photo_over_the_whole_budget_renders_alone() -> None:
    """Every photo here is over the budget: one at a time, each rendered; before each, the
    other (idle) process returns the memory it kept for its next photo."""
    async with pool(2, SMALL_MB // 2) as renderer:
        starts = Starts(renderer)
        async with anyio.create_task_group() as tasks:
            for i, data in enumerate([BIG, SMALL, BIG]):
                tasks.start_soon(starts.render(f"photo {i}", data))
        assert renderer.trims == 3, "before each, the idle process returned what it kept"
        assert (len(renderer.pids()), renderer.started) == (2, 2), "and stayed, warm"
    assert [shares for _, shares in starts.seen] == [[SMALL_MB // 2]] * 3


async def test_waiters_are_admitted_in_order_no_small_photo_overtakes_a_big_one() -> None:
    """A render holding most of the budget: a big photo waits; small ones that came after
    it wait behind it though they would fit now; then all in their arrival order."""
    async with pool(4, BIG_MB + SMALL_MB) as renderer:
        starts = Starts(renderer)
        blocker = await renderer.budget.take(BIG_MB)  # a big render under way
        async with anyio.create_task_group() as tasks:
            for i, (name, data) in enumerate(
                [("big", BIG), ("small 1", SMALL), ("small 2", SMALL)]
            ):
                tasks.start_soon(starts.render(name, data))
                await until(lambda i=i: renderer.budget.waiting == i + 1)
            assert starts.seen == [], "the small ones wait behind the big one though they fit"
            renderer.budget.give_back(blocker)
    assert starts.order == ["big", "small 1", "small 2"]
    assert starts.seen[1][1] == [BIG_MB, SMALL_MB], "small 1 beside the big one"


async def test_an_interactive_photo_goes_ahead_of_waiting_bulk_ones() -> None:
    async with pool(2, BIG_MB, reserved=1) as renderer:
        starts = Starts(renderer)
        blocker = await renderer.budget.take(BIG_MB)
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(starts.render("bulk", BIG))
            await until(lambda: renderer.budget.waiting == 1)
            tasks.start_soon(starts.render("upload", SMALL, interactive=True))
            await until(lambda: renderer.budget.waiting == 2)
            renderer.budget.give_back(blocker)
    assert starts.order == ["upload", "bulk"]


async def test_a_photo_cancelled_while_it_waits_leaves_the_queue() -> None:
    """The one behind it renders; the budget and the slots are whole again."""
    async with pool(2, BIG_MB + SMALL_MB) as renderer:
        starts = Starts(renderer)
        blocker = await renderer.budget.take(BIG_MB)
        waiting = anyio.CancelScope()

        async def doomed() -> None:
            with waiting:
                await starts.render("big", BIG)()

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(doomed)
            await until(lambda: renderer.budget.waiting == 1)
            tasks.start_soon(starts.render("small", SMALL))
            await until(lambda: renderer.budget.waiting == 2)
            waiting.cancel()
        renderer.budget.give_back(blocker)
        assert starts.order == ["small"]
        assert (renderer.budget.in_use_mb, renderer.budget.waiting) == (0, 0)
        await renderer.render(BIG, DEFAULTS)  # both slots are free again


async def test_a_tiny_photo_renders_beside_one_that_holds_the_whole_budget() -> None:
    """Outside the budget: it starts while the big photo renders (started from the big
    one's admission, so before that render can end), in the other process, which first
    returns the memory it kept."""
    async with pool(2, BIG_MB) as renderer:
        starts = Starts(renderer)
        async with anyio.create_task_group() as tasks:
            beside = starts.render("tiny", TINY)
            tasks.start_soon(starts.render("big", BIG, then=lambda: tasks.start_soon(beside)))
        assert renderer.trims == 1 and renderer.started == 2
    assert starts.seen == [("big", [BIG_MB]), ("tiny", [BIG_MB])]


async def test_a_process_a_render_took_is_not_trimmed_under_it() -> None:
    """Three processes: the big photo takes one and trims the idle others one by one; the
    tiny photo takes one of those meanwhile and trims it itself before its photo. Each pipe
    carries one exchange at a time: both render, and no process is replaced."""
    async with pool(3, BIG_MB) as renderer:
        starts = Starts(renderer)
        async with anyio.create_task_group() as tasks:
            beside = starts.render("tiny", TINY)
            tasks.start_soon(starts.render("big", BIG, then=lambda: tasks.start_soon(beside)))
        assert renderer.trims == 2
        assert (renderer.started, sum(renderer.retired.values())) == (3, 0)
    assert starts.order == ["big", "tiny"]
