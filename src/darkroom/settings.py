"""Every DARKROOM_* setting, validated once at start-up into one frozen Struct.

`from_env` is the only reader of the environment; a bad value raises SettingsError
naming the variable, which the CLI turns into a message and exit code 2. `redact` masks
the passwords these values may carry, wherever a value or a message is shown.
"""

from __future__ import annotations

import math
import os
import re
import socket
import uuid
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar
from urllib.parse import parse_qsl, unquote, urlsplit

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


DEFAULT_PROBE_KEY = "renditions/.darkroom-probe"


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
    duty_lease_s: float = 10.0
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
    renders_per_process: int = 500
    render_max_rss_mb: int = 256
    # A render process at most this resident after a photo keeps what it freed, for the next
    # photo; above it, and after 0.5 s without a photo, it returns all freed memory to the
    # system. 0: after every photo. Capped at render_max_rss_mb.
    render_keep_mb: int = 128
    # Sent with every rendition upload: a rendition's key names its content, so it never
    # changes under its URL (see store/keys.py).
    cache_control: str = "public, max-age=31536000, immutable"
    # Inside a prefix the worker writes anyway, so a least-privilege policy allows it.
    storage_probe_key: str = DEFAULT_PROBE_KEY
    # The operator's page: large downloads streamed at once, and the age of its counts.
    web_downloads: int = 4
    web_snapshot_s: float = 2.0
    # -- issue 14: attempt history (docs/history.md)
    history: bool = True
    history_keep_days: float = 30.0
    # Photo events (issue 14, docs/events.md): the capped stream the relay XADDs to, how
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
    # ---- issue 13/14.5: the feeder (bulk fairness, PostgreSQL intake) ----
    # Enqueue `interactive` rows nobody XADDed (PostgreSQL-only producers); bulk feeding
    # runs whatever this says (the feeder is the only way into the bulk stream).
    pg_intake: bool = True
    # Bulk entries waiting undelivered in the bulk stream at most: the fair order is
    # decided this late, so a new tenant starts within one round.
    bulk_ahead: int = 8
    tenant_weights: tuple[tuple[str, int], ...] = ()
    tenant_max_in_flight: int = 0  # 0: no cap

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
    def interactive_places(self) -> int:
        """In-flight places reserved for interactive: two per reserved render slot, as the
        regular places are two per slot by default (one renders, one downloads)."""
        return 2 * self.interactive_slots


T = TypeVar("T")


def _at_least(kind: Callable[[str], T], minimum: float) -> Callable[[str], T]:
    def convert(raw: str) -> T:
        value = kind(raw)
        if not math.isfinite(value) or value < minimum:  # type: ignore[arg-type,operator]
            raise ValueError(f"must be a finite number of at least {minimum:g}")
        return value

    return convert


# The floor of every duration and count: below it a loop spins (a heartbeat every
# CLAIM_IDLE_MS/3), a retry hammers, or the setting cannot work at all.
MINIMUMS: dict[str, float] = {
    "dead_letter_maxlen": 100,  # Redis trims whole stream nodes of 100 entries
    "concurrency": 1,
    "shutdown_grace_s": 0.1,
    "max_attempts": 1,
    "retry_base_ms": 100,
    "claim_idle_ms": 1000,  # the heartbeat beats every CLAIM_IDLE_MS/3
    "sweep_after_s": 1.0,  # younger photos may be between their commit and XADD
    "duty_lease_s": 1.0,  # renewed every lease/3
    "job_timeout_s": 0.1,
    "render_memory_mb": 200,  # its own libraries (libvips, numpy) map ~190 MB before a photo
    "max_pixels": 1,
    "max_original_bytes": 1,
    "read_block_ms": 10,
    "max_in_flight": 1,
    "renders_per_process": 1,
    "transient_budget_s": 1.0,
    "web_downloads": 1,
    "web_snapshot_s": 0.5,  # no setting turns the shared snapshot into a count per request
    "render_max_rss_mb": 64,  # a warm process is about 40 MB: each would be replaced
    "render_keep_mb": 0,  # 0: freed memory goes back after every photo
    "history_keep_days": 1.0,  # retention deletes whole days, oldest first
    "events_maxlen": 100,  # Redis trims whole stream nodes of 100 entries
    "events_keep_days": 0.01,  # about 15 minutes: a consumer away longer replays nothing
    "interactive_slots": 0,  # 0: no reserved slot (interactive then waits behind bulk)
    "bulk_floor": 0.0,  # a share, at most 1 (from_env)
    "bulk_ahead": 1,
    "tenant_max_in_flight": 0,
}


