"""The worker's end of a render process's pipe, driven by the event loop.

The render process keeps multiprocessing's blocking `Connection`; its frames are a 4-byte
big-endian signed length (-1, then an 8-byte length, past 2 GiB) and a pickle. The worker
reads and writes the same frames on its own end, set non-blocking, and waits for the
socket in the event loop: a photo's exchange needs no thread, so no thread hand-off and no
wait for the GIL when the reply lands (docs/architecture.md, "The render pipe on the event
loop").
"""

from __future__ import annotations

import os
import struct
from multiprocessing.reduction import ForkingPickler
from typing import Any

import anyio

_LENGTH = struct.Struct("!i")
_LARGE_LENGTH = struct.Struct("!Q")
_MAX_SMALL = 0x7FFFFFFF
# Up to this, length and pickle go out in one write (as multiprocessing does).
_JOIN_UP_TO = 16384


async def send(fd: int, obj: object) -> None:
    """Write one frame to the non-blocking `fd`; OSError if the other end is gone."""
    payload = ForkingPickler.dumps(obj)
    size = len(payload)
    if size > _MAX_SMALL:
        header = _LENGTH.pack(-1) + _LARGE_LENGTH.pack(size)
    else:
        header = _LENGTH.pack(size)
    if size <= _JOIN_UP_TO:
        await _write_all(fd, header + bytes(payload))
        return
    await _write_all(fd, header)
    await _write_all(fd, payload)


async def recv(fd: int) -> Any:
    """Read one frame from the non-blocking `fd`; EOFError if the other end closed first."""
    await anyio.wait_readable(fd)  # the reply is a photo's render away
    (size,) = _LENGTH.unpack(await _read_exactly(fd, _LENGTH.size))
    if size == -1:
        (size,) = _LARGE_LENGTH.unpack(await _read_exactly(fd, _LARGE_LENGTH.size))
    return ForkingPickler.loads(await _read_exactly(fd, size))


async def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            await anyio.wait_writable(fd)


async def _read_exactly(fd: int, size: int) -> bytearray:
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        try:
            read = os.readv(fd, [view[got:]])
        except BlockingIOError:
            await anyio.wait_readable(fd)
            continue
        if read == 0:
            raise EOFError("render process closed its pipe")
        got += read
    return buffer
