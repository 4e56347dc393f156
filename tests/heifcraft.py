"""Hand-made HEIF/AVIF files for tests: a valid grid image with more items than libheif's
default limits allow, and files whose item references are invalid per ISO/IEC 23008-12."""

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
