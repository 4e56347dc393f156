"""The environment the tests run in is uv.lock's, package for package: a green run means the
locked set, never whatever a registry served that day."""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

from packaging.utils import canonicalize_name

LOCK = Path(__file__).resolve().parent.parent / "uv.lock"


def locked() -> dict[str, set[str]]:
    """Each package's locked versions: one, or one per Python where a newer release dropped
    3.11 (numpy), the installer picking by marker."""
    versions: dict[str, set[str]] = {}
    for package in tomllib.loads(LOCK.read_text())["package"]:
        versions.setdefault(canonicalize_name(package["name"]), set()).add(package["version"])
    return versions


def installed() -> dict[str, str]:
    return {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions()}


def test_every_installed_package_is_at_its_locked_version() -> None:
    """No package outside the lock and none at another version (a `pip install` by hand,
    a stale venv, an install that ignored the lock)."""
    lock = locked()
    differ = {n: (v, lock.get(n)) for n, v in installed().items() if v not in lock.get(n, ())}
    assert differ == {}, "installed (version, locked version); run `make` to sync from uv.lock"


def test_the_test_group_is_installed_whole() -> None:
    """Every tool and library of `make test` that the lock names is present."""
    group = tomllib.loads(LOCK.read_text())["package"]
    project = next(p for p in group if p["name"] == "darkroom")
    wanted = {canonicalize_name(d["name"]) for d in project["dev-dependencies"]["test"]}
    assert wanted - installed().keys() == set()
