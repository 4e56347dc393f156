-- darkroom schema: applied idempotently by `darkroom migrate`.
-- Postgres is the source of truth; the Redis stream is only the delivery mechanism.

CREATE TABLE IF NOT EXISTS photos (
    id               uuid PRIMARY KEY,
    original_key     text        NOT NULL,
    processing_state text        NOT NULL DEFAULT 'uploaded'
        CONSTRAINT photos_processing_state_check
        CHECK (processing_state IN ('uploaded', 'processing', 'processed', 'processing_failed',
                                    'erased')),
    visibility       text        NOT NULL DEFAULT 'unpublished'
        CONSTRAINT photos_visibility_check
        CHECK (visibility IN ('unpublished', 'published')),
    error_code       text,
    width            integer     CHECK (width > 0),
    height           integer     CHECK (height > 0),
    format           text,
    bytes            bigint      CHECK (bytes >= 0),
    renditions       jsonb,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    processed_at     timestamptz,
    -- never publish a half-made photo: published implies processed with renditions
    CONSTRAINT photos_published_is_processed CHECK (
        visibility = 'unpublished'
        OR (processing_state = 'processed' AND renditions IS NOT NULL AND processed_at IS NOT NULL)
    )
);

CREATE TABLE IF NOT EXISTS photo_jobs (
    id             bigserial   PRIMARY KEY,
    photo_id       uuid        NOT NULL REFERENCES photos (id) ON DELETE CASCADE,
    type           text        NOT NULL DEFAULT 'process'
        CONSTRAINT photo_jobs_type_check CHECK (type IN ('process')),
    state          text        NOT NULL DEFAULT 'pending'
        CONSTRAINT photo_jobs_state_check CHECK (state IN ('pending', 'active', 'done', 'failed')),
    attempt        integer     NOT NULL DEFAULT 0 CHECK (attempt >= 0),
    error_code     text,
    last_error     text,
    next_retry_at  timestamptz,
    stream_entry   text,
    consumer       text,
    created_at     timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now(),
    started_at     timestamptz,
    finished_at    timestamptz,
    CONSTRAINT photo_jobs_photo_type_key UNIQUE (photo_id, type)
);

CREATE INDEX IF NOT EXISTS photo_jobs_unfinished_idx
    ON photo_jobs (updated_at) WHERE state IN ('pending', 'active');

-- ---- the sweep's keyset -------------------------------------------------------------------
-- photos.last_activity_at: the last sign of progress of the photo or its job. Every state
-- change in db.py sets it (claim, publish, retry, failure, requeue, reset); a new row gets
-- now(). The sweep pages over (last_activity_at, id) of unfinished photos through
-- photos_sweep_idx, so each page costs O(page) whatever the backlog. Idempotent on a
-- database with rows: the column is added and backfilled (from the photo's and its job's
-- updated_at, as the old sweep computed it) only when it is missing, so a re-run takes no
-- lock on photos and scans nothing.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = 'photos'::regclass
                   AND attname = 'last_activity_at' AND NOT attisdropped) THEN
        ALTER TABLE photos ADD COLUMN IF NOT EXISTS last_activity_at timestamptz;
        UPDATE photos p SET last_activity_at = greatest(p.updated_at, coalesce(
            (SELECT j.updated_at FROM photo_jobs j
             WHERE j.photo_id = p.id AND j.type = 'process'), p.updated_at));
        ALTER TABLE photos ALTER COLUMN last_activity_at SET DEFAULT now(),
                           ALTER COLUMN last_activity_at SET NOT NULL;
    END IF;
END $$;
CREATE INDEX IF NOT EXISTS photos_sweep_idx
    ON photos (last_activity_at, id) WHERE processing_state IN ('uploaded', 'processing');
-- superseded by photos_sweep_idx (it served the old sweep, which no longer reads updated_at)
DROP INDEX IF EXISTS photos_unfinished_idx;
-- photos_of_entries (entries deleted while pending) looks jobs up by their stream entry
CREATE INDEX IF NOT EXISTS photo_jobs_stream_entry_idx ON photo_jobs (stream_entry);
-- ---- end of the sweep's keyset ------------------------------------------------------------

