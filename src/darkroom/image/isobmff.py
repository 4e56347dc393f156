"""Structural checks of HEIF/AVIF files (ISO/IEC 23008-12, MIAF) that libheif does not make
strictly enough, and the parsed container that heifedit.py rewrites. Pure: bytes in, a
Container or CorruptImageError out.

Checked: every top-level box fits in the data; the primary item exists; every item
reference (`iref`) comes from and goes to an existing item (or entity group), never to
itself; derived images (`dimg`) form no cycle; a grid references exactly rows × columns
tiles, each once; in AVIF, transformative properties (`clap`, `irot`, `imir`) are marked
essential (HEVC HEIF may leave them unmarked: the pipeline applies them). Everything else
(and all decoding) is left to libheif.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from fractions import Fraction
from typing import NamedTuple

from darkroom.errors import CorruptImageError

Box = tuple[bytes, bytes]  # (type, payload)
TRANSFORMS = (b"clap", b"irot", b"imir")


class Ref(NamedTuple):
    kind: bytes
    source: int
    targets: list[int]


class Location(NamedTuple):
    """Where an item's data is: construction method, base offset and extents, each extent
    as (offset, length, where its length field starts in the iloc payload)."""

    method: int
    base: int
    extents: list[tuple[int, int, int]]
    entry: tuple[int, int]  # the entry's span in the iloc payload
    length_size: int  # bytes of each extent's length field


class Container(NamedTuple):
    """What the meta box says: items, references and properties, as read by `parse`."""

    meta_span: tuple[int, int]  # the meta box's span in the file
    meta: list[Box]  # its children, in file order
    items: dict[int, bytes]  # item id → item type
    groups: set[int]
    primary: int
    refs: list[Ref]
    properties: list[bytes]  # ipco children as whole boxes; property index i is [i - 1]
    associations: dict[int, list[tuple[int, bool]]]  # item → (property index, essential)

    def child(self, kind: bytes) -> bytes:
        """The payload of the meta child box of this type (empty if absent)."""
        return next((payload for k, payload in self.meta if k == kind), b"")

    def props(self, item: int) -> list[tuple[bytes, bytes, bool]]:
        """The item's properties in association order: (type, payload, essential)."""
        found = []
        for index, essential in self.associations.get(item, []):
            if 0 < index <= len(self.properties):
                prop = self.properties[index - 1]
                found.append((prop[4:8], prop[8:], essential))
        return found


def check(data: bytes, *, essential_transforms: bool = True) -> Container:
    """The parsed container; raise CorruptImageError when its structure is invalid.
    `essential_transforms`: refuse a clap/irot/imir not marked essential."""
    try:
        container = parse(data)
        _check_meta(data, container, essential_transforms)
        return container
    except (struct.error, LookupError, ValueError) as exc:
        raise CorruptImageError(f"HEIF structure is damaged: {exc}") from None


def parse(data: bytes) -> Container:
    """The container's meta box, read without any check beyond box sizes."""
    top = [(kind, start, end) for kind, start, _, end in spans(data, top_level=True)]
    meta_at = next(((start, end) for kind, start, end in top if kind == b"meta"), None)
    if meta_at is None:
        raise CorruptImageError("HEIF file has no meta box")
    box = data[meta_at[0] : meta_at[1]]
    meta = [(kind, box[body:end]) for kind, _, body, end in spans(box, header_size(box) + 4)]
    boxes = dict(reversed(meta))  # the first box of a type is the one read, as in heifedit.py
    iprp = dict(reversed(list(payloads(boxes.get(b"iprp", b"")))))
    return Container(
        meta_at,
        meta,
        _items(boxes.get(b"iinf", b"")),
        _groups(boxes.get(b"grpl", b"")),
        _primary(boxes.get(b"pitm", b"")),
        list(_references(boxes.get(b"iref", b""))),
        _properties(iprp.get(b"ipco", b"")),
        _associations(iprp.get(b"ipma", b"")),
    )


def header_size(box: bytes) -> int:
    """Where a box's payload starts: after its 8- or 16-byte header."""
    return 16 if box[:4] == b"\0\0\0\1" else 8


