"""The S3 backend (aioboto3): S3Storage and its streams through one long-lived client, and
the table of what each S3 failure says about the bucket (`_s3_rules`). A denied object is
the photo's own failure unless the bucket probe is denied too.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio

from darkroom import errors
from darkroom.errors import (
    PERMANENT,
    TRANSIENT,
    ObjectForbiddenError,
    OriginalMissingError,
    Rule,
    StorageUnavailableError,
)
from darkroom.settings import DEFAULT_PROBE_KEY
from darkroom.store.storage.port import (
    CHUNK_BYTES,
    ObjectStream,
    Page,
    StoredObject,
    Upload,
    too_large,
)

# Objects per page of `list` (S3's own maximum for ListObjectsV2).
LIST_PAGE = 1000


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
            raise too_large(key, size, max_bytes)
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


async def open_s3(
    bucket: str, prefix: str, endpoint_url: str | None, probe_key: str = DEFAULT_PROBE_KEY
) -> S3Storage:
    """The bucket through a client of its own, closed by `aclose`."""
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
    return S3Storage(client, stack, bucket, f"{prefix}/" if prefix else "", probe_key)
