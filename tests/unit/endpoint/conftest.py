"""The endpoint tests' app: create_app over a ScriptedBackend (a file may override `backend`)."""

from __future__ import annotations

import pytest

from services.endpoint.app import create_app
from services.endpoint.settings import EndpointSettings
from tests.unit.endpoint.scripted import TOKEN, ScriptedBackend


@pytest.fixture
def backend() -> ScriptedBackend:
    return ScriptedBackend()


@pytest.fixture
def app(backend):
    return create_app(EndpointSettings(max_body_bytes=64 * 1024), TOKEN, backend)