def spans(
    data: bytes, pos: int = 0, *, top_level: bool = False
) -> Iterator[tuple[bytes, int, int, int]]:
    """(type, start, payload start, end) of each box in data[pos:]."""
    while pos < len(data):
        size, kind = struct.unpack(">I4s", data[pos : pos + 8])
        header = 8
        if size == 1:
            size, header = struct.unpack(">Q", data[pos + 8 : pos + 16])[0], 16
        elif size == 0 and top_level:
            size = len(data) - pos  # the last box runs to the end of the file
        if size < header or pos + size > len(data):
            raise CorruptImageError(f"HEIF box {kind!r} at byte {pos} runs past the end")
        yield kind, pos, pos + header, pos + size
        pos += size


def payloads(data: bytes) -> Iterator[Box]:
    for kind, _, body, end in spans(data):
        yield kind, data[body:end]


def _check_meta(data: bytes, c: Container, essential_transforms: bool) -> None:
    if c.primary not in c.items:
        raise CorruptImageError(f"HEIF primary item {c.primary} does not exist")
    derived: dict[int, list[int]] = {}
    for kind, source, targets in c.refs:
        for item in (source, *targets):
            if item not in c.items and item not in c.groups:
                raise CorruptImageError(f"HEIF {kind.decode()} reference to missing item {item}")
        if source in targets:
            raise CorruptImageError(f"HEIF item {source} references itself")
        if kind == b"dimg":
            derived[source] = targets
    _check_acyclic(derived)
    for item, targets in derived.items():
        if c.items.get(item) == b"grid":
            _check_grid(data, c, item, targets)
    for item in c.associations if essential_transforms else ():
        _check_essential(c, item)


def _full(payload: bytes) -> tuple[int, bytes]:
    """(version, rest) of a full box payload."""
    return payload[0], payload[4:]


def _items(iinf: bytes) -> dict[int, bytes]:
    """item id → item type, from infe boxes of version 2 or 3."""
    items: dict[int, bytes] = {}
    for _, item_id, item_type in infe_entries(iinf):
        items[item_id] = item_type
    return items


def infe_entries(iinf: bytes) -> Iterator[tuple[bytes, int, bytes]]:
    """(infe box, item id, item type) of each infe of version 2 or 3 in iinf."""
    if not iinf:
        raise CorruptImageError("HEIF file has no item information")
    version = iinf[0]
    for kind, start, body, end in spans(iinf, 6 if version == 0 else 8):
        v, rest = _full(iinf[body:end])
        if kind != b"infe" or v not in (2, 3):
            continue  # old infe versions carry no type: nothing to check against
        fmt = ">HH4s" if v == 2 else ">IH4s"
        item_id, _, item_type = struct.unpack(fmt, rest[: struct.calcsize(fmt)])
        yield iinf[start:end], item_id, item_type


def _groups(grpl: bytes) -> set[int]:
    return {struct.unpack(">I", payload[4:8])[0] for _, payload in payloads(grpl)}


def _primary(pitm: bytes) -> int:
    version, rest = _full(pitm)
    return int(struct.unpack(">H" if version == 0 else ">I", rest[: 2 if version == 0 else 4])[0])


def _references(iref: bytes) -> Iterator[Ref]:
    if not iref:
        return
    version, rest = _full(iref)
    width, fmt = (2, ">H") if version == 0 else (4, ">I")
    for kind, payload in payloads(rest):
        source = struct.unpack(fmt, payload[:width])[0]
        count = struct.unpack(">H", payload[width : width + 2])[0]
        start = width + 2
        if start + count * width > len(payload):
            raise CorruptImageError(f"HEIF {kind!r} reference list runs past its box")
        targets = [struct.unpack(fmt, payload[start + i * width : start + (i + 1) * width])[0]
                   for i in range(count)]  # fmt: skip
        yield Ref(kind, source, targets)


def _properties(ipco: bytes) -> list[bytes]:
    return [ipco[start:end] for _, start, _, end in spans(ipco)]


