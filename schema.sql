-- darkroom schema: applied idempotently by `darkroom migrate`.
-- Postgres is the source of truth; the Redis stream is only the delivery mechanism.

CREATE TABLE IF NOT EXISTS photos (
    id               uuid PRIMARY KEY,
    original_key     text        NOT NULL,
    processing_state text        NOT NULL DEFAULT 'uploaded'
        CONSTRAINT photos_processing_state_check
        CHECK (processing_state IN ('uploaded', 'processing', 'processed', 'processing_failed')),
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

-- the sweeper's scan: photos not yet terminal, oldest first
CREATE INDEX IF NOT EXISTS photos_unfinished_idx
    ON photos (updated_at) WHERE processing_state IN ('uploaded', 'processing');

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

-- the operator's page: keyset pages of photos (newest first, by state) and the throughput chart
CREATE INDEX IF NOT EXISTS photos_updated_idx ON photos (updated_at, id);
CREATE INDEX IF NOT EXISTS photos_state_updated_idx ON photos (processing_state, updated_at, id);
CREATE INDEX IF NOT EXISTS photos_processed_at_idx ON photos (processed_at)
    WHERE processed_at IS NOT NULL;
