"""Object storage: one small port, a local-folder backend and an S3 backend (aioboto3).

Keys are relative paths (`originals/<id>/...`, `renditions/<id>/<name>-<hash12>.<ext>`).
Backends raise OriginalMissingError for an absent object, OriginalTooLargeError past the
byte cap, ObjectForbiddenError for one object denied while the bucket answers, and
StorageUnavailableError (an outage) for everything else. `get` reads a whole object (the
worker renders it); `open` streams one in chunks of CHUNK_BYTES (the web page serves it).
`list` pages through a prefix, `stat` reads one object's size and write time afresh, and
`delete` removes one object (absent is fine): what `darkroom gc` needs.
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol
from urllib.parse import urlsplit

import anyio

from darkroom import errors
from darkroom.errors import (
    PERMANENT,
    TRANSIENT,
    ObjectForbiddenError,
    OriginalMissingError,
    OriginalTooLargeError,
    Rule,
    StorageUnavailableError,
)
from darkroom.settings import DEFAULT_PROBE_KEY

CONTENT_TYPES = {
    "webp": "image/webp",
    "jpeg": "image/jpeg",
    "avif": "image/avif",
    "png": "image/png",
}


# Objects per page of `list` on S3 (its own maximum for ListObjectsV2), and folders (one
# per photo) per page in the local folder.
LIST_PAGE = 1000
LIST_FOLDERS = 250


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


def _too_large(key: str, size: int, max_bytes: int) -> OriginalTooLargeError:
    return OriginalTooLargeError(f"{key} is {size} bytes, over the cap of {max_bytes}")


class FileStorage:
    """A local folder; writes go to a temporary name in the same folder, fsynced, renamed
    into place, and the folder fsynced: a put that returned survives a power cut."""

    def __init__(self, root: Path, probe_key: str = DEFAULT_PROBE_KEY) -> None:
        self.root, self.probe_key = root, probe_key
        self._base = os.path.abspath(root)  # resolved once, not per key

    def _path(self, key: str) -> Path:
        path = os.path.normpath(os.path.join(self._base, key))
        if not path.startswith(self._base + os.sep):
            raise OriginalMissingError(f"key {key!r} escapes the storage folder")
        return Path(path)

    async def get(self, key: str, max_bytes: int) -> bytes:
        path = self._path(key)
        try:
            return await anyio.to_thread.run_sync(_read_file, path, key, max_bytes)
        except FileNotFoundError as exc:
            raise OriginalMissingError(f"no object at {key}") from exc
        except OSError as exc:
            raise _file_error(f"reading {key}", exc) from exc

    async def open(self, key: str, max_bytes: int) -> ObjectStream:
        """The file as it is now: a writer replaces it by rename, so this descriptor keeps
        reading the bytes it opened, never a half-written new version."""
        path = self._path(key)
        try:
            f = await anyio.to_thread.run_sync(_open_file, path, key, max_bytes)
        except FileNotFoundError as exc:
            raise OriginalMissingError(f"no object at {key}") from exc
        except OSError as exc:
            raise _file_error(f"reading {key}", exc) from exc
        return FileStream(f, key)

    async def put(
        self, key: str, data: bytes, content_type: str, cache_control: str | None = None
    ) -> None:
        """One thread hop per object: mkdir, write and fsync a temporary name, rename it
        into place, fsync the folder."""
        try:
            await anyio.to_thread.run_sync(_write_file, self._path(key), data)
        except OSError as exc:
            raise _file_error(f"writing {key}", exc) from exc

    async def put_many(self, objects: list[Upload], cache_control: str | None = None) -> None:
        """One thread hop for them all, and one fsync per folder (a photo's renditions
        share one): what a put of each costs four times."""
        files = [(self._path(o.key), o.data) for o in objects]
        try:
            await anyio.to_thread.run_sync(_write_files, files)
        except OSError as exc:
            more = f" (+{len(objects) - 1} more)" if len(objects) > 1 else ""
            raise _file_error(f"writing {objects[0].key}{more}", exc) from exc

    async def delete(self, key: str) -> None:
        try:
            await anyio.to_thread.run_sync(_remove_file, self._path(key))
        except OSError as exc:
            raise _file_error(f"deleting {key}", exc) from exc

    async def list(self, prefix: str) -> AsyncIterator[Page]:
        """The prefix's entries in name order, a few hundred folders (one per photo) per
        thread hop: of a large tree only the folder names are held at once."""
        try:
            top = self._path(prefix.rstrip("/"))
            names = await anyio.to_thread.run_sync(_sorted_names, top)
            for start in range(0, len(names), LIST_FOLDERS):
                chunk = names[start : start + LIST_FOLDERS]
                yield await anyio.to_thread.run_sync(_scan, self._base, top, chunk)
        except OSError as exc:
            raise StorageUnavailableError(f"listing {prefix}: {exc}") from exc

    async def stat(self, key: str) -> StoredObject | None:
        try:
            found = await anyio.to_thread.run_sync(_stat_file, self._path(key))
        except OSError as exc:
            raise _file_error(f"reading {key}", exc) from exc
        return None if found is None else StoredObject(key, found.st_size, found.st_mtime)

    async def probe(self) -> None:
        """Write and read back a small object: a read-only or full disk fails it."""
        try:
            await self.put(self.probe_key, b"darkroom", "text/plain")
            await anyio.Path(self._path(self.probe_key)).read_bytes()
        except (OSError, OriginalMissingError) as exc:
            raise StorageUnavailableError(f"storage folder {self.root}: {exc}") from exc

    async def aclose(self) -> None:
        return None


def _errno(*names: str) -> Any:
    codes = {getattr(errno, name) for name in names if hasattr(errno, name)}
    return lambda exc: getattr(exc, "errno", None) in codes


# What each OSError of the local folder says about it, first match wins (a network mount
# can be busy or time out; a full disk can be freed).
FILE_ERRORS: tuple[Rule, ...] = (
    Rule(OSError, StorageUnavailableError, "busy", TRANSIENT,
         _errno("EAGAIN", "EBUSY", "EINTR", "ETIMEDOUT", "ESTALE")),
    Rule(OSError, StorageUnavailableError, "resources", TRANSIENT,
         _errno("ENOSPC", "EDQUOT", "EMFILE", "ENFILE", "ENOMEM")),
    Rule(OSError, StorageUnavailableError, "io", PERMANENT),
)  # fmt: skip


def _file_error(what: str, exc: OSError) -> StorageUnavailableError:
    mapped = errors.classify(FILE_ERRORS, exc)
    assert mapped is not None  # the last row takes every OSError
    return StorageUnavailableError(f"{what}: {mapped}", reason=mapped.reason,
                                   transient=mapped.transient)  # fmt: skip


def _read_file(path: Path, key: str, max_bytes: int) -> bytes:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise _too_large(key, size, max_bytes)
        return f.read()


def _open_file(path: Path, key: str, max_bytes: int) -> BinaryIO:
    f = open(path, "rb")  # noqa: SIM115 - FileStream owns it and closes it
    size = os.fstat(f.fileno()).st_size
    if size > max_bytes:
        f.close()
        raise _too_large(key, size, max_bytes)
    return f


class FileStream:
    """One chunk per thread hop, so the event loop never waits on the disk."""

    def __init__(self, f: BinaryIO, key: str) -> None:
        self._f, self._key = f, key
        self.size = os.fstat(f.fileno()).st_size
        self._left = self.size

    async def read(self) -> bytes:
        if self._left <= 0:
            return b""
        try:
            data = await anyio.to_thread.run_sync(self._f.read, min(CHUNK_BYTES, self._left))
        except (OSError, ValueError) as exc:  # ValueError: read after close
            raise StorageUnavailableError(f"reading {self._key}: {exc}") from exc
        self._left -= len(data)
        return data

    def close(self) -> None:
        self._f.close()


def _write_file(path: Path, data: bytes) -> None:
    _write_files([(path, data)])


def _write_files(files: list[tuple[Path, bytes]]) -> None:
    # Ordering: the bytes are on disk before the rename publishes the name, and the names
    # are on disk (folders fsynced) before put returns, so before the publishing commit.
    # Every temporary file is written before any is fsynced: on a journalling filesystem
    # the first fsync then commits most of their metadata at once, not one commit each.
    folders = list(dict.fromkeys(path.parent for path, _ in files))
    for folder in folders:
        _make_folders(folder)
    staged: list[tuple[BinaryIO, Path, Path]] = []
    try:
        for path, data in files:
            staged.append(_staged(path, data))
        for f, _, _ in staged:
            os.fsync(f.fileno())
            f.close()
        for _, tmp, path in staged:
            os.replace(tmp, path)
    except BaseException:
        _discard(staged)
        raise
    for folder in folders:
        _fsync_folder(folder)


def _staged(path: Path, data: bytes) -> tuple[BinaryIO, Path, Path]:
    """`data` written (not yet fsynced) to a temporary name beside `path`, still open."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    f = open(tmp, "wb")  # noqa: SIM115 - closed by the caller once fsynced
    try:
        f.write(data)
        f.flush()
    except BaseException:
        _discard([(f, tmp, path)])
        raise
    return f, tmp, path


