"""Pure pieces: settings parsing, retry policy, entry codec, and the import arrows."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from darkroom.errors import (
    ERROR_CODES,
    BadMessageError,
    CorruptImageError,
    SettingsError,
    StorageUnavailableError,
)
from darkroom.queue import policy
from darkroom.queue.messages import DeadLetter, Entry, parse_task
from darkroom.settings import RenditionSpec, from_env, parse_renditions

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
    """DARKROOM_RENDITIONS takes name:size:format[:quality]; mistakes name the item."""
    assert parse_renditions("a:64:png, b:100:jpg:70") == (
        RenditionSpec("a", 64, "png", 100), RenditionSpec("b", 100, "jpeg", 70))  # fmt: skip
    for bad in [
        "a:64",
        "a:64:gif",
        "a:0:webp",
        "a:64:webp:101",
        "a:64:webp,a:32:webp",
        "A!:64:webp",
    ]:
        with pytest.raises(ValueError):  # noqa: PT011 - the message varies by mistake
            parse_renditions(bad)


def test_settings_error_names_the_variable() -> None:
    """A bad value's error message starts with the variable's name."""
    expected = r"^DARKROOM_MAX_ATTEMPTS: must be a finite number greater than 0"
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


def test_entry_codec() -> None:
    """A task needs a UUID photo_id; dead letters keep every original field."""
    photo_id = uuid.uuid4()
    assert parse_task(Entry("1-0", {"photo_id": str(photo_id)})).photo_id == photo_id
    for fields in ({}, {"photo_id": "42"}):
        with pytest.raises(BadMessageError):
            parse_task(Entry("1-0", fields))
    letter = DeadLetter(photo_id="p", source_id="1-0", error_code="c", error="e", attempts=2,
                        stage="render", consumer="w")  # fmt: skip
    fields = letter.fields({"photo_id": "p", "extra": "x"})
    assert fields["extra"] == "x" and fields["orig_photo_id"] == "p" and fields["attempts"] == "2"


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
    from darkroom.settings import PARSERS, env_name

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
