"""from_env: the only reader of the environment. Each DARKROOM_* variable is parsed by its
entry in PARSERS (with its floor from MINIMUMS), then the settings are checked against one
another; a bad value raises SettingsError naming the variable, which the CLI turns into a
message and exit code 2.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from darkroom.config import convert
from darkroom.config.redis_url import parse_redis_url
from darkroom.errors import SettingsError
from darkroom.settings import Settings, parse_renditions, redact

T = TypeVar("T")

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
    "render_budget_mb": 0,  # 0: RENDER_BUDGET_PER_SLOT_MB per regular slot
    "history_keep_days": 1.0,  # retention deletes whole days, oldest first
    "events_maxlen": 100,  # Redis trims whole stream nodes of 100 entries
    "events_keep_days": 0.01,  # about 15 minutes: a consumer away longer replays nothing
    "interactive_slots": 0,  # 0: no reserved slot (interactive then waits behind bulk)
    "bulk_floor": 0.0,  # a share, at most 1 (from_env)
    "bulk_ahead": 0,  # 0: sized from the live workers' places
    "tenant_max_in_flight": 0,
    "tenant_rate": 0.0,  # 0: unlimited
    "tenant_burst": 0,  # 0: one second's worth of the rate
}


# A longer lease would leave a frozen holder's duty (bulk feeding, events) stalled longer.
MAX_DUTY_LEASE_S = 60.0


def _bounded(field: str, kind: Callable[[str], T]) -> Callable[[str], T]:
    return convert.at_least(kind, MINIMUMS[field])


PARSERS: dict[str, Callable[[str], Any]] = {
    "redis_url": lambda raw: parse_redis_url(raw).url,  # validated here, opened by streams
    "database_url": convert.url("postgres", "postgresql"),
    "storage_url": convert.storage_url,
    "s3_endpoint_url": convert.url("http", "https"),
    "stream": convert.nonempty,
    "group": convert.nonempty,
    "consumer": convert.nonempty,
    "dead_letter_stream": convert.nonempty,
    "bulk_stream": convert.nonempty,
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
    "metrics_port": convert.port,
    "log_format": convert.choice("json", "console"),
    "log_level": convert.choice("debug", "info", "warning", "error"),
    "max_in_flight": _bounded("max_in_flight", int),
    "keep_location": convert.boolean,
    "web_host": convert.nonempty,
    "web_port": convert.tcp_port,
    "web_token": convert.token,
    "trace_url": convert.trace_url,
    "operator": convert.operator_name,
    "renders_per_process": _bounded("renders_per_process", int),
    "render_max_rss_mb": _bounded("render_max_rss_mb", int),
    "render_keep_mb": _bounded("render_keep_mb", int),
    "render_budget_mb": _bounded("render_budget_mb", int),
    "cache_control": convert.header_value,
    "storage_probe_key": convert.probe_key,
    "web_downloads": _bounded("web_downloads", int),
    "web_snapshot_s": _bounded("web_snapshot_s", float),
    "history": convert.boolean,
    "history_keep_days": _bounded("history_keep_days", float),
    "events_stream": convert.nonempty,
    "events_maxlen": _bounded("events_maxlen", int),
    "events_keep_days": _bounded("events_keep_days", float),
    "events_source": convert.nonempty,
    "interactive_slots": _bounded("interactive_slots", int),
    "bulk_floor": _bounded("bulk_floor", float),
    "pg_intake": convert.boolean,
    "bulk_ahead": _bounded("bulk_ahead", int),
    "tenant_weights": convert.parse_weights,
    "tenant_max_in_flight": _bounded("tenant_max_in_flight", int),
    "tenant_rate": convert.rate_per_s,
    "tenant_burst": _bounded("tenant_burst", int),
}


# Never echoed back in an error message.
SECRETS = frozenset({"web_token"})


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


def _check_socket_timeout(settings: Settings) -> None:
    """A blocking XREADGROUP must return before the socket timeout cuts it off."""
    timeout_s = parse_redis_url(settings.redis_url).options.get("socket_timeout")
    if timeout_s is not None and timeout_s * 1000 < settings.read_block_ms + 1000:
        raise SettingsError(
            "DARKROOM_REDIS_URL",
            f"socket_timeout={timeout_s} must exceed DARKROOM_READ_BLOCK_MS by at least 1 s",
        )
