"""Object storage: the port callers use (port.py), a local-folder backend (files.py) and an
S3 backend (s3.py), each with its own table of driver errors; `open_storage` picks one by
URL.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from darkroom.settings import DEFAULT_PROBE_KEY
from darkroom.store.storage.files import FileStorage
from darkroom.store.storage.port import (
    CHUNK_BYTES,
    CONTENT_TYPES,
    ObjectStream,
    Page,
    Storage,
    StoredObject,
    Upload,
)
from darkroom.store.storage.s3 import S3Storage, open_s3

__all__ = [
    "CHUNK_BYTES",
    "CONTENT_TYPES",
    "FileStorage",
    "ObjectStream",
    "Page",
    "S3Storage",
    "Storage",
    "StoredObject",
    "Upload",
    "open_storage",
]


async def open_storage(
    url: str, endpoint_url: str | None = None, probe_key: str = DEFAULT_PROBE_KEY
) -> Storage:
    """`file:PATH` (relative to the working directory) or `s3://BUCKET[/PREFIX]`."""
    parts = urlsplit(url)
    if parts.scheme == "file":
        return FileStorage(Path(parts.netloc + parts.path), probe_key)
    return await open_s3(parts.netloc, parts.path.strip("/"), endpoint_url, probe_key)
