"""Entries are untrusted bytes: whatever a producer XADDs (bytes that are not UTF-8, no or
a bad photo_id, a field twice, thousands of fields, megabyte values), the entry is
dead-lettered `bad_message` on its first delivery with an escaped, capped copy of what was
sent, and intake, `run --drain`, the sweep and a restarted worker go on with real work."""

from __future__ import annotations

import json
import re
import signal
import time
import uuid
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
import redis
import redis.asyncio

from darkroom.queue.messages import KEPT_CHARS, KEPT_FIELDS
from darkroom.queue.streams import Streams
from darkroom.settings import Settings
from darkroom.store import db
from darkroom.store.storage import FileStorage
from darkroom.worker import Worker
from tests.conftest import PHOTOS, REDIS_URL, Env
from tests.malformed import SHAPES, uid
from tests.test_web import start_web

GOOD = PHOTOS / "animated-loop-3.gif"  # the cheapest sample to render
OURS = {"photo_id", "source_id", "error_code", "error", "attempts", "stage", "consumer",
        "failed_at", "field_count", "lane", "tenant"}  # fmt: skip


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def shown(data: bytes) -> str:
    """What an operator sees, written independently of darkroom's code."""
    text = data.decode("utf-8", "backslashreplace")
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def xadd(client: redis.Redis, stream: str, flat: list[bytes]) -> str:
    return bytes(client.execute_command("XADD", stream, "*", *flat)).decode()


@pytest.fixture
def raw(file_env: Env) -> Iterator[redis.Redis]:
    """A client that reads bytes, as a producer's or an inspector's would."""
    client = redis.Redis.from_url(REDIS_URL)
    yield client
    client.close()


def letters_by_source(raw: redis.Redis, env: Env) -> dict[str, list[dict[str, str]]]:
    found: dict[str, list[dict[str, str]]] = {}
    for _, fields in raw.xrange(env.dead):
        letter = {k.decode(): v.decode() for k, v in fields.items()}  # our letters are UTF-8
        found.setdefault(letter["source_id"], []).append(letter)
    return found


def letters_of(
    letters: dict[str, list[dict[str, str]]], sent: dict[str, str], shape: str
) -> dict[str, str]:
    return next(ls[0] for s, ls in letters.items() if sent[s] == shape)


def check_kept(letter: dict[str, str], flat: list[bytes]) -> None:
    """The letter keeps the first 64 fields sent, escaped, each cut to 1 KiB plus its size."""
    sent = list(zip(flat[::2], flat[1::2], strict=True))
    kept = {k: v for k, v in letter.items() if k not in OURS}
    assert int(letter["field_count"]) == len(sent)
    assert len(kept) == min(len(sent), KEPT_FIELDS), "a repeated name is numbered, not lost"
    for name, value in sent[:KEPT_FIELDS]:
        want = shown(value)
        if len(want) > KEPT_CHARS:
            assert any(v.endswith(f"… [{len(value)} bytes]") and v[:32] == want[:32]
                       and len(v) <= KEPT_CHARS + 20 for v in kept.values())  # fmt: skip
        else:
            assert want in kept.values()
        assert shown(name)[:KEPT_CHARS] in "".join(letter), name[:40]


def test_every_malformed_shape_is_dead_lettered_once_on_its_first_delivery(
    file_env: Env, raw: redis.Redis
) -> None:
    """33 malformed entries among good photos through `run --drain`: each is dead-lettered
    once as bad_message on delivery 1 with an escaped, capped copy; the photos publish."""
    before = file_env.ingest([GOOD, GOOD])
    sent = {xadd(raw, file_env.stream, flat): shape for shape, flat in SHAPES.items()}
    after = file_env.ingest([GOOD, GOOD])
    started = time.monotonic()
    log = file_env.cli("run", "--drain", timeout=120).stderr
    drained_s = time.monotonic() - started
    letters = letters_by_source(raw, file_env)
    found = Counter({sent.get(s, s): len(ls) for s, ls in letters.items()})
    assert found == Counter(dict.fromkeys(SHAPES, 1)), "each dead-lettered once, nothing else"
    for source, shape in sent.items():
        [letter] = letters[source]
        assert (letter["error_code"], letter["attempts"], letter["photo_id"]) == (
            "bad_message", "1", ""), shape  # fmt: skip
        assert len(letter) <= KEPT_FIELDS + len(OURS) and letter["error"].isprintable(), shape
        check_kept(letter, SHAPES[shape])
    reported = letters_of(letters, sent, "a note that is not UTF-8")
    assert reported["note"] == "\\xff\\xfe" and "note" in reported["error"]
    assert letters_of(letters, sent, "20,000 fields")["field_count"] == "20000"
    states = file_env.query("SELECT processing_state, visibility FROM photos")
    assert len(states) == 4 and {tuple(r.values()) for r in states} == {("processed", "published")}
    assert {r["id"] for r in file_env.query("SELECT id FROM photos")} == {*before, *after}
    assert (raw.xlen(file_env.stream), raw.xpending(file_env.stream, "darkroom")["pending"]) == (
        0, 0)  # fmt: skip
    assert "intake failed" not in log and drained_s < 60
    print(f"drained 33 malformed entries and 4 photos in {drained_s:.1f} s")


