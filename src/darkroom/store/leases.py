"""A job's lease in PostgreSQL: the claim that grants it with a fencing token, and every
write its holder makes under it (renewal, transient streak, release, retry, final failure,
failed re-render). Each such write is conditioned on the token the claim returned: a claim
by anyone since makes it match no row, so a holder that froze past its lease cannot change
what the new holder owns. A refused write says so (False, or an outcome naming it).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Literal

from darkroom.store.db import Pool, translated
from darkroom.store.entries import appended

Outcome = Literal["claimed", "already", "skipped", "busy", "exhausted", "paused"]
NO_PHOTO = uuid.UUID(int=0)


@dataclass(frozen=True)
class Died:
    """The delivery a claim took the job from, cut short by its worker's death: its
    `running` attempt row, kept for its `darkroom.process` span to be written by the claimer
    (docs/tracing.md). Only a traced claim reads it."""

    span_id: str  # as the dead delivery stored it (16 hex digits)
    started_at: datetime
    entry_id: str
    lane: str
    attempt: int  # the attempt its claim counted, of its run
    tenant: str
    traceparent: str | None  # the photo's


@dataclass(frozen=True)
class Claim:
    outcome: Outcome
    original_key: str = ""
    # This run's attempt number: of this claim (claimed), of the refused one (exhausted),
    # or the job's (busy).
    attempt: int = 0
    state: str = ""
    # For a photo that already failed: where and how (to finish an unwritten dead letter);
    # for a busy job: the entry it was claimed through.
    last_entry: str | None = None
    error_code: str | None = None
    last_error: str | None = None
    photo_id: uuid.UUID = NO_PHOTO
    counted: bool = False  # this claim counted an attempt (not a claim by its own holder)
    owner: str | None = None  # busy: the consumer whose live process holds the job
    history_row: int | None = None  # the delivery's `running` row in photo_attempts
    # The fencing token this claim was granted (claimed, exhausted): every write under the
    # lease carries it. 0 for a claim that took no job.
    token: int = 0
    # The claim of a processed photo's upgrade (its deferred renditions), not a render.
    upgrade: bool = False
    died: Died | None = None  # a traced claim that took the job from a dead delivery


# One statement. Lock the photo, then its job (so the job is read as it is now, not as the
# statement's snapshot saw it before the photo's lock was granted). A terminal photo
# (processed, or failed and not reset by a retry) is left alone: `already`. A job active
# under a live lease of another consumer's process (its owner lives; a Redis outage ate its
# heartbeat) is left alone too: `busy`, nothing counted. A claim by the job's own holder (a
# lost reply, a reclaim of its own entry) counts nothing; any other claim counts one
# attempt; past this run's attempts it is `exhausted`, and the job is taken all the same (it
# is this delivery that records the failure, and only a job's owner may: FAIL_SQL).
# Own means this process and this entry: another entry of a photo this process is working
# on (a duplicate XADD, e.g. a producer's and the intake's) is `busy`, never a second render.
# A job that is done or failed (a re-render, an operator retry) starts a new run. The photo
# becomes `processing`; a processed photo with a re-render requested stays processed.
# A processed photo with an upgrade requested (deferred renditions, store/upgrading.py) and
# no re-render is claimed by a bulk entry (never an interactive one: heavy encodes stay off
# that lane) as an upgrade; with a re-render requested too, the re-render comes first.
# An erased photo is no photo to work on (its row stays, for the record): `skipped`, as a
# deleted one. A claim waiting for the row's lock re-reads it once granted, so a claim
# that queued behind an erase sees it erased.
# A claim sets `enqueued_at` if unset: the PostgreSQL intake never enqueues a photo again
# once a worker claimed it through its producer's own XADD.
# Every claim that takes the job, its own holder's included, grants the next fencing token
# (`lease_token`, which only grows) and records the re-render generation it renders
# (`generation`): a publish clears the requests up to that generation, no further.
# An unfinished photo of a paused scope (queue_pauses, in force: `until` against now(); a
# lane pause holds the lane of the entry's stream, $8, and the photo's own lane, which an
# operator's move may have changed since that entry was added) is left alone: `paused`, nothing
# counted, nothing written; but a claim by the job's own holder (work in progress, its
# first reply lost) goes on. Read by this statement, a pause committed before it started
# holds whatever any worker has heard of it.
# An entry whose job run ended (`spent`: done or failed through this very entry) starts
# nothing, whatever was requested since: a request has an entry of its own (the feeder's,
# the intake's, `again`'s). A reclaim of an entry its old holder then finished and acked
# would otherwise take the job for a re-render under an entry already deleted from the
# stream: were its worker to die, no reclaim could find the job, and duplicates of the
# photo, answered `busy` by that lease, are acked meanwhile. So is every entry the job's
# `dropped_entries` names (store/entries.py): this claim notes the one it leaves alone and
# its worker acks (the photo finished, or a live lease held the job through another
# entry), and, starting a new run, the entry of the run that ended.
# A traced claim ($10: its delivery's span id, else NULL) writes the span id on the attempt
# row it inserts; and when it takes the job from another delivery whose row is still
# `running` (its lease ran out, or the sweep re-enqueued the job meanwhile: its worker
# died), it answers that row, whose span is written by the claimer (docs/tracing.md).
# Untraced, that look is skipped whole (a constant filter).
CLAIM_SQL = f"""
WITH p AS (
    SELECT id, original_key, processing_state, rerender_generation, lane, tenant, traceparent,
           processing_state IN ('processed', 'processing_failed')
           AND NOT (processing_state = 'processed' AND rerender_requested_at IS NOT NULL)
           AND NOT (processing_state = 'processed' AND upgrade_requested_at IS NOT NULL
                    AND $8 IS DISTINCT FROM 'interactive')
           AS finished,
           processing_state = 'processed' AS rerender,
           processing_state = 'processed' AND rerender_requested_at IS NULL
           AND upgrade_requested_at IS NOT NULL AS upgrade
    FROM photos WHERE id = $1 AND processing_state <> 'erased' FOR UPDATE
), prior AS (
    SELECT j.id, j.state, j.attempt, j.run_offset, j.stream_entry, j.consumer, j.error_code,
           j.last_error, j.lease_token, j.started_at, j.lease_until,
           j.state = 'active' AND j.holder = $4 AND j.stream_entry = $2 AS own,
           (j.state IN ('done', 'failed') AND j.stream_entry = $2)
           OR $2 = ANY(j.dropped_entries) AS spent,
           j.state = 'active' AND j.lease_until > now()
           AND ((j.holder IS DISTINCT FROM $4 AND j.consumer IS DISTINCT FROM $3)
                OR (j.holder = $4 AND j.stream_entry IS DISTINCT FROM $2)) AS held
    FROM photo_jobs j JOIN p ON j.photo_id = p.id
    WHERE j.photo_id = $1 AND j.type = 'process'
    FOR UPDATE OF j
), paused AS (
    SELECT EXISTS (
        SELECT 1 FROM queue_pauses q JOIN p ON true
        WHERE (q.lane IS NULL OR q.lane = coalesce($8, p.lane) OR q.lane = p.lane)
          AND (q.tenant IS NULL OR q.tenant = p.tenant)
          AND (q.until IS NULL OR q.until > now())) AS held
), next AS (
    SELECT p.id AS photo_id, prior.id AS job_id, coalesce(prior.own, false) AS own,
           coalesce(prior.attempt, 0) + CASE WHEN prior.own THEN 0 ELSE 1 END AS attempt,
           CASE WHEN prior.state IN ('done', 'failed') THEN prior.attempt
                ELSE coalesce(prior.run_offset, 0) END AS run_offset,
           coalesce(prior.lease_token, 0) + 1 AS lease_token,
           p.rerender_generation AS generation
    FROM p LEFT JOIN prior ON true
    WHERE NOT p.finished AND NOT coalesce(prior.held, false) AND NOT coalesce(prior.spent, false)
      AND (NOT (SELECT held FROM paused) OR coalesce(prior.own, false))
), dropped AS (
    -- what jobs.py acks: `already` (a finished photo) and `busy` under another entry's
    -- live lease, unless paused (that entry stays pending); the last 16 are kept
    UPDATE photo_jobs j SET dropped_entries = {appended("$2")}
    FROM prior, p
    WHERE j.id = prior.id AND NOT prior.spent
      AND (p.finished OR (prior.held AND prior.stream_entry IS DISTINCT FROM $2
                          AND NOT (SELECT held FROM paused)))
), job AS (
    INSERT INTO photo_jobs AS j (id, photo_id, type, state, attempt, run_offset, stream_entry,
                                 consumer, holder, lease_until, started_at, lease_token,
                                 generation)
    SELECT coalesce(job_id, nextval(pg_get_serial_sequence('photo_jobs', 'id'))), photo_id,
           'process', 'active', attempt, run_offset, $2, $3, $4,
           now() + $5 * interval '1 millisecond', now(), lease_token, generation
    FROM next
    ON CONFLICT (photo_id, type) DO UPDATE SET
        state = 'active',
        attempt = EXCLUDED.attempt,
        run_offset = EXCLUDED.run_offset,
        stream_entry = EXCLUDED.stream_entry,
        consumer = EXCLUDED.consumer,
        holder = EXCLUDED.holder,
        lease_until = EXCLUDED.lease_until,
        lease_token = EXCLUDED.lease_token,
        generation = EXCLUDED.generation,
        -- a finished run's entry, acked by its worker: the job no longer names it
        dropped_entries = CASE WHEN j.state IN ('done', 'failed')
                               THEN {appended("j.stream_entry")} ELSE j.dropped_entries END,
        started_at = now(),
        next_retry_at = NULL,
        updated_at = now()
    -- only the job locked in `prior`: one inserted meanwhile is another claim's
    WHERE j.id = EXCLUDED.id
    RETURNING attempt - run_offset AS run_attempt, lease_token
), photo AS (
    UPDATE photos SET processing_state = 'processing', error_code = NULL, updated_at = now(),
        last_activity_at = now(), enqueued_at = coalesce(photos.enqueued_at, now()),
        traceparent = coalesce(photos.traceparent, $9::text)
    FROM p WHERE photos.id = $1 AND p.id = $1 AND NOT p.rerender AND EXISTS (SELECT 1 FROM job)
), attempt_row AS (
    -- the delivery's `running` history row, in the claim's own commit ($7: its lane;
    -- NULL with DARKROOM_HISTORY=false). A claim by the job's own holder (its first reply
    -- was lost) has its row already: no second one, which would stay `running` for good.
    INSERT INTO photo_attempts (photo_id, entry_id, consumer, lane, span_id, span_sent)
    SELECT $1, $2, $3, $7, $10, $10::text IS NULL FROM job
    WHERE $7::text IS NOT NULL AND NOT (SELECT own FROM next)
    RETURNING id
), died AS (
    -- traced ($10, this delivery's span id): the row of the claim this one takes the job
    -- from (the photo's latest from the job's start back, its consumer's: that claim wrote
    -- both with one now(); one entry of photo_attempts_photo_idx, read backwards) if still
    -- `running` under a lease that ran out: that delivery never ended (its worker died, or
    -- a sweep re-enqueued the job from its expired lease), and its span is written now.
    -- A retry or a release ends its row just after its own statement, with its lease still
    -- running (a retry) or cleared (a release): neither is taken for dead. The photo's own
    -- context only: a delivery of a photo without one was a trace of its own.
    SELECT last.span_id, last.started_at, last.entry_id, last.lane,
           prior.attempt - prior.run_offset AS attempt, p.tenant,
           p.traceparent
    FROM prior JOIN p ON true CROSS JOIN LATERAL (
        SELECT a.span_id, a.started_at, a.entry_id, a.lane, a.outcome, a.consumer
        FROM photo_attempts a WHERE a.photo_id = $1 AND a.started_at <= prior.started_at
        ORDER BY a.started_at DESC, a.id DESC LIMIT 1) last
    WHERE $10::text IS NOT NULL AND prior.state IN ('active', 'pending') AND NOT prior.own
      AND prior.consumer IS NOT NULL AND prior.lease_until <= now()
      AND last.consumer = prior.consumer AND last.outcome = 'running'
      AND last.span_id IS NOT NULL AND EXISTS (SELECT 1 FROM job)
), own_row AS (
    SELECT a.id FROM photo_attempts a
    WHERE a.photo_id = $1 AND a.entry_id = $2 AND a.consumer = $3 AND a.outcome = 'running'
      AND $7::text IS NOT NULL AND (SELECT own FROM next) AND EXISTS (SELECT 1 FROM job)
    ORDER BY a.id DESC LIMIT 1
)
SELECT p.original_key, p.finished OR coalesce(prior.spent, false) AS finished,
       p.processing_state, p.upgrade, job.run_attempt, job.lease_token,
       next.attempt - next.run_offset AS next_attempt, next.own,
       NOT next.own AND next.attempt - next.run_offset > $6 AS over_cap, prior.held,
       prior.stream_entry, prior.consumer, prior.error_code, prior.last_error,
       coalesce((SELECT id FROM attempt_row), (SELECT id FROM own_row)) AS attempt_row,
       (SELECT held FROM paused) AND NOT coalesce(prior.own, false) AS paused,
       died.span_id AS died_span, died.started_at AS died_at, died.entry_id AS died_entry,
       died.lane AS died_lane, died.attempt AS died_attempt, died.tenant AS died_tenant,
       died.traceparent AS died_traceparent
FROM p LEFT JOIN job ON true LEFT JOIN prior ON true LEFT JOIN next ON true
     LEFT JOIN died ON true
"""


@dataclass(frozen=True)
class Lease:
    """Who claims: the worker process (`holder`, unique per process), how long its lease
    runs between heartbeats, and this run's attempt cap (DARKROOM_MAX_ATTEMPTS)."""

    holder: str | None
    ms: int
    max_attempts: int

    @property
    def args(self) -> tuple[str | None, int, int]:
        """CLAIM_SQL's $4, $5, $6."""
        return self.holder, self.ms, self.max_attempts


# A claim from outside any worker process (a tool, a test): every one counts, none is
# held, no cap.
NO_LEASE = Lease(None, 0, 2**31 - 1)


@translated
async def claim(
    pool: Pool,
    photo_id: uuid.UUID,
    entry_id: str,
    consumer: str,
    lease: Lease = NO_LEASE,
    history_lane: str | None = None,
    lane: str | None = None,
    traceparent: str | None = None,
    span_id: str | None = None,
) -> Claim:
    """`history_lane`: write the delivery's `running` history row (with that lane) in the
    same statement when a job is claimed; None writes none. `lane`: the stream the entry
    came from, which a pause of a lane holds (None: the photo's own lane). `traceparent`:
    the entry's, kept on a photo that has none yet (every later hop carries it). `span_id`:
    the delivery's span (tracing on), kept on its row; the claim then answers `died`."""
    args = (photo_id, entry_id, consumer, *lease.args, history_lane, lane, traceparent, span_id)
    row = await pool.fetchrow(CLAIM_SQL, *args)
    if row is None:
        return Claim("skipped", photo_id=photo_id)
    return _claim_of(photo_id, row)


def _claim_of(photo_id: uuid.UUID, row: Any) -> Claim:
    base = Claim("already", row["original_key"], state=row["processing_state"],
                 last_entry=row["stream_entry"], error_code=row["error_code"],
                 last_error=row["last_error"], photo_id=photo_id,
                 history_row=row["attempt_row"],
                 token=row["lease_token"] or 0, upgrade=bool(row["upgrade"]),
                 died=_died(row))  # fmt: skip
    if row["finished"]:
        return base
    if row["paused"]:
        return replace(base, outcome="paused", token=0)
    if row["over_cap"]:  # the job is taken all the same: only its owner records a failure
        return replace(base, outcome="exhausted", attempt=row["next_attempt"])
    if row["run_attempt"] is not None:
        return replace(base, outcome="claimed", attempt=row["run_attempt"], counted=not row["own"])
    # a live owner, or (rarely) a claim that committed while this one waited for the photo
    return replace(base, outcome="busy", owner=row["consumer"] if row["held"] else None)


def _died(row: Any) -> Died | None:
    if row["died_span"] is None:
        return None
    return Died(row["died_span"], row["died_at"], row["died_entry"], row["died_lane"],
                row["died_attempt"], row["died_tenant"], row["died_traceparent"])  # fmt: skip


# The heartbeat of this process's claims: their leases move on, so a worker that reclaims
# one of their entries (a Redis outage ate the stream's heartbeat) finds the owner alive.
# Each lease by its own token: a job claimed since by anyone is not renewed. `= ANY($1)`
# finds the held jobs by their key, not among every active job of the deployment.
RENEW_SQL = """
UPDATE photo_jobs j SET lease_until = now() + $3 * interval '1 millisecond'
FROM unnest($1::uuid[], $2::bigint[]) AS held(photo_id, token)
WHERE j.photo_id = ANY($1::uuid[]) AND j.type = 'process'
  AND j.photo_id = held.photo_id AND j.state = 'active' AND j.lease_token = held.token
RETURNING j.photo_id
"""


@translated
async def renew_leases(
    pool: Pool, lease: Lease, held: list[tuple[uuid.UUID, int]]
) -> set[uuid.UUID]:
    """Renew each (photo, token) still held; the photos whose lease was renewed (a photo
    missing from the answer has been claimed by someone since: its lease is lost)."""
    if not held:
        return set()
    photos, tokens = [p for p, _ in held], [t for _, t in held]
    rows = await pool.fetch(RENEW_SQL, photos, tokens, lease.ms)
    return {row["photo_id"] for row in rows}


# The photo's streak of transient errors, on the job this lease holds: started now unless
# one runs already (`$3`: an outage ended the last one); its age in seconds, by the
# database's clock. Kept across restarts and reclaims; publish, failure and retry clear it.
STREAK_SQL = """
UPDATE photo_jobs SET transient_since = CASE WHEN $3 OR transient_since IS NULL THEN now()
                                             ELSE transient_since END
WHERE photo_id = $1 AND type = 'process' AND state = 'active' AND lease_token = $2
RETURNING extract(epoch FROM now() - transient_since)::float8
"""


@translated
async def transient_streak_s(
    pool: Pool, photo_id: uuid.UUID, token: int, restart: bool
) -> float | None:
    """None when the lease of `token` is lost."""
    age_s: float | None = await pool.fetchval(STREAK_SQL, photo_id, token, restart)
    return age_s


# A stop cut this lease short (a wait in place, the grace period): not an attempt. Undone
# in the statement that gives the job back, so the next claim counts once.
RELEASE_SQL = """
UPDATE photo_jobs SET state = 'pending', attempt = greatest(run_offset, attempt - 1),
    lease_until = NULL, updated_at = now()
WHERE photo_id = $1 AND type = 'process' AND state = 'active' AND lease_token = $2
RETURNING attempt
"""


@translated
async def release(pool: Pool, photo_id: uuid.UUID, token: int) -> bool:
    """False when the lease of `token` is lost (nothing is changed then)."""
    return await pool.fetchval(RELEASE_SQL, photo_id, token) is not None


@translated
async def leave_or_drop(
    pool: Pool, photo_id: uuid.UUID, token: int, entry_id: str
) -> Literal["left", "dropped"]:
    """After a failure this delivery could not record: `left` when another lease holds the
    job through this same entry (active, or pending after that lease's retry or release),
    whose holder acks it; else `dropped`, noted on the job in the same statement, and the
    caller acks it (a stale duplicate, or a job that ended otherwise)."""
    left = await pool.fetchval(LEAVE_OR_DROP_SQL, photo_id, token, entry_id)
    return "left" if left else "dropped"


# The job locked as it is now; its one lock, so no order against the photo's to keep.
LEAVE_OR_DROP_SQL = f"""
WITH j AS (
    SELECT id, coalesce(state IN ('active', 'pending') AND lease_token <> $2
                        AND stream_entry = $3, false) AS left_to
    FROM photo_jobs WHERE photo_id = $1 AND type = 'process'
    FOR UPDATE
), dropped AS (
    UPDATE photo_jobs SET dropped_entries = {appended("$3", "photo_jobs")}
    FROM j WHERE photo_jobs.id = j.id AND NOT j.left_to
)
SELECT coalesce((SELECT left_to FROM j), false)
"""