# A longer lease would leave a frozen holder's duty (bulk feeding, events) stalled longer.
MAX_DUTY_LEASE_S = 60.0


def _bounded(field: str, kind: Callable[[str], T]) -> Callable[[str], T]:
    return _at_least(kind, MINIMUMS[field])


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


def _tcp_port(raw: str) -> int:
    value = int(raw)
    if not 1 <= value <= 65535:
        raise ValueError("must be a TCP port (1..65535)")
    return value


def _token(raw: str) -> str:
    # Guessable tokens defeat the point; 16 characters is the floor (32 random bytes is better).
    if len(raw.strip()) < 16 or raw != raw.strip():
        raise ValueError("must be at least 16 characters, without surrounding spaces")
    return raw


def _probe_key(raw: str) -> str:
    """A key relative to the storage root: a folder or a prefix the worker writes."""
    if raw != raw.strip() or raw.startswith("/") or ".." in raw.split("/") or raw.endswith("/"):
        raise ValueError("must be a relative key such as renditions/.darkroom-probe")
    return raw


def _nonempty(raw: str) -> str:
    if not raw.strip():
        raise ValueError("must not be empty")
    return raw


def _header_value(raw: str) -> str:
    # Visible ASCII and spaces only: a CR or LF would let a value forge another header.
    if not raw.strip() or len(raw) > 512 or not all(" " <= c <= "~" for c in raw):
        raise ValueError("must be 1 to 512 printable ASCII characters (an HTTP header value)")
    return raw.strip()


def _boolean(raw: str) -> bool:
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


PARSERS: dict[str, Callable[[str], Any]] = {
    "redis_url": lambda raw: parse_redis_url(raw).url,  # validated here, opened by streams
    "database_url": _url("postgres", "postgresql"),
    "storage_url": _storage_url,
    "s3_endpoint_url": _url("http", "https"),
    "stream": _nonempty,
    "group": _nonempty,
    "consumer": _nonempty,
    "dead_letter_stream": _nonempty,
    "bulk_stream": _nonempty,
    "dead_letter_maxlen": _bounded("dead_letter_maxlen", int),
    "concurrency": _bounded("concurrency", int),
    "shutdown_grace_s": _bounded("shutdown_grace_s", float),
    "renditions": parse_renditions,
    "max_attempts": _bounded("max_attempts", int),
    "retry_base_ms": _bounded("retry_base_ms", int),
    "claim_idle_ms": _bounded("claim_idle_ms", int),
    "transient_budget_s": _bounded("transient_budget_s", float),
    "sweep_after_s": _bounded("sweep_after_s", float),
    "duty_lease_s": _bounded("duty_lease_s", float),
    "job_timeout_s": _bounded("job_timeout_s", float),
    "render_memory_mb": _bounded("render_memory_mb", int),
    "max_pixels": _bounded("max_pixels", int),
    "max_original_bytes": _bounded("max_original_bytes", int),
    "read_block_ms": _bounded("read_block_ms", int),
    "metrics_port": _port,
    "log_format": _choice("json", "console"),
    "log_level": _choice("debug", "info", "warning", "error"),
    "max_in_flight": _bounded("max_in_flight", int),
    "keep_location": _boolean,
    "web_host": _nonempty,
    "web_port": _tcp_port,
    "web_token": _token,
    "renders_per_process": _bounded("renders_per_process", int),
    "render_max_rss_mb": _bounded("render_max_rss_mb", int),
    "render_keep_mb": _bounded("render_keep_mb", int),
    "cache_control": _header_value,
    "storage_probe_key": _probe_key,
    "web_downloads": _bounded("web_downloads", int),
    "web_snapshot_s": _bounded("web_snapshot_s", float),
    "history": _boolean,
    "history_keep_days": _bounded("history_keep_days", float),
    "events_stream": _nonempty,
    "events_maxlen": _bounded("events_maxlen", int),
    "events_keep_days": _bounded("events_keep_days", float),
    "events_source": _nonempty,
    "interactive_slots": _bounded("interactive_slots", int),
    "bulk_floor": _bounded("bulk_floor", float),
    "pg_intake": _boolean,
    "bulk_ahead": _bounded("bulk_ahead", int),
    "tenant_weights": parse_weights,
    "tenant_max_in_flight": _bounded("tenant_max_in_flight", int),
}


