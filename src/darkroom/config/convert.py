"""Converters from one environment or URL-option text to its value, raising ValueError with
the reason: numbers with a floor, URLs, ports, tokens, keys, header values, booleans,
tenant weights and rates. darkroom.config.env and darkroom.config.redis_url build their
tables of them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import urlsplit

T = TypeVar("T")


def at_least(kind: Callable[[str], T], minimum: float) -> Callable[[str], T]:
    def convert(raw: str) -> T:
        value = kind(raw)
        if not math.isfinite(value) or value < minimum:  # type: ignore[arg-type,operator]
            raise ValueError(f"must be a finite number of at least {minimum:g}")
        return value

    return convert


def url(*schemes: str) -> Callable[[str], str]:
    def convert(raw: str) -> str:
        if urlsplit(raw).scheme not in schemes:
            raise ValueError(f"scheme must be one of {', '.join(schemes)}")
        return raw

    return convert


def trace_url(raw: str) -> str:
    """A trace viewer's http(s) URL template; the photo page fills in the trace id."""
    if urlsplit(raw).scheme not in ("http", "https") or "{trace_id}" not in raw:
        raise ValueError("must be an http(s) URL containing {trace_id}")
    return raw


def storage_url(raw: str) -> str:
    parts = urlsplit(raw)
    if parts.scheme == "file" and (parts.path or parts.netloc):
        return raw
    if parts.scheme == "s3" and parts.netloc:
        return raw
    raise ValueError("must be file:PATH or s3://BUCKET[/PREFIX]")


def choice(*options: str) -> Callable[[str], str]:
    def convert(raw: str) -> str:
        if raw.lower() not in options:
            raise ValueError(f"must be one of {', '.join(options)}")
        return raw.lower()

    return convert


def port(raw: str) -> int:
    value = int(raw)
    if not 0 <= value <= 65535:
        raise ValueError("must be 0 (off) or a TCP port")
    return value


def tcp_port(raw: str) -> int:
    value = int(raw)
    if not 1 <= value <= 65535:
        raise ValueError("must be a TCP port (1..65535)")
    return value


def token(raw: str) -> str:
    # Guessable tokens defeat the point; 16 characters is the floor (32 random bytes is better).
    if len(raw.strip()) < 16 or raw != raw.strip():
        raise ValueError("must be at least 16 characters, without surrounding spaces")
    return raw


def probe_key(raw: str) -> str:
    """A key relative to the storage root: a folder or a prefix the worker writes."""
    if raw != raw.strip() or raw.startswith("/") or ".." in raw.split("/") or raw.endswith("/"):
        raise ValueError("must be a relative key such as renditions/.darkroom-probe")
    return raw


def nonempty(raw: str) -> str:
    if not raw.strip():
        raise ValueError("must not be empty")
    return raw


def header_value(raw: str) -> str:
    # Visible ASCII and spaces only: a CR or LF would let a value forge another header.
    if not raw.strip() or len(raw) > 512 or not all(" " <= c <= "~" for c in raw):
        raise ValueError("must be 1 to 512 printable ASCII characters (an HTTP header value)")
    return raw.strip()


def boolean(raw: str) -> bool:
    value = raw.strip().lower()
    if value not in ("true", "false", "1", "0", "yes", "no"):
        raise ValueError("must be true or false")
    return value in ("true", "1", "yes")


def parse_weights(text: str) -> tuple[tuple[str, int], ...]:
    """`tenant=weight,...` with whole weights 1..1000 (a tenant not named weighs 1)."""
    weights: dict[str, int] = {}
    for item in (part.strip() for part in text.split(",") if part.strip()):
        tenant, _, raw = item.rpartition("=")
        if not tenant or not raw.isdigit() or not 1 <= int(raw) <= 1000:
            raise ValueError(f"{item!r} is not tenant=weight (a whole number 1..1000)")
        weights[tenant] = int(raw)
    return tuple(weights.items())


def rate_per_s(text: str) -> float:
    """`N/s`, `N/m` or a bare `N` (per second), N >= 0: photos per second (0: unlimited)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(?:/\s*([sm]))?\s*", text)
    if not match:
        raise ValueError(f"rate must be at least 0: N/s, N/m or N (per second), got {text!r}")
    return float(match[1]) / (60.0 if match[2] == "m" else 1.0)


def operator_name(raw: str) -> str:
    """A name for the audit trail: printable, at most 200 characters."""
    name = raw.strip()
    if not name or len(name) > 200 or not name.isprintable():
        raise ValueError("must be 1 to 200 printable characters (a person or a service)")
    return name
