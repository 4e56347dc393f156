"""Object storage: one small port, a local-folder backend and an S3 backend (aioboto3).

Keys are relative paths (`originals/<id>/...`, `renditions/<id>/<name>.<ext>`). Backends
raise OriginalMissingError for an absent object, OriginalTooLargeError past the byte cap
and StorageUnavailableError for everything else.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import anyio

from darkroom.errors import OriginalMissingError, OriginalTooLargeError, StorageUnavailableError

CONTENT_TYPES = {
    "webp": "image/webp",
    "jpeg": "image/jpeg",
    "avif": "image/avif",
    "png": "image/png",
}


class Storage(Protocol):
    async def get(self, key: str, max_bytes: int) -> bytes: ...

    async def put(self, key: str, data: bytes, content_type: str) -> None: ...

    async def probe(self) -> None:
        """Raise StorageUnavailableError unless the backend answers at all."""

    async def aclose(self) -> None: ...


def _too_large(key: str, size: int, max_bytes: int) -> OriginalTooLargeError:
    return OriginalTooLargeError(f"{key} is {size} bytes, over the cap of {max_bytes}")


class FileStorage:
    """A local folder; writes go to a temporary name and are renamed into place."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if self.root.resolve() not in path.parents:
            raise OriginalMissingError(f"key {key!r} escapes the storage folder")
        return path

    async def get(self, key: str, max_bytes: int) -> bytes:
        path = self._path(key)
        try:
            size = (await anyio.Path(path).stat()).st_size
            if size > max_bytes:
                raise _too_large(key, size, max_bytes)
            return await anyio.Path(path).read_bytes()
        except FileNotFoundError as exc:
            raise OriginalMissingError(f"no object at {key}") from exc
        except OSError as exc:
            raise StorageUnavailableError(f"reading {key}: {exc}") from exc

    async def put(self, key: str, data: bytes, content_type: str) -> None:
        path = self._path(key)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        try:
            await anyio.Path(path.parent).mkdir(parents=True, exist_ok=True)
            await anyio.Path(tmp).write_bytes(data)
            await anyio.to_thread.run_sync(os.replace, tmp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise StorageUnavailableError(f"writing {key}: {exc}") from exc

    async def probe(self) -> None:
        try:
            await anyio.Path(self.root).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageUnavailableError(f"storage folder {self.root}: {exc}") from exc

    async def aclose(self) -> None:
        return None


class S3Storage:
    """A bucket (and optional key prefix) through one long-lived aioboto3 client."""

    def __init__(self, client: Any, stack: contextlib.AsyncExitStack, bucket: str, prefix: str):
        self.client, self._stack, self.bucket, self.prefix = client, stack, bucket, prefix

    def _key(self, key: str) -> str:
        return f"{self.prefix}{key}"

    async def get(self, key: str, max_bytes: int) -> bytes:
        try:
            response = await self.client.get_object(Bucket=self.bucket, Key=self._key(key))
            size = int(response.get("ContentLength") or 0)
            async with response["Body"] as body:
                if size > max_bytes:
                    raise _too_large(key, size, max_bytes)
                return bytes(await body.read())
        except self.client.exceptions.NoSuchKey as exc:
            raise OriginalMissingError(f"no object at s3://{self.bucket}/{self._key(key)}") from exc
        except OriginalTooLargeError:
            raise
        except Exception as exc:  # botocore/aiohttp errors: the boundary translates all
            raise StorageUnavailableError(f"reading {key}: {_describe(exc)}") from exc

    async def put(self, key: str, data: bytes, content_type: str) -> None:
        try:
            await self.client.put_object(
                Bucket=self.bucket, Key=self._key(key), Body=data, ContentType=content_type
            )
        except Exception as exc:
            raise StorageUnavailableError(f"writing {key}: {_describe(exc)}") from exc

    async def probe(self) -> None:
        """Any HTTP answer below 500 (404, or 403 without s3:ListBucket) means S3 is up."""
        try:
            await self.client.head_object(Bucket=self.bucket, Key=self._key(".darkroom-probe"))
        except Exception as exc:
            status = _status(exc)
            if status is None or status >= 500:
                raise StorageUnavailableError(f"probe: {_describe(exc)}") from exc

    async def aclose(self) -> None:
        await self._stack.aclose()


def _status(exc: Exception) -> int | None:
    response = getattr(exc, "response", None) or {}
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return int(status) if status else None


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


async def open_storage(url: str, endpoint_url: str | None = None) -> Storage:
    """`file:PATH` (relative to the working directory) or `s3://BUCKET[/PREFIX]`."""
    parts = urlsplit(url)
    if parts.scheme == "file":
        return FileStorage(Path(parts.netloc + parts.path))
    import aioboto3
    from botocore.config import Config

    config = Config(
        connect_timeout=5,
        read_timeout=30,
        retries={"max_attempts": 3, "mode": "standard"},
        max_pool_connections=32,
    )
    stack = contextlib.AsyncExitStack()
    client = await stack.enter_async_context(
        aioboto3.Session().client("s3", endpoint_url=endpoint_url, config=config)
    )
    prefix = parts.path.strip("/")
    return S3Storage(client, stack, parts.netloc, f"{prefix}/" if prefix else "")