def test_a_restarted_worker_with_a_fixed_name_dead_letters_its_poison_entry_then_works(
    file_env: Env, raw: redis.Redis
) -> None:
    """A worker killed holding a malformed entry restarts under the same DARKROOM_CONSUMER,
    dead-letters that entry once and then publishes a photo added afterwards."""
    raw.xgroup_create(file_env.stream, "darkroom", id="0", mkstream=True)
    poison = xadd(raw, file_env.stream, [b"photo_id", uid(), b"note", b"\xff\xfe"])
    # what a worker named "fixed" held when it was SIGKILLed: delivered, never acked
    raw.xreadgroup("darkroom", "fixed", {file_env.stream: ">"}, count=1)
    worker = file_env.start("run", DARKROOM_CONSUMER="fixed")
    deadline = time.monotonic() + 60
    while raw.xlen(file_env.dead) == 0:
        assert time.monotonic() < deadline and worker.poll() is None, "no dead letter"
        time.sleep(0.05)
    [photo_id] = file_env.ingest([GOOD])
    sql = "SELECT 1 FROM photos WHERE id = $1 AND processing_state = 'processed'"
    while not file_env.query(sql, photo_id):
        assert time.monotonic() < deadline and worker.poll() is None, "the photo never published"
        time.sleep(0.05)
    worker.send_signal(signal.SIGTERM)
    _, stderr = worker.communicate(timeout=60)
    assert worker.returncode == 0, stderr
    [[letter]] = letters_by_source(raw, file_env).values()
    assert (letter["source_id"], letter["error_code"], letter["attempts"]) == (
        poison, "bad_message", "2"), "the restart's XCLAIM is its second delivery"  # fmt: skip
    assert letter["consumer"] == "fixed" and stderr.count("dead-lettered") == 1
    assert raw.xlen(file_env.stream) == 0 and "intake failed" not in stderr


async def test_an_entry_past_the_cap_is_given_up_whatever_it_holds(
    file_env: Env, raw: redis.Redis
) -> None:
    """Delivered past the stream's backstop (4 × DARKROOM_MAX_ATTEMPTS + 10), a malformed
    entry is dead-lettered attempts_exhausted (the backstop comes before parsing), its
    problem named in the message."""
    client = redis.asyncio.Redis.from_url(REDIS_URL)
    streams = Streams(client, file_env.stream, "darkroom", "w", file_env.dead)
    pool = await db.connect(file_env.database_url, 2)
    try:
        await streams.ensure_group()
        xadd(raw, file_env.stream, [b"photo_id", uid(), b"note", b"\xff"])
        [entry] = await streams.read_new(1, 100)
        settings = Settings(max_attempts=3, stream=streams.stream,
                            dead_letter_stream=streams.dead_stream)  # fmt: skip
        worker = Worker(settings, pool, streams, FileStorage(file_env.tmp / "storage"))
        await worker.jobs.handle(entry, 4 * settings.max_attempts + 11)
    finally:
        await client.aclose()
        await pool.close()
    [[letter]] = letters_by_source(raw, file_env).values()
    assert (letter["error_code"], letter["attempts"]) == ("attempts_exhausted", "23")
    assert "delivered 23 times" in letter["error"] and "not UTF-8" in letter["error"]
    assert letter["note"] == "\\xff" and raw.xlen(file_env.stream) == 0


def test_dead_letters_of_any_bytes_are_listed_replayed_and_shown(
    file_env: Env, raw: redis.Redis
) -> None:
    """Letters another writer put in the dead-letter stream (bytes that are not UTF-8, a
    terminal escape, a field twice, 1 MB): `dlq list`, `dlq replay` and /dead-letters work,
    showing them escaped."""
    file_env.cli("enqueue", str(uuid.uuid4()))  # creates the group
    junk = [b"photo_id", b"\xff", b"error_code", b"bad_message", b"error", b"\x1b[2J\xfe",
            b"x", b"1", b"x", b"2", b"blob", b"\xfe" * 1_000_000]  # fmt: skip
    letter_id = xadd(raw, file_env.dead, junk)
    listed = file_env.cli("dlq", "list").stdout
    assert letter_id in listed and "\\xff" in listed and "\\x1b[2J\\xfe" in listed
    assert "\x1b" not in listed
    [as_json] = json.loads(file_env.cli("dlq", "list", "--json").stdout)
    assert (as_json["id"], as_json["photo_id"], as_json["x"]) == (letter_id, "\\xff", "2")
    assert "would replay" in file_env.cli("dlq", "replay", "--dry-run").stdout
    replayed = file_env.cli("dlq", "replay")
    assert "skipped" in replayed.stdout and raw.xlen(file_env.dead) == 1
    base = start_web(file_env)
    page = httpx.get(f"{base}/dead-letters", timeout=10)
    assert page.status_code == 200 and letter_id in page.text
    assert "\\x1b[2J\\xfe" in page.text and "\x1b" not in page.text
