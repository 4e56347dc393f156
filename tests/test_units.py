"""Pure pieces: settings parsing, retry policy, entry codec, and the import arrows."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from darkroom.config.env import MINIMUMS, PARSERS, env_name, from_env
from darkroom.config.redis_url import REDIS_MINIMUMS
from darkroom.errors import (
    ERROR_CODES,
    BadMessageError,
    CorruptImageError,
    SettingsError,
    StorageUnavailableError,
)
from darkroom.operate.web.auth import Auth
from darkroom.queue import policy
from darkroom.queue.messages import (
    KEPT_CHARS,
    KEPT_FIELDS,
    DeadLetter,
    Entry,
    escaped,
    parse_task,
    received,
)
from darkroom.settings import AUTO_TARGET, RenditionSpec, Settings, parse_renditions, redact
from darkroom.store import keys

SRC = Path(__file__).parents[1] / "src" / "darkroom"


def test_defaults_match_the_documented_contract() -> None:
    """With no variables set, the defaults are the documented ones."""
    s = from_env({})
    assert s.redis_url == "redis://127.0.0.1:6379/0"
    assert s.database_url == "postgresql://postgres@127.0.0.1:5432/darkroom"
    assert s.storage_url == "file:./var/storage"
    assert (s.stream, s.dead_letter_stream) == ("{darkroom}:photos", "{darkroom}:dead")
    assert s.shutdown_grace_s == 30 and s.concurrency >= 1 and s.max_attempts == 5
    assert [(r.name, r.size, r.format, r.quality) for r in s.renditions] == [
        ("thumb", 320, "webp", 80), ("medium", 1024, "webp", 80),
        ("medium", 1024, "jpeg", 82), ("large", 2048, "webp", 80)]  # fmt: skip


def test_stream_keys_share_one_hash_tag() -> None:
    """Work and dead-letter streams hash to one Redis Cluster slot (one script moves entries)."""
    s = from_env({})
    assert s.stream.split("}")[0] == s.dead_letter_stream.split("}")[0] == "{darkroom"


def test_renditions_setting_parses_and_rejects() -> None:
    """DARKROOM_RENDITIONS takes name:SIZE:format[:OPTION]...; mistakes name the item."""
    assert parse_renditions("a:64:png, b:100:jpg:70") == (
        RenditionSpec("a", 64, "png", 100), RenditionSpec("b", 100, "jpeg", 70))  # fmt: skip
    for bad in [
        "a:64",
        "a:64:gif",
        "a:0:webp",
        "a:64:webp:101",
        "a:64:webp,a:32:webp",
        "A!:64:webp",
        "a:64x:webp",
        "a:8x64:webp",
        "a:64:webp:crop=attention",
        "a:64x64:webp:crop=left",
        "a:64:webp:q=80:q=70",
        "a:64:webp:80:size=3",
    ]:
        with pytest.raises(ValueError):  # noqa: PT011 - the message varies by mistake
            parse_renditions(bad)


def test_rendition_boxes_options_and_quality_targets() -> None:
    """Boxes, q=N, crop, q=auto and score=N parse; a target on PNG or out of range is refused."""
    assert parse_renditions("avatar:256x256:webp:crop=attention, b:300x200:jpg:q=70") == (
        RenditionSpec("avatar", 256, "webp", 80, (256, 256), "attention"),
        RenditionSpec("b", 300, "jpeg", 70, (300, 200)),
    )
    assert parse_renditions("c:64x32:avif:crop=centre:50")[0].quality == 50
    assert parse_renditions("t:320:webp:q=75") == parse_renditions("t:320:webp:75")
    assert parse_renditions("t:320:webp:q=auto")[0].target == AUTO_TARGET["webp"]
    assert parse_renditions("t:320x320:jpeg:score=80:crop=centre")[0].target == 80.0
    assert parse_renditions("t:320:webp")[0].target is None
    for bad in (
        "png:q=auto",
        "webp:score=99",
        "webp:score=29",
        "webp:q=80:score=70",
        "webp:q=best",
    ):
        with pytest.raises(ValueError):  # noqa: PT011 - the message varies by mistake
            parse_renditions(f"t:320:{bad}")
    with pytest.raises(SettingsError, match=r"^DARKROOM_RENDITIONS: .*score must be 30..95"):
        from_env({"DARKROOM_RENDITIONS": "t:320:webp:score=10"})


def test_settings_error_names_the_variable() -> None:
    """A bad value's error message starts with the variable's name."""
    expected = r"^DARKROOM_MAX_ATTEMPTS: must be a finite number of at least 1"
    with pytest.raises(SettingsError, match=expected):
        from_env({"DARKROOM_MAX_ATTEMPTS": "0"})


def test_policy_retries_transient_errors_with_capped_backoff() -> None:
    """Transient errors retry with growing, jittered, capped delays until the cap."""
    error = StorageUnavailableError("down")
    delays = [
        policy.decide(n, error, max_attempts=9, base_ms=1000, cap_ms=30_000, rand=lambda: 1.0)
        for n in range(1, 8)
    ]
    assert delays == [policy.Retry(d) for d in (1000, 2000, 4000, 8000, 16000, 30000, 30000)]
    low = policy.decide(3, error, max_attempts=9, base_ms=1000, cap_ms=30_000, rand=lambda: 0.0)
    assert low == policy.Retry(2000)
    assert policy.decide(9, error, max_attempts=9, base_ms=1, cap_ms=1) == policy.DeadLetter(
        "storage_unavailable"
    )


def test_policy_dead_letters_permanent_errors_at_once() -> None:
    """A permanent error is never retried."""
    decision = policy.decide(1, CorruptImageError("x"), max_attempts=5, base_ms=1, cap_ms=1)
    assert decision == policy.DeadLetter("corrupt_image")
    assert policy.preset_idle_ms(30_000, 4_000) == 26_000 and policy.preset_idle_ms(100, 500) == 0


def test_policy_waits_out_a_transient_error_in_place_until_its_budget() -> None:
    """A transient error while the probe passes waits in place, 0.25 s doubling to 10 s,
    counting nothing; past DARKROOM_TRANSIENT_BUDGET_S it ends the attempt, and the decision
    on it is final with the dependency's own code (it was never the photo's attempt)."""
    slow = StorageUnavailableError("SlowDown", reason="throttled", transient=True)
    waits = [policy.in_place_ms(slow, n, 10.0, budget_s=60, rand=lambda: 1.0) for n in range(8)]
    assert waits == [250, 500, 1000, 2000, 4000, 8000, 10_000, 10_000]
    low = policy.in_place_ms(slow, 3, 10.0, budget_s=60, rand=lambda: 0.0)
    assert low == 1000, "jittered within the upper half"
    assert policy.in_place_ms(slow, 0, 60.0, budget_s=60) is None
    decision = policy.decide(1, slow, max_attempts=5, base_ms=1000, cap_ms=30_000)
    assert decision == policy.DeadLetter("storage_unavailable")


def test_policy_gives_other_dependency_errors_two_quick_retries() -> None:
    """A permanent dependency error while the probe passes gets 0.5 s and 1 s in place, then
    ends the attempt as the photo's own failure: retried on the stream, counted."""
    odd = StorageUnavailableError("io", reason="io")
    waits = [policy.in_place_ms(odd, n, 0.0, budget_s=60) for n in range(3)]
    assert waits == [500, 1000, None]
    decision = policy.decide(1, odd, max_attempts=5, base_ms=1000, cap_ms=30_000, rand=lambda: 1)
    assert decision == policy.Retry(1000)


