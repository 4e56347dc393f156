"""`image.pipe`: the worker's non-blocking end speaks the frames a render process's blocking
`multiprocessing` Connection reads and writes, at every size, and tells a closed peer."""

from __future__ import annotations

import multiprocessing
import os
import threading
from typing import Any

import anyio
import pytest

from darkroom.image import pipe

# Below the one-write size, above it (length and pickle written apart), and far past the
# socket's buffer, so both sides wait for each other many times.
SIZES = [10, 20_000, 24 * 1024 * 1024]


def _ends() -> tuple[Any, Any]:
    ours, theirs = multiprocessing.get_context("forkserver").Pipe(duplex=True)
    os.set_blocking(ours.fileno(), False)
    return ours, theirs


def _echo(conn: Any, replies: int) -> None:
    """A render process's side: blocking recv, then send back what came, `replies` times."""
    for _ in range(replies):
        conn.send(conn.recv())


@pytest.mark.parametrize("size", SIZES)
async def test_a_frame_goes_both_ways_whole(size: int) -> None:
    ours, theirs = _ends()
    peer = threading.Thread(target=_echo, args=(theirs, 2), daemon=True)
    peer.start()
    try:
        for payload in (os.urandom(size), ("ok", os.urandom(size), size, None)):
            with anyio.fail_after(30):
                await pipe.send(ours.fileno(), payload)
                assert await pipe.recv(ours.fileno()) == payload
    finally:
        ours.close()  # a peer still waiting gets its EOF
        peer.join(30)
        theirs.close()


async def test_the_loop_keeps_running_while_a_large_frame_waits_for_its_reader() -> None:
    """A frame larger than the socket holds does not block the event loop: other tasks run
    while the peer is slow to read."""
    ours, theirs = _ends()
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.sleep(0.01)

    def slow_echo() -> None:
        threading.Event().wait(0.3)
        _echo(theirs, 1)

    peer = threading.Thread(target=slow_echo, daemon=True)
    peer.start()
    payload = os.urandom(8 * 1024 * 1024)
    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(tick)
                await pipe.send(ours.fileno(), payload)
                assert await pipe.recv(ours.fileno()) == payload
                tg.cancel_scope.cancel()
        assert ticks >= 5  # about 0.3 s of 10 ms ticks went by during the send (30 unloaded)
    finally:
        ours.close()
        peer.join(30)
        theirs.close()


async def test_a_peer_that_closes_mid_frame_is_an_eof() -> None:
    ours, theirs = _ends()
    theirs.send("first")  # a whole frame, then half of the next one's length
    os.write(theirs.fileno(), b"\x00\x00")
    theirs.close()
    assert await pipe.recv(ours.fileno()) == "first"
    with pytest.raises(EOFError), anyio.fail_after(30):
        await pipe.recv(ours.fileno())
    ours.close()


async def test_writing_to_a_closed_peer_is_an_os_error() -> None:
    ours, theirs = _ends()
    theirs.close()
    with pytest.raises(BrokenPipeError), anyio.fail_after(30):
        await pipe.send(ours.fileno(), os.urandom(1024 * 1024))
    ours.close()