def _discard(staged: list[tuple[BinaryIO, Path, Path]]) -> None:
    """Close and remove what a failed put staged (a renamed one is gone already: the
    renditions of a put that failed are unreferenced, for `darkroom gc`)."""
    for f, tmp, _ in staged:
        with contextlib.suppress(OSError):
            f.close()
        with contextlib.suppress(OSError):
            tmp.unlink()


def _make_folders(folder: Path) -> None:
    """mkdir -p, fsyncing the parent of each folder it creates (a new name is an entry
    in its parent, lost in a power cut until the parent is synced)."""
    missing: list[Path] = []
    while not folder.is_dir():
        missing.append(folder)
        folder = folder.parent
    for new in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another put made it meanwhile
            new.mkdir()
        _fsync_folder(new.parent)


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_file(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _stat_file(path: Path) -> os.stat_result | None:
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None


def _sorted_names(top: Path) -> list[str]:
    try:
        return sorted(os.listdir(top))
    except FileNotFoundError:
        return []


def _scan(base: str, top: Path, names: list[str]) -> Page:
    """The files under these entries of `top`, with keys relative to the storage folder.
    A file that vanishes while scanned (deleted, or a temporary name renamed) is skipped."""
    found: Page = []
    for name in names:
        path = top / name
        walked = os.walk(path) if path.is_dir() else [(str(top), [], [name])]
        for folder, _, files in walked:
            for file in sorted(files):
                full = os.path.join(folder, file)
                with contextlib.suppress(FileNotFoundError):
                    stat = os.stat(full)
                    key = os.path.relpath(full, base).replace(os.sep, "/")
                    found.append(StoredObject(key, stat.st_size, stat.st_mtime))
    return found


def _s3_code(exc: BaseException) -> str:
    response = getattr(exc, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


def _status(exc: BaseException) -> int:
    response = getattr(exc, "response", None) or {}
    return int(response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


def _codes(*codes: str) -> Any:
    return lambda exc: _s3_code(exc) in codes


DENIED = ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
          "InvalidToken", "TokenRefreshRequired", "AllAccessDisabled", "AccountProblem",
          "Forbidden", "403")  # fmt: skip
THROTTLED = ("SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
             "TooManyRequests", "RequestTimeout", "503")  # fmt: skip


def _s3_rules() -> tuple[Rule, ...]:
    """What each S3 failure says about the bucket, first match wins. `access_denied` is
    an outage only if the bucket probe is denied too (see S3Storage._denied)."""
    from botocore import exceptions as bx

    S, T, P = StorageUnavailableError, TRANSIENT, PERMANENT
    credentials = (bx.NoCredentialsError, bx.PartialCredentialsError, bx.CredentialRetrievalError)
    timeouts = (bx.ConnectTimeoutError, bx.ReadTimeoutError, TimeoutError)
    connection = (bx.EndpointConnectionError, bx.ConnectionClosedError, bx.HTTPClientError, OSError)
    return (
        Rule(bx.ClientError, S, "access_denied", P, _codes(*DENIED)),
        # the worker's clock is off: no retry helps until it is set right
        Rule(bx.ClientError, S, "clock_skew", P, _codes("RequestTimeTooSkewed")),
        Rule(bx.ClientError, S, "throttled", T, _codes(*THROTTLED)),
        Rule(bx.ClientError, S, "no_such_bucket", P, _codes("NoSuchBucket")),
        Rule(bx.ClientError, S, "server_error", T, lambda exc: _status(exc) >= 500),
        Rule(credentials, S, "credentials", P),
        Rule(timeouts, S, "timeout", T),
        Rule(connection, S, "connection", T),
        Rule(Exception, S, "error", P),  # any other answer: the boundary translates all
    )


class S3Storage:
    """A bucket (and optional key prefix) through one long-lived aioboto3 client."""

    def __init__(
        self,
        client: Any,
        stack: contextlib.AsyncExitStack,
        bucket: str,
        prefix: str,
        probe_key: str = DEFAULT_PROBE_KEY,
    ):
        self.client, self._stack, self.bucket, self.prefix = client, stack, bucket, prefix
        self.rules, self.probe_key = _s3_rules(), probe_key

    def _key(self, key: str) -> str:
        return f"{self.prefix}{key}"

    async def get(self, key: str, max_bytes: int) -> bytes:
        try:
            with errors.map_exceptions(self.rules):
                return await self._get(key, max_bytes)
        except StorageUnavailableError as exc:
            raise await self._denied(key, exc) from exc.__cause__

    async def _get(self, key: str, max_bytes: int) -> bytes:
        response, _ = await self._response(key, max_bytes)
        async with response["Body"] as body:
            return bytes(await body.read())

    async def open(self, key: str, max_bytes: int) -> ObjectStream:
        try:
            with errors.map_exceptions(self.rules):
                return await self._open(key, max_bytes)
        except StorageUnavailableError as exc:
            raise await self._denied(key, exc) from exc.__cause__

    async def _open(self, key: str, max_bytes: int) -> ObjectStream:
        response, size = await self._response(key, max_bytes)
        return S3Stream(response["Body"], size, self.rules)

    async def _response(self, key: str, max_bytes: int) -> tuple[dict[str, Any], int]:
        """A GET whose body is still unread, and its size; over the cap, closed and refused."""
        try:
            response = await self.client.get_object(Bucket=self.bucket, Key=self._key(key))
        except self.client.exceptions.NoSuchKey as exc:
            raise OriginalMissingError(f"no object at s3://{self.bucket}/{self._key(key)}") from exc
        size = int(response.get("ContentLength") or 0)
        if size > max_bytes:
            response["Body"].close()
            raise _too_large(key, size, max_bytes)
        return response, size

    async def put(
        self, key: str, data: bytes, content_type: str, cache_control: str | None = None
    ) -> None:
        headers = {"CacheControl": cache_control} if cache_control else {}
        try:
            with errors.map_exceptions(self.rules):
                await self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data,
                                             ContentType=content_type, **headers)  # fmt: skip
        except StorageUnavailableError as exc:
            raise await self._denied(key, exc) from exc.__cause__

    async def put_many(self, objects: list[Upload], cache_control: str | None = None) -> None:
        """Concurrent PUTs; the first failure is raised (the others are cancelled)."""
        try:
            async with anyio.create_task_group() as puts:
                for o in objects:
                    puts.start_soon(self.put, o.key, o.data, o.content_type, cache_control)
        except ExceptionGroup as group:
            raise errors.first_error(group) from group

    async def delete(self, key: str) -> None:
        """S3 answers 204 for an absent key too."""
        try:
            with errors.map_exceptions(self.rules):
                await self.client.delete_object(Bucket=self.bucket, Key=self._key(key))
        except StorageUnavailableError as exc:
            raise await self._denied(key, exc) from exc.__cause__

    async def list(self, prefix: str) -> AsyncIterator[Page]:
        """ListObjectsV2 pages (keys in UTF-8 binary order), continued by token."""
        token: dict[str, str] = {}
        while True:
            with errors.map_exceptions(self.rules):
                page = await self.client.list_objects_v2(
                    Bucket=self.bucket, Prefix=self._key(prefix), MaxKeys=LIST_PAGE, **token
                )
            yield [self._listed(item) for item in page.get("Contents", [])]
            if not page.get("IsTruncated"):
                return
            token = {"ContinuationToken": page["NextContinuationToken"]}

    def _listed(self, item: dict[str, Any]) -> StoredObject:
        key = str(item["Key"]).removeprefix(self.prefix)
        return StoredObject(key, int(item.get("Size") or 0), item["LastModified"].timestamp())

    async def stat(self, key: str) -> StoredObject | None:
        """A listing of the key alone: what `list` needs (`s3:ListBucket`) and no more; a
        HEAD would need `s3:GetObject`, which `darkroom gc`'s policy does not grant. The
        key itself sorts before any longer key it prefixes, so one entry answers."""
        with errors.map_exceptions(self.rules):
            page = await self.client.list_objects_v2(
                Bucket=self.bucket, Prefix=self._key(key), MaxKeys=1
            )
        found = [self._listed(item) for item in page.get("Contents", [])]
        return found[0] if found and found[0].key == key else None

    async def _denied(self, key: str, exc: StorageUnavailableError) -> Exception:
        """A denied object while the bucket probe passes is that photo's own failure; a
        denied probe too (revoked credentials, a bucket policy) is an outage."""
        if exc.reason != "access_denied":
            return exc
        try:
            await self.probe()
        except StorageUnavailableError:
            return exc
        return ObjectForbiddenError(f"access denied to {key} while the bucket answers: {exc}")

    async def probe(self) -> None:
        """Write and read back a small object where the worker writes renditions: what the
        worker needs (a HEAD answers 403 or 404 alike when access is gone), and what a
        least-privilege policy allows."""
        with errors.map_exceptions(self.rules):
            key = self._key(self.probe_key)
            await self.client.put_object(Bucket=self.bucket, Key=key, Body=b"darkroom")
            response = await self.client.get_object(Bucket=self.bucket, Key=key)
            async with response["Body"] as body:
                await body.read()

    async def aclose(self) -> None:
        await self._stack.aclose()


class S3Stream:
    """The body of one GET, read at most CHUNK_BYTES at a time off its connection. aiohttp
    stops at the Content-Length, and aiobotocore checks it at the end: a body cut short is
    `storage_unavailable`, never silently short bytes."""

    def __init__(self, body: Any, size: int, rules: tuple[Rule, ...]) -> None:
        self._body, self.size, self._rules = body, size, rules

    async def read(self) -> bytes:
        with errors.map_exceptions(self._rules):
            return bytes(await self._body.read(CHUNK_BYTES))

    def close(self) -> None:
        self._body.close()


async def open_storage(
    url: str, endpoint_url: str | None = None, probe_key: str = DEFAULT_PROBE_KEY
) -> Storage:
    """`file:PATH` (relative to the working directory) or `s3://BUCKET[/PREFIX]`."""
    parts = urlsplit(url)
    if parts.scheme == "file":
        return FileStorage(Path(parts.netloc + parts.path), probe_key)
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
    return S3Storage(client, stack, parts.netloc, f"{prefix}/" if prefix else "", probe_key)
