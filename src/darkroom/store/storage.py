"""Object storage: one small port, a local-folder backend and an S3 backend (aioboto3).

Keys are relative paths (`originals/<id>/...`, `renditions/<id>/<name>.<ext>`). Backends
raise OriginalMissingError for an absent object, OriginalTooLargeError past the byte cap,
ObjectForbiddenError for one object denied while the bucket answers, and
StorageUnavailableError (an outage) for everything else.
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from pathlib import Path
from typing import Any, Protocol
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

CONTENT_TYPES = {
    "webp": "image/webp",
    "jpeg": "image/jpeg",
    "avif": "image/avif",
    "png": "image/png",
}


PROBE_KEY = ".darkroom-probe"


class Storage(Protocol):
    async def get(self, key: str, max_bytes: int) -> bytes: ...

    async def put(self, key: str, data: bytes, content_type: str) -> None: ...

    async def probe(self) -> None:
        """Raise StorageUnavailableError unless the worker can write and read an object."""

    async def aclose(self) -> None: ...


def _too_large(key: str, size: int, max_bytes: int) -> OriginalTooLargeError:
    return OriginalTooLargeError(f"{key} is {size} bytes, over the cap of {max_bytes}")


class FileStorage:
    """A local folder; writes go to a temporary name and are renamed into place."""

    def __init__(self, root: Path) -> None:
        self.root = root
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

    async def put(self, key: str, data: bytes, content_type: str) -> None:
        """One thread hop per object: mkdir, write a temporary name, rename into place."""
        try:
            await anyio.to_thread.run_sync(_write_file, self._path(key), data)
        except OSError as exc:
            raise _file_error(f"writing {key}", exc) from exc

    async def probe(self) -> None:
        """Write and read back a small object: a read-only or full disk fails it."""
        try:
            await self.put(PROBE_KEY, b"darkroom", "text/plain")
            await anyio.Path(self._path(PROBE_KEY)).read_bytes()
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


def _write_file(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


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

    def __init__(self, client: Any, stack: contextlib.AsyncExitStack, bucket: str, prefix: str):
        self.client, self._stack, self.bucket, self.prefix = client, stack, bucket, prefix
        self.rules = _s3_rules()

    def _key(self, key: str) -> str:
        return f"{self.prefix}{key}"

    async def get(self, key: str, max_bytes: int) -> bytes:
        try:
            with errors.map_exceptions(self.rules):
                return await self._get(key, max_bytes)
        except StorageUnavailableError as exc:
            raise await self._denied(key, exc) from exc.__cause__

    async def _get(self, key: str, max_bytes: int) -> bytes:
        try:
            response = await self.client.get_object(Bucket=self.bucket, Key=self._key(key))
        except self.client.exceptions.NoSuchKey as exc:
            raise OriginalMissingError(f"no object at s3://{self.bucket}/{self._key(key)}") from exc
        size = int(response.get("ContentLength") or 0)
        async with response["Body"] as body:
            if size > max_bytes:
                raise _too_large(key, size, max_bytes)
            return bytes(await body.read())

    async def put(self, key: str, data: bytes, content_type: str) -> None:
        try:
            with errors.map_exceptions(self.rules):
                await self.client.put_object(
                    Bucket=self.bucket, Key=self._key(key), Body=data, ContentType=content_type
                )
        except StorageUnavailableError as exc:
            raise await self._denied(key, exc) from exc.__cause__

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
        """Write and read back a small object under the prefix: what the worker needs
        (a HEAD answers 403 or 404 alike when access is gone)."""
        with errors.map_exceptions(self.rules):
            key = self._key(PROBE_KEY)
            await self.client.put_object(Bucket=self.bucket, Key=key, Body=b"darkroom")
            response = await self.client.get_object(Bucket=self.bucket, Key=key)
            async with response["Body"] as body:
                await body.read()

    async def aclose(self) -> None:
        await self._stack.aclose()


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
