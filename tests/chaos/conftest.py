"""Registers the `chaos` marker until pyproject.toml does."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "chaos: kills, restarts and outages around real workers (minutes long)"
    )
