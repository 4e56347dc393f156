"""Hand-made HEIF/AVIF files for tests: a valid grid image with more items than libheif's
default limits allow, files whose item references are invalid per ISO/IEC 23008-12, and
(from `heif` down) any set of items, properties and references, re-boxing real HEVC and
AV1 payloads into the conformance classes of tests/test_conformance.py."""

from __future__ import annotations

import struct


def box(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", 8 + len(payload)) + kind + payload


def full(kind: bytes, payload: bytes, version: int = 0, flags: int = 0) -> bytes:
    return box(kind, struct.pack(">I", version << 24 | flags) + payload)


def children(data: bytes, start: int, end: int) -> dict[bytes, bytes]:
    """The boxes in data[start:end], by type (the last of each type)."""
    found, pos = {}, start
    while pos < end:
        size, kind = struct.unpack(">I4s", data[pos : pos + 8])
        found[kind] = data[pos : pos + size]
        pos += size
    return found


class Tile:
    """The coded image item of a small HEIC or AVIF: its codec configuration box, pixi box,
    coded data and size, read through iinf, iloc and ipma."""

    def __init__(self, data: bytes) -> None:
        top = children(data, 0, len(data))
        meta = children(top[b"meta"], 12, len(top[b"meta"]))
        iprp = children(meta[b"iprp"], 8, len(meta[b"iprp"]))
        self.item_type = b"av01" if b"av1C" in meta[b"iprp"] else b"hvc1"
        item = self._item_id(meta[b"iinf"])
        props = self._properties(iprp[b"ipco"])
        wanted = self._associations(iprp[b"ipma"])[item]
        self.config = next(
            p for p in (props[i - 1] for i in wanted) if p[4:8] in (b"av1C", b"hvcC")
        )
        ispe = next(p for p in (props[i - 1] for i in wanted) if p[4:8] == b"ispe")
        self.size = struct.unpack(">II", ispe[12:20])
        self.pixi = next((p for p in props if p[4:8] == b"pixi"), b"")
        self.coded = self._extent(meta[b"iloc"], item, data)
        self.brand = b"avif" if self.item_type == b"av01" else b"heic"

    def _item_id(self, iinf: bytes) -> int:
        pos = 14
        while pos < len(iinf):
            size = struct.unpack(">I", iinf[pos : pos + 4])[0]
            item_id, _, kind = struct.unpack(">HH4s", iinf[pos + 12 : pos + 20])
            if kind == self.item_type:
                return int(item_id)
            pos += size
        raise ValueError("no coded image item")

    @staticmethod
    def _properties(ipco: bytes) -> list[bytes]:
        props, pos = [], 8
        while pos < len(ipco):
            size = struct.unpack(">I", ipco[pos : pos + 4])[0]
            props.append(ipco[pos : pos + size])
            pos += size
        return props

    @staticmethod
    def _associations(ipma: bytes) -> dict[int, list[int]]:
        found, pos = {}, 16
        for _ in range(struct.unpack(">I", ipma[12:16])[0]):
            item_id, count = struct.unpack(">HB", ipma[pos : pos + 3])
            found[item_id] = [b & 0x7F for b in ipma[pos + 3 : pos + 3 + count]]
            pos += 3 + count
        return found

    @staticmethod
    def _extent(iloc: bytes, item: int, data: bytes) -> bytes:
        version, sizes = iloc[8], iloc[12:14]
        if sizes[0] != 0x44 or sizes[1] >> 4 not in (0, 4) or sizes[1] & 15:
            raise ValueError("only 4-byte offsets and lengths, no index")
        base_size = sizes[1] >> 4
        pos = 16
        for _ in range(struct.unpack(">H", iloc[14:16])[0]):
            item_id = struct.unpack(">H", iloc[pos : pos + 2])[0]
            pos += (4 if version else 2) + 2 + base_size  # method, data_reference, base
            base = int.from_bytes(iloc[pos - base_size : pos], "big") if base_size else 0
            count = struct.unpack(">H", iloc[pos : pos + 2])[0]
            offset, length = struct.unpack(">II", iloc[pos + 2 : pos + 10])
            if item_id == item:
                return data[base + offset : base + offset + length]
            pos += 2 + 8 * count
        raise ValueError("item has no extent")


def _infe(item: int, kind: bytes) -> bytes:
    return full(b"infe", struct.pack(">HH4s", item, 0, kind) + b"\0", version=2)


def grid(
    sample: bytes,
    columns: int,
    rows: int,
    refs: list[int] | None = None,
    cycle: bool = False,
    *,
    overlay: bool = False,
    crop: int = 0,
) -> bytes:
    """A HEIC or AVIF grid of columns×rows copies of the sample's coded image (all tiles
    share one extent). `refs` overrides the grid's `dimg` references and `cycle` adds one
    from the first tile back to the grid (both to make them invalid). `overlay` makes it an
    `iovl` overlay instead, on a canvas one tile wider filled with opaque red; `crop`
    adds a clean-aperture (`clap`) property taking `crop` px off each side."""
    tile = Tile(sample)
    av1c, pixi, coded, (tw, th) = tile.config, tile.pixi, tile.coded, tile.size
    tiles = list(range(2, 2 + columns * rows))
    width, height = tw * (columns + overlay), th * rows
    grid = struct.pack(">BBBBHH", 0, 0, rows - 1, columns - 1, width, height)
    if overlay:
        offsets = [(c * tw, r * th) for r in range(rows) for c in range(columns)]
        grid = struct.pack(">BB4HHH", 0, 0, 65535, 0, 0, 65535, width, height)
        grid += b"".join(struct.pack(">hh", x, y) for x, y in offsets)
    clap = full(b"clap", b"")[:8] + struct.pack(
        ">8I", width - 2 * crop, 1, height - 2 * crop, 1, 0, 1, 0, 1
    )  # centred: offsets 0
    clap = struct.pack(">I", len(clap)) + clap[4:]
    ftyp = box(b"ftyp", tile.brand + b"\0\0\0\0" + b"mif1" + tile.brand + b"miaf")
    ipco = box(b"ipco", av1c + full(b"ispe", struct.pack(">II", tw, th))
               + full(b"ispe", struct.pack(">II", width, height)) + pixi
               + (clap if crop else b""))  # fmt: skip
    clap_index = 5 if pixi else 4
    assoc = (
        struct.pack(">HBB", 1, 1, 3)
        if not crop
        else struct.pack(">HBBB", 1, 2, 3, 0x80 | clap_index)
    )
    tile_props = struct.pack(">BBB", 0x81, 2, 4) if pixi else struct.pack(">BB", 0x81, 2)
    assoc += b"".join(struct.pack(">HB", t, len(tile_props)) + tile_props for t in tiles)
    ipma = full(b"ipma", struct.pack(">I", 1 + len(tiles)) + assoc)
    iinf = full(b"iinf", struct.pack(">H", 1 + len(tiles))
                + _infe(1, b"iovl" if overlay else b"grid")
                + b"".join(_infe(t, tile.item_type) for t in tiles))  # fmt: skip
    targets = tiles if refs is None else refs
    iref = full(b"iref", box(b"dimg", struct.pack(">HH", 1, len(targets))
                             + b"".join(struct.pack(">H", t) for t in targets))
                + (box(b"dimg", struct.pack(">HHH", 2, 1, 1)) if cycle else b""))  # fmt: skip

    def build(mdat_at: int) -> bytes:
        iloc_items = struct.pack(">HHHII", 1, 0, 1, mdat_at + 8, len(grid))
        iloc_items += b"".join(struct.pack(">HHHII", t, 0, 1, mdat_at + 8 + len(grid), len(coded))
                               for t in tiles)  # fmt: skip
        iloc = full(b"iloc", struct.pack(">BBH", 0x44, 0x00, 1 + len(tiles)) + iloc_items)
        hdlr = full(b"hdlr", b"\0\0\0\0pict" + b"\0" * 12 + b"\0")
        pitm = full(b"pitm", struct.pack(">H", 1))
        return full(b"meta", hdlr + pitm + iloc + iinf + iref + box(b"iprp", ipco + ipma))

    meta = build(0)
    meta = build(len(ftyp) + len(meta))
    return ftyp + meta + box(b"mdat", grid + coded)


class Item:
    """One item of a hand-made file: its type, payload (in mdat) and properties, each a
    (box, essential) pair associated in this order."""

    def __init__(
        self,
        item_id: int,
        kind: bytes,
        data: bytes = b"",
        props: list[tuple[bytes, bool]] | None = None,
        *,
        hidden: bool = False,
    ) -> None:
        self.id, self.kind, self.data = item_id, kind, data
        self.props, self.hidden = props or [], hidden


def ispe(width: int, height: int) -> bytes:
    return full(b"ispe", struct.pack(">II", width, height))


def clap(width: int, height: int, dx: int = 0, dy: int = 0) -> bytes:
    """A clean aperture of width×height px, its centre moved (dx, dy) px from the image's."""
    return box(b"clap", struct.pack(">IIIIiIiI", width, 1, height, 1, dx, 1, dy, 1))


def irot(quarters: int) -> bytes:
    """Rotation anti-clockwise by quarters × 90°."""
    return box(b"irot", bytes([quarters & 3]))


def imir(axis: int) -> bytes:
    """Mirroring (ISO/IEC 23008-12:2022 6.5.12): axis 0 exchanges top and bottom, axis 1
    left and right."""
    return box(b"imir", bytes([axis & 1]))


def a1op(index: int) -> bytes:
    """The operating point of a layered AV1 item to decode (essential)."""
    return box(b"a1op", bytes([index]))


def lsel(layer: int) -> bytes:
    """The layer of a layered item to output (essential)."""
    return box(b"lsel", struct.pack(">H", layer))


def a1lx(sizes: list[int]) -> bytes:
    """Byte sizes of a layered AV1 item's layers but the last (which takes the rest)."""
    return box(b"a1lx", b"\x01" + struct.pack(">3I", *[*sizes, 0, 0, 0][:3]))


def grid_descriptor(columns: int, rows: int, width: int, height: int) -> bytes:
    return struct.pack(">BBBBHH", 0, 0, rows - 1, columns - 1, width, height)


def overlay_descriptor(
    width: int, height: int, offsets: list[tuple[int, int]], fill: tuple[int, ...]
) -> bytes:
    """An `iovl` canvas of width×height filled with RGBA `fill` (16 bits per channel), one
    (x, y) offset per referenced image."""
    head = struct.pack(">BB4H", 0, 0, *fill) + struct.pack(">HH", width, height)
    return head + b"".join(struct.pack(">hh", x, y) for x, y in offsets)


def heif(
    brand: bytes,
    items: list[Item],
    refs: list[tuple[bytes, int, list[int]]],
    primary: int = 1,
) -> bytes:
    """A HEIF file of these items (payloads in mdat) and item references (type, from, to)."""
    ftyp = box(b"ftyp", brand + b"\0\0\0\0" + b"mif1" + brand + b"miaf")
    shared: dict[bytes, int] = {}  # equal property boxes are stored once in ipco
    assoc = b""
    for item in items:
        marks = [shared.setdefault(prop, len(shared) + 1) | essential << 15
                 for prop, essential in item.props]  # fmt: skip
        assoc += struct.pack(f">HB{len(marks)}H", item.id, len(marks), *marks)
    ipco = b"".join(shared)
    ipma = full(b"ipma", struct.pack(">I", len(items)) + assoc, flags=1)  # 15-bit indices
    iinf = full(b"iinf", struct.pack(">H", len(items)) + b"".join(
        full(b"infe", struct.pack(">HH4s", i.id, 0, i.kind) + b"\0", version=2, flags=i.hidden)
        for i in items))  # fmt: skip
    iref = b"".join(
        box(kind, struct.pack(f">HH{len(targets)}H", source, len(targets), *targets))
        for kind, source, targets in refs
    )

    def build(mdat_at: int) -> bytes:
        at, locations = mdat_at + 8, b""
        for item in items:
            locations += struct.pack(">HHHII", item.id, 0, 1, at, len(item.data))
            at += len(item.data)
        iloc = full(b"iloc", struct.pack(">BBH", 0x44, 0x00, len(items)) + locations)
        hdlr = full(b"hdlr", b"\0\0\0\0pict" + b"\0" * 12 + b"\0")
        pitm = full(b"pitm", struct.pack(">H", primary))
        boxes = hdlr + pitm + iloc + iinf + (full(b"iref", iref) if refs else b"")
        return full(b"meta", boxes + box(b"iprp", box(b"ipco", ipco) + ipma))

    meta = build(0)
    meta = build(len(ftyp) + len(meta))
    return ftyp + meta + box(b"mdat", b"".join(item.data for item in items))


def coded(tile: Tile, item_id: int, props: list[tuple[bytes, bool]] | None = None) -> Item:
    """A coded image item of the tile's payload, with its codec configuration, size and pixi
    (essential as the spec requires) before any further properties."""
    base = [(tile.config, True), (ispe(*tile.size), False)]
    base += [(tile.pixi, False)] if tile.pixi else []
    return Item(item_id, tile.item_type, tile.coded, base + (props or []))


def transformed(tile: Tile, props: list[tuple[bytes, bool]]) -> bytes:
    """A MIAF file of one coded image carrying these (transformative) properties."""
    return heif(tile.brand, [coded(tile, 1, props)], [])


def overlay_twice(tile: Tile, second: tuple[int, int], fill: tuple[int, ...]) -> bytes:
    """An `iovl` of two tiles' size placing the same tile item at (0, 0) and at `second`."""
    width, height = tile.size[0] * 2, tile.size[1]
    canvas = overlay_descriptor(width, height, [(0, 0), second], fill)
    overlay = Item(1, b"iovl", canvas, [(ispe(width, height), False)])
    inner = coded(tile, 2)
    inner.hidden = True
    return heif(tile.brand, [overlay, inner], [(b"dimg", 1, [2, 2])])


def grid_twice(tile: Tile) -> bytes:
    """A 2×1 grid whose `dimg` names the same tile item twice."""
    width, height = tile.size[0] * 2, tile.size[1]
    grid = Item(1, b"grid", grid_descriptor(2, 1, width, height), [(ispe(width, height), False)])
    inner = coded(tile, 2)
    inner.hidden = True
    return heif(tile.brand, [grid, inner], [(b"dimg", 1, [2, 2])])


def two_cropped(tile: Tile, first: bytes, second: bytes, primary: int = 1) -> bytes:
    """Two coded images of the tile's payload, each cropped by its own clap."""
    items = [coded(tile, 1, [(first, True)]), coded(tile, 2, [(second, True)])]
    return heif(tile.brand, items, [], primary=primary)


def temporal_unit_layers(obu: bytes) -> tuple[bytes, list[int]]:
    """An AV1 temporal unit as an AVIF item payload (its temporal delimiter dropped) and
    the byte size of each spatial layer in it, by the OBUs' extension headers."""
    payload, sizes, pos = b"", [0, 0, 0, 0], 0
    while pos < len(obu):
        header, extended = obu[pos], bool(obu[pos] & 4)
        size, at, shift = 0, pos + 1 + extended, 0
        while True:
            size |= (obu[at] & 0x7F) << shift
            at, shift = at + 1, shift + 7
            if not obu[at - 1] & 0x80:
                break
        if (header >> 3) & 15 != 2:  # OBU_TEMPORAL_DELIMITER
            payload += obu[pos : at + size]
            sizes[(obu[pos + 1] >> 3) & 3 if extended else 0] += at + size - pos
        pos = at + size
    return payload, [s for s in sizes if s]


def layered(
    obu: bytes, size: tuple[int, int], props: list[tuple[bytes, bool]], *, config_obus: bool = False
) -> bytes:
    """An AVIF of one layered AV1 item (profile 0, 8-bit 4:2:0) whose ispe is `size`, the
    output of its selected operating point, with a1lx and these further properties;
    `config_obus` repeats the sequence header in av1C, as libavif writes it."""
    payload, sizes = temporal_unit_layers(obu)
    sequence_header = payload[: 2 + payload[1]] if config_obus else b""  # the first OBU
    config = box(b"av1C", bytes([0x81, 0x05, 0x0C, 0x00]) + sequence_header)  # level 3.1, 4:2:0
    item_props = [(config, True), (ispe(*size), False), (full(b"pixi", bytes([3, 8, 8, 8])), False)]
    item_props += [(a1lx(sizes[:-1]), False), *props]
    return heif(b"avif", [Item(1, b"av01", payload, item_props)], [])
