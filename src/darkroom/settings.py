"""Every DARKROOM_* setting with its default, in one frozen Struct, and the renditions it names.

darkroom.config reads and validates the environment into it (from_env); this module stays
pure so every layer may import it. `redact` masks the passwords these values may carry,
wherever a value or a message is shown.
"""

from __future__ import annotations

import os
import re
import socket
import uuid
from typing import Literal

import msgspec

Format = Literal["webp", "jpeg", "avif", "png"]
EXTENSIONS: dict[str, str] = {"webp": "webp", "jpeg": "jpg", "avif": "avif", "png": "png"}
# AVIF 67 (effort 4): the JPEG fallback's mean SSIMULACRA2 at about 32 % fewer bytes
# (bench/avif.py; docs/photos.md "Modern formats with a fallback").
DEFAULT_QUALITY: dict[str, int] = {"webp": 80, "jpeg": 82, "avif": 67, "png": 100}
# q=auto's floor per format: a photo whose predicted score at DEFAULT_QUALITY sits above it
# may drop in proportion, one at or below it keeps DEFAULT_QUALITY (image/quality.py
# `relative`; calibrated by bench/quality.py, docs/photos.md "A quality target per rendition").
AUTO_TARGET: dict[str, float] = {"webp": 60.0, "jpeg": 60.0, "avif": 60.0}
SCORES = (30, 95)  # the score=N a target may ask for: below, artefacts; above, near-lossless
# Formats whose encode would move an interactive photo's first publish (bench/avif.py: AVIF
# at 1024 and 2048 px costs more CPU than the rest of the default list's render together):
# deferred unless marked `:inline`.
HEAVY: frozenset[str] = frozenset({"avif"})
_FLAGS = ("defer", "inline")


Crop = Literal["attention", "centre"]


class RenditionSpec(msgspec.Struct, frozen=True):
    """One output: `size` is the long edge in pixels (never upscaled). With a `box`
    (width, height), the rendition fits inside the box, or with `crop` fills it exactly
    (`size` is then the box's long edge)."""

    name: str
    size: int
    format: Format
    quality: int
    box: tuple[int, int] | None = None
    crop: Crop | None = None
    # An SSIMULACRA2 score to reach: the quality is then chosen per photo (image/quality.py)
    target: float | None = None
    # q=auto: `target` is a floor, and the quality drops from `quality` relative to the
    # photo's own score at it (image/quality.py `relative`); score=N bisects to `target`.
    auto: bool = False
    # Rendered after an interactive photo's first publish, in the bulk lane, as an upgrade
    # (`:defer`, or a HEAVY format without `:inline`): upgrades.py, docs/photos.md.
    deferred: bool = False

    @property
    def ext(self) -> str:
        return EXTENSIONS[self.format]


DEFAULT_RENDITIONS = "thumb:320:webp:80,medium:1024:webp:80,medium:1024:jpeg:82,large:2048:webp:80"
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")
_SIZE = re.compile(r"^(\d{1,5})(?:x(\d{1,5}))?$")
_CROPS: dict[str, Crop] = {"attention": "attention", "centre": "centre", "center": "centre"}


def parse_renditions(text: str) -> tuple[RenditionSpec, ...]:
    """Parse `name:SIZE:format[:OPTION]...,...` (SIZE: a long edge `2048` or a box
    `256x256`; OPTION: `q=N` or a bare N, `q=auto`, `score=N`, `crop=attention|centre`,
    `defer` or `inline`); raises ValueError."""
    specs = tuple(_spec(part.strip()) for part in text.split(","))
    if len({(s.name, s.format) for s in specs}) != len(specs):
        raise ValueError("two renditions share a name and format")
    return specs


def split(specs: tuple[RenditionSpec, ...]) -> tuple[list[RenditionSpec], list[RenditionSpec]]:
    """The renditions a first publish carries, and those its upgrade adds; all at once when
    every one is deferred (a photo publishes with something)."""
    fast = [s for s in specs if not s.deferred]
    return (fast, [s for s in specs if s.deferred]) if fast else (list(specs), [])