-- Facts read from the original during its one decode. Added in place, so
-- `migrate` upgrades a database that already holds photos; all NULL until (re)rendered.
ALTER TABLE photos
    ADD COLUMN IF NOT EXISTS taken_at_local  timestamp,
    ADD COLUMN IF NOT EXISTS taken_at        timestamptz,
    ADD COLUMN IF NOT EXISTS camera_make     text,
    ADD COLUMN IF NOT EXISTS camera_model    text,
    ADD COLUMN IF NOT EXISTS lens_model      text,
    ADD COLUMN IF NOT EXISTS exposure        jsonb,
    ADD COLUMN IF NOT EXISTS original_sha256 text,
    ADD COLUMN IF NOT EXISTS has_alpha       boolean,
    ADD COLUMN IF NOT EXISTS frames          integer,
    ADD COLUMN IF NOT EXISTS source_profile  text,
    ADD COLUMN IF NOT EXISTS latitude        double precision,
    ADD COLUMN IF NOT EXISTS longitude       double precision,
    ADD COLUMN IF NOT EXISTS thumbhash       text,
    ADD COLUMN IF NOT EXISTS dominant_color  text,
    -- re-render on demand: requested by `darkroom enqueue --rerender`, done by publish
    ADD COLUMN IF NOT EXISTS rerender_requested_at timestamptz,
    ADD COLUMN IF NOT EXISTS rerendered_at   timestamptz;

-- a producer finds the same upload twice
CREATE INDEX IF NOT EXISTS photos_original_sha256_idx ON photos (original_sha256);

-- the operator's page: keyset pages of photos (newest first, by state) and the throughput chart
CREATE INDEX IF NOT EXISTS photos_updated_idx ON photos (updated_at, id);
CREATE INDEX IF NOT EXISTS photos_state_updated_idx ON photos (processing_state, updated_at, id);
CREATE INDEX IF NOT EXISTS photos_processed_at_idx ON photos (processed_at)
    WHERE processed_at IS NOT NULL;

