"""The operator's actions in the chaos timeline, run as the CLI an operator would: pauses (a
timed lane pause during the faults, an explicit pause of everything and its resume) and an
erase of a few photos mid-run, some in flight; and what each must show once quiesced."""

from __future__ import annotations

import random
from typing import Any

from tests.chaos.rig import Rig

N_ERASE, N_ERASE_IN_FLIGHT = 5, 2
# A claim whose statement began before the pause committed may carry a `started_at` just
# after the pause's `since` (both are their transaction's now()): the rule starts after this.
PAUSE_GRACE_S = 1.0
# The scope's last pause as its `paused` event says: a timed one's row is deleted once it ran
# out (by the first worker's watch), which may be before this reads it on a loaded machine.
SCOPE_SQL = """
SELECT (data->>'since')::timestamptz AS since, (data->>'until')::timestamptz AS until
FROM photo_events WHERE type = 'darkroom.queue.paused' AND data->>'lane' IS NOT DISTINCT FROM $1
  AND data->>'tenant' IS NULL
ORDER BY id DESC LIMIT 1
"""
# The operator's resume, not a timed pause's automatic one (via `timer`).
RESUMED_SQL = (
    "SELECT max(at) AS at FROM operator_actions WHERE action = 'resume' AND via <> 'timer'"
)
# Attempts of the paused scope (the entry's lane or the photo's own) around a pause window.
WINDOW_SQL = """
SELECT a.photo_id::text, a.started_at,
       a.started_at >= $1::timestamptz + make_interval(secs => $4::float8) AS late
FROM photo_attempts a LEFT JOIN photos p ON p.id = a.photo_id
WHERE ($3::text IS NULL OR a.lane = $3 OR p.lane = $3)
  AND a.started_at >= $1::timestamptz AND a.started_at < $2::timestamptz
"""
RUNNING_SQL = """
SELECT count(*) AS n FROM photo_attempts a LEFT JOIN photos p ON p.id = a.photo_id
WHERE ($2::text IS NULL OR a.lane = $2 OR p.lane = $2)
  AND a.started_at < $1::timestamptz AND a.ended_at > $1::timestamptz
"""
# The same scope's attempts started in as long a window right after it: what a pause holds.
AFTER_SQL = """
SELECT count(*) AS n FROM photo_attempts a LEFT JOIN photos p ON p.id = a.photo_id
WHERE ($3::text IS NULL OR a.lane = $3 OR p.lane = $3)
  AND a.started_at >= $2::timestamptz
  AND a.started_at < $2::timestamptz + ($2::timestamptz - $1::timestamptz)
"""
IN_FLIGHT_SQL = "SELECT id::text FROM photos WHERE processing_state = 'processing'"
# Deliveries that did not end cleanly: a killed one stays `running`; one whose refused publish
# lost its reply may end otherwise. Only these may leave uploads for `darkroom gc`.
UNCLEAN_SQL = """
SELECT DISTINCT photo_id::text FROM photo_attempts WHERE photo_id = ANY($1::uuid[])
  AND outcome NOT IN ('published', 'skipped', 'already', 'busy', 'lease_lost')
"""
ERASED = "darkroom.photo.erased"
# In commit order (`id`, which the photo's row lock orders per photo).
EVENTS_SQL = """
SELECT photo_id::text, type FROM photo_events WHERE photo_id = ANY($1::uuid[]) ORDER BY id
"""


