"""The events stream (DARKROOM_EVENTS_STREAM): one field `event` per entry holding a
CloudEvents JSON document, capped by MAXLEN ~ (PostgreSQL keeps the history: photo_events).
Only the relay writes it; driver errors become QueueUnavailableError here, as in streams.
"""

from __future__ import annotations

from collections.abc import Sequence

from darkroom.queue.streams import Client, translated

FIELD = "event"


class EventStream:
    def __init__(self, client: Client, key: str, maxlen: int) -> None:
        self.client, self.key, self.maxlen = client, key, maxlen

    @translated
    async def append(self, documents: Sequence[str]) -> list[str]:
        """XADD each document in order, pipelined (one round trip); their entry ids. Not a
        transaction: a failure part-way leaves a prefix, which the relay sends again."""
        if not documents:
            return []
        pipe = self.client.pipeline(transaction=False)
        for document in documents:
            pipe.xadd(self.key, {FIELD: document}, maxlen=self.maxlen, approximate=True)
        return [_text(entry_id) for entry_id in await pipe.execute()]


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)