def test_the_delivery_count_is_only_a_generous_backstop() -> None:
    """Deliveries of one entry end it only past 4 × MAX_ATTEMPTS + 10 (30 by default)."""
    assert not policy.past_backstop(30, 5) and policy.past_backstop(31, 5)
    assert not policy.past_backstop(14, 1) and policy.past_backstop(15, 1)


@pytest.mark.parametrize("claim_idle_ms", [100, 300, 3000, 30_000, 120_000])
def test_a_dead_owners_lease_runs_out_before_xautoclaim_can_take_its_entry(
    claim_idle_ms: int,
) -> None:
    """The lease is two heartbeats (a live owner renews it with one to spare) and at least
    one heartbeat shorter than CLAIM_IDLE_MS (a dead owner's has run out at reclaim)."""
    beat_ms = policy.heartbeat_s(claim_idle_ms) * 1000
    assert policy.lease_ms(claim_idle_ms) == pytest.approx(2 * beat_ms, abs=1)
    assert policy.lease_ms(claim_idle_ms) + beat_ms <= claim_idle_ms
    assert policy.lease_ms(30_000) == 20_000


def test_the_transient_budget_defaults_to_an_hour_and_has_a_floor() -> None:
    """DARKROOM_TRANSIENT_BUDGET_S: 3600 by default; below 1 s, inf or nan is refused."""
    assert from_env({}).transient_budget_s == 3600
    assert from_env({"DARKROOM_TRANSIENT_BUDGET_S": "2.5"}).transient_budget_s == 2.5
    for bad in ("0.5", "0", "-1", "inf", "nan"):
        with pytest.raises(SettingsError, match=r"^DARKROOM_TRANSIENT_BUDGET_S: "):
            from_env({"DARKROOM_TRANSIENT_BUDGET_S": bad})