def _associations(ipma: bytes) -> dict[int, list[tuple[int, bool]]]:
    found: dict[int, list[tuple[int, bool]]] = {}
    for item, marks, _ in ipma_entries(ipma):
        found.setdefault(item, []).extend(marks)
    return found


def ipma_entries(ipma: bytes) -> Iterator[tuple[int, list[tuple[int, bool]], tuple[int, int]]]:
    """(item id, [(property index, essential)], the entry's span) of each ipma entry."""
    if not ipma:
        return
    version, flags = ipma[0], ipma[3]
    id_size, wide = (2 if version < 1 else 4), bool(flags & 1)
    pos = 8
    for _ in range(struct.unpack(">I", ipma[4:8])[0]):
        start = pos
        item = int.from_bytes(ipma[pos : pos + id_size], "big")
        count, pos = ipma[pos + id_size], pos + id_size + 1
        marks = []
        for _ in range(count):
            mark = int.from_bytes(ipma[pos : pos + 1 + wide], "big")
            top = 0x8000 if wide else 0x80
            marks.append((mark & (top - 1), bool(mark & top)))
            pos += 1 + wide
        if pos > len(ipma):
            raise CorruptImageError("HEIF property associations run past their box")
        yield item, marks, (start, pos)


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


def _check_grid(data: bytes, c: Container, item: int, targets: list[int]) -> None:
    descriptor = item_data(data, c, item)
    rows, columns = descriptor[2] + 1, descriptor[3] + 1
    if len(targets) != rows * columns:
        raise CorruptImageError(f"HEIF grid of {rows}x{columns} references {len(targets)} tiles")
    twice = next((t for i, t in enumerate(targets) if t in targets[:i]), None)
    if twice is not None:  # libavif: "invalid image grid"; libheif would draw it twice
        raise CorruptImageError(f"HEIF grid {item} references tile {twice} more than once")


def _check_essential(c: Container, item: int) -> None:
    for kind, _, essential in c.props(item):
        if kind in TRANSFORMS and not essential:  # ISO/IEC 23008-12: shall be essential
            raise CorruptImageError(
                f"HEIF item {item} has a non-essential {kind.decode()}: "
                "transformative properties must be marked essential"
            )


def item_data(data: bytes, c: Container, item: int) -> bytes:
    """An item's first extent, from the file (construction method 0) or idat (1)."""
    place = locations(c.child(b"iloc")).get(item)
    if place is None or not place.extents:
        raise CorruptImageError(f"HEIF item {item} has no location")
    offset, length, _ = place.extents[0]
    source = c.child(b"idat") if place.method == 1 else data
    start = place.base + offset
    chunk = source[start : start + (length or len(source))]
    if len(chunk) < 8:
        raise CorruptImageError(f"HEIF item {item} data is missing")
    return chunk


def locations(iloc: bytes) -> dict[int, Location]:
    """item id → Location, from an iloc payload of version 0, 1 or 2."""
    version, rest = _full(iloc)
    sizes = rest[0] << 8 | rest[1]
    offset_size, length_size = sizes >> 12, (sizes >> 8) & 15
    base_size, index_size = (sizes >> 4) & 15, (sizes & 15) if version else 0
    id_size = 2 if version < 2 else 4
    count = int.from_bytes(rest[2 : 2 + id_size], "big")
    pos, found = 2 + id_size, {}
    for _ in range(count):
        start = pos
        item_id = int.from_bytes(rest[pos : pos + id_size], "big")
        pos += id_size
        method = (int.from_bytes(rest[pos : pos + 2], "big") & 15) if version else 0
        pos += (2 if version else 0) + 2
        base = int.from_bytes(rest[pos : pos + base_size], "big")
        extents, pos = [], pos + base_size + 2
        for _ in range(int.from_bytes(rest[pos - 2 : pos], "big")):
            pos += index_size
            offset = int.from_bytes(rest[pos : pos + offset_size], "big")
            at = pos + offset_size
            length = int.from_bytes(rest[at : at + length_size], "big")
            extents.append((offset, length, at + 4 if length_size else -1))
            pos = at + length_size
        if pos > len(rest):
            raise CorruptImageError("HEIF item locations run past their box")
        found[item_id] = Location(method, base, extents, (start + 4, pos + 4), length_size)
    return found


