"""PostgreSQL of the leased duties (darkroom_duties): take, renew and give up a duty's
lease, the fence a holder's writes carry, and who holds what. Every time is the
database's now(), never a worker's clock. Driver errors become darkroom errors here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from darkroom.store.db import Pool, translated

# The single runners (duty.py runs each): the feeder (bulk feeding and the PostgreSQL
# intake), the events relay, the sweep and the attempt history's retention.
FEEDER, RELAY, SWEEP, PRUNE = "feeder", "relay", "sweep", "history_prune"


@dataclass(frozen=True)
class Fence:
    """What a holder's fenced statement carries: the duty, its holder, the token it got."""

    name: str
    holder: str
    token: int

    @property
    def args(self) -> tuple[str, str, int]:
        return self.name, self.holder, self.token


def fenced(first: int) -> str:
    """SQL true while the fence in parameters $first..$first+2 (Fence.args) still holds: the
    same holder, the same token, the lease running. One primary key lookup. FOR SHARE: a
    takeover (an UPDATE of the row) waits for the fenced statement's commit, and a fenced
    statement that waited for a takeover sees the new holder: a write accepted under a
    token always commits before the next token exists."""
    a, b, c = first, first + 1, first + 2
    return (f"EXISTS (SELECT 1 FROM darkroom_duties WHERE name = ${a} AND holder = ${b}"
            f" AND token = ${c} AND expires_at > now() FOR SHARE)")  # fmt: skip


# Take the duty if nobody has it, its lease ran out, or it is already ours; a takeover
# (another holder, or our own expired lease) adds one to the token, keeping it leaves it.
# One statement: of two candidates at once, the second sees the first's row and gets none.
ACQUIRE_SQL = """
INSERT INTO darkroom_duties AS d (name, holder, token, acquired_at, renewed_at, expires_at)
VALUES ($1, $2, 1, now(), now(), now() + make_interval(secs => $3))
ON CONFLICT (name) DO UPDATE SET
    token = CASE WHEN d.holder = EXCLUDED.holder AND d.expires_at > now()
                 THEN d.token ELSE d.token + 1 END,
    acquired_at = CASE WHEN d.holder = EXCLUDED.holder AND d.expires_at > now()
                       THEN d.acquired_at ELSE now() END,
    holder = EXCLUDED.holder,
    renewed_at = now(),
    expires_at = EXCLUDED.expires_at
WHERE d.holder = EXCLUDED.holder OR d.expires_at <= now()
RETURNING token
"""

# Only the holder with the token it was given: a lease taken over since is never extended.
RENEW_SQL = """
UPDATE darkroom_duties SET renewed_at = now(), expires_at = now() + make_interval(secs => $4)
WHERE name = $1 AND holder = $2 AND token = $3
"""

# Expire, never delete: the token must keep growing across holders.
RELEASE_SQL = """
UPDATE darkroom_duties SET expires_at = least(expires_at, now())
WHERE name = $1 AND holder = $2 AND token = $3
"""

HOLDERS_SQL = """
SELECT name, holder, token, acquired_at AS since, renewed_at AS renewed, expires_at AS expires,
       round(extract(epoch FROM expires_at - now())::numeric, 1)::float8 AS expires_in_s
FROM darkroom_duties ORDER BY name
"""


@translated
async def acquire(pool: Pool, name: str, holder: str, lease_s: float) -> int | None:
    """The token of this holding, or None while another holder's lease runs."""
    token: int | None = await pool.fetchval(ACQUIRE_SQL, name, holder, lease_s)
    return token


@translated
async def renew(pool: Pool, fence: Fence, lease_s: float) -> bool:
    """Extend the lease by `lease_s` from now; False: taken over, the duty is lost."""
    return bool(await pool.execute(RENEW_SQL, *fence.args, lease_s) == "UPDATE 1")


@translated
async def release(pool: Pool, fence: Fence) -> bool:
    """End the lease now so another worker takes the duty at its next try; False if it
    was taken over already (nothing changed)."""
    return bool(await pool.execute(RELEASE_SQL, *fence.args) == "UPDATE 1")


@translated
async def holders(pool: Pool) -> list[dict[str, Any]]:
    """Every duty ever held: who holds (or last held) it, with what token, since when,
    until when."""
    return [dict(row) for row in await pool.fetch(HOLDERS_SQL)]
