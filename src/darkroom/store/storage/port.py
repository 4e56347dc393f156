"""The storage port: what every backend offers (`Storage`, `ObjectStream`) and the values
they exchange. Keys are relative paths (`originals/<id>/...`,
`renditions/<id>/<name>-<hash12>.<ext>`).

Backends raise OriginalMissingError for an absent object, OriginalTooLargeError past the
byte cap, ObjectForbiddenError for one object denied while the bucket answers, and
StorageUnavailableError (an outage) for everything else. `get` reads a whole object (the
worker renders it); `open` streams one in chunks of CHUNK_BYTES (the web page serves it).
`list` pages through a prefix, `stat` reads one object's size and write time afresh, and
`delete` removes one object (absent is fine): what `darkroom gc` needs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from darkroom.errors import OriginalTooLargeError

CONTENT_TYPES = {
    "webp": "image/webp",
    "jpeg": "image/jpeg",
    "avif": "image/avif",
    "png": "image/png",
}


@dataclass(frozen=True)
class StoredObject:
    key: str
    size: int
    modified_s: float  # last write, seconds since the epoch (an overwrite renews it)


Page = list[StoredObject]


@dataclass(frozen=True)
class Upload:
    key: str
    data: bytes
    content_type: str


# What one read of a stream holds in memory, whatever the object's size.
CHUNK_BYTES = 256 * 1024


class ObjectStream(Protocol):
    """An object being read: its size up front, then at most `size` bytes chunk by chunk
    (b"" at the end). Errors while reading are translated like those of `open`."""

    size: int

    async def read(self) -> bytes: ...

    def close(self) -> None:
        """Release the file or connection; safe to call twice."""


class Storage(Protocol):
    async def get(self, key: str, max_bytes: int) -> bytes: ...

    async def open(self, key: str, max_bytes: int) -> ObjectStream: ...

    async def put(
        self, key: str, data: bytes, content_type: str, cache_control: str | None = None
    ) -> None:
        """Write (or overwrite) one object; the local folder keeps no headers."""

    async def put_many(self, objects: list[Upload], cache_control: str | None = None) -> None:
        """Write several objects (a photo's renditions); all are stored once it returns."""

    async def delete(self, key: str) -> None:
        """Remove one object; an absent one is not an error."""

    def list(self, prefix: str) -> AsyncIterator[Page]:
        """Every object whose key starts with `prefix` (a folder, ending in `/`), by pages."""

    async def stat(self, key: str) -> StoredObject | None:
        """One object as it is now (None: absent), not as a listing saw it a while ago."""

    async def probe(self) -> None:
        """Raise StorageUnavailableError unless the worker can write and read an object."""

    async def aclose(self) -> None: ...


def too_large(key: str, size: int, max_bytes: int) -> OriginalTooLargeError:
    return OriginalTooLargeError(f"{key} is {size} bytes, over the cap of {max_bytes}")