-- What counts as an attempt. `attempt` counts the claims that started work and
-- ended in the photo's own failure or its worker's death; a claim by a live holder's own
-- process, or one that ended in a transient error, is not counted. `attempt - run_offset`
-- is this run's count, the one DARKROOM_MAX_ATTEMPTS caps (an operator retry or a
-- re-render starts a new run; `attempt` keeps the history). The process that claimed the
-- job (`holder`, one per worker process) keeps `lease_until` in the future while it
-- works on it (the worker's heartbeat), so a worker that reclaims the entry can tell a live
-- owner (back off, count nothing) from a dead one. `transient_since`: where the photo's
-- current streak of transient errors started (DARKROOM_TRANSIENT_BUDGET_S), kept across
-- restarts and reclaims, cleared by an outcome. Added in place: a constant default
-- rewrites nothing.
ALTER TABLE photo_jobs
    ADD COLUMN IF NOT EXISTS run_offset      integer NOT NULL DEFAULT 0 CHECK (run_offset >= 0),
    ADD COLUMN IF NOT EXISTS holder          text,
    ADD COLUMN IF NOT EXISTS lease_until     timestamptz,
    ADD COLUMN IF NOT EXISTS transient_since timestamptz;

-- the operator's page filtered by error code: failed photos of one code, newest
-- first, a keyset page reading only its own index entries (db.page_photos_sql). Only failed
-- photos have a code: every statement that moves a photo out of processing_failed clears it.
CREATE INDEX IF NOT EXISTS photos_code_idx ON photos (error_code, updated_at, id)
    WHERE error_code IS NOT NULL;

-- ---- lanes and tenants --------------------------------------------------------------------
-- lane: which work stream the photo goes through (interactive: DARKROOM_STREAM; bulk:
-- DARKROOM_BULK_STREAM, fed fairly between tenants). tenant: whose photo it is ('' =
-- nobody's). enqueued_at: when the photo last entered a work stream (NULL: never, so a
-- PostgreSQL-only producer's row is still to be enqueued). cost: what rendering it costs
-- (pixels from the header, else bytes; NULL = not known before the render). Constant
-- defaults: added in place without rewriting the table.
ALTER TABLE photos
    ADD COLUMN IF NOT EXISTS lane        text   NOT NULL DEFAULT 'interactive',
    ADD COLUMN IF NOT EXISTS tenant      text   NOT NULL DEFAULT '',
    ADD COLUMN IF NOT EXISTS cost        bigint CHECK (cost >= 0);
-- Rows that exist when the column arrives were enqueued by their producers (or are
-- finished): backfilled once, so an upgrade does not hand the whole backlog to the feeder
-- again (a photo whose producer never XADDed it is the sweep's to find, as before).
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = 'photos'::regclass
                   AND attname = 'enqueued_at' AND NOT attisdropped) THEN
        ALTER TABLE photos ADD COLUMN enqueued_at timestamptz;
        UPDATE photos SET enqueued_at = created_at;
    END IF;
END $$;
DO $$
BEGIN
    ALTER TABLE photos ADD CONSTRAINT photos_lane_check CHECK (lane IN ('interactive', 'bulk'));
EXCEPTION WHEN duplicate_object THEN NULL;
END $$;
-- A tenant is at most 128 characters (queue/lanes.py MAX_TENANT_CHARS), so the feeder's bulk
-- entry always fits a stream field (1,024 bytes; a longer one is a bad_message): a producer's
-- longer tenant fails its INSERT with check_violation (SQLSTATE 23514) naming this
-- constraint. NOT VALID: adding it scans nothing under its lock and never fails an upgrade.
-- PostgreSQL still checks every later UPDATE of an older row, so a row already longer could
-- no longer be fed, claimed or published: the same block (run once, when the constraint is
-- added; one scan of photos) cuts those tenants to their first 128 characters.
DO $$
BEGIN
    ALTER TABLE photos ADD CONSTRAINT photos_tenant_length_check
        CHECK (char_length(tenant) <= 128) NOT VALID;
    UPDATE photos SET tenant = left(tenant, 128) WHERE char_length(tenant) > 128;
EXCEPTION WHEN duplicate_object THEN NULL;
END $$;
-- ---- end of lanes and tenants -------------------------------------------------------------

-- ---- HDR originals ------------------------------------------------------------------------
-- hdr: what an HDR display could show of the original (docs/hdr.md): 'gainmap' (an Ultra HDR
-- or ISO 21496-1 JPEG, or an iPhone HEIC, whose JPEG renditions carry the map; an AVIF
-- `tmap`, shown as its SDR base), 'pq' or 'hlg' (an HDR transfer without a map, tone-mapped
-- to SDR); NULL = SDR.
ALTER TABLE photos ADD COLUMN IF NOT EXISTS hdr text;
DO $$
BEGIN
    ALTER TABLE photos ADD CONSTRAINT photos_hdr_check CHECK (hdr IN ('gainmap', 'pq', 'hlg'));
EXCEPTION WHEN duplicate_object THEN NULL;
END $$;
-- ---- end of HDR originals -----------------------------------------------------------------

-- ---- focal point --------------------------------------------------------------------------
-- Where a crop=attention rendition centres its box (libvips attention), as x and y in 0..1
-- of the upright original, for clients that crop on their own; NULL until (re)rendered.
ALTER TABLE photos
    ADD COLUMN IF NOT EXISTS focal_x real CHECK (focal_x BETWEEN 0 AND 1),
    ADD COLUMN IF NOT EXISTS focal_y real CHECK (focal_y BETWEEN 0 AND 1);
-- ---- end of focal point -------------------------------------------------------------------

-- ---- attempt history ----------------------------------------------------------------------
-- One row per delivery that reached a worker (docs/history.md). A claimed delivery's row
-- is inserted `running` by its claim and finished by its publish, or by one UPDATE when it
-- ends otherwise; a row still `running` after its job's lease is gone is a worker that
-- died. A delivery that claims nothing (busy, already, a bad_message entry: photo_id
-- NULL) is one finished row. No foreign key: the history outlives a deleted photo, and an insert checks nothing.
-- Kept DARKROOM_HISTORY_KEEP_DAYS by batched deletes over photo_attempts_started_idx.
CREATE TABLE IF NOT EXISTS photo_attempts (
    id          bigserial PRIMARY KEY,
    photo_id    uuid,
    entry_id    text NOT NULL,
    consumer    text NOT NULL,
    lane        text,
    started_at  timestamptz NOT NULL DEFAULT now(),
    ended_at    timestamptz,
    download_ms real,
    render_ms   real,
    upload_ms   real,
    publish_ms  real,
    outcome     text NOT NULL DEFAULT 'running',
    error_code  text,
    error       text,
    peak_rss_mb real
);
CREATE INDEX IF NOT EXISTS photo_attempts_photo_idx ON photo_attempts (photo_id, started_at);
CREATE INDEX IF NOT EXISTS photo_attempts_started_idx ON photo_attempts (started_at);
CREATE INDEX IF NOT EXISTS photo_attempts_code_idx ON photo_attempts (error_code, started_at)
    WHERE error_code IS NOT NULL;
CREATE INDEX IF NOT EXISTS photo_attempts_consumer_idx ON photo_attempts (consumer, started_at);
-- ---- end of attempt history ---------------------------------------------------------------

-- ---- photo events, a transactional outbox -------------------------------------------------
-- One row per terminal outcome, inserted by the outcome's own statement (db.PUBLISH_SQL,
-- FAIL_SQL, RERENDER_FAILED_SQL), so an event exists exactly when its state change committed.
-- The relay (relay.py) XADDs unpublished rows in id order and sets published_at. Every
-- statement that inserts one holds the photo's row lock from before it takes the id until its
-- commit: a photo's events have ids in commit order. Rows older than
-- DARKROOM_EVENTS_KEEP_DAYS are deleted in batches once published.
CREATE TABLE IF NOT EXISTS photo_events (
    id           bigserial   PRIMARY KEY,
    event_id     uuid        NOT NULL UNIQUE DEFAULT gen_random_uuid(),
    photo_id     uuid        NOT NULL,
    type         text        NOT NULL CONSTRAINT photo_events_type_check CHECK (type IN (
        'darkroom.photo.published', 'darkroom.photo.failed',
        'darkroom.photo.rerendered', 'darkroom.photo.rerender_failed',
        'darkroom.queue.paused', 'darkroom.queue.resumed', 'darkroom.photo.erased',
        'darkroom.photo.upgraded')),
    data         jsonb       NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    published_at timestamptz
);
-- the relay's scan: only the few rows not yet published
CREATE INDEX IF NOT EXISTS photo_events_unpublished_idx ON photo_events (id)
    WHERE published_at IS NULL;
-- `darkroom events --since TIME` and the retention's batches
CREATE INDEX IF NOT EXISTS photo_events_created_idx ON photo_events (created_at, id);
-- an erase's scrub of the photo's earlier events (their facts nulled): one photo's few rows,
-- not a scan of every event kept, which a bulk erase would make once per photo
CREATE INDEX IF NOT EXISTS photo_events_photo_idx ON photo_events (photo_id);
-- An event's `data`, from the photo's row after the change ($2, $3: a failure's code and
-- message). A new fact column is one more pair in `facts`. Built from the columns by name
-- (about 25 µs a call here), not by walking to_jsonb(p) (about 150 µs): it runs inside
-- every publishing commit. `facts` leaves out what is null; `exposure` is added apart, so
-- the nulls inside it stay (jsonb_strip_nulls would strip them at every depth).
CREATE OR REPLACE FUNCTION darkroom_event_data(p photos, code text, message text)
RETURNS jsonb LANGUAGE sql STABLE AS $$
SELECT jsonb_build_object(
    'photo_id', p.id,
    'renditions', coalesce(p.renditions, '[]'::jsonb),
    'facts', jsonb_strip_nulls(jsonb_build_object(
                 'width', p.width, 'height', p.height, 'format', p.format, 'bytes', p.bytes,
                 'taken_at_local', p.taken_at_local, 'taken_at', p.taken_at,
                 'camera_make', p.camera_make, 'camera_model', p.camera_model,
                 'lens_model', p.lens_model, 'original_sha256', p.original_sha256,
                 'has_alpha', p.has_alpha, 'frames', p.frames,
                 'source_profile', p.source_profile, 'latitude', p.latitude,
                 'longitude', p.longitude, 'hdr', p.hdr,
                 'focal_x', p.focal_x, 'focal_y', p.focal_y))
             || CASE WHEN p.exposure IS NULL OR p.exposure = 'null'::jsonb THEN '{}'::jsonb
                     ELSE jsonb_build_object('exposure', p.exposure) END,
    'thumbhash', p.thumbhash,
    'dominant_color', p.dominant_color,
    'lane', p.lane,
    'tenant', p.tenant
) || CASE WHEN code IS NULL THEN '{}'::jsonb
          ELSE jsonb_build_object('error_code', code, 'error', message) END
$$;
-- What NOTIFY darkroom_events carries (delivered at commit): enough for a listener to
-- choose, never the event itself (a payload is capped at 8000 bytes). STABLE, as
-- json_build_object is: the planner then inlines it into the statement that writes the
-- event, instead of running it as a SQL function (parsed and planned again in every
-- publishing statement).
CREATE OR REPLACE FUNCTION darkroom_event_notice(id bigint, photo_id uuid, type text)
RETURNS text LANGUAGE sql STABLE AS $$
SELECT json_build_object('id', id, 'photo_id', photo_id, 'type', type)::text
$$;
-- ---- end of photo events ------------------------------------------------------------------
-- ---- the feeder (PostgreSQL intake, fair bulk feeding) ------------------------------------
-- The one rule: a row with `enqueued_at IS NULL` whose photo is unfinished is put into its
-- lane's stream by the feeder (interactive at once, bulk in fair order); a claim sets
-- enqueued_at, so a photo its producer XADDed and a worker claimed is never enqueued again.
-- The partial indexes hold only rows still to feed (or bulk rows in flight): their size
-- follows the backlog, never the table.
CREATE INDEX IF NOT EXISTS photos_intake_idx ON photos (created_at, id)
    WHERE enqueued_at IS NULL AND lane = 'interactive'
      AND processing_state IN ('uploaded', 'processing');
-- A bulk photo to feed is unfinished, or processed with a re-render requested.
CREATE INDEX IF NOT EXISTS photos_bulk_backlog_idx ON photos (tenant, created_at, id)
    WHERE enqueued_at IS NULL AND lane = 'bulk'
      AND (processing_state IN ('uploaded', 'processing')
       OR (processing_state = 'processed' AND rerender_requested_at IS NOT NULL));
CREATE INDEX IF NOT EXISTS photos_bulk_in_flight_idx ON photos (tenant)
    WHERE enqueued_at IS NOT NULL AND lane = 'bulk'
      AND (processing_state IN ('uploaded', 'processing')
       OR (processing_state = 'processed' AND rerender_requested_at IS NOT NULL));
-- Wakes the feeder at commit (NOTIFY is delivered then, never for a rolled-back insert).
-- A notification missed while no feeder listened is found by its catch-up scan.
CREATE OR REPLACE FUNCTION darkroom_notify_intake() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('darkroom_intake', NEW.id::text);
    RETURN NULL;
END $$;
CREATE OR REPLACE TRIGGER photos_intake_notify AFTER INSERT ON photos
    FOR EACH ROW WHEN (NEW.enqueued_at IS NULL) EXECUTE FUNCTION darkroom_notify_intake();
-- ---- end of the feeder --------------------------------------------------------------------

-- ---- leased duties: the feeder, the relay, the sweep, the history prune -------------------
-- One row per duty (store/duties.py), held by one worker process at a time until
-- expires_at (the database's clock). `token` only grows: each takeover adds one, and a
-- release only expires the row (a deleted row would start again at 1), so a holder's
-- fenced write (`... AND token = $n`) is refused once anyone else has taken the duty.
CREATE TABLE IF NOT EXISTS darkroom_duties (
    name        text        PRIMARY KEY,
    holder      text        NOT NULL,
    token       bigint      NOT NULL CHECK (token > 0),
    acquired_at timestamptz NOT NULL DEFAULT now(),
    renewed_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL
);
-- ---- end of leased duties -------------------------------------------------------------------

-- ---- fencing tokens and re-render generations ----------------------------------------------
-- photo_jobs.lease_token: the fencing token of the job's lease. Every claim that takes the
-- job grants the next one (it only grows), and every write its holder makes is conditioned
-- on it (store/leases.py, store/publishing.py): a holder that froze past its lease, whose
-- job was claimed again since, matches no row. photo_jobs.generation: the re-render
-- generation the claim renders. photos.rerender_generation counts the re-render requests; a
-- publish (or a failed re-render) answers those up to its claim's generation, so a request
-- made during a render is rendered again, once. Constant defaults: added in place, nothing
-- rewritten; an existing request (generation 0) is answered by the next render as before.
ALTER TABLE photo_jobs
    ADD COLUMN IF NOT EXISTS lease_token bigint NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS generation  bigint NOT NULL DEFAULT 0;
ALTER TABLE photos ADD COLUMN IF NOT EXISTS rerender_generation bigint NOT NULL DEFAULT 0;
-- An interactive re-render still to do after its render ended (requested meanwhile): its
-- publish cleared enqueued_at; the worker XADDs it at once, the intake if that worker died.
CREATE INDEX IF NOT EXISTS photos_rerender_due_idx ON photos (updated_at, id)
    WHERE enqueued_at IS NULL AND lane = 'interactive'
      AND processing_state = 'processed' AND rerender_requested_at IS NOT NULL;
-- photo_jobs.dropped_entries: the last 16 entries acked without the job's run going through
-- them (a claim left them alone, a publish or a failure was refused, a later run or a retry
-- replaced their run; src/darkroom/store/entries.py). A worker that read one of them and
-- stalled before its claim finds it here and takes nothing: a lease under an entry gone
-- from the stream is found by no reclaim, and the request's own entry, meeting that
-- lease, would be acked as a duplicate too.
ALTER TABLE photo_jobs ADD COLUMN IF NOT EXISTS dropped_entries text[] NOT NULL DEFAULT '{}';
-- ---- end of fencing tokens -----------------------------------------------------------------

-- ---- the operator's audit trail ---------------------------------------------------------------
-- One row per operator action (store/audit.py): who, through what, what, on which
-- selection, how many, why, and how it ended. Append-only: an action that runs long writes
-- a row when it starts and another when it ends (same `action_id`), never an update, so the
-- trail cannot be rewritten by the code that acts; the trigger refuses an UPDATE.
CREATE TABLE IF NOT EXISTS operator_actions (
    id        bigserial   PRIMARY KEY,
    action_id uuid        NOT NULL,
    at        timestamptz NOT NULL DEFAULT now(),
    operator  text        NOT NULL CHECK (operator <> ''),
    via       text        NOT NULL
        CONSTRAINT operator_actions_via_check CHECK (via IN ('cli', 'page', 'api', 'timer')),
    action    text        NOT NULL,
    selection jsonb       NOT NULL DEFAULT '{}'::jsonb,
    count     bigint      CHECK (count >= 0),
    reason    text,
    outcome   text        NOT NULL
        CONSTRAINT operator_actions_outcome_check
        CHECK (outcome IN ('started', 'done', 'dry_run', 'refused', 'failed', 'interrupted')),
    detail    jsonb
);
CREATE INDEX IF NOT EXISTS operator_actions_at_idx ON operator_actions (at, id);
CREATE INDEX IF NOT EXISTS operator_actions_action_idx ON operator_actions (action_id);
-- `darkroom audit --action` and the page's filter: one action's rows newest first, O(limit).
CREATE INDEX IF NOT EXISTS operator_actions_action_at_idx ON operator_actions (action, at, id);
CREATE OR REPLACE FUNCTION darkroom_audit_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'operator_actions rows are never updated in place'
        USING ERRCODE = 'restrict_violation';
END $$;
CREATE OR REPLACE TRIGGER operator_actions_append_only BEFORE UPDATE ON operator_actions
    FOR EACH ROW EXECUTE FUNCTION darkroom_audit_append_only();
-- ---- end of the audit trail -------------------------------------------------------------------

-- ---- bulk actions by query ------------------------------------------------------------------
-- One row per photo a bulk action (`darkroom bulk retry|rerender|move`, store/selection.py)
-- selected, inserted when the action starts: the selection frozen as a snapshot of ids, so a
-- photo that matches later is not added and a rerun walks the same set. `state` moves
-- pending -> acted (its state change committed, in the same transaction as this row) ->
-- sent (handed to its lane), or pending -> skipped (it no longer qualified). A row leaves
-- `pending` only in the transaction that acts on its photo, so a photo is acted on at most
-- once per action whatever kills the run. Rows of a done action stay with its audit rows.
CREATE TABLE IF NOT EXISTS bulk_action_items (
    action_id uuid NOT NULL,
    photo_id  uuid NOT NULL,
    state     text NOT NULL DEFAULT 'pending'
        CONSTRAINT bulk_action_items_state_check
        CHECK (state IN ('pending', 'acted', 'sent', 'skipped')),
    acted_at  timestamptz,
    PRIMARY KEY (action_id, photo_id)
);
-- A batch is the next ids still `pending` (or `acted`, still to hand over), keyset by id:
-- the index holds each state's ids apart, so a batch reads O(batch) entries however many
-- are done.
CREATE INDEX IF NOT EXISTS bulk_action_items_state_idx
    ON bulk_action_items (action_id, state, photo_id);
-- Selections by tenant (the most common operator scope) read only that tenant's photos,
-- by state and creation time; by error code photos_code_idx serves, by state alone
-- photos_state_updated_idx, by processed time photos_processed_at_idx.
CREATE INDEX IF NOT EXISTS photos_tenant_state_created_idx
    ON photos (tenant, processing_state, created_at, id);
-- ---- end of bulk actions --------------------------------------------------------------------

-- ---- pauses: an operator's hold on a lane, a tenant, both or everything ---------------------
-- One row per paused scope (store/pauses.py); NULL lane: every lane, NULL tenant: every
-- tenant. A row past `until` is no pause (every reader compares it with now()), so a timed
-- pause ends by itself with no process to end it. Each claim reads it (leases.CLAIM_SQL):
-- a photo of a paused scope is not claimed, counting no attempt. Queue events (paused,
-- resumed) are outbox rows about no photo: their photo_id is the nil UUID.
CREATE TABLE IF NOT EXISTS queue_pauses (
    id       bigserial   PRIMARY KEY,
    lane     text        CHECK (lane IN ('interactive', 'bulk')),
    tenant   text        CHECK (char_length(tenant) <= 128),
    operator text        NOT NULL CHECK (operator <> ''),
    reason   text        NOT NULL CHECK (reason <> ''),
    since    timestamptz NOT NULL DEFAULT now(),
    until    timestamptz
);
CREATE UNIQUE INDEX IF NOT EXISTS queue_pauses_scope_idx
    ON queue_pauses ((coalesce(lane, '')), (coalesce(tenant, '')), (tenant IS NULL));
-- The autoscaler's per-lane count of unfinished photos no pause holds (deploy/kubernetes/
-- scaledobject.yaml): one lane's rows only, each tenant's together, so a poll reads at most
-- its LIMIT of the lane's rows plus those of the tenants paused.
-- Its predicate names the lanes too, so only a query that names a lane can use it: the
-- operator's state-filtered pages (by updated_at) are not tempted into a bitmap over every
-- unfinished row and a sort.
CREATE INDEX IF NOT EXISTS photos_unfinished_lane_idx ON photos (lane, tenant)
    WHERE processing_state IN ('uploaded', 'processing') AND lane IN ('interactive', 'bulk');
-- A database made before the queue events (or erasure): its check admits them from now on
-- (NOT VALID: the rows already there are the photo types, no scan needed).
ALTER TABLE photo_events DROP CONSTRAINT IF EXISTS photo_events_type_check;
ALTER TABLE photo_events ADD CONSTRAINT photo_events_type_check CHECK (type IN (
    'darkroom.photo.published', 'darkroom.photo.failed',
    'darkroom.photo.rerendered', 'darkroom.photo.rerender_failed',
    'darkroom.queue.paused', 'darkroom.queue.resumed', 'darkroom.photo.erased',
    'darkroom.photo.upgraded')) NOT VALID;
-- A trail made before timed pauses ended themselves: its check admits `timer`, the
-- automatic resume's `via`, from now on (NOT VALID: the rows there are checked already).
ALTER TABLE operator_actions DROP CONSTRAINT IF EXISTS operator_actions_via_check;
ALTER TABLE operator_actions ADD CONSTRAINT operator_actions_via_check
    CHECK (via IN ('cli', 'page', 'api', 'timer')) NOT VALID;
-- ---- end of pauses ------------------------------------------------------------------------

-- W3C trace context of the photo (docs/tracing.md): filled by a PostgreSQL-only producer, or
-- by the first claim from its entry's `traceparent` field (never overwritten), so the feeder,
-- the sweep and a replay put it on every later entry: one photo, one trace. NULL: untraced.
ALTER TABLE photos ADD COLUMN IF NOT EXISTS traceparent text;
-- The span id (16 hex digits) of the delivery's `darkroom.process` span, written by the claim
-- that inserts the attempt row (NULL: that worker did not trace). A delivery SIGKILLed before
-- its span ended never exports it; the delivery that reclaims the job writes a span of this id
-- for it, ended `worker_died`, so the stages the dead one had exported find their parent.
ALTER TABLE photo_attempts ADD COLUMN IF NOT EXISTS span_id text;
-- Whether that span is known to have left (store/spans.py): set from the exporter's report
-- of the batch that held it, or by a late writer that wrote it from this row (or found
-- nothing to write). The statements that write a span id write it false (the claim's and
-- the history's whole row); every other insert, a worker's of a version before this column
-- included (a rolling upgrade), leaves it true: no late writer copies what such a worker
-- exported. Only traced rows that are not sent are in the partial index: tracing off, it
-- stays empty.
ALTER TABLE photo_attempts ADD COLUMN IF NOT EXISTS span_sent boolean NOT NULL DEFAULT true;
ALTER TABLE photo_attempts ALTER COLUMN span_sent SET DEFAULT true;
CREATE INDEX IF NOT EXISTS photo_attempts_unsent_idx ON photo_attempts (started_at)
    WHERE span_id IS NOT NULL AND NOT span_sent;

-- ---- per-tenant rate limits ------------------------------------------------------------------
-- The truth of each tenant's bulk rate (store/limits.py): the feeder reloads it every few
-- seconds; Redis holds only each bucket's state (queue/buckets.py), recreated from here
-- after a wipe. `per_s` 0 exempts the tenant from DARKROOM_TENANT_RATE; `interactive`
-- charges its interactive photos too (docs/fairness.md, "Rate limits").
CREATE TABLE IF NOT EXISTS tenant_limits (
    tenant      text             PRIMARY KEY,
    per_s       double precision NOT NULL CHECK (per_s >= 0 AND per_s <= 1000000),
    burst       integer          NOT NULL CHECK (burst >= 1),
    interactive boolean          NOT NULL DEFAULT false,
    shown       text             NOT NULL,
    updated_at  timestamptz      NOT NULL DEFAULT now()
);
-- The interactive uploads of a tenant charged for them, read by upload time every few
-- seconds (feeder.py): only rows that name a tenant (most producers name none).
CREATE INDEX IF NOT EXISTS photos_interactive_tenant_idx ON photos (tenant, created_at)
    WHERE lane = 'interactive' AND tenant <> '';
-- ---- end of per-tenant rate limits -----------------------------------------------------------

-- ---- erasure ------------------------------------------------------------------------------
-- `darkroom erase` (store/erasure.py): a terminal state no claim takes (CLAIM_SQL sees an
-- erased row as no row: `skipped`), `erased_at` when it happened; its event type is admitted
-- with the queue events' above. A database made before erasure has the narrower state check:
-- replaced once, NOT VALID (every existing row passes the narrower one: no scan under the
-- table's lock).
ALTER TABLE photos ADD COLUMN IF NOT EXISTS erased_at timestamptz;
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_constraint WHERE conname = 'photos_processing_state_check'
                   AND pg_get_constraintdef(oid) LIKE '%erased%') THEN
        ALTER TABLE photos DROP CONSTRAINT IF EXISTS photos_processing_state_check,
            ADD CONSTRAINT photos_processing_state_check CHECK (processing_state IN (
                'uploaded', 'processing', 'processed', 'processing_failed', 'erased')) NOT VALID;
    END IF;
END $$;
-- ---- end of erasure -----------------------------------------------------------------------

-- ---- upgrades -----------------------------------------------------------------------------
-- Deferred renditions (AVIF by default, or `:defer`; store/upgrading.py): an interactive
-- photo's publish that left some out sets `upgrade_requested_at`; a bulk-lane delivery then
-- claims the job (CLAIM_SQL: a processed photo with an upgrade requested is not finished for
-- a bulk entry), renders them, and its fenced upgrade adds them to the manifest and clears
-- it. Any publish of the photo sets or clears it with the renditions it writes.
ALTER TABLE photos ADD COLUMN IF NOT EXISTS upgrade_requested_at timestamptz;
-- the sweep's look for upgrades whose entry was never added (a worker gone between its
-- publish and the XADD): only the few photos with one requested
CREATE INDEX IF NOT EXISTS photos_upgrade_due_idx ON photos (upgrade_requested_at, id)
    WHERE upgrade_requested_at IS NOT NULL AND processing_state = 'processed';
-- ---- end of upgrades ----------------------------------------------------------------------
