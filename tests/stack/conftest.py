"""Fixtures for the stack's tests."""

from __future__ import annotations

import pytest

from gpuscope import ports


@pytest.fixture
def free_port() -> int:
    return ports.free_port()
