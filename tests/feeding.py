"""For tests only: set the scene the feeder (feeder.py) would leave, where no worker runs.
Every unfinished bulk photo not fed yet is XADDed to the bulk stream, oldest first, and
recorded as the feeder records it."""

from __future__ import annotations

import uuid
from typing import Any

from darkroom.store import db

UNFED_SQL = """
SELECT id, tenant FROM photos
WHERE lane = 'bulk' AND enqueued_at IS NULL
  AND (processing_state IN ('uploaded', 'processing') OR rerender_requested_at IS NOT NULL)
ORDER BY created_at, id
"""


def bulk_stream(env: Any) -> str:
    return f"{env.stream}:bulk"


def feed_bulk(env: Any) -> list[uuid.UUID]:
    """XADD `photo_id` + `tenant` of every unfed bulk photo; the photos fed."""
    fed = []
    for row in env.query(UNFED_SQL):
        fields = {"photo_id": str(row["id"]), "tenant": row["tenant"]}
        entry_id = env.redis.xadd(bulk_stream(env), fields)
        env.query(db.REQUEUED_SQL, row["id"], entry_id)
        fed.append(row["id"])
    return fed