def test_entry_codec() -> None:
    """A task needs a UUID photo_id; dead letters keep every original field."""
    photo_id = uuid.uuid4()
    assert parse_task(Entry("1-0", {"photo_id": str(photo_id)})).photo_id == photo_id
    for fields in ({}, {"photo_id": "42"}):
        with pytest.raises(BadMessageError):
            parse_task(Entry("1-0", fields))
    letter = DeadLetter(photo_id="p", source_id="1-0", error_code="c", error="e", attempts=2,
                        stage="render", consumer="w")  # fmt: skip
    fields = letter.fields(Entry("1-0", {"photo_id": "p", "extra": "x"}))
    assert fields["extra"] == "x" and fields["orig_photo_id"] == "p" and fields["attempts"] == "2"
    assert fields["field_count"] == "2"


def _sent(*flat: bytes) -> Entry:
    return received("1-0", flat)


UUID = str(uuid.UUID(int=7)).encode()
MALFORMED = {
    "no photo_id": _sent(b"note", b"x"),
    "not a UUID": _sent(b"photo_id", b"42"),
    "a 1 MB id": _sent(b"photo_id", b"a" * 1_000_000),
    "id not UTF-8": _sent(b"photo_id", b"\xff\xfe"),
    "name not UTF-8": _sent(b"photo_id", UUID, b"n\xffote", b"x"),
    "value not UTF-8": _sent(b"photo_id", UUID, b"note", b"\xff\xfe"),
    "photo_id twice": _sent(b"photo_id", UUID, b"photo_id", UUID),
    "another name twice": _sent(b"photo_id", UUID, b"a", b"1", b"a", b"2"),
    "too many fields": _sent(b"photo_id", UUID, *(b"f%d" % i for i in range(2 * 16))),
    "a 1 MB value": _sent(b"photo_id", UUID, b"blob", b"v" * 1_000_000),
    "a long name": _sent(b"photo_id", UUID, b"n" * 1025, b"x"),
    "empty": _sent(b"", b""),
}


@pytest.mark.parametrize("shape", MALFORMED)
def test_a_malformed_entry_is_a_bad_message(shape: str) -> None:
    """Each shape a producer can XADD but darkroom cannot trust is a bad_message, with a
    message short enough for a log line and free of raw bytes."""
    with pytest.raises(BadMessageError) as caught:
        parse_task(MALFORMED[shape])
    message = str(caught.value)
    assert len(message) < 200 and message.isprintable(), message


def test_a_well_formed_entry_with_small_extra_fields_is_a_task() -> None:
    """A UUID photo_id beside up to 15 more small UTF-8 fields is still a task."""
    extra = [b"k%d" % i for i in range(15) for _ in (0, 1)]
    assert parse_task(_sent(b"photo_id", UUID, *extra)).photo_id == uuid.UUID(int=7)
    assert parse_task(_sent(b"trace", "é".encode(), b"photo_id", b" " + UUID)).photo_id


