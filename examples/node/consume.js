// A consumer of darkroom's events (ioredis + pg): read `{darkroom}:events` through a consumer
// group, handle each CloudEvent once (dedupe on its `id`), then XACK.
//
//   node consume.js                  # until Ctrl-C
//   node consume.js --idle-exit 3    # stop after 3 s without an event (what the tests do)
//
// Delivery is at least once, so the handler records the event's `id` in the same transaction
// as its own effect; a duplicate finds it there and is only acked. Prints `<type> <photo_id> <id>`.
import Redis from "ioredis";
import pg from "pg";

const env = process.env;
const DATABASE_URL = env.DARKROOM_DATABASE_URL ?? "postgresql://postgres@127.0.0.1/darkroom";
const EVENTS = env.DARKROOM_EVENTS_STREAM ?? "{darkroom}:events";
const GROUP = "example-gallery", CONSUMER = `gallery-${process.pid}`;
const idleAt = process.argv.indexOf("--idle-exit");
const idleExitS = idleAt > 0 ? Number(process.argv[idleAt + 1]) : Infinity;

async function handle(db, fields) {
  const event = JSON.parse(fields[fields.indexOf("event") + 1]);
  await db.query("BEGIN"); // the dedupe row commits with the handler's own effect
  try {
    const seen = await db.query(
      "INSERT INTO example_seen_events (id) VALUES ($1) ON CONFLICT DO NOTHING RETURNING 1",
      [event.id]);
    if (seen.rowCount) console.log(event.type, event.data?.photo_id, event.id); // the effect
    await db.query("COMMIT");
  } catch (error) {
    await db.query("ROLLBACK");
    throw error;
  }
}

const redis = new Redis(env.DARKROOM_REDIS_URL ?? "redis://127.0.0.1:6379/0");
const db = new pg.Client({ connectionString: DATABASE_URL });
await db.connect();
await db.query("CREATE TABLE IF NOT EXISTS example_seen_events (id text PRIMARY KEY)");
await redis.xgroup("CREATE", EVENTS, GROUP, "0", "MKSTREAM").catch((error) => {
  if (!String(error).includes("BUSYGROUP")) throw error; // the group exists
});
let start = "0", idleS = 0; // first this consumer's own pending entries, then new ones
while (idleS < idleExitS) {
  const reply = await redis.xreadgroup(
    "GROUP", GROUP, CONSUMER, "COUNT", 50, "BLOCK", 1000, "STREAMS", EVENTS, start);
  const entries = reply ? reply[0][1] : [];
  for (const [entryId, fields] of entries) {
    await handle(db, fields);
    await redis.xack(EVENTS, GROUP, entryId); // after the commit: a crash redelivers
  }
  idleS = entries.length || start === "0" ? 0 : idleS + 1; // a `>` read blocks 1 s
  if (start === "0" && !entries.length) start = ">";
}
redis.disconnect();
await db.end();