# Never echoed back in an error message.
SECRETS = frozenset({"web_token"})

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
            shown = "a hidden value" if field in SECRETS else repr(raw)
            raise SettingsError(env_name(field), redact(f"{exc} (got {shown})")) from None
    known = {env_name(f) for f in PARSERS}
    for name in environ:
        if name.startswith("DARKROOM_") and name not in known:
            raise SettingsError(name, "unknown setting (see README.md, Settings)")
    settings = Settings(**values)
    if settings.read_block_ms > 5000:
        raise SettingsError("DARKROOM_READ_BLOCK_MS", "must be at most 5000")
    if settings.duty_lease_s > MAX_DUTY_LEASE_S:
        raise SettingsError("DARKROOM_DUTY_LEASE_S", f"must be at most {MAX_DUTY_LEASE_S:g}")
    if settings.max_in_flight and settings.max_in_flight < settings.concurrency:
        raise SettingsError("DARKROOM_MAX_IN_FLIGHT", "must be at least DARKROOM_CONCURRENCY")
    _check_socket_timeout(settings)
    if settings.dead_letter_stream == settings.stream:
        raise SettingsError("DARKROOM_DEAD_LETTER_STREAM", "must differ from DARKROOM_STREAM")
    if hash_tag(settings.stream) != hash_tag(settings.dead_letter_stream):
        raise SettingsError(
            "DARKROOM_DEAD_LETTER_STREAM",
            "must share DARKROOM_STREAM's {hash tag} (one script moves entries between them,"
            " and on a Redis Cluster its keys must be in one slot)",
        )
    _check_bulk_stream(settings)
    if settings.events_stream in (settings.stream, settings.bulk_stream_key,
                                  settings.dead_letter_stream):  # fmt: skip
        raise SettingsError("DARKROOM_EVENTS_STREAM", "must differ from the work and dead streams")
    if settings.bulk_floor > 1:
        raise SettingsError("DARKROOM_BULK_FLOOR", "must be a share of at most 1")
    return settings


def _check_bulk_stream(settings: Settings) -> None:
    bulk = settings.bulk_stream_key
    if bulk in (settings.stream, settings.dead_letter_stream):
        raise SettingsError("DARKROOM_BULK_STREAM", "must differ from the other streams")
    if hash_tag(bulk) != hash_tag(settings.stream):
        raise SettingsError(
            "DARKROOM_BULK_STREAM",
            "must share DARKROOM_STREAM's {hash tag} (on a Redis Cluster every key of the"
            " queue must be in one slot)",
        )


def hash_tag(key: str) -> str:
    """The part of a key Redis Cluster hashes: the first {...}, else the whole key."""
    start = key.find("{")
    end = key.find("}", start + 1)
    return key[start + 1 : end] if start >= 0 and end > start + 1 else key


# -- DARKROOM_REDIS_URL: one node, a Sentinel service or a Cluster -------------------------

Topology = Literal["single", "sentinel", "cluster"]
SCHEMES: dict[str, tuple[Topology, bool]] = {
    "redis": ("single", False),
    "rediss": ("single", True),
    "unix": ("single", False),
    "redis+sentinel": ("sentinel", False),
    "rediss+sentinel": ("sentinel", True),
    "redis+cluster": ("cluster", False),
    "rediss+cluster": ("cluster", True),
}


def _flag(raw: str) -> bool:
    if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
        raise ValueError("must be true or false")
    return raw.lower() in ("1", "true", "yes")


# The floor of the URL's durations (seconds) and counts; socket_timeout must also exceed
# DARKROOM_READ_BLOCK_MS by 1 s (_check_socket_timeout).
REDIS_MINIMUMS: dict[str, float] = {
    "socket_timeout": 1.0,
    "socket_connect_timeout": 0.1,
    "health_check_interval": 1.0,
    "max_connections": 1,
}
# Connection options accepted in the URL's query string (redis-py keyword arguments).
REDIS_OPTIONS: dict[str, Callable[[str], Any]] = {
    "socket_timeout": _at_least(float, REDIS_MINIMUMS["socket_timeout"]),
    "socket_connect_timeout": _at_least(float, REDIS_MINIMUMS["socket_connect_timeout"]),
    "health_check_interval": _at_least(float, REDIS_MINIMUMS["health_check_interval"]),
    "max_connections": _at_least(int, REDIS_MINIMUMS["max_connections"]),
    "client_name": _nonempty,
    "ssl_ca_certs": _nonempty,
    "ssl_certfile": _nonempty,
    "ssl_keyfile": _nonempty,
    "ssl_cert_reqs": _choice("required", "optional", "none"),
    "ssl_check_hostname": _flag,
}
SENTINEL_OPTIONS: dict[str, Callable[[str], Any]] = {
    "sentinel_username": _nonempty,
    "sentinel_password": _nonempty,
}


