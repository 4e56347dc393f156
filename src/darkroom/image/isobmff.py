"""Structural checks of HEIF/AVIF files (ISO/IEC 23008-12) that libheif does not make
strictly enough: libheif fills a cut-short file or a grid that is missing tiles with flat
colour instead of failing. Pure: bytes in, CorruptImageError out.

Checked: every top-level box fits in the data; the primary item exists; every item
reference (`iref`) comes from and goes to an existing item (or entity group), never to
itself; derived images (`dimg`) form no cycle; a grid references exactly rows × columns
tiles. Everything else (and all decoding) is left to libheif.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

from darkroom.errors import CorruptImageError

Box = tuple[bytes, bytes]  # (type, payload)


def check(data: bytes) -> None:
    """Raise CorruptImageError when the file's structure is invalid."""
    try:
        top = list(_boxes(data, top_level=True))
        meta = next((payload for kind, payload in top if kind == b"meta"), None)
        if meta is None:
            raise CorruptImageError("HEIF file has no meta box")
        _check_meta(data, dict(_boxes(meta[4:])))
    except (struct.error, IndexError, ValueError) as exc:
        raise CorruptImageError(f"HEIF structure is damaged: {exc}") from None


def _boxes(data: bytes, *, top_level: bool = False) -> Iterator[Box]:
    pos = 0
    while pos < len(data):
        size, kind = struct.unpack(">I4s", data[pos : pos + 8])
        header = 8
        if size == 1:
            size, header = struct.unpack(">Q", data[pos + 8 : pos + 16])[0], 16
        elif size == 0 and top_level:
            size = len(data) - pos  # the last box runs to the end of the file
        if size < header or pos + size > len(data):
            raise CorruptImageError(f"HEIF box {kind!r} at byte {pos} runs past the end")
        yield kind, data[pos + header : pos + size]
        pos += size


def _check_meta(data: bytes, meta: dict[bytes, bytes]) -> None:
    items = _items(meta.get(b"iinf", b""))
    groups = _groups(meta.get(b"grpl", b""))
    primary = _primary(meta.get(b"pitm", b""))
    if primary not in items:
        raise CorruptImageError(f"HEIF primary item {primary} does not exist")
    refs = list(_references(meta.get(b"iref", b"")))
    derived: dict[int, list[int]] = {}
    for kind, source, targets in refs:
        for item in (source, *targets):
            if item not in items and item not in groups:
                raise CorruptImageError(f"HEIF {kind.decode()} reference to missing item {item}")
        if source in targets:
            raise CorruptImageError(f"HEIF item {source} references itself")
        if kind == b"dimg":
            derived[source] = targets
    _check_acyclic(derived)
    for item, targets in derived.items():
        if items[item] == b"grid":
            _check_grid(data, meta, item, len(targets))


def _full(payload: bytes) -> tuple[int, bytes]:
    """(version, rest) of a full box payload."""
    return payload[0], payload[4:]


def _items(iinf: bytes) -> dict[int, bytes]:
    """item id → item type, from infe boxes of version 2 or 3."""
    if not iinf:
        raise CorruptImageError("HEIF file has no item information")
    version, rest = _full(iinf)
    rest = rest[2:] if version == 0 else rest[4:]
    items: dict[int, bytes] = {}
    for kind, payload in _boxes(rest):
        if kind != b"infe":
            continue
        v, body = _full(payload)
        if v == 2:
            item_id, _, item_type = struct.unpack(">HH4s", body[:8])
        elif v == 3:
            item_id, _, item_type = struct.unpack(">IH4s", body[:10])
        else:
            continue  # old infe versions carry no type: nothing to check against
        items[item_id] = item_type
    return items


def _groups(grpl: bytes) -> set[int]:
    return {struct.unpack(">I", payload[4:8])[0] for _, payload in _boxes(grpl)}


def _primary(pitm: bytes) -> int:
    version, rest = _full(pitm)
    return int(struct.unpack(">H" if version == 0 else ">I", rest[: 2 if version == 0 else 4])[0])


def _references(iref: bytes) -> Iterator[tuple[bytes, int, list[int]]]:
    if not iref:
        return
    version, rest = _full(iref)
    width, fmt = (2, ">H") if version == 0 else (4, ">I")
    for kind, payload in _boxes(rest):
        source = struct.unpack(fmt, payload[:width])[0]
        count = struct.unpack(">H", payload[width : width + 2])[0]
        start = width + 2
        if start + count * width > len(payload):
            raise CorruptImageError(f"HEIF {kind!r} reference list runs past its box")
        targets = [struct.unpack(fmt, payload[start + i * width : start + (i + 1) * width])[0]
                   for i in range(count)]  # fmt: skip
        yield kind, source, targets


def _check_acyclic(derived: dict[int, list[int]]) -> None:
    done: set[int] = set()
    for start in derived:
        path: set[int] = set()
        stack = [(start, iter(derived.get(start, [])))]
        path.add(start)
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                path.discard(node)
                done.add(node)
            elif child in path:
                raise CorruptImageError(f"HEIF derived images form a cycle through item {child}")
            elif child not in done:
                path.add(child)
                stack.append((child, iter(derived.get(child, []))))


def _check_grid(data: bytes, meta: dict[bytes, bytes], item: int, tiles: int) -> None:
    descriptor = _item_data(data, meta, item)
    rows, columns = descriptor[2] + 1, descriptor[3] + 1
    if tiles != rows * columns:
        raise CorruptImageError(f"HEIF grid of {rows}x{columns} references {tiles} tiles")


def _item_data(data: bytes, meta: dict[bytes, bytes], item: int) -> bytes:
    """An item's first extent, from the file (construction method 0) or idat (1)."""
    version, rest = _full(meta[b"iloc"])
    sizes = rest[0] << 8 | rest[1]
    offset_size, length_size = sizes >> 12, (sizes >> 8) & 15
    base_size, index_size = (sizes >> 4) & 15, (sizes & 15) if version else 0
    count_fmt, id_size = (">H", 2) if version < 2 else (">I", 4)
    count = struct.unpack(count_fmt, rest[2 : 2 + id_size])[0]
    pos = 2 + id_size
    for _ in range(count):
        item_id = int.from_bytes(rest[pos : pos + id_size], "big")
        pos += id_size
        method = (int.from_bytes(rest[pos : pos + 2], "big") & 15) if version else 0
        pos += (2 if version else 0) + 2
        base = int.from_bytes(rest[pos : pos + base_size], "big")
        pos += base_size
        extents = int.from_bytes(rest[pos : pos + 2], "big")
        pos += 2 + index_size
        offset = int.from_bytes(rest[pos : pos + offset_size], "big")
        length = int.from_bytes(rest[pos + offset_size : pos + offset_size + length_size], "big")
        if item_id == item:
            source = meta.get(b"idat", b"") if method == 1 else data
            chunk = source[base + offset : base + offset + (length or len(source))]
            if len(chunk) < 8:
                raise CorruptImageError(f"HEIF item {item} data is missing")
            return chunk
        pos += (offset_size + length_size) + (extents - 1) * (
            index_size + offset_size + length_size
        )
    raise CorruptImageError(f"HEIF item {item} has no location")
