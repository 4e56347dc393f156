"""The OTLP/HTTP span exporter: the SDK's, configured by the same OTEL_* variables, sending
spans it writes straight in the protobuf wire format (docs/tracing.md, "Cost when on"), and
the export timeout darkroom gives it. The SDK's encoder builds a protobuf message object for
every span, attribute, value and status before serializing them (about 11 µs a span, on the
export thread, for 15 spans a tiny photo); this writes the same bytes (tests/test_otlpwire.py
compares them) in a little over half that.

What the SDK's encoder does, this does: spans grouped by resource, then by instrumentation
scope; the span flags' is-remote bits; a value of a type OTLP has no field for is logged and
its attribute left out; a batch this cannot encode goes to the SDK's own `export`. No
OpenTelemetry module is imported until `request` or `exporter` is called.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

log = logging.getLogger("darkroom.tracing")

_FIXED64 = struct.Struct("<Q").pack
_DOUBLE = struct.Struct("<d").pack
_FIXED32 = struct.Struct("<I").pack
_INT64_MIN, _INT64_END = -(2**63), 2**63
# opentelemetry.trace.SpanKind (INTERNAL = 0 ...) as OTLP's SpanKind field (INTERNAL = 1 ...)
_KINDS: dict[Any, bytes] = {}
# SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK, and SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK with it
_LOCAL, _REMOTE = _FIXED32(0x100), _FIXED32(0x300)
# The exporter's timeout unless OTEL_EXPORTER_OTLP_(TRACES_)TIMEOUT says otherwise: the flush at
# exit waits this long for a collector that is down (the SDK's 10 s measured 10.8 s), which
# must fit in the stop's margin past DARKROOM_SHUTDOWN_GRACE_S (compose's is 10 s).
EXPORT_TIMEOUT_S = 3.0
# The resources' and scopes' encodings (a worker has a few), by the object's identity: two
# that compare equal may still encode differently ({"n": 1} == {"n": True}). Each object is
# kept with its bytes, so its id is not reused while here; one with a value that can change
# in place (a mapping) is encoded each time.
_kept: dict[tuple[str, int], tuple[Any, bytes]] = {}
# Whether a batch went through the SDK's `export` because `request` could not encode it:
# said once in the log, since every later batch like it would take the slower path too.
_fell_back = False
_keys: dict[str, bytes] = {}
KEYS_KEPT = 1024


def request(spans: Iterable[Any]) -> bytes:
    """An ExportTraceServiceRequest holding `spans` (the SDK's ReadableSpans)."""
    if not _KINDS:
        from opentelemetry.trace import SpanKind

        _KINDS.update({kind: b"\x30" + _varint(kind.value + 1) for kind in SpanKind})
    grouped: dict[Any, dict[Any, list[bytes]]] = {}
    for span in spans:
        scopes = grouped.setdefault(span.resource, {})
        scopes.setdefault(span.instrumentation_scope, []).append(_span(span))
    return b"".join(_ld(b"\x0a", _resource_spans(r, s)) for r, s in grouped.items())


def _resource_spans(resource: Any, scopes: dict[Any, list[bytes]]) -> bytes:
    head = _once(
        ("resource", resource), lambda: _ld(b"\x0a", _attributes(b"\x0a", resource.attributes))
    )
    body = b"".join(_ld(b"\x12", _scope_spans(scope, spans)) for scope, spans in scopes.items())
    return head + body + _string(b"\x1a", resource.schema_url)


def _scope_spans(scope: Any, spans: list[bytes]) -> bytes:
    head = _once(("scope", scope), lambda: _ld(b"\x0a", _scope(scope)))
    schema = _string(b"\x1a", scope.schema_url) if scope is not None else b""
    return head + b"".join(b"\x12" + _varint(len(s)) + s for s in spans) + schema


def _scope(scope: Any) -> bytes:
    if scope is None:
        return b""
    return (_string(b"\x0a", scope.name) + _string(b"\x12", scope.version)
            + _attributes(b"\x1a", scope.attributes))  # fmt: skip


def _once(key: tuple[str, Any], make: Any) -> bytes:
    kind, of = key
    kept = _kept.get((kind, id(of)))
    if kept is not None and kept[0] is of:
        return kept[1]
    done: bytes = make()
    if len(_kept) < 64 and (of is None or _settled(of.attributes)):
        _kept[(kind, id(of))] = (of, done)
    return done


def _settled(attributes: Mapping[str, Any] | None) -> bool:
    """No value that could change in place (the SDK's attributes keep a mapping as given)."""
    return all(not isinstance(v, (Mapping, list, bytearray)) for v in (attributes or {}).values())


def _span(span: Any) -> bytes:
    context, parent, events, links = span.context, span.parent, span.events, span.links
    state = context.trace_state
    name = span.name.encode()
    out = [
        b"\x0a\x10", context.trace_id.to_bytes(16, "big"),
        b"\x12\x08", context.span_id.to_bytes(8, "big"),
    ]  # fmt: skip
    if state:
        out.append(_string(b"\x1a", ",".join(f"{k}={v}" for k, v in state.items())))
    if parent:
        out += (b"\x22\x08", parent.span_id.to_bytes(8, "big"))
    if name:
        out += (b"\x2a", _varint(len(name)), name)
    out.append(_KINDS[span.kind])
    if span.start_time:
        out += (b"\x39", _FIXED64(span.start_time))
    if span.end_time:
        out += (b"\x41", _FIXED64(span.end_time))
    out.append(_attributes(b"\x4a", span.attributes))
    out.append(_count(b"\x50", span.dropped_attributes))
    out += [_ld(b"\x5a", _event(event)) for event in events]
    out.append(_count(b"\x60", span.dropped_events))
    out += [_ld(b"\x6a", _link(link)) for link in links]
    out.append(_count(b"\x70", span.dropped_links))
    out += (_ld(b"\x7a", _status(span.status)), b"\x85\x01")
    out.append(_REMOTE if parent and parent.is_remote else _LOCAL)
    return b"".join(out)


def _event(event: Any) -> bytes:
    return (
        (b"\x09" + _FIXED64(event.timestamp) if event.timestamp else b"")
        + _string(b"\x12", event.name)
        + _attributes(b"\x1a", event.attributes)
        + _count(b"\x20", event.dropped_attributes)
    )


def _link(link: Any) -> bytes:
    context = link.context
    encoded: bytes = (
        b"\x0a\x10" + context.trace_id.to_bytes(16, "big")
        + b"\x12\x08" + context.span_id.to_bytes(8, "big")
        + _attributes(b"\x22", link.attributes)
        + _count(b"\x28", link.dropped_attributes)
        + b"\x35" + (_REMOTE if context.is_remote else _LOCAL)
    )  # fmt: skip
    return encoded


def _status(status: Any) -> bytes:
    code, description = status.status_code, status.description
    if not (code.value or description):
        return b""  # unset, no description: the common case
    return _string(b"\x12", description or "") + _count(b"\x18", code.value)


def _attributes(tag: bytes, attributes: Mapping[str, Any] | None) -> bytes:
    if not attributes:
        return b""
    out = []
    for key, value in attributes.items():
        try:
            out.append(_ld(tag, _key_value(key, value)))
        except Exception as error:  # as the SDK's encoder: the attribute is left out, logged
            log.exception("Failed to encode key %s: %s", key, error)
    return b"".join(out)


def _key_value(key: str, value: Any) -> bytes:
    named = _keys.get(key)
    if named is None:
        named = _string(b"\x0a", key)
        if len(_keys) < KEYS_KEPT:
            _keys[key] = named
    return named + _ld(b"\x12", _value(value))


def _value(value: Any) -> bytes:
    """An AnyValue: a oneof, so a default value (False, 0, "") is written too."""
    if value is None:
        return b""
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, str):
        return _ld(b"\x0a", value.encode())
    if isinstance(value, int):
        if not _INT64_MIN <= value < _INT64_END:  # a comparison: `in range` walks an int subclass
            raise ValueError(f"Value out of range: {value}")
        return b"\x18" + _varint(value)
    if isinstance(value, float):
        return b"\x21" + _DOUBLE(value)
    if isinstance(value, bytes):
        return _ld(b"\x3a", value)
    if isinstance(value, Sequence):
        return _ld(b"\x2a", b"".join(_ld(b"\x0a", _value(v)) for v in value))
    if isinstance(value, Mapping):
        pairs = b"".join(_ld(b"\x0a", _key_value(str(k), v)) for k, v in value.items())
        return _ld(b"\x32", pairs)
    raise TypeError(f"Invalid type {type(value)} of value {value}")


