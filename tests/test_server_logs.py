"""The server's log lines say what happened in a few words: a table created is its name and the
settings it does not leave at their defaults, on one short line."""

from __future__ import annotations

import logging

import pytest

from expbuf.client import BufferClient
from expbuf.server.store.schema.table_config import TableConfig

from conftest import Servers


def test_a_table_created_is_its_name_and_its_own_settings(
    start_server: Servers, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="expbuf")
    config = TableConfig.of("from_config", group_size=8, estimator="rloo", shaping={"reward_clip": 5.0})
    server = start_server(tables=(config,))
    with BufferClient(f"127.0.0.1:{server.port}") as client:
        client.create_table("by_call", group_size=4, estimator_params={"epsilon": 0.01})
        client.create_table("plain")
    created = [m for m in caplog.messages if "table created" in m]
    assert created == [
        "table created from config: from_config (group_size=8, estimator=rloo, shaping={'reward_clip': 5.0})",
        "table created: by_call (group_size=4, estimator_params={'epsilon': 0.01})",
        "table created: plain (defaults)",
    ]