def test_escaped_shows_every_byte_and_escapes_once() -> None:
    """Bytes that are not UTF-8 and control characters show as \\xNN; UTF-8 text stays;
    escaping an escaped text changes nothing; a cut never splits an escape."""
    every_byte = bytes(range(256))
    shown = escaped(every_byte)
    assert shown.isprintable() and "\\xff" in shown and "\\x00" in shown and "XYZ" in shown
    assert escaped(shown.encode()) == shown
    assert escaped("naïve café 写真".encode()) == "naïve café 写真"
    cut = escaped(b"ab" + b"\xff" * 600, 10)
    assert cut == "ab\\xff\\xff… [602 bytes]"


def test_a_dead_letter_keeps_a_bounded_escaped_copy_of_what_was_sent() -> None:
    """At most 64 fields of at most 1 KiB (escaped) are kept, a repeated name is numbered,
    a name of ours is prefixed orig_, and the total field count is recorded."""
    letter = DeadLetter(photo_id="", source_id="1-0", error_code="bad_message", error="e",
                        attempts=1, stage="read", consumer="w")  # fmt: skip
    huge = _sent(*(b"f%d" % (i // 2) if i % 2 == 0 else b"\xff" * 5000 for i in range(40_000)))
    fields = letter.fields(huge)
    assert len(fields) == KEPT_FIELDS + 11 and fields["field_count"] == "20000"
    assert fields["f0"].startswith("\\xff") and fields["f0"].endswith("… [5000 bytes]")
    assert max(len(v) for v in fields.values()) <= KEPT_CHARS + 20
    twice = letter.fields(_sent(b"photo_id", b"a", b"photo_id", b"b", b"x", b"1", b"x", b"2"))
    assert (twice["orig_photo_id"], twice["orig_photo_id #2"]) == ("a", "b")
    assert (twice["x"], twice["x #2"], twice["photo_id"]) == ("1", "2", "")


def test_error_codes_are_unique_snake_case() -> None:
    """Every error class has a distinct, stable, snake_case code."""
    assert all(code.replace("_", "").isalpha() and code.islower() for code in ERROR_CODES)
    assert ERROR_CODES["corrupt_image"].retryable is False
    assert ERROR_CODES["storage_unavailable"].retryable is True


def test_the_import_contract_refuses_a_wrong_import(tmp_path: Path) -> None:
    """import-linter (run by `make test`) fails, naming the contract, when image imports store."""
    tree = tmp_path / "src"
    shutil.copytree(SRC, tree / "darkroom")
    bad = tree / "darkroom" / "image" / "exif.py"
    bad.write_text("from darkroom.store import db  # noqa: F401\n" + bad.read_text())
    config = tmp_path / "pyproject.toml"
    shutil.copy(SRC.parents[1] / "pyproject.toml", config)
    ran = subprocess.run(
        [str(Path(sys.executable).parent / "lint-imports"), "--config", str(config), "--no-cache"],
        cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True,
    )  # fmt: skip
    assert ran.returncode == 1, ran.stdout
    assert "BROKEN" in ran.stdout and "darkroom.image.exif -> darkroom.store" in ran.stdout


def test_readme_documents_every_setting_and_error_code() -> None:
    """docs/ lists every DARKROOM_* setting (configuration.md) and error code (reliability.md)."""
    from darkroom.config.env import PARSERS, env_name

    docs = SRC.parents[1] / "docs"
    configuration = (docs / "configuration.md").read_text()
    reliability = (docs / "reliability.md").read_text()
    assert [env_name(f) for f in PARSERS if f"`{env_name(f)}`" not in configuration] == []
    assert [code for code in ERROR_CODES if f"| `{code}` |" not in reliability] == []


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({"DARKROOM_SWEEP_AFTER_S": "inf"}, "DARKROOM_SWEEP_AFTER_S"),
        ({"DARKROOM_JOB_TIMEOUT_S": "nan"}, "DARKROOM_JOB_TIMEOUT_S"),
        ({"DARKROOM_DEAD_LETTER_STREAM": "{darkroom}:photos"}, "DARKROOM_DEAD_LETTER_STREAM"),
        ({"DARKROOM_DEAD_LETTER_STREAM": "{other}:dead"}, "DARKROOM_DEAD_LETTER_STREAM"),
        ({"DARKROOM_CONCURRENCY": "4", "DARKROOM_MAX_IN_FLIGHT": "3"}, "DARKROOM_MAX_IN_FLIGHT"),
    ],
)
def test_settings_refuse_non_finite_numbers_and_split_streams(
    env: dict[str, str], variable: str
) -> None:
    """inf/nan durations and a dead-letter stream outside the work stream's slot are refused."""
    with pytest.raises(SettingsError) as caught:
        from_env(env)
    assert caught.value.variable == variable


def test_entries_in_flight_default_to_twice_the_render_slots() -> None:
    """More entries than render slots are held (the next downloads while others render);
    DARKROOM_MAX_IN_FLIGHT sets the bound."""
    assert from_env({"DARKROOM_CONCURRENCY": "3"}).in_flight_bound == 6
    both = {"DARKROOM_CONCURRENCY": "3", "DARKROOM_MAX_IN_FLIGHT": "4"}
    assert from_env(both).in_flight_bound == 4


# -- rendition keys and what may be deleted (store/keys.py) ----------------------------------

PHOTO = uuid.UUID("0b5c4e2a-6d3f-4c1e-9a57-2f1d8e6b9c30")
OLD = f"renditions/{PHOTO}/thumb.webp"  # a key from before content-named keys
NEW = f"renditions/{PHOTO}/thumb-0123456789ab.webp"


def test_rendition_keys_name_their_content() -> None:
    """A key carries the first 12 hex digits of the bytes' sha256: other bytes, other key."""
    digest = "0123456789ab" + "f" * 52
    assert keys.rendition_key(PHOTO, "thumb", "webp", digest) == NEW
    assert keys.rendition_key(PHOTO, "thumb", "webp", "1" * 64) != NEW
    assert keys.photo_of(NEW) == keys.photo_of(OLD) == PHOTO
    for foreign in ("originals/x/y.jpg", "renditions/not-a-uuid/a.webp", f"renditions/{PHOTO}/",
                    f"renditions/{PHOTO}/deeper/a.webp", ".darkroom-probe"):  # fmt: skip
        assert keys.photo_of(foreign) is None, foreign


def test_a_rerender_deletes_only_the_keys_its_row_stopped_referencing() -> None:
    """Old fixed keys and renditions no longer configured go; a key kept by identical bytes
    stays; a first render (no previous renditions) deletes nothing."""
    unconfigured = f"renditions/{PHOTO}/small-aaaaaaaaaaaa.webp"
    replaced = keys.keys_of(json.dumps([{"key": OLD}, {"key": NEW}, {"key": unconfigured}]))
    assert keys.superseded(replaced, [NEW, "renditions/x/large-1.webp"]) == [unconfigured, OLD]
    assert keys.superseded(keys.keys_of(None), [NEW]) == []


def test_nothing_referenced_or_in_progress_is_deletable() -> None:
    """Under the row lock: never a referenced key, nothing of a photo being processed, and
    everything of a photo whose row is gone."""
    held = keys.Held(frozenset({NEW}), busy=False)
    assert keys.deletable([OLD, NEW], held) == [OLD]
    assert keys.deletable([OLD], keys.Held(frozenset(), busy=True)) == []
    assert keys.deletable([OLD, NEW], None) == [NEW, OLD]


@pytest.mark.parametrize(
    ("key", "age_s", "held", "expected"),
    [
        (OLD, 7200, keys.Held(frozenset({OLD}), busy=False), "referenced"),
        (OLD, 7200, keys.Held(frozenset({OLD}), busy=True), "referenced"),
        (NEW, 7200, keys.Held(frozenset({OLD}), busy=False), "orphan"),
        (NEW, 7200, None, "orphan"),  # the photo's row was deleted
        (NEW, 3599, None, "young"),  # maybe an upload whose publish is about to commit
        (NEW, 7200, keys.Held(frozenset(), busy=True), "busy"),
        ("renditions/readme.txt", 7200, None, "foreign"),
    ],
)
def test_gc_verdicts(key: str, age_s: float, held: keys.Held | None, expected: str) -> None:
    """gc deletes only unreferenced rendition objects older than the grace period whose
    photo is not being processed."""
    now_s = 1_800_000_000.0
    assert keys.verdict(now_s - age_s, now_s, 3600, key, held) == expected


@pytest.mark.parametrize(
    "value", ["   ", "public\r\nSet-Cookie: a=b", "max-age=1\x00", "max-age=é", "x" * 513]
)
def test_cache_control_must_be_one_header_value(value: str) -> None:
    """DARKROOM_CACHE_CONTROL refuses a blank value and anything that is not one header
    value (a CR or LF would forge another header); a plain one is taken as given."""
    with pytest.raises(SettingsError) as caught:
        from_env({"DARKROOM_CACHE_CONTROL": value})
    assert caught.value.variable == "DARKROOM_CACHE_CONTROL"
    assert from_env({}).cache_control == "public, max-age=31536000, immutable"
    assert from_env({"DARKROOM_CACHE_CONTROL": "no-cache"}).cache_control == "no-cache"


@pytest.mark.parametrize(
    ("text", "masked"),
    [
        ("redis://:pw1@host:6379/0", "redis://:***@host:6379/0"),
        ("rediss://app:p@ss:w@host/0", "rediss://app:***@host/0"),
        ("postgresql://u:pw1@db/x?password=pw2&sslmode=require",
         "postgresql://u:***@db/x?password=***&sslmode=require"),
        ("redis+sentinel://s1:26379,s2/main?sentinel_password=pw1",
         "redis+sentinel://s1:26379,s2/main?sentinel_password=***"),
        ("error: 'redis://a:pw1@h' then postgres://b:pw2@h2 and PASSWORD=pw3",
         "error: 'redis://a:***@h' then postgres://b:***@h2 and PASSWORD=***"),
        ("postgresql://postgres@127.0.0.1:5432/darkroom", None),
        ("redis://127.0.0.1:6379/0", None),
    ],
)  # fmt: skip
def test_redact_masks_every_password_and_nothing_else(text: str, masked: str | None) -> None:
    """A URL's userinfo password and any password= option are masked, in a URL or in any
    message quoting one; a URL without a password is unchanged."""
    assert redact(text) == (masked or text)


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("DARKROOM_REDIS_URL", "redis://:sekret@host:abc"),
        ("DARKROOM_REDIS_URL", "redis://app:sekret@host/0?sentinel_password=sekret"),
        ("DARKROOM_REDIS_URL", "redis://app:sekret@host/0?socket_timeout=0.5"),
        ("DARKROOM_DATABASE_URL", "mysql://app:sekret@host/db"),
        ("DARKROOM_DATABASE_URL", "mysql://db/x?password=sekret"),
    ],
)
def test_a_settings_error_never_shows_a_password(variable: str, value: str) -> None:
    """A bad URL's error names the variable and shows the value with its password masked."""
    with pytest.raises(SettingsError) as caught:
        from_env({variable: value})
    assert caught.value.variable == variable
    assert "sekret" not in str(caught.value) and "***" in str(caught.value)


