"""The server's torch threads: one by default (its computations are small, and on a few cores a
second thread costs every table CPU: bench/RESULTS.md), torch's own default with 0, from TOML,
environment or flag, and a bad value refused by name."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from expbuf.client import BufferClient
from expbuf.server.config import ConfigError, ServerConfig, load

from conftest import Servers
from helpers import make_experience


@pytest.fixture
def threads() -> Iterator[None]:
    """torch's threads as the test process had them, restored after the test."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_setting_comes_from_toml_environment_and_flag_and_a_bad_value_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert ServerConfig(data=str(tmp_path)).torch_threads == 1
    toml = tmp_path / "expbuf.toml"
    toml.write_text("torch_threads = 3\n")
    assert load(str(toml)).torch_threads == 3
    monkeypatch.setenv("EXPBUF_TORCH_THREADS", "0")
    assert load(str(toml)).torch_threads == 0
    assert load(str(toml), {"torch_threads": 2}).torch_threads == 2
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ConfigError, match="torch_threads must be an integer"):
            ServerConfig(data=str(tmp_path), torch_threads=bad)  # type: ignore[arg-type]


@pytest.mark.usefixtures("threads")
def threads_of_a_new_thread() -> int:
    """torch's intra-op threads as a thread that starts now sees them: the server's computations
    run on its RPC and worker threads, each of which takes torch's setting at its first op (a
    thread that ran one before keeps the setting it had then)."""
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return seen[0]


def test_a_server_computes_with_the_threads_it_is_given(start_server: Servers) -> None:
    torch.set_num_threads(2)
    server = start_server(torch_threads=1)
    assert server.advantages.wait(60)  # torch's threads are set where it loads, after the start
    assert threads_of_a_new_thread() == 1
    with BufferClient(f"127.0.0.1:{server.port}") as client:
        client.create_table("t", group_size=4, estimator="grpo")
        assert client.push([make_experience(1, 0, run) for run in range(4)], table="t").completed_groups == ["1/0"]
        batch = next(client.sample("t", num_groups=1, delivery="consume", timeout=10, max_batches=1))
        assert all(e.advantages is not None for e in batch.experiences)
    server.stop()
    torch.set_num_threads(2)
    assert start_server(torch_threads=0).advantages.wait(60)
    assert threads_of_a_new_thread() == 2  # 0: torch's own setting is left as it is