def image_size(c: Container, item: int) -> tuple[int, int] | None:
    """The item's `ispe`: its size before any transformative property."""
    ispe = next((p for kind, p, _ in c.props(item) if kind == b"ispe"), None)
    return struct.unpack(">II", ispe[4:12]) if ispe and len(ispe) >= 12 else None


def largest_image(c: Container) -> tuple[int, int]:
    """The largest image libheif decodes for the primary, by its `ispe`: the primary (a
    grid's or overlay's whole canvas, before clap crops it) and each image it is derived
    from or carries (tiles, overlay inputs, alpha). (0, 0) when none has an ispe."""
    carried = {r.source for r in c.refs if r.kind == b"auxl" and c.primary in r.targets}
    derived = {r.source: r.targets for r in c.refs if r.kind == b"dimg"}
    seen, todo = set(), [c.primary, *carried]
    while todo:
        item = todo.pop()
        if item not in seen:
            seen.add(item)
            todo.extend(derived.get(item, []))
    sizes = [size for size in (image_size(c, item) for item in seen) if size]
    return max(sizes, key=lambda s: s[0] * s[1], default=(0, 0))


# The payload each transformative property needs: a short one is a damaged file, refused
# as one (not an IndexError in the render process, which would read as a crash).
PROPERTY_BYTES = {b"clap": 32, b"irot": 1, b"imir": 1}


class Step(NamedTuple):
    """One transformative operation on the decoded pixels, in the order of association:
    `crop` (left, top, width, height), `rotate` (anti-clockwise quarter turns) or `mirror`
    (axis 0: top and bottom exchanged; 1: left and right)."""

    op: str
    args: tuple[int, ...]


def transform_steps(c: Container, item: int, width: int, height: int) -> list[Step]:
    """The item's clap/irot/imir as steps on a width×height decode, sizes carried along."""
    steps = []
    for kind, payload, _ in c.props(item):
        if len(payload) < PROPERTY_BYTES.get(kind, 0):
            raise CorruptImageError(f"HEIF {kind.decode()} of {len(payload)} bytes is truncated")
        if kind == b"clap":
            rect = clean_aperture(payload, width, height)
            steps.append(Step("crop", rect))
            width, height = rect[2], rect[3]
        elif kind == b"irot":
            steps.append(Step("rotate", (payload[0] & 3,)))
            width, height = (height, width) if payload[0] & 1 else (width, height)
        elif kind == b"imir":
            steps.append(Step("mirror", (payload[0] & 1,)))
    return steps


def clean_aperture(clap: bytes, width: int, height: int) -> tuple[int, int, int, int]:
    """(left, top, width, height) of a clap on a width×height image (ISO/IEC 14496-12
    12.1.4: the aperture's centre is the image's centre moved by the offsets). Rounded as
    libheif rounds it, so HEVC and AV1 crop alike: left down, top, width and height to the
    nearest. Raises CorruptImageError for an empty aperture or one outside the image."""
    num = struct.unpack(">IIIIiIiI", clap[:32])
    if 0 in num[1::2]:
        raise CorruptImageError("HEIF clap has a zero denominator")
    cw, ch, dx, dy = (Fraction(num[i], num[i + 1]) for i in range(0, 8, 2))
    left = int(dx + Fraction(width - cw, 2))  # int() rounds towards zero, as libheif does
    top, w, h = (_nearest(v) for v in (dy + Fraction(height - ch, 2), cw, ch))
    if w < 1 or h < 1 or left < 0 or top < 0 or left + w > width or top + h > height:
        raise CorruptImageError(
            f"HEIF clap {w}x{h} at ({left}, {top}) does not fit the {width}x{height} image"
        )
    return left, top, w, h


def _nearest(value: Fraction) -> int:
    return int(value + Fraction(1, 2)) if value >= 0 else -int(-value + Fraction(1, 2))