DURATIONS_AND_COUNTS = {
    env_name(f): (minimum, type(getattr(Settings(), f))) for f, minimum in MINIMUMS.items()
}


@pytest.mark.parametrize(("variable", "bound"), DURATIONS_AND_COUNTS.items())
def test_every_duration_and_count_refuses_a_value_below_its_minimum(
    variable: str, bound: tuple[float, type]
) -> None:
    """Below its minimum a duration or count is refused, naming the variable (exit 2 in the
    CLI); the minimum itself is accepted."""
    minimum, kind = bound
    below = str(kind(minimum) - (1 if kind is int else minimum / 2 or 0.5))
    with pytest.raises(SettingsError) as caught:
        from_env({"DARKROOM_CONCURRENCY": "1", variable: below})
    assert caught.value.variable == variable
    assert f"at least {minimum:g}" in str(caught.value)
    setting = variable.removeprefix("DARKROOM_").lower()
    at_minimum = from_env({"DARKROOM_CONCURRENCY": "1", variable: str(kind(minimum))})
    assert getattr(at_minimum, setting) == minimum


@pytest.mark.parametrize(("option", "minimum"), REDIS_MINIMUMS.items())
def test_redis_url_durations_and_counts_refuse_a_value_below_their_minimum(
    option: str, minimum: float
) -> None:
    """The URL's timeouts, health-check interval and pool size have a floor too."""
    below = minimum - 1 if option == "max_connections" else minimum / 2
    url = f"redis://127.0.0.1:6379/0?{option}={below:g}"
    with pytest.raises(SettingsError, match=f"option {option}: .*at least {minimum:g}"):
        from_env({"DARKROOM_REDIS_URL": url})


