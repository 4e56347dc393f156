"""Lanes: the names a photo's lane may have, and the work stream each lane is read from.

`interactive` is DARKROOM_STREAM (what producers have always XADDed to); `bulk` is
DARKROOM_BULK_STREAM. Every lane's stream shares the hash tag, so one slot holds the queue.
"""

from __future__ import annotations

from typing import Literal

from darkroom.settings import Settings

Lane = Literal["interactive", "bulk"]
LANES: tuple[Lane, ...] = ("interactive", "bulk")
DEFAULT_LANE: Lane = "interactive"
# A tenant names who a photo belongs to, for fair shares inside bulk ('' = nobody's).
MAX_TENANT_CHARS = 128


def parse_lane(text: str) -> Lane:
    """A lane by name, or ValueError naming the lanes there are."""
    for lane in LANES:
        if text == lane:
            return lane
    raise ValueError(f"unknown lane {text!r}: one of {', '.join(LANES)}")


def parse_tenant(text: str) -> str:
    """A tenant name: at most MAX_TENANT_CHARS printable characters."""
    if len(text) > MAX_TENANT_CHARS or not text.isprintable():
        raise ValueError(f"a tenant is at most {MAX_TENANT_CHARS} printable characters")
    return text


def entry_tenant(tenant: str) -> str:
    """The tenant a bulk entry names: at most MAX_TENANT_CHARS characters (at most 512 bytes
    of UTF-8, within a field's 1,024), whatever the row holds. schema.sql's
    photos_tenant_length_check keeps rows that short; a database without it (dropped, or not
    migrated yet) must not turn a row into an entry every worker refuses as bad_message."""
    return tenant[:MAX_TENANT_CHARS]


def stream_of(settings: Settings, lane: Lane) -> str:
    return settings.stream if lane == "interactive" else settings.bulk_stream_key


def streams_of(settings: Settings) -> dict[Lane, str]:
    return {lane: stream_of(settings, lane) for lane in LANES}
