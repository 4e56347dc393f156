"""Rewrites of a checked HEIF/AVIF file before libheif reads it, for valid structures the
libheif versions darkroom runs refuse (1.23 in pi-heif for HEVC, the one in libvips 8.18
for AV1). Pure: bytes in, bytes out; decoding stays libheif's.

- Transformative properties on HEVC: libheif 1.23 bounds the decoded picture by its size
  *after* clap/irot/imir plus 64 px a side, so a clap that crops more refuses a valid
  file. libheif gets the file without them; the pipeline applies them
  (isobmff.transform_steps).
- An overlay (`iovl`) that places one image twice: libheif 1.23 refuses the double
  reference. Each further placement gets a clone of the item: same data, same properties.
- A layered AV1 item with an operating point (`a1op`) or layer (`lsel`) selected: libheif
  decodes every layer and refuses the top one as larger than the ispe. The item is cut to
  the selected layer (av1.cut).

Item data never moves: a meta box that changes size is written at the end of the file and
the old one becomes a `free` box, so every file offset in `iloc` stays valid.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from darkroom.errors import CorruptImageError
from darkroom.image import av1, isobmff
from darkroom.image.isobmff import TRANSFORMS, Container

_EDITED = (b"iinf", b"iloc", b"iref", b"idat")  # besides iprp, the meta boxes rewritten


class _Work:
    """Working copies of the file and of the meta boxes the rewrites touch."""

    def __init__(self, data: bytes, c: Container) -> None:
        self.data, self.c, self.changed = bytearray(data), c, False
        self.boxes = {kind: bytearray(c.child(kind)) for kind in _EDITED}
        self.iprp = [(k, bytearray(p)) for k, p in isobmff.payloads(c.child(b"iprp"))]

    def prop_box(self, kind: bytes) -> bytearray:
        """The iprp child of this type (ipco, ipma), empty when the file has none."""
        return next((payload for k, payload in self.iprp if k == kind), bytearray())


def for_libheif(data: bytes, c: Container, *, strip_transforms: bool) -> bytes:
    """The file as libheif should read it; the same bytes when nothing needs rewriting."""
    if b"iprp" not in dict(c.meta) or not c.child(b"iloc"):
        return data
    work = _Work(data, c)
    try:
        _select_layers(work)
        if strip_transforms:
            _strip_transforms(work)
        _clone_repeats(work)
    except (struct.error, LookupError, ValueError) as exc:
        raise CorruptImageError(f"HEIF structure is damaged: {exc}") from None
    return _with_meta(work) if work.changed else data


def _select_layers(work: _Work) -> None:
    for item, kind in work.c.items.items():
        props = {k: p for k, p, _ in work.c.props(item)}
        if kind == b"av01" and (b"a1op" in props or b"lsel" in props):
            _select_layer(work, item, props)


def _select_layer(work: _Work, item: int, props: dict[bytes, bytes]) -> None:
    place = isobmff.locations(bytes(work.boxes[b"iloc"])).get(item)
    size = isobmff.image_size(work.c, item)
    if place is None or len(place.extents) != 1 or not place.extents[0][1] or size is None:
        return  # several extents or one running to the end: left to libheif as it is
    offset, length, length_at = place.extents[0]
    source = work.boxes[b"idat"] if place.method == 1 else work.data
    start = place.base + offset
    coded = bytes(source[start : start + length])
    op = props[b"a1op"][0] if b"a1op" in props else None
    chosen = struct.unpack(">H", props[b"lsel"][:2])[0] if b"lsel" in props else None
    layer = av1.output_layer(_operating_points(coded, props), op, chosen)
    if layer is None or layer + 1 >= av1.layers(coded):
        return
    cut = av1.cut(coded, layer, *size)
    source[start : start + len(cut)] = cut  # the rest of the old extent is left unreferenced
    work.boxes[b"iloc"][length_at : length_at + place.length_size] = len(cut).to_bytes(
        place.length_size, "big"
    )
    _cut_config(work, item, layer, size)
    work.changed = True


def _operating_points(coded: bytes, props: dict[bytes, bytes]) -> list[int]:
    for data in (coded, props.get(b"av1C", b"")[4:]):
        for obu in av1.obus(data):
            if obu.kind == av1.SEQUENCE_HEADER:
                return av1.sequence_header(data[obu.body : obu.end]).operating_points
    raise CorruptImageError("AV1 item has no sequence header")


def _cut_config(work: _Work, item: int, layer: int, size: tuple[int, int]) -> None:
    """The same maximum frame size in the sequence header av1C may carry: libheif hands
    av1C's configOBUs to the decoder ahead of the item's own."""
    ipco = work.prop_box(b"ipco")
    spans = list(isobmff.spans(bytes(ipco)))
    for index, _ in work.c.associations.get(item, []):
        kind, _, body, end = spans[index - 1]
        if kind == b"av1C" and end - body > 4:
            ipco[body + 4 : end] = av1.cut(bytes(ipco[body + 4 : end]), layer, *size)


def _strip_transforms(work: _Work) -> None:
    kinds = [p[4:8] for p in work.c.properties]
    ipma = work.prop_box(b"ipma")
    if not ipma:
        return
    kept = _ipma(bytes(ipma), lambda i: not 0 < i <= len(kinds) or kinds[i - 1] not in TRANSFORMS)
    if kept != ipma:
        ipma[:] = kept
        work.changed = True


def _ipma(ipma: bytes, keep: Callable[[int], bool]) -> bytes:
    """The ipma payload with only the associations `keep(property index)` accepts."""
    id_size, wide = (2 if ipma[0] < 1 else 4), ipma[3] & 1
    entries = []
    for item, marks, _ in isobmff.ipma_entries(ipma):
        chosen = [(i, e) for i, e in marks if keep(i)]
        packed = [(i | e << (15 if wide else 7)).to_bytes(1 + wide, "big") for i, e in chosen]
        entries.append(item.to_bytes(id_size, "big") + bytes([len(chosen)]) + b"".join(packed))
    return ipma[:4] + struct.pack(">I", len(entries)) + b"".join(entries)


def _clone_repeats(work: _Work) -> None:
    """Each further placement of one image in an overlay gets a clone of that item."""
    next_id = max([*work.c.items, *work.c.groups, 0]) + 1
    refs = []
    for ref in work.c.refs:
        targets = list(ref.targets)
        if ref.kind == b"dimg" and work.c.items.get(ref.source) == b"iovl":
            for i, target in enumerate(targets):
                if target in targets[:i] and target in work.c.items and next_id <= 0xFFFF:
                    _clone(work, target, next_id)
                    targets[i], next_id = next_id, next_id + 1
        refs.append(isobmff.Ref(ref.kind, ref.source, targets))
    if refs != work.c.refs:
        work.boxes[b"iref"][:] = _iref(bytes(work.boxes[b"iref"][:4]), refs)
        work.changed = True


def _clone(work: _Work, item: int, clone: int) -> None:
    iinf, iloc, ipma = work.boxes[b"iinf"], work.boxes[b"iloc"], work.prop_box(b"ipma")
    infe = next(box for box, i, _ in isobmff.infe_entries(bytes(iinf)) if i == item)
    _append(iinf, 4, 2 if iinf[0] == 0 else 4, _with_id(infe, 12, 2 if infe[8] == 2 else 4, clone))
    place = isobmff.locations(bytes(iloc))[item]
    id_size = 2 if iloc[0] < 2 else 4
    entry = bytes(iloc[place.entry[0] : place.entry[1]])
    _append(iloc, 6, id_size, _with_id(entry, 0, id_size, clone))
    for i, _, (start, end) in list(isobmff.ipma_entries(bytes(ipma))):
        if i == item:
            _append(ipma, 4, 4, _with_id(bytes(ipma[start:end]), 0, 2 if ipma[0] < 1 else 4, clone))


def _with_id(entry: bytes, at: int, size: int, item: int) -> bytes:
    return entry[:at] + item.to_bytes(size, "big") + entry[at + size :]


def _append(payload: bytearray, count_at: int, count_size: int, entry: bytes) -> None:
    """Add an entry at the end of a box's list and one to the list's count."""
    span = slice(count_at, count_at + count_size)
    payload[span] = (int.from_bytes(payload[span], "big") + 1).to_bytes(count_size, "big")
    payload += entry


def _iref(head: bytes, refs: list[isobmff.Ref]) -> bytes:
    fmt = ">H" if head[0] == 0 else ">I"
    boxes = b""
    for kind, source, targets in refs:
        ids = b"".join(struct.pack(fmt, t) for t in targets)
        boxes += _box(kind, struct.pack(fmt, source) + struct.pack(">H", len(targets)) + ids)
    return head + boxes


def _box(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", 8 + len(payload)) + kind + payload


def _with_meta(work: _Work) -> bytes:
    """The file with the rewritten meta box: in place when it kept its size, else at the
    end of the file, the old one turned into a `free` box of the same size."""
    start, end = work.c.meta_span
    old = bytes(work.data[start:end])
    iprp = b"".join(_box(k, bytes(p)) for k, p in work.iprp)
    children, seen = b"", set[bytes]()
    for kind, payload in work.c.meta:  # the first box of each edited type is the one read
        if kind not in seen and (kind == b"iprp" or kind in _EDITED):
            payload = iprp if kind == b"iprp" else bytes(work.boxes[kind])
        children, seen = children + _box(kind, payload), seen | {kind}
    head = old[isobmff.header_size(old) : isobmff.header_size(old) + 4]  # version and flags
    meta = _box(b"meta", head + children)
    if len(meta) == end - start:
        return bytes(work.data[:start]) + meta + bytes(work.data[end:])
    free = struct.pack(">I4s", end - start, b"free") + bytes(end - start - 8)
    rest = _sized_last_box(bytes(work.data[end:]))
    return bytes(work.data[:start]) + free + rest + meta


def _sized_last_box(tail: bytes) -> bytes:
    """The boxes after meta, the last one's size made explicit: a box of size 0 runs to
    the end of the file and would swallow the meta box written after it."""
    last = None
    for _, start, _, _ in isobmff.spans(tail, top_level=True):
        last = start
    if last is None or tail[last : last + 4] != b"\0\0\0\0":
        return tail
    return tail[:last] + struct.pack(">I", len(tail) - last) + tail[last + 4 :]