def test_every_numeric_setting_has_a_minimum() -> None:
    """No duration or count escapes a floor: every int or float setting but the ports is in
    MINIMUMS, and the configuration page gives each minimum."""
    defaults = Settings()
    numeric = {f for f in PARSERS if type(getattr(defaults, f)) in (int, float)}
    assert numeric - {"metrics_port", "web_port"} == set(MINIMUMS)
    configuration = (SRC.parents[1] / "docs" / "configuration.md").read_text()
    for field, minimum in MINIMUMS.items():
        row = next(line for line in configuration.splitlines()
                   if line.startswith(f"| `{env_name(field)}` |"))  # fmt: skip
        assert row.split("|")[3].strip() == f"{minimum:g}", row


def test_a_non_ascii_cookie_csrf_or_token_is_a_mismatch_not_an_error() -> None:
    """A cookie, CSRF field or token holding non-ASCII text (a Latin-1 byte) is simply not
    ours: no session, no match, never an exception (a 500 on every page)."""
    auth = Auth("x" * 32)
    session, cookie = auth.new_session(operator=True)
    assert auth.read_session(cookie) == session
    nonce, operator, issued, signature = cookie.split(".")
    for forged in (f"{nonce}.{operator}.{issued}.\u00e9", f"\u00e9.1.{issued}.{signature}",
                   f"{nonce}.1.\u00b2.{signature}", "\udce9.1.1.x"):  # fmt: skip
        assert auth.read_session(forged) is None
    assert not auth.csrf_ok(session, "\u00e9" + auth.csrf_token(session)[1:])
    assert auth.csrf_ok(session, auth.csrf_token(session))
    assert not auth.token_matches("\u00e9" * 32) and auth.bearer("Bearer \u00e9") == "wrong"