def _string(tag: bytes, text: str | None) -> bytes:
    """A proto3 string field: left out when empty."""
    return _ld(tag, text.encode()) if text else b""


def _count(tag: bytes, number: int) -> bytes:
    return tag + _varint(number) if number else b""


def _ld(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field (a message, string or bytes)."""
    size = len(payload)
    return tag + (bytes((size,)) if size < 0x80 else _varint(size)) + payload


def _varint(number: int) -> bytes:
    if 0 <= number < 0x80:
        return bytes((number,))
    number &= (1 << 64) - 1  # a negative int64 as ten bytes, as protobuf writes it
    out = bytearray()
    while number >= 0x80:
        out.append((number & 0x7F) | 0x80)
        number >>= 7
    out.append(number)
    return bytes(out)


def export_timeout_s(environ: Mapping[str, str] = os.environ) -> float:
    """The exporter's timeout: OTEL_EXPORTER_OTLP_(TRACES_)TIMEOUT, which this SDK reads in
    seconds (the specification says milliseconds; the SDK's own default is `10`), else
    darkroom's EXPORT_TIMEOUT_S."""
    for name in _TIMEOUT_VARIABLES:
        try:
            value = float(environ.get(name, ""))
        except ValueError:
            continue
        if 0 <= value < float("inf"):
            return value
    return EXPORT_TIMEOUT_S


_TIMEOUT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT")


def _timeout_set() -> bool:
    return any(name in os.environ for name in _TIMEOUT_VARIABLES)


def exporter() -> Any:
    """The SDK's OTLP/HTTP span exporter, configured by the same OTEL_* variables, sending
    `request`'s bytes. It reaches the SDK's HTTP client (`_client`), which the SDK exports
    no way to: should a version lack it, the SDK's own `export` runs (the same bytes, slower).
    tests/test_otlpwire.py checks that the locked version takes this path. A batch `request`
    cannot encode (a span the SDK would refuse, or one it would take that this does not
    know) goes through the SDK's `export` too, which encodes it or logs and counts the
    failure. On the fast path the exporter's own duration metric leaves the encoding out."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import SpanExportResult

    class WireExporter(OTLPSpanExporter):
        def export(self, spans: Sequence[Any]) -> Any:
            client, metrics = getattr(self, "_client", None), getattr(self, "_metrics", None)
            limit = getattr(self, "_max_request_size", None)
            if self._shutdown or client is None or metrics is None or limit is None:
                return super().export(spans)
            try:
                data = request(spans)
            except Exception as error:  # the SDK's export decides: encoded, or a failure it logs
                _said_fallen_back(error)
                return super().export(spans)
            if 0 < limit < len(data):  # the SDK's own refusal, logged and counted
                return super().export(spans)
            with metrics.export_operation(len(spans)) as result:
                sent = client.export(data)
                if not sent.success:
                    result.error = sent.error
                    if sent.status_code is not None:
                        result.error_attrs = {"http.response.status_code": sent.status_code}
                    return SpanExportResult.FAILURE
            return SpanExportResult.SUCCESS

        def lean(self) -> bool:
            return all(hasattr(self, n) for n in ("_client", "_metrics", "_max_request_size"))

    return WireExporter(timeout=None if _timeout_set() else EXPORT_TIMEOUT_S)


def _said_fallen_back(error: Exception) -> None:
    global _fell_back
    if not _fell_back:
        _fell_back = True
        log.warning("spans sent through the SDK's encoder: darkroom's could not encode a "
                    "batch (%s: %s); said once", type(error).__name__, error)  # fmt: skip
