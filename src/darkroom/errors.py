"""The exception tree and the stable error-code table.

Every failure a photo can meet is one of these classes; its `code` is stored in
Postgres, the dead-letter entry, logs and metric labels, and never changes meaning.
Adapters translate driver exceptions into these (`raise ... from exc`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, ClassVar, Final, NamedTuple, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


class CodeInfo(NamedTuple):
    retryable: bool
    stage: str
    meaning: str


class DarkroomError(Exception):
    """Base of every error darkroom raises about a photo or a dependency. `reason` says
    what a dependency error means (`read_only`, `auth`, `connection`, ...): /readyz and
    the logs show it; the code stays the stable contract. `transient` (set by an adapter's
    table) says the dependency could not serve the request now (throttled, unavailable,
    timed out, a dropped connection) and may well serve it on a later try: such an error
    never counts an attempt of the photo."""

    code: ClassVar[str] = "internal_error"
    retryable: ClassVar[bool] = True
    stage: ClassVar[str] = "process"

    def __init__(self, *args: object, reason: str = "", transient: bool = False) -> None:
        super().__init__(*args)
        self.reason = reason or self.code
        self.transient = transient


class TransientError(DarkroomError):
    """Worth retrying: the photo is fine, something around it was not."""


class PermanentError(DarkroomError):
    """Retrying cannot help: the photo or the entry itself is at fault."""

    retryable: ClassVar[bool] = False


class BadMessageError(PermanentError):
    code = "bad_message"
    stage = "read"


class OriginalMissingError(PermanentError):
    code = "original_missing"
    stage = "download"


class OriginalTooLargeError(PermanentError):
    code = "original_too_large"
    stage = "download"


class UnsupportedFormatError(PermanentError):
    code = "unsupported_format"
    stage = "render"


class CorruptImageError(PermanentError):
    code = "corrupt_image"
    stage = "render"


class ImageTooLargeError(PermanentError):
    code = "image_too_large"
    stage = "render"


class StorageUnavailableError(TransientError):
    code = "storage_unavailable"
    stage = "storage"


class DatabaseUnavailableError(TransientError):
    code = "database_unavailable"
    stage = "database"


class QueueUnavailableError(TransientError):
    code = "queue_unavailable"
    stage = "queue"


class RenderTimeoutError(TransientError):
    code = "timeout"
    stage = "render"


class RenderCrashedError(TransientError):
    code = "render_crashed"
    stage = "render"


class RenderOutOfMemoryError(TransientError):
    code = "out_of_memory"
    stage = "render"


class ObjectForbiddenError(TransientError):
    """Storage denies this one object while the bucket answers (another KMS key, an object
    ACL): the photo's own failure, retried with backoff in case a policy is propagating."""

    code = "object_forbidden"
    stage = "transfer"


class DownloadsBusyError(TransientError):
    """The operator's page already streams DARKROOM_WEB_DOWNLOADS large objects: 503 with
    Retry-After. Never stored on a photo."""

    code = "downloads_busy"
    stage = "web"


class AttemptsExhaustedError(PermanentError):
    code = "attempts_exhausted"
    stage = "process"


class WorkerDiedError(TransientError):
    """A delivery whose worker died (SIGKILL, out of memory, power) before it ended: never
    raised nor stored on a photo; the attempt history's outcome for its row, and the status
    of the `darkroom.process` span the reclaiming delivery writes for it (docs/tracing.md)."""

    code = "worker_died"
    stage = "process"


class InternalError(TransientError):
    code = "internal_error"
    stage = "process"


