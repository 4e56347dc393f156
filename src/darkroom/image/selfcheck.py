"""Start-up self-check: proves, on tiny samples built into the package, that every allowed
input format decodes, every configured output format encodes (and decodes back), and that
orientation, alpha and colour conversion work. `darkroom run` refuses to start (exit 2)
when a check fails; `darkroom check` prints the table.

Pure and synchronous like the pipeline it drives; it takes a few milliseconds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from importlib import resources

import msgspec
import pyvips

from darkroom.image import rawdecode
from darkroom.image.pipeline import render
from darkroom.image.results import RenderResult
from darkroom.settings import RenditionSpec

# a tiny sample of each allowed input format; the upright picture is 24×32 px in quadrants:
# red (top left), green (top right), blue (bottom left), white (bottom right)
SAMPLES = {
    "jpeg": "orientation-6.jpg",  # stored on its side, EXIF orientation 6
    "png": "alpha.png",  # bottom-right quadrant transparent
    "webp": "sample.webp",
    "gif": "sample.gif",
    "heic": "sample.heic",
    "avif": "sample.avif",
    "dng": "sample.dng",  # its embedded JPEG preview stored on its side, orientation 6
}
CMYK_SAMPLE = "cmyk.jpg"  # pure cyan, CMYK without a profile
# a DNG with no preview: its 32×24 RGGB sensor data stored on its side, orientation 6
SENSOR_SAMPLE = "bayer.dng"
_SIZE = 32
_TOLERANCE = 40


class Check(msgspec.Struct, frozen=True):
    name: str
    ok: bool
    detail: str


def sample(name: str) -> bytes:
    return resources.files("darkroom.image").joinpath("samples", name).read_bytes()


def run(specs: Iterable[RenditionSpec], max_pixels: int = 10_000) -> list[Check]:
    """Every check, in order; none raises."""
    outputs = _output_specs(specs)
    checks = [_attempt(f"decode {fmt}", functools.partial(_decode, fmt)) for fmt in SAMPLES]
    if rawdecode.available():
        checks.append(_attempt("decode RAW sensor data (LibRaw)", _sensor))
    checks += [_attempt(f"encode {s.format}", functools.partial(_encode, s)) for s in outputs]
    checks.append(_attempt("orientation", _orientation))
    checks.append(_attempt("alpha", _alpha))
    checks.append(_attempt("colour (CMYK → sRGB)", _colour))
    return checks


def failures(checks: list[Check]) -> list[Check]:
    return [c for c in checks if not c.ok]


def table(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = [f"{'check':<{width}}  result  detail"]
    lines += [f"{c.name:<{width}}  {'ok' if c.ok else 'FAILED':<6}  {c.detail}" for c in checks]
    return "\n".join(lines)


def _output_specs(specs: Iterable[RenditionSpec]) -> list[RenditionSpec]:
    """One small spec per configured output format, with that format's quality."""
    seen: dict[str, RenditionSpec] = {}
    for spec in specs:
        seen.setdefault(spec.format, RenditionSpec(spec.format, _SIZE, spec.format, spec.quality))
    return list(seen.values())


def _attempt(name: str, check: Callable[[], str]) -> Check:
    try:
        return Check(name, True, check())
    except Exception as exc:  # a check reports what went wrong, whatever it is
        return Check(name, False, f"{type(exc).__name__}: {exc}".splitlines()[0][:160])


def _render(name: str, specs: list[RenditionSpec] | None = None) -> RenderResult:
    return render(sample(name), specs or [RenditionSpec("check", _SIZE, "png", 100)], 10_000)


def _decode(fmt: str) -> str:
    result = _render(SAMPLES[fmt])
    if result.facts.format != fmt:
        raise AssertionError(f"detected as {result.facts.format}")
    _expect_quadrants(_pixels(result))
    return f"{result.facts.width}x{result.facts.height}, colours in place"


def _sensor() -> str:
    result = _render(SENSOR_SAMPLE)
    if (result.facts.width, result.facts.height) != (24, 32):
        raise AssertionError(f"upright size {result.facts.width}x{result.facts.height}, not 24x32")
    _expect_quadrants(_pixels(result))
    return "demosaiced, upright, colours in place"


def _encode(spec: RenditionSpec) -> str:
    rendered = _render(SAMPLES["png"], [spec]).renditions[0]
    back = pyvips.Image.new_from_buffer(rendered.data, "", fail_on="error")
    if (back.width, back.height) != (rendered.width, rendered.height):
        raise AssertionError(f"encoded {rendered.width}x{rendered.height}, reads back otherwise")
    return f"{len(rendered.data)} bytes, decodes back"


def _orientation() -> str:
    result = _render(SAMPLES["jpeg"])
    if (result.facts.width, result.facts.height) != (24, 32):
        raise AssertionError(f"upright size {result.facts.width}x{result.facts.height}, not 24x32")
    _expect_quadrants(_pixels(result))
    return "EXIF orientation 6 applied"


def _alpha() -> str:
    result = _render(SAMPLES["png"])
    image = _image(result)
    if not result.facts.has_alpha or image.bands != 4 or image(18, 24)[3] > 0:
        raise AssertionError("transparency was lost")
    return "transparency kept"


def _colour() -> str:
    pixel = _image(_render(CMYK_SAMPLE))(12, 16)
    if not (pixel[0] < 80 and pixel[1] > 120 and pixel[2] > 180):
        raise AssertionError(f"cyan came out as {pixel[:3]}")
    return f"cyan → sRGB {tuple(round(v) for v in pixel[:3])}"


def _image(result: RenderResult) -> pyvips.Image:
    return pyvips.Image.new_from_buffer(result.renditions[0].data, "")


def _pixels(result: RenderResult) -> pyvips.Image:
    image = _image(result)
    return image.thumbnail_image(24, height=32, size="force") if image.width != 24 else image


def _expect_quadrants(image: pyvips.Image) -> None:
    expected = {(6, 8): (220, 30, 30), (18, 8): (30, 200, 30), (6, 24): (30, 60, 220)}
    for (x, y), colour in expected.items():
        got = image(x, y)[:3]
        if max(abs(a - b) for a, b in zip(got, colour, strict=True)) > _TOLERANCE:
            raise AssertionError(f"pixel ({x},{y}) is {tuple(round(v) for v in got)}, not {colour}")
