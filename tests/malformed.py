"""Malformed stream entries a producer can XADD, by shape: bytes that are not UTF-8 in
names or values, no or a bad photo_id, repeated names, thousands of fields, megabyte
values. Shared by tests/test_entries.py and the chaos test."""

from __future__ import annotations

import uuid


def uid() -> bytes:
    return str(uuid.uuid4()).encode()


def pairs(n: int, name: bytes = b"f", value: bytes = b"v") -> list[bytes]:
    return [x for i in range(n) for x in (name + b"%d" % i, value)]


SAME = uid()
SHAPES: dict[str, list[bytes]] = {
    "a note that is not UTF-8": [b"photo_id", uid(), b"note", b"\xff\xfe"],
    "photo_id not UTF-8": [b"photo_id", b"\xff\xfe\xfd"],
    "a field name not UTF-8": [b"photo_id", uid(), b"n\xffte", b"x"],
    "the name photo_id not UTF-8": [b"photo_id\xff", uid()],
    "a UTF-16 photo_id": [b"photo_id", str(uuid.uuid4()).encode("utf-16")],
    "an encoded surrogate": [b"photo_id", b"\xed\xa0\x80"],
    "an overlong slash": [b"photo_id", b"\xc0\xaf"],
    "a cut multi-byte character": [b"photo_id", uid(), b"note", "写".encode()[:2]],
    "no photo_id": [b"note", b"hello"],
    "only unknown fields": [b"a", b"1", b"b", b"2", b"c", b"3"],
    "an empty name and value": [b"", b""],
    "PHOTO_ID in capitals": [b"PHOTO_ID", uid()],
    "photo_id with a space in its name": [b"photo_id ", uid()],
    "an empty photo_id": [b"photo_id", b""],
    "a blank photo_id": [b"photo_id", b"   "],
    "not a UUID": [b"photo_id", b"42"],
    "a UUID and more": [b"photo_id", uid() + b";DROP TABLE photos"],
    "a UUID as 16 raw bytes": [b"photo_id", uuid.uuid4().bytes],
    "a UUID in JSON": [b"photo_id", b'{"id": "%s"}' % uid()],
    "control characters": [b"photo_id", b"\x00\x1b[31mred\x07"],
    "a 1 MB photo_id": [b"photo_id", b"a" * 1_000_000],
    "a 1 MB value beside a good id": [b"photo_id", uid(), b"blob", b"v" * 1_000_000],
    "a 1 MB value not UTF-8": [b"blob", b"\xff" * 1_000_000],
    "a 2 KB field name": [b"photo_id", uid(), b"n" * 2000, b"x"],
    "photo_id twice, the same": [b"photo_id", SAME, b"photo_id", SAME],
    "photo_id twice, different": [b"photo_id", uid(), b"photo_id", uid()],
    "photo_id three times": [b"photo_id", uid(), b"photo_id", uid(), b"photo_id", uid()],
    "another field twice": [b"photo_id", uid(), b"trace", b"1", b"trace", b"2"],
    "17 fields": [b"photo_id", uid(), *pairs(16)],
    "100 names not UTF-8": pairs(100, b"\xff"),
    "5,000 fields": [b"photo_id", uid(), *pairs(4999)],
    "20,000 fields": pairs(20_000, b"g", b"\xfe"),
    "names of ours only": [b"source_id", b"x", b"error_code", b"y"],
}
