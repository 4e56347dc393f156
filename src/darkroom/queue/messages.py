"""Stream entries and their codec: the task a producer XADDs and the dead letter we write."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import msgspec

from darkroom.errors import BadMessageError


class Entry(msgspec.Struct, frozen=True):
    """One stream entry as delivered: its id and its raw fields."""

    id: str
    fields: dict[str, str]


class Task(msgspec.Struct, frozen=True):
    photo_id: uuid.UUID


def task_fields(photo_id: uuid.UUID) -> dict[str, str]:
    return {"photo_id": str(photo_id)}


def parse_task(entry: Entry) -> Task:
    """Validate a work entry; anything but a UUID photo_id is a bad_message."""
    raw = entry.fields.get("photo_id")
    if raw is None:
        raise BadMessageError(f"entry {entry.id} has no photo_id field")
    try:
        return Task(uuid.UUID(raw.strip()))
    except ValueError:
        raise BadMessageError(f"entry {entry.id}: photo_id {raw[:80]!r} is not a UUID") from None


class DeadLetter(msgspec.Struct, frozen=True, kw_only=True):
    photo_id: str
    source_id: str
    error_code: str
    error: str
    attempts: int
    stage: str
    consumer: str
    failed_at: str = msgspec.field(default_factory=lambda: datetime.now(UTC).isoformat())

    def fields(self, original: dict[str, str]) -> dict[str, str]:
        """Every original field (prefixed `orig_` on a clash), then ours."""
        ours = {k: str(v) for k, v in msgspec.structs.asdict(self).items()}
        kept = {(f"orig_{k}" if k in ours else k): v for k, v in original.items()}
        return {**kept, **ours}
