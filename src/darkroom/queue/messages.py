"""Stream entries and their codec: the task a producer XADDs and the dead letter we write.

An entry is untrusted bytes: it is read raw (`received`), judged whole by `parse_task`
(any shape but one UUID `photo_id` among a few small UTF-8 fields is a bad_message), and
shown to people only `escaped` and capped.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime

import msgspec

from darkroom.errors import BadMessageError

# A work entry has at most MAX_FIELDS fields, each name and value at most MAX_FIELD_BYTES.
MAX_FIELDS = 16
MAX_FIELD_BYTES = 1024
# A dead letter keeps the first KEPT_FIELDS fields sent, each name and value cut to
# KEPT_CHARS characters once escaped: its size is bounded whatever the entry held, and
# the dead-letter script never meets Lua's unpack limit (about 8,000 values).
KEPT_FIELDS = 64
KEPT_CHARS = 1024
# C0 controls, DEL and C1 controls: shown as \xNN, so a value cannot forge a log or
# terminal line.
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}
# W3C trace context a producer may add to its entry (or to its row's `traceparent`): carried
# forward by every later hop so one photo is one trace (docs/tracing.md). A value of any
# other shape is ignored, never a bad_message: tracing must not fail a photo.
TRACE_FIELDS = ("traceparent", "tracestate")
TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
MAX_TRACESTATE_CHARS = 512


class Entry(msgspec.Struct, frozen=True):
    """One stream entry as delivered: its id, its fields as text (`escaped`: bytes that are
    not UTF-8 and control characters as \\xNN), and in `sent` the names and values exactly
    as sent, alternating, a repeated name included (empty for an entry built from a dict);
    `lane` names the stream it was read from (its acks, backoff and reclaim stay there)."""

    id: str
    fields: dict[str, str]
    sent: tuple[bytes, ...] = ()
    lane: str = "interactive"

    def pairs(self) -> Iterator[tuple[bytes, bytes]]:
        """(name, value) as sent, in order."""
        if not self.sent:
            return ((k.encode(), v.encode()) for k, v in self.fields.items())
        return zip(self.sent[::2], self.sent[1::2], strict=False)

    @property
    def field_count(self) -> int:
        return len(self.sent) // 2 if self.sent else len(self.fields)


class Task(msgspec.Struct, frozen=True):
    photo_id: uuid.UUID
    traceparent: str | None = None


def task_fields(photo_id: uuid.UUID, carried: Mapping[str, str] | None = None) -> dict[str, str]:
    """A work entry's fields: the photo, and the trace context `carried` (when valid)."""
    return {"photo_id": str(photo_id), **trace_fields(carried or {})}


def trace_fields(fields: Mapping[str, str | None]) -> dict[str, str]:
    """Pure: the W3C trace context among `fields` (an entry's, a letter's, a row's), as
    the next hop's entry carries it; {} without a valid traceparent."""
    parent = (fields.get("traceparent") or "").strip()
    if not TRACEPARENT.fullmatch(parent) or parent.startswith("ff"):
        return {}
    state = (fields.get("tracestate") or "").strip()
    if state and len(state) <= MAX_TRACESTATE_CHARS:
        return {"traceparent": parent, "tracestate": state}
    return {"traceparent": parent}


def escaped(data: bytes, limit: int | None = None) -> str:
    """`data` as text anyone can read: UTF-8 as is, other bytes and control characters as
    \\xNN (so escaping twice changes nothing); past `limit` characters cut, never inside
    an escape, and followed by the size sent."""
    text = data.decode("utf-8", "backslashreplace").translate(_CONTROLS)
    if limit is None or len(text) <= limit:
        return text
    cut = text[:limit]
    slash = cut.rfind("\\", limit - 3)
    return f"{cut[:slash] if slash >= 0 else cut}… [{len(data)} bytes]"


