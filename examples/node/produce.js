// A darkroom producer (ioredis + pg): store the original, insert the row, then XADD.
//
//   node produce.js photo.jpg     # prints the photo id
//
// Settings are darkroom's own: DARKROOM_DATABASE_URL, DARKROOM_REDIS_URL, DARKROOM_STREAM,
// DARKROOM_STORAGE_URL (a local folder, `file:PATH`; on S3, PUT the original at the same key).
// Traced: TRACEPARENT (a W3C traceparent), or with OpenTelemetry configured
// (`node --import ./tracing.js produce.js photo.jpg`, OTEL_EXPORTER_OTLP_ENDPOINT set) the
// photo's own `darkroom.produce` span, goes on the row and the entry, so darkroom's spans
// join that trace.
import { randomUUID } from "node:crypto";
import { copyFile, mkdir } from "node:fs/promises";
import { basename, dirname, join } from "node:path";
import Redis from "ioredis";
import pg from "pg";

const env = process.env;
const DATABASE_URL = env.DARKROOM_DATABASE_URL ?? "postgresql://postgres@127.0.0.1/darkroom";
const REDIS_URL = env.DARKROOM_REDIS_URL ?? "redis://127.0.0.1:6379/0";
const STREAM = env.DARKROOM_STREAM ?? "{darkroom}:photos";
const STORAGE = (env.DARKROOM_STORAGE_URL ?? "file:./var/storage").replace(/^file:(\/\/)?/, "");

// The W3C fields darkroom reads (docs/tracing.md); {} untraced.
async function traceContext() {
  if (env.TRACEPARENT) return { traceparent: env.TRACEPARENT };
  const carrier = {};
  try {
    const { context, propagation } = await import("@opentelemetry/api");
    propagation.inject(context.active(), carrier); // nothing without a configured SDK
  } catch {
    return {}; // not installed: untraced
  }
  return Object.fromEntries(
    Object.entries(carrier).filter(([k]) => k === "traceparent" || k === "tracestate"),
  );
}

async function produce(path) {
  const photoId = randomUUID();
  const traced = await traceContext();
  const key = `originals/${photoId}/${basename(path).replace(/[^\w.-]/g, "_")}`;
  const target = join(STORAGE, key);
  await mkdir(dirname(target), { recursive: true });
  await copyFile(path, target); // 1. the original, before anything names it
  const db = new pg.Client({ connectionString: DATABASE_URL });
  await db.connect();
  try { // 2. the row; enqueued_at: this producer XADDs it next (the intake leaves it alone)
    await db.query(
      "INSERT INTO photos (id, original_key, enqueued_at, traceparent) VALUES ($1, $2, now(), $3)",
      [photoId, key, traced.traceparent ?? null],
    );
  } finally {
    await db.end();
  }
  const redis = new Redis(REDIS_URL);
  try { // 3. the entry, only after the row's commit
    await redis.xadd(STREAM, "*", "photo_id", photoId, ...Object.entries(traced).flat());
  } finally {
    redis.disconnect();
  }
  return photoId;
}

// Each photo in a `darkroom.produce` span when @opentelemetry/api is installed (a no-op span
// unless an SDK is registered, as tracing.js does): its context is what traceContext injects.
async function inSpan(path, work) {
  let api;
  try {
    api = await import("@opentelemetry/api");
  } catch {
    return work(); // not installed: untraced
  }
  const tracer = api.trace.getTracer("darkroom-examples");
  const options = { kind: api.SpanKind.PRODUCER, attributes: { "darkroom.file": basename(path) } };
  return tracer.startActiveSpan("darkroom.produce", options, async (span) => {
    try {
      return await work();
    } catch (error) {
      span.recordException(error);
      span.setStatus({ code: api.SpanStatusCode.ERROR, message: String(error) });
      throw error;
    } finally {
      span.end();
    }
  });
}

for (const path of process.argv.slice(2)) console.log(await inSpan(path, () => produce(path)));
