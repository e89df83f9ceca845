"""Shared fixtures: the TRXP payloads copied from shared/fixtures into tests/fixtures."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import pytest

# torch warns at import when NumPy is absent; expbuf does not use NumPy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")


def _keep_one_logging_tree() -> None:
    """AReaL 1.0.4's `areal.utils.logging.getLogger` replaces the logging module's manager and
    root at every call (to undo another library's configuration). Loggers made after such a call,
    expbuf's among them, hang off a root that no handler reads, and pytest's log capture then sets
    the level of one logger object while records go through another. Each call keeps its own
    loggers; the process's manager and root are put back afterwards."""
    manager, root = logging.Logger.manager, logging.Logger.root
    try:
        from areal.utils import logging as areal_logging
    except ImportError:
        return
    finally:
        logging.Logger.manager, logging.Logger.root = manager, root  # areal's import calls it too
    make = areal_logging.getLogger

    def get_logger(*args: object, **kwargs: object) -> logging.Logger:
        try:
            return make(*args, **kwargs)
        finally:
            logging.Logger.manager, logging.Logger.root = manager, root

    areal_logging.getLogger = get_logger


_keep_one_logging_tree()

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