def _table() -> dict[str, CodeInfo]:
    docs = {
        "bad_message": "stream entry is not a UUID photo_id among at most 16 small UTF-8 fields",
        "original_missing": "no original at the photo's original_key",
        "original_too_large": "original is larger than DARKROOM_MAX_ORIGINAL_BYTES",
        "unsupported_format": (
            "content is not JPEG, PNG, WebP, GIF, HEIC/HEIF, AVIF,"
            " or a camera RAW with a large enough preview"
        ),
        "corrupt_image": "truncated or damaged image data",
        "image_too_large": "header claims more pixels than DARKROOM_MAX_PIXELS",
        "storage_unavailable": "object storage failed or was unreachable",
        "object_forbidden": "storage denied this photo's object while the bucket answered",
        "database_unavailable": "PostgreSQL failed or was unreachable",
        "queue_unavailable": "Redis failed or was unreachable",
        "timeout": "render took longer than DARKROOM_JOB_TIMEOUT_S",
        "render_crashed": "the render process died (native crash)",
        "out_of_memory": "render exceeded DARKROOM_RENDER_MEMORY_MB",
        "downloads_busy": "the web page already streams DARKROOM_WEB_DOWNLOADS large objects",
        "attempts_exhausted": "attempted DARKROOM_MAX_ATTEMPTS times without finishing",
        "worker_died": "the delivery's worker died before it ended (attempt history, traces)",
        "internal_error": "unexpected exception in darkroom",
    }
    classes: list[type[DarkroomError]] = [
        BadMessageError, OriginalMissingError, OriginalTooLargeError, UnsupportedFormatError,
        CorruptImageError, ImageTooLargeError, StorageUnavailableError, DatabaseUnavailableError,
        QueueUnavailableError, RenderTimeoutError, RenderCrashedError, RenderOutOfMemoryError,
        ObjectForbiddenError, DownloadsBusyError, AttemptsExhaustedError, WorkerDiedError,
        InternalError,
    ]  # fmt: skip
    return {c.code: CodeInfo(c.retryable, c.stage, docs[c.code]) for c in classes}


ERROR_CODES: Final[dict[str, CodeInfo]] = _table()


# A Rule's `transient`: the dependency could not serve the request now and may on a later
# try (TRANSIENT), or it answered that this request cannot succeed as made: credentials,
# grants, a missing bucket or table, a bug in darkroom's own request (PERMANENT).
TRANSIENT, PERMANENT = True, False


class Rule(NamedTuple):
    """One row of an adapter's exception table: a driver exception (optionally refined by
    `match`, for a message prefix, a SQLSTATE or an S3 error code) becomes `to`, transient
    or permanent."""

    driver: type[BaseException] | tuple[type[BaseException], ...]
    to: type[DarkroomError]
    reason: str
    transient: bool
    match: Callable[[BaseException], bool] | None = None


def classify(rules: Sequence[Rule], exc: BaseException) -> DarkroomError | None:
    """The first matching row's error (message keeps the driver's words), else None."""
    for rule in rules:
        if isinstance(exc, rule.driver) and (rule.match is None or rule.match(exc)):
            message = f"{rule.reason}: {type(exc).__name__}: {exc}"[:1000]
            return rule.to(message, reason=rule.reason, transient=rule.transient)
    return None


@contextlib.contextmanager
def map_exceptions(rules: Sequence[Rule]) -> Iterator[None]:
    """httpcore's shape: translate driver exceptions at the adapter's edge, `from exc`."""
    try:
        yield
    except DarkroomError:
        raise
    except Exception as exc:
        mapped = classify(rules, exc)
        if mapped is None:
            raise
        raise mapped from exc


def translated(
    rules: Sequence[Rule],
) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Awaitable[R]]]:
    """Decorator form of map_exceptions for an adapter's async methods."""

    def decorate(fn: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
        @functools.wraps(fn)
        async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            with map_exceptions(rules):
                return await fn(*args, **kwargs)

        return wrapper

    return decorate


def first_error(group: BaseExceptionGroup[Any]) -> BaseException:
    """The first DarkroomError among a task group's failures, else the group itself."""
    for exc in group.exceptions:
        found = first_error(exc) if isinstance(exc, BaseExceptionGroup) else exc
        if isinstance(found, DarkroomError):
            return found
    return group


class SettingsError(Exception):
    """A DARKROOM_* variable is missing or malformed; the CLI exits 2."""

    def __init__(self, variable: str, problem: str) -> None:
        super().__init__(f"{variable}: {problem}")
        self.variable = variable
