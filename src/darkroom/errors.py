"""The exception tree and the stable error-code table.

Every failure a photo can meet is one of these classes; its `code` is stored in
Postgres, the dead-letter entry, logs and metric labels, and never changes meaning.
Adapters translate driver exceptions into these (`raise ... from exc`).
"""

from __future__ import annotations

from typing import Any, ClassVar, Final, NamedTuple


class CodeInfo(NamedTuple):
    retryable: bool
    stage: str
    meaning: str


class DarkroomError(Exception):
    """Base of every error darkroom raises about a photo or a dependency."""

    code: ClassVar[str] = "internal_error"
    retryable: ClassVar[bool] = True
    stage: ClassVar[str] = "process"


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


class AttemptsExhaustedError(PermanentError):
    code = "attempts_exhausted"
    stage = "process"


class InternalError(TransientError):
    code = "internal_error"
    stage = "process"


def _table() -> dict[str, CodeInfo]:
    docs = {
        "bad_message": "stream entry has no valid photo_id field",
        "original_missing": "no original at the photo's original_key",
        "original_too_large": "original is larger than DARKROOM_MAX_ORIGINAL_BYTES",
        "unsupported_format": "content is not JPEG, PNG, WebP, GIF, HEIC/HEIF or AVIF",
        "corrupt_image": "truncated or damaged image data",
        "image_too_large": "header claims more pixels than DARKROOM_MAX_PIXELS",
        "storage_unavailable": "object storage failed or was unreachable",
        "database_unavailable": "PostgreSQL failed or was unreachable",
        "queue_unavailable": "Redis failed or was unreachable",
        "timeout": "render took longer than DARKROOM_JOB_TIMEOUT_S",
        "render_crashed": "the render process died (native crash)",
        "out_of_memory": "render exceeded DARKROOM_RENDER_MEMORY_MB",
        "attempts_exhausted": "delivered DARKROOM_MAX_ATTEMPTS times without finishing",
        "internal_error": "unexpected exception in darkroom",
    }
    classes: list[type[DarkroomError]] = [
        BadMessageError, OriginalMissingError, OriginalTooLargeError, UnsupportedFormatError,
        CorruptImageError, ImageTooLargeError, StorageUnavailableError, DatabaseUnavailableError,
        QueueUnavailableError, RenderTimeoutError, RenderCrashedError, RenderOutOfMemoryError,
        AttemptsExhaustedError, InternalError,
    ]  # fmt: skip
    return {c.code: CodeInfo(c.retryable, c.stage, docs[c.code]) for c in classes}


ERROR_CODES: Final[dict[str, CodeInfo]] = _table()


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