class Actions:
    """Injects the actions (their randomness from their own generator, so the kills keep the
    sequence the seed gives them) and keeps what they did."""

    def __init__(self, rig: Rig, rng: random.Random) -> None:
        self.rig, self.rng = rig, rng
        self.pauses: list[dict[str, Any]] = []
        self.erased: list[str] = []
        self.in_flight: list[str] = []

    def pause(self, lane: str | None, for_s: float | None) -> dict[str, Any]:
        """`darkroom pause [--lane L] --reason chaos [--for Ns]`; its window as stored."""
        scope = ("--lane", lane) if lane else ()
        timed = ("--for", f"{for_s:g}s") if for_s else ()
        self.rig.cli("pause", *scope, "--reason", "chaos", *timed)
        row = self.rig.query(SCOPE_SQL, lane)[0]
        self.pauses.append(pause := {"lane": lane, "since": row["since"], "until": row["until"]})
        return pause

    def resume(self, pause: dict[str, Any]) -> None:
        """`darkroom resume`: the window ends at the resume's commit (its audit row's `at`)."""
        self.rig.cli("resume", "--reason", "chaos")
        pause["until"] = self.rig.query(RESUMED_SQL)[0]["at"]

    def erase(self, expected: dict[str, str]) -> None:
        """`darkroom erase --original` of N_ERASE photos that would be processed, of them up
        to N_ERASE_IN_FLIGHT being processed now; they must end `erased`."""
        valid = [i for i, end in expected.items() if end == "processed"]  # in ingest order
        busy = {r["id"] for r in self.rig.query(IN_FLIGHT_SQL)}
        hot = [i for i in valid if i in busy]
        self.in_flight = self.rng.sample(hot, min(N_ERASE_IN_FLIGHT, len(hot)))
        rest = [i for i in valid if i not in self.in_flight]
        self.erased = self.in_flight + self.rng.sample(rest, N_ERASE - len(self.in_flight))
        self.rig.cli("erase", *self.erased, "--original", "--reason", "chaos")
        expected.update(dict.fromkeys(self.erased, "erased"))

    def pause_figures(self) -> tuple[list[dict[str, Any]], list[str]]:
        """Per pause: its window (PostgreSQL's clock), the attempts of its scope started in
        it (at its commit, within PAUSE_GRACE_S, and after), those running across its start
        and those started in as long a window after it; and the photos that started after
        its grace, which no pause allows."""
        figures, late = [], []
        for p in self.pauses:
            rows = self.rig.query(WINDOW_SQL, p["since"], p["until"], p["lane"], PAUSE_GRACE_S)
            running = self.rig.query(RUNNING_SQL, p["since"], p["lane"])[0]["n"]
            after = self.rig.query(AFTER_SQL, p["since"], p["until"], p["lane"])[0]["n"]
            late += [f"{r['photo_id']} started {r['started_at']}" for r in rows if r["late"]]
            figures.append({
                "scope": p["lane"] or "everything", "since": p["since"], "until": p["until"],
                "window_s": round((p["until"] - p["since"]).total_seconds(), 2),
                "started_at_its_commit": sum(not r["late"] for r in rows),
                "started_after": sum(r["late"] for r in rows),
                "running_across_its_start": running, "started_in_as_long_after": after,
            })  # fmt: skip
        return figures, late

    def erase_checks(self, rows: dict[str, Any]) -> tuple[dict[str, Any], dict[str, list[Any]]]:
        """Each erased photo is `erased`, has one erase event and none after it, and leaves
        no object once quiesced but for a delivery that did not end cleanly, and none at all
        once `darkroom gc` has collected what those left."""
        rig, originals = self.rig, {i: rows.get(i, {}).get("original_key") for i in self.erased}
        types: dict[str, list[str]] = {i: [] for i in self.erased}
        for event in rig.query(EVENTS_SQL, self.erased):
            types.get(event["photo_id"], []).append(event["type"])
        before = {i: rig.objects_of(i, originals[i]) for i in self.erased}
        unclean = {r["photo_id"] for r in rig.query(UNCLEAN_SQL, self.erased)}
        collected = rig.gc_ahead()
        after = {i: rig.objects_of(i, originals[i]) for i in self.erased}
        figures = {
            "photos": len(self.erased), "in_flight_when_erased": len(self.in_flight),
            "with_an_unclean_delivery": len(unclean),
            "objects_left_before_gc": sum(map(len, before.values())),
            "gc": collected, "objects_left_after_gc": sum(map(len, after.values())),
            "events": {i: t for i, t in types.items()},
        }  # fmt: skip
        checks = {
            "erased photos not in state erased": [
                i for i in self.erased if rows.get(i, {}).get("state") != "erased"],
            "erased photos without one erase event last (a publish or failure after it)": [
                i for i, t in types.items() if t.count(ERASED) != 1 or t[-1] != ERASED],
            "erased photos' objects left, every delivery of them clean": [
                f"{i}: {keys}" for i, keys in before.items() if keys and i not in unclean],
            "erased photos' objects left after gc": [
                f"{i}: {keys}" for i, keys in after.items() if keys],
        }  # fmt: skip
        return figures, checks