def _spec(item: str) -> RenditionSpec:
    fields = item.split(":")
    flags = {f.strip().lower() for f in fields[3:]} & set(_FLAGS)
    # only among the options: a rendition may be named `inline` or `defer`
    fields = fields[:3] + [f for f in fields[3:] if f.strip().lower() not in _FLAGS]
    if len(flags) > 1:
        raise ValueError(f"{item!r}: defer and inline both set")
    if len(fields) < 3 or not _NAME.match(fields[0]):
        raise ValueError(f"{item!r} is not name:SIZE:format[:OPTION]...")
    size = _SIZE.match(fields[1])
    fmt = fields[2].lower().replace("jpg", "jpeg")
    if size is None:
        raise ValueError(f"{item!r}: SIZE must be a long edge (2048) or a box (256x256)")
    if fmt not in EXTENSIONS:
        raise ValueError(f"{item!r}: format must be one of webp, jpeg, avif, png")
    options = _options(item, fields[3:])
    target = _target(item, fmt, options)
    quality = DEFAULT_QUALITY[fmt] if target else int(options.get("q", DEFAULT_QUALITY[fmt]))
    box = (int(size[1]), int(size[2])) if size[2] else None
    edges = box or (int(size[1]),)
    if not all(16 <= edge <= 8192 for edge in edges) or not 1 <= quality <= 100:
        raise ValueError(f"{item!r}: sizes must be 16..8192 and quality 1..100")
    if "crop" in options and box is None:
        raise ValueError(f"{item!r}: crop needs a box (WIDTHxHEIGHT)")
    crop = _CROPS[options["crop"]] if "crop" in options else None
    deferred = "defer" in flags or (fmt in HEAVY and "inline" not in flags)
    auto = options.get("q") == "auto"
    return RenditionSpec(fields[0], max(edges), fmt, quality, box, crop, target, auto, deferred)  # type: ignore[arg-type]


def _target(item: str, fmt: str, options: dict[str, str]) -> float | None:
    """The score q=auto or score=N asks for; None at a fixed quality."""
    if "score" in options and "q" in options:
        raise ValueError(f"{item!r}: q and score both set the quality")
    if options.get("q") != "auto" and "score" not in options:
        return None
    if fmt not in AUTO_TARGET:
        raise ValueError(f"{item!r}: {fmt} is lossless, it has no quality to choose")
    if options.get("q") == "auto":
        return AUTO_TARGET[fmt]
    if not options["score"].isdigit() or not SCORES[0] <= int(options["score"]) <= SCORES[1]:
        raise ValueError(f"{item!r}: score must be {SCORES[0]}..{SCORES[1]}")
    return float(options["score"])


def _options(item: str, fields: list[str]) -> dict[str, str]:
    """`q`, `score` and `crop` by name, each at most once; a bare number is the quality."""
    options: dict[str, str] = {}
    for option in (f.strip().lower() for f in fields):
        key, _, value = option.rpartition("=") if "=" in option else ("q", "", option)
        if (key == "q" and not (value.isdigit() or value == "auto")) or (
            key == "crop" and value not in _CROPS
        ):
            raise ValueError(
                f"{item!r}: {option!r} is not q=1..100, q=auto, score=N or crop=attention|centre"
            )
        if key not in ("q", "crop", "score") or key in options:
            raise ValueError(f"{item!r}: unknown or repeated option {option!r}")
        options[key] = value
    return options