class RedisTarget(msgspec.Struct, frozen=True, kw_only=True):
    """Where the streams live. `nodes` are the server (single), the sentinels, or the
    cluster's seed nodes; `options` are redis-py connection keyword arguments."""

    url: str
    topology: Topology
    tls: bool = False
    nodes: tuple[tuple[str, int], ...] = ()
    unix_path: str | None = None
    service: str | None = None
    db: int = 0
    username: str | None = None
    password: str | None = None
    options: dict[str, Any] = msgspec.field(default_factory=dict)


def parse_redis_url(raw: str) -> RedisTarget:
    """`redis[s]://[user:pass@]host[:port][/db]`, `unix:///path.sock[?db=N]`,
    `redis[s]+sentinel://[user:pass@]host:port[,host:port...]/service[/db]` and
    `redis[s]+cluster://[user:pass@]host:port[,host:port...]`, each with an optional
    `?option=value&...` from REDIS_OPTIONS. Raises ValueError with the reason."""
    parts = urlsplit(raw)
    if parts.scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {', '.join(f'{s}://' for s in SCHEMES)}")
    topology, tls = SCHEMES[parts.scheme]
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    target = RedisTarget(
        url=raw,
        topology=topology,
        tls=tls,
        username=unquote(username) or None,
        password=unquote(password) or None,
        options=_redis_options(parts.query, topology, tls),
    )
    if parts.scheme == "unix":
        return _unix_target(target, parts.path)
    return _located(target, _redis_nodes(hosts, topology), parts.path)


def _redis_options(query: str, topology: Topology, tls: bool) -> dict[str, Any]:
    allowed = {**REDIS_OPTIONS, **(SENTINEL_OPTIONS if topology == "sentinel" else {})}
    if topology != "cluster":
        allowed["db"] = _db
    options: dict[str, Any] = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name not in allowed:
            raise ValueError(f"unknown option {name!r} (known: {', '.join(sorted(allowed))})")
        if name.startswith("ssl_") and not tls:
            raise ValueError(f"option {name} needs TLS (rediss://, rediss+sentinel://, ...)")
        try:
            options[name] = allowed[name](value)
        except ValueError as exc:
            raise ValueError(f"option {name}: {exc}") from None
    return options


def _db(raw: str) -> int:
    value = int(raw)
    if not 0 <= value <= 10_000:
        raise ValueError("database number must be 0 or more")
    return value


def _redis_nodes(hosts: str, topology: Topology) -> tuple[tuple[str, int], ...]:
    """`host[:port]`, or for sentinel and cluster a comma-separated list (IPv6 in [])."""
    default_port = 26379 if topology == "sentinel" else 6379
    nodes: list[tuple[str, int]] = []
    for item in hosts.split(","):
        parsed = urlsplit(f"//{item}")
        if not parsed.hostname:
            raise ValueError(f"{item!r} is not host[:port]")
        nodes.append((parsed.hostname, parsed.port or default_port))
    if topology == "single" and len(nodes) > 1:
        raise ValueError("several hosts need redis+sentinel:// or redis+cluster://")
    return tuple(nodes)


def _located(target: RedisTarget, nodes: tuple[tuple[str, int], ...], path: str) -> RedisTarget:
    """Apply the URL path: `/db` (single), `/service[/db]` (sentinel), nothing (cluster)."""
    segments = [unquote(s) for s in path.split("/") if s]
    service = segments.pop(0) if target.topology == "sentinel" and segments else None
    if target.topology == "sentinel" and not service:
        raise ValueError("redis+sentinel:// needs the service name: host:port,.../SERVICE[/db]")
    if len(segments) > 1 or (segments and target.topology == "cluster"):
        raise ValueError(f"unexpected path {path!r} (a cluster has only database 0)")
    db = _db(segments[0]) if segments else 0
    db = target.options.pop("db", db)
    return msgspec.structs.replace(target, nodes=nodes, service=service, db=db)


def _unix_target(target: RedisTarget, path: str) -> RedisTarget:
    if not path:
        raise ValueError("unix:// needs a socket path: unix:///run/redis.sock")
    db = target.options.pop("db", 0)
    return msgspec.structs.replace(target, unix_path=unquote(path), db=db)


def _check_socket_timeout(settings: Settings) -> None:
    """A blocking XREADGROUP must return before the socket timeout cuts it off."""
    timeout_s = parse_redis_url(settings.redis_url).options.get("socket_timeout")
    if timeout_s is not None and timeout_s * 1000 < settings.read_block_ms + 1000:
        raise SettingsError(
            "DARKROOM_REDIS_URL",
            f"socket_timeout={timeout_s} must exceed DARKROOM_READ_BLOCK_MS by at least 1 s",
        )