def received(entry_id: str, flat: Sequence[bytes], lane: str = "interactive") -> Entry:
    """An entry from the raw reply: its id and its names and values, alternating."""
    sent = tuple(flat)
    fields = {escaped(k): escaped(v) for k, v in zip(sent[::2], sent[1::2], strict=False)}
    return Entry(entry_id, fields, sent, lane)


def enqueued_ms(entry: Entry) -> int:
    """When the entry entered its stream: the millisecond part of its id."""
    return int(entry.id.split("-", 1)[0])


def parse_task(entry: Entry) -> Task:
    """Validate a work entry; anything but a UUID photo_id among at most MAX_FIELDS small
    UTF-8 fields, each name once, is a bad_message."""
    problem = _shape_problem(entry)
    if problem is not None:
        raise BadMessageError(f"entry {entry.id}: {problem}")
    raw = dict(entry.pairs()).get(b"photo_id")
    if raw is None:
        raise BadMessageError(f"entry {entry.id} has no photo_id field")
    try:
        photo_id = uuid.UUID(raw.decode().strip())
    except ValueError:
        shown = escaped(raw, 80)
        raise BadMessageError(f"entry {entry.id}: photo_id '{shown}' is not a UUID") from None
    return Task(photo_id, trace_fields(entry.fields).get("traceparent"))


def _shape_problem(entry: Entry) -> str | None:
    """Pure: what is wrong with the entry's fields as a whole, if anything."""
    if entry.field_count > MAX_FIELDS:
        return f"{entry.field_count} fields (at most {MAX_FIELDS})"
    names: set[bytes] = set()
    for name, value in entry.pairs():
        problem = _field_problem(name, value, names)
        if problem is not None:
            return problem
        names.add(name)
    return None


def _field_problem(name: bytes, value: bytes, seen: set[bytes]) -> str | None:
    if name in seen:
        return f"field '{escaped(name, 80)}' sent more than once"
    for what, data in (("name", name), ("value", value)):
        if len(data) > MAX_FIELD_BYTES:
            size = f"{len(data)} bytes (at most {MAX_FIELD_BYTES})"
            return f"field '{escaped(name, 80)}': {what} of {size}"
        if not _is_utf8(data):
            return f"field '{escaped(name, 80)}': {what} is not UTF-8"
    return None


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def kept_fields(entry: Entry, reserved: set[str]) -> dict[str, str]:
    """Pure: the first KEPT_FIELDS fields sent, escaped and cut to KEPT_CHARS; a name in
    `reserved` is prefixed `orig_`, and a name seen before gets ` #2`, ` #3`..."""
    kept: dict[str, str] = {}
    for n, (name, value) in enumerate(entry.pairs()):
        if n == KEPT_FIELDS:
            break
        shown = escaped(name, KEPT_CHARS)
        base = unique = f"orig_{shown}" if shown in reserved else shown
        suffix = 1
        while unique in kept:
            suffix += 1
            unique = f"{base} #{suffix}"
        kept[unique] = escaped(value, KEPT_CHARS)
    return kept


class DeadLetter(msgspec.Struct, frozen=True, kw_only=True):
    photo_id: str
    source_id: str
    error_code: str
    error: str
    attempts: int
    stage: str
    consumer: str
    failed_at: str = msgspec.field(default_factory=lambda: datetime.now(UTC).isoformat())
    # The lane the entry came through (a replay sends the letter back to it) and, for
    # bulk, the tenant the feeder named in the entry ('' when none).
    lane: str = "interactive"
    tenant: str = ""

    def fields(self, entry: Entry) -> dict[str, str]:
        """What the producer sent (`kept_fields`), then ours, with `field_count`: how many
        fields the entry had. At most KEPT_FIELDS + 11 fields, whatever the entry held."""
        ours = {k: str(v) for k, v in msgspec.structs.asdict(self).items()}
        ours["field_count"] = str(entry.field_count)
        return {**kept_fields(entry, set(ours)), **ours}
