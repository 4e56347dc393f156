"""Every DARKROOM_* setting, validated once at start-up into one frozen Struct.

`from_env` is the only reader of the environment; a bad value raises SettingsError
naming the variable, which the CLI turns into a message and exit code 2.
"""

from __future__ import annotations

import math
import os
import re
import socket
import uuid
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

import msgspec

from darkroom.errors import SettingsError

Format = Literal["webp", "jpeg", "avif", "png"]
EXTENSIONS: dict[str, str] = {"webp": "webp", "jpeg": "jpg", "avif": "avif", "png": "png"}
DEFAULT_QUALITY: dict[str, int] = {"webp": 80, "jpeg": 82, "avif": 60, "png": 100}


class RenditionSpec(msgspec.Struct, frozen=True):
    """One output: `size` is the long edge in pixels (never upscaled)."""

    name: str
    size: int
    format: Format
    quality: int

    @property
    def ext(self) -> str:
        return EXTENSIONS[self.format]


DEFAULT_RENDITIONS = "thumb:320:webp:80,medium:1024:webp:80,medium:1024:jpeg:82,large:2048:webp:80"
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")


def parse_renditions(text: str) -> tuple[RenditionSpec, ...]:
    """Parse `name:size:format[:quality],...`; raises ValueError with the reason."""
    specs: list[RenditionSpec] = []
    for item in (part.strip() for part in text.split(",")):
        fields = item.split(":")
        if len(fields) not in (3, 4) or not _NAME.match(fields[0]):
            raise ValueError(f"{item!r} is not name:size:format[:quality]")
        name, size, fmt = fields[0], int(fields[1]), fields[2].lower().replace("jpg", "jpeg")
        if fmt not in EXTENSIONS:
            raise ValueError(f"{item!r}: format must be one of webp, jpeg, avif, png")
        quality = int(fields[3]) if len(fields) == 4 else DEFAULT_QUALITY[fmt]
        if not 16 <= size <= 8192 or not 1 <= quality <= 100:
            raise ValueError(f"{item!r}: size must be 16..8192 and quality 1..100")
        specs.append(RenditionSpec(name, size, fmt, quality))  # type: ignore[arg-type]
    if len({(s.name, s.format) for s in specs}) != len(specs):
        raise ValueError("two renditions share a name and format")
    return tuple(specs)


def default_consumer() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    redis_url: str = "redis://127.0.0.1:6379/0"
    database_url: str = "postgresql://postgres@127.0.0.1:5432/darkroom"
    storage_url: str = "file:./var/storage"
    s3_endpoint_url: str | None = None
    stream: str = "{darkroom}:photos"
    group: str = "darkroom"
    consumer: str = msgspec.field(default_factory=default_consumer)
    dead_letter_stream: str = "{darkroom}:dead"
    dead_letter_maxlen: int = 100_000
    concurrency: int = msgspec.field(default_factory=lambda: os.cpu_count() or 1)
    shutdown_grace_s: float = 30.0
    renditions: tuple[RenditionSpec, ...] = parse_renditions(DEFAULT_RENDITIONS)
    max_attempts: int = 5
    retry_base_ms: int = 1000
    claim_idle_ms: int = 30_000
    sweep_after_s: float = 300.0
    job_timeout_s: float = 120.0
    render_memory_mb: int = 2048
    max_pixels: int = 100_000_000
    max_original_bytes: int = 200 * 1024 * 1024
    read_block_ms: int = 2000
    metrics_port: int = 0
    log_format: Literal["json", "console"] = "json"
    log_level: str = "info"
    renders_per_process: int = 500
    render_max_rss_mb: int = 256


T = TypeVar("T")


def _positive(kind: Callable[[str], T]) -> Callable[[str], T]:
    def convert(raw: str) -> T:
        value = kind(raw)
        if not math.isfinite(value) or value <= 0:  # type: ignore[arg-type,operator]
            raise ValueError("must be a finite number greater than 0")
        return value

    return convert


