"""Spans batched for export, encoded by the thread that ends them (docs/tracing.md#cost-when-on).

The SDK's batch processor encodes each batch on its export thread. On a busy worker that
thread and the event loop then take the GIL from each other: a 512-span batch is about 6 ms of
Python, and the loop, woken by a socket meanwhile, waits for it in slices of the interpreter's
switch interval. Here the thread that ends a span (the event loop's, for a delivery's spans)
encodes it, a few dozen at a time, to OTLP protobuf; the export thread only joins the encoded
chunks (a protobuf message's repeated fields concatenate: chunks of `ExportTraceServiceRequest`
joined are one request) and posts them. The batching is the SDK's, as the standard variables
set it: a batch leaves when `OTEL_BSP_MAX_EXPORT_BATCH_SIZE` spans wait or every
`OTEL_BSP_SCHEDULE_DELAY`; past `OTEL_BSP_MAX_QUEUE_SIZE` waiting, a new span is dropped.

The processor is duck-typed to the SDK's `SpanProcessor` and is given its encoder and its post
by `darkroom.tracing`, so importing this module imports no OpenTelemetry package.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("darkroom.spanbatch")

# Spans encoded together by the thread that ends them: about 0.4 ms of its time, and one
# resource and scope header (about 150 bytes) per chunk in the request.
CHUNK = 32


@dataclass(frozen=True, slots=True)
class Limits:
    """The batch processor's settings, with the SDK's defaults."""

    delay_s: float = 5.0
    queue: int = 2048
    batch: int = 512


def limits(environ: Mapping[str, str] = os.environ) -> Limits:
    """OTEL_BSP_SCHEDULE_DELAY (ms), OTEL_BSP_MAX_QUEUE_SIZE and OTEL_BSP_MAX_EXPORT_BATCH_SIZE;
    a value that is not a positive number is the default, as the SDK takes it."""
    default = Limits()
    delay_ms = _positive(environ, "OTEL_BSP_SCHEDULE_DELAY", default.delay_s * 1000)
    queue = int(_positive(environ, "OTEL_BSP_MAX_QUEUE_SIZE", default.queue))
    batch = int(_positive(environ, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", default.batch))
    return Limits(delay_ms / 1000, queue, min(batch, queue))


def _positive(environ: Mapping[str, str], name: str, default: float) -> float:
    try:
        value = float(environ.get(name, ""))
    except ValueError:
        return default
    return value if 0 < value < float("inf") else default


@dataclass(frozen=True, slots=True)
class Chunk:
    """Spans encoded: their part of a request, how many, and what `picked` took from them."""

    data: bytes
    spans: int
    keys: list[Any]


class EncodedBatches:
    """A span processor: `encode` turns ended spans into a serialized export request, `post`
    sends one (True: delivered), `delivered` is told the `picked` keys of each batch
    delivered (from the export thread), and `close` is called at the shutdown."""

    def __init__(
        self,
        encode: Callable[[Sequence[Any]], bytes],
        post: Callable[[bytes], bool],
        picked: Callable[[Sequence[Any]], list[Any]],
        delivered: Callable[[list[Any]], None],
        settings: Limits | None = None,
        close: Callable[[], object] = lambda: None,
    ) -> None:
        self._encode, self._post, self._close = encode, post, close
        self._picked, self._delivered = picked, delivered
        self._limits = settings or limits()
        self._chunk = min(CHUNK, self._limits.batch)
        self._shutdown = False
        self._reset()
        weak = weakref.WeakMethod(self._reset)

        def in_child() -> None:
            if (reset := weak()) is not None:
                reset()

        os.register_at_fork(after_in_child=in_child)

    def _reset(self) -> None:
        """A fresh queue and export thread (also in a forked child, whose thread did not
        survive the fork, and whose parent's spans are not its to send)."""
        self._lock = threading.Lock()  # the two queues and their counts
        self._export_lock = threading.Lock()  # one export at a time, in order
        self._ended: list[Any] = []  # spans ended, not encoded yet
        self._ready: list[Chunk] = []  # encoded, not posted yet
        self._ready_spans = 0
        self._waiting = 0  # spans in both
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="darkroom-span-export", daemon=True)
        self._thread.start()

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        """Nothing to do as a span starts."""

    def _on_ending(self, span: Any) -> None:
        """Nothing to do as a span ends, before it is read-only."""

    def on_end(self, span: Any) -> None:
        """Queue a sampled span; encode the queue's spans once a chunk's worth waits."""
        if self._shutdown or not span.context.trace_flags.sampled:
            return
        with self._lock:
            full = self._waiting >= self._limits.queue
            if not full:
                self._ended.append(span)
                self._waiting += 1
            ended = self._take_ended(self._chunk_due())
        if full:
            log.warning("span export queue full (OTEL_BSP_MAX_QUEUE_SIZE): a span dropped")
        self._add(ended)

    def _chunk_due(self) -> int:
        """How many ended spans make a chunk: fewer than a chunk's worth when they complete
        a batch, so that a batch leaves as soon as it is whole (under the lock)."""
        completes = self._ready_spans < self._limits.batch <= self._ready_spans + len(self._ended)
        return 1 if completes else self._chunk

    def _take_ended(self, at_least: int) -> list[Any]:
        """The ended spans, if at least `at_least` wait (under the lock)."""
        if len(self._ended) < max(at_least, 1):
            return []
        ended, self._ended = self._ended, []
        return ended

    def _add(self, ended: list[Any]) -> None:
        """Encode `ended` here, outside the lock, and queue the chunk; wake the export thread
        once a batch waits."""
        if not ended:
            return
        try:
            chunk = Chunk(self._encode(ended), len(ended), self._picked(ended))
        except Exception:  # as the SDK's exporter: a batch that cannot be encoded is dropped
            log.exception("span encoding failed: %d spans dropped", len(ended))
            with self._lock:
                self._waiting -= len(ended)
            return
        with self._lock:
            self._ready.append(chunk)
            self._ready_spans += chunk.spans
            full = self._ready_spans >= self._limits.batch
        if full:
            self._wake.set()

    def _run(self) -> None:
        while not self._shutdown:
            full = self._wake.wait(self._limits.delay_s)
            self._wake.clear()
            if not self._shutdown:
                self._export(everything=not full)

    def _export(self, everything: bool) -> bool:
        """Post the waiting batches: every one (the delay passed, or a flush), else while a
        whole batch waits. True if every post was delivered."""
        ok = True
        with self._export_lock:
            if everything:
                with self._lock:
                    ended = self._take_ended(1)
                self._add(ended)
            while batch := self._next_batch(whole=not everything):
                ok = self._send(batch) and ok
        return ok

    def _next_batch(self, whole: bool) -> list[Chunk]:
        """The oldest chunks, up to a batch's spans (at least one chunk)."""
        with self._lock:
            spans, count = 0, 0
            for chunk in self._ready:
                if count and spans + chunk.spans > self._limits.batch:
                    break
                spans, count = spans + chunk.spans, count + 1
            if whole and spans < self._limits.batch and count == len(self._ready):
                return []
            batch, self._ready = self._ready[:count], self._ready[count:]
            self._ready_spans -= spans
            self._waiting -= spans
            return batch

    def _send(self, batch: list[Chunk]) -> bool:
        try:
            sent = self._post(b"".join(c.data for c in batch))
        except Exception:  # an exporter's bug must not end the export thread
            log.exception("span export failed unexpectedly")
            return False
        if sent:
            self._delivered([key for c in batch for key in c.keys])
        return sent

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        """Post everything waiting now, from the caller's thread; False if a post failed (each
        post is bounded by the exporter's own timeout)."""
        return False if self._shutdown else self._export(everything=True)

    def shutdown(self) -> None:
        """Stop the export thread and post what waits; later spans are dropped."""
        if self._shutdown:
            return
        self._shutdown = True
        self._wake.set()
        self._thread.join(timeout=1.0)
        self._export(everything=True)
        self._close()


def otlp(exporter: Any, picked: Callable[[Sequence[Any]], list[Any]],
         delivered: Callable[[list[Any]], None], settings: Limits | None = None,
         ) -> EncodedBatches:  # fmt: skip
    """Batches for the SDK's OTLP/HTTP span exporter."""
    encode, post = otlp_parts(exporter)
    return EncodedBatches(encode, post, picked, delivered, settings, close=exporter.shutdown)


def otlp_parts(exporter: Any) -> tuple[Callable[[Sequence[Any]], bytes], Callable[[bytes], bool]]:
    """The SDK's OTLP/HTTP span exporter's encoder, and its client's post (the endpoint,
    headers, compression, timeout, retries and backoff its own `export` uses)."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    # The exporter's post without its encoding: not public API, so the version is locked and
    # tests/test_spanbatch.py posts through it to a receiver.
    client = exporter._client

    def encode(spans: Sequence[Any]) -> bytes:
        return bytes(encode_spans(spans).SerializePartialToString())

    def post(data: bytes) -> bool:
        return bool(client.export(data).success)

    return encode, post