DEFAULT_PROBE_KEY = "renditions/.darkroom-probe"
# The render budget per regular slot when DARKROOM_RENDER_BUDGET_MB is 0: two 12 MP photos of
# any format but AVIF fit beside each other (JPEG ~38 MB, HEIC ~81, PNG ~72), a 12 MP AVIF
# (~210 MB) renders alone; measured to hold a worker at concurrency 2 under 400 MB PSS
# (docs/performance.md, "A memory budget across render slots").
RENDER_BUDGET_PER_SLOT_MB = 100


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
    # The bulk lane's work stream; empty means DARKROOM_STREAM + ":bulk" (same hash tag).
    bulk_stream: str = ""
    dead_letter_maxlen: int = 100_000
    concurrency: int = msgspec.field(default_factory=lambda: os.cpu_count() or 1)
    shutdown_grace_s: float = 30.0
    renditions: tuple[RenditionSpec, ...] = parse_renditions(DEFAULT_RENDITIONS)
    max_attempts: int = 5
    retry_base_ms: int = 1000
    claim_idle_ms: int = 30_000
    # How long a photo may keep meeting transient errors of a dependency that answers its
    # probe (throttling, 5xx, dropped connections) before it fails with that dependency's code.
    transient_budget_s: float = 3600.0
    sweep_after_s: float = 300.0
    # The lease of a single runner (feeder, relay, sweep, history prune: duty.py): a holder
    # that stops renewing loses its duty to another worker within this plus one retry (2 s).
    duty_lease_s: float = 8.0  # taken over within lease + 2 s: 10 s
    job_timeout_s: float = 120.0
    render_memory_mb: int = 2048
    max_pixels: int = 100_000_000
    max_original_bytes: int = 200 * 1024 * 1024
    read_block_ms: int = 2000
    metrics_port: int = 0
    log_format: Literal["json", "console"] = "json"
    log_level: str = "info"
    # Entries held at once (downloading, waiting for a render slot, uploading); 0 means
    # 2 × concurrency. Render slots stay `concurrency`: the extra entries keep them fed.
    max_in_flight: int = 0
    keep_location: bool = False
    web_host: str = "127.0.0.1"
    web_port: int = 8080
    web_token: str | None = None
    # The trace viewer's URL of one trace, `{trace_id}` in it (docs/tracing.md): the photo
    # page links a traced photo to its trace. None: no link, the trace id shown as text.
    trace_url: str | None = None
    # Who the command line's operator actions are recorded as (the audit trail); empty: the
    # login user.
    operator: str = ""
    renders_per_process: int = 500
    render_max_rss_mb: int = 256
    # A render process at most this resident after a photo keeps what it freed, for the next
    # photo; above it, and after 0.5 s without a photo, it returns all freed memory to the
    # system. 0: after every photo. Capped at render_max_rss_mb.
    render_keep_mb: int = 128
    # Estimated decode memory the render slots share (image/budget.py): a render waits until
    # its photo's estimate fits beside the running ones; a photo larger than all of it
    # renders alone, a tiny one outside it. 0: RENDER_BUDGET_PER_SLOT_MB × concurrency.
    render_budget_mb: int = 0
    # Sent with every rendition upload: a rendition's key names its content, so it never
    # changes under its URL (see store/keys.py).
    cache_control: str = "public, max-age=31536000, immutable"
    # Inside a prefix the worker writes anyway, so a least-privilege policy allows it.
    storage_probe_key: str = DEFAULT_PROBE_KEY
    # The operator's page: large downloads streamed at once, and the age of its counts.
    web_downloads: int = 4
    web_snapshot_s: float = 2.0
    # Attempt history (docs/history.md): record every delivery in photo_attempts, and
    # delete rows older than this many days.
    history: bool = True
    history_keep_days: float = 30.0
    # Photo events (docs/events.md): the capped stream the relay XADDs to, how
    # long PostgreSQL keeps them for `darkroom events`, and their CloudEvents `source`
    # (empty: darkroom://GROUP).
    events_stream: str = "{darkroom}:events"
    events_maxlen: int = 100_000
    events_keep_days: float = 7.0
    events_source: str = ""
    # Lanes (docs/lanes.md): render slots only interactive work may use, on top of
    # `concurrency`; and the share of the regular in-flight places bulk keeps while
    # interactive load is sustained.
    interactive_slots: int = 1
    bulk_floor: float = 0.25
    # The feeder (docs/fairness.md): one worker at a time feeds the bulk lane fairly by
    # tenant and enqueues the rows of PostgreSQL-only producers.
    # Enqueue `interactive` rows nobody XADDed (PostgreSQL-only producers); bulk feeding
    # runs whatever this says (the feeder is the only way into the bulk stream).
    pg_intake: bool = True
    # The reserve of bulk entries waiting undelivered in the bulk stream, topped up as
    # workers take them: 0 sizes it from the live workers (their regular in-flight places,
    # so every place that frees finds an entry); the fair order is decided this late.
    bulk_ahead: int = 0
    tenant_weights: tuple[tuple[str, int], ...] = ()
    tenant_max_in_flight: int = 0  # 0: no cap
    # Every tenant's bulk rate (photos per second, 0: unlimited) and burst (photos at once
    # after an idle spell, 0: one second's worth) unless `darkroom limits set` names its own.
    tenant_rate: float = 0.0
    tenant_burst: int = 0

    @property
    def bulk_stream_key(self) -> str:
        return self.bulk_stream or f"{self.stream}:bulk"

    @property
    def events_source_uri(self) -> str:
        return self.events_source or f"darkroom://{self.group}"

    @property
    def in_flight_bound(self) -> int:
        return self.max_in_flight or 2 * self.concurrency

    @property
    def render_budget_total_mb(self) -> int:
        return self.render_budget_mb or RENDER_BUDGET_PER_SLOT_MB * self.concurrency

    @property
    def interactive_places(self) -> int:
        """In-flight places reserved for interactive: two per reserved render slot, as the
        regular places are two per slot by default (one renders, one downloads)."""
        return 2 * self.interactive_slots


# A URL's userinfo password (scheme://user:PASSWORD@host, up to the netloc's last @) and
# every `password=` option (password, sentinel_password...), in a URL or in any text.
_USERINFO_PASSWORD = re.compile(r"(://[^:/?#@\s]*:)[^/?#\s]*(?=@)")
_PASSWORD_OPTION = re.compile(r"(password=)[^&#\s'\"]*", re.IGNORECASE)
MASK = "***"


def redact(text: str) -> str:
    """`text` (a URL, or a message quoting one) with every password in it masked."""
    if "@" not in text and "=" not in text:
        return text  # neither pattern can match (every log line's every text comes here)
    return _PASSWORD_OPTION.sub(rf"\g<1>{MASK}", _USERINFO_PASSWORD.sub(rf"\g<1>{MASK}", text))


def servers(settings: Settings) -> dict[str, str]:
    """Where this process works, safe to print: Redis, PostgreSQL and storage."""
    return {
        "redis": redact(settings.redis_url),
        "database": redact(settings.database_url),
        "storage": redact(settings.storage_url),
    }