def _url(*schemes: str) -> Callable[[str], str]:
    def convert(raw: str) -> str:
        if urlsplit(raw).scheme not in schemes:
            raise ValueError(f"scheme must be one of {', '.join(schemes)}")
        return raw

    return convert


def _storage_url(raw: str) -> str:
    parts = urlsplit(raw)
    if parts.scheme == "file" and (parts.path or parts.netloc):
        return raw
    if parts.scheme == "s3" and parts.netloc:
        return raw
    raise ValueError("must be file:PATH or s3://BUCKET[/PREFIX]")


def _choice(*options: str) -> Callable[[str], str]:
    def convert(raw: str) -> str:
        if raw.lower() not in options:
            raise ValueError(f"must be one of {', '.join(options)}")
        return raw.lower()

    return convert


def _port(raw: str) -> int:
    value = int(raw)
    if not 0 <= value <= 65535:
        raise ValueError("must be 0 (off) or a TCP port")
    return value


def _nonempty(raw: str) -> str:
    if not raw.strip():
        raise ValueError("must not be empty")
    return raw


PARSERS: dict[str, Callable[[str], Any]] = {
    "redis_url": _url("redis", "rediss", "unix"),
    "database_url": _url("postgres", "postgresql"),
    "storage_url": _storage_url,
    "s3_endpoint_url": _url("http", "https"),
    "stream": _nonempty,
    "group": _nonempty,
    "consumer": _nonempty,
    "dead_letter_stream": _nonempty,
    "dead_letter_maxlen": _positive(int),
    "concurrency": _positive(int),
    "shutdown_grace_s": _positive(float),
    "renditions": parse_renditions,
    "max_attempts": _positive(int),
    "retry_base_ms": _positive(int),
    "claim_idle_ms": _positive(int),
    "sweep_after_s": _positive(float),
    "job_timeout_s": _positive(float),
    "render_memory_mb": _positive(int),
    "max_pixels": _positive(int),
    "max_original_bytes": _positive(int),
    "read_block_ms": _positive(int),
    "metrics_port": _port,
    "log_format": _choice("json", "console"),
    "log_level": _choice("debug", "info", "warning", "error"),
    "renders_per_process": _positive(int),
    "render_max_rss_mb": _positive(int),
}


def env_name(field: str) -> str:
    return f"DARKROOM_{field.upper()}"


def from_env(environ: Mapping[str, str] | None = None) -> Settings:
    """Build Settings from DARKROOM_* variables; unknown DARKROOM_* names are errors too."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for field, parse in PARSERS.items():
        raw = environ.get(env_name(field))
        if raw is None or raw == "":
            continue
        try:
            values[field] = parse(raw)
        except ValueError as exc:
            raise SettingsError(env_name(field), f"{exc} (got {raw!r})") from None
    known = {env_name(f) for f in PARSERS}
    for name in environ:
        if name.startswith("DARKROOM_") and name not in known:
            raise SettingsError(name, "unknown setting (see README.md, Settings)")
    settings = Settings(**values)
    if settings.read_block_ms > 5000:
        raise SettingsError("DARKROOM_READ_BLOCK_MS", "must be at most 5000")
    if settings.dead_letter_stream == settings.stream:
        raise SettingsError("DARKROOM_DEAD_LETTER_STREAM", "must differ from DARKROOM_STREAM")
    if hash_tag(settings.stream) != hash_tag(settings.dead_letter_stream):
        raise SettingsError(
            "DARKROOM_DEAD_LETTER_STREAM",
            "must share DARKROOM_STREAM's {hash tag} (one MULTI moves entries between them)",
        )
    return settings


def hash_tag(key: str) -> str:
    """The part of a key Redis Cluster hashes: the first {...}, else the whole key."""
    start = key.find("{")
    end = key.find("}", start + 1)
    return key[start + 1 : end] if start >= 0 and end > start + 1 else key