def test_the_storage_probe_key_stays_inside_the_storage() -> None:
    """The probe writes inside renditions/ by default; a key that is absolute, climbs out
    with .., or names a folder is refused."""
    assert from_env({}).storage_probe_key == "renditions/.darkroom-probe"
    for bad in ("/etc/probe", "renditions/../../probe", "renditions/", " probe"):
        with pytest.raises(SettingsError) as caught:
            from_env({"DARKROOM_STORAGE_PROBE_KEY": bad})
        assert caught.value.variable == "DARKROOM_STORAGE_PROBE_KEY"


def test_web_page_limits_have_defaults_and_lower_bounds() -> None:
    """DARKROOM_WEB_DOWNLOADS defaults to 4 and DARKROOM_WEB_SNAPSHOT_S to 2 s; no
    download slot at all, or a snapshot younger than 0.5 s, is refused."""
    s = from_env({})
    assert (s.web_downloads, s.web_snapshot_s) == (4, 2.0)
    for name, value in [("DARKROOM_WEB_DOWNLOADS", "0"), ("DARKROOM_WEB_SNAPSHOT_S", "0.1"),
                        ("DARKROOM_WEB_SNAPSHOT_S", "inf")]:  # fmt: skip
        with pytest.raises(SettingsError) as caught:
            from_env({name: value})
        assert caught.value.variable == name
