"""What rendering a photo will cost, known before it is queued (the feeder charges tenants
by it): its pixels from the header, a header-only load for JPEG, PNG and WebP; its size in
bytes for any other content, or when the header does not read.
"""

from __future__ import annotations

import pyvips

from darkroom.errors import DarkroomError
from darkroom.image import pipeline

HEADER_FORMATS = ("jpeg", "png", "webp")


def cost_of(data: bytes) -> int:
    """Pixels (width × height) if the header says so cheaply, else bytes."""
    try:
        if pipeline.sniff(data) not in HEADER_FORMATS:
            return len(data)
        pipeline.configure()  # only the allow-listed loaders read it
        header = pyvips.Image.new_from_buffer(data, "", access="sequential")
        return int(header.width) * int(header.height)
    except (DarkroomError, pyvips.Error):
        return len(data)
