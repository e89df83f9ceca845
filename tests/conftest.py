"""Shared fixtures: the TRXP payloads copied from shared/fixtures into tests/fixtures."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

# torch warns at import when NumPy is absent; expbuf does not use NumPy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

FIXTURES = Path(__file__).parent / "fixtures"
TRXP_DIR = FIXTURES / "trxp"
BAD_DIR = FIXTURES / "bad"
MANIFEST = json.loads((TRXP_DIR / "manifest.json").read_text())
BAD_README = json.loads((BAD_DIR / "README.json").read_text())


def payload(name: str) -> bytes:
    return (TRXP_DIR / name).read_bytes()


@pytest.fixture(params=sorted(MANIFEST["payloads"]))
def fixture_name(request: pytest.FixtureRequest) -> str:
    return request.param
