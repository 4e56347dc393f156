"""Per-tenant rate limits end to end: three real worker processes, one tenant limited by
`darkroom limits set`, another without a limit; the limited one starts its photos at
about its rate while the other's are rendered meanwhile."""

from __future__ import annotations

import time

from tests.conftest import PHOTOS, Env

SMALL = PHOTOS / "4.webp"
RATE_PER_S, PHOTOS_EACH = 1, 8
# Photos claimed (first attempt's start) and finished, per tenant, oldest first.
TIMES_SQL = """
SELECT p.tenant, extract(epoch FROM j.started_at) AS started_s,
       extract(epoch FROM p.processed_at) AS finished_s
FROM photos p JOIN photo_jobs j ON j.photo_id = p.id
WHERE p.processing_state = 'processed'
ORDER BY j.started_at
"""


def wait_processed(env: Env, n: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    query = "SELECT count(*) AS n FROM photos WHERE processing_state = 'processed'"
    while env.query(query)[0]["n"] < n:
        assert time.monotonic() < deadline, "photos not processed in time"
        time.sleep(0.25)


def test_a_limited_tenant_starts_at_its_rate_while_another_takes_the_rest(
    file_env: Env,
) -> None:
    """`slow` at 1/s (burst 1) with 8 photos: their starts span at least 7 s (the limit's
    floor, whatever the load: without a limit three workers start them within a second or
    two) and at most a wide 35 s; `free`'s 8 photos all start before slow's last does (its
    renders fill the slots slow's limit leaves: a render's own time is the machine's load,
    so it is the starts that tell), and every photo of both is processed (none lost to the
    hold)."""
    file_env.cli("limits", "set", "slow", f"{RATE_PER_S}/s", "--burst", "1")
    for tenant in ("slow", "free"):
        file_env.cli("ingest", "--lane", "bulk", "--tenant", tenant, *[str(SMALL)] * PHOTOS_EACH)
    for _ in range(3):
        file_env.start("run", DARKROOM_CONCURRENCY="1")
    wait_processed(file_env, 2 * PHOTOS_EACH, timeout_s=180)
    rows = file_env.query(TIMES_SQL)
    slow = [r for r in rows if r["tenant"] == "slow"]
    free = [r for r in rows if r["tenant"] == "free"]
    assert len(slow) == len(free) == PHOTOS_EACH
    span_s = float(slow[-1]["started_s"] - slow[0]["started_s"])
    floor_s = (PHOTOS_EACH - 1) / RATE_PER_S
    assert 0.9 * floor_s <= span_s <= 5 * floor_s, f"slow's starts spanned {span_s:.1f} s"
    assert max(r["started_s"] for r in free) < slow[-1]["started_s"], "free waited for slow"
