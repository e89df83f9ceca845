"""Bearer tokens with scopes, TLS and mutual TLS, against a real server on loopback."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from expbuf.client import AsyncBufferClient, BufferClient, BufferError, PermissionDeniedError, Tls
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc
from expbuf.server.app import ExpbufServer, StartupError
from expbuf.server.config import ServerConfig, TlsConfig, load, parse_tokens
from expbuf.server.store.schema.table_config import ConfigError

import cli_forks
from conftest import Servers, payload
from helpers import ServerProcess

# What a plaintext client's error adds when a server closes its connection (as a TLS one does).
TLS_HINT = "if the server takes TLS only, give the client its CA"
# What a TLS client without a certificate adds, as a server asking for client certificates closes its connection.
MUTUAL_TLS_HINT = "if the server asks for client certificates (mutual TLS), give the client its certificate and key"

TOKENS = {
    "pusher-secret": frozenset({"push"}),
    "trainer-secret": frozenset({"sample"}),
    "ops": frozenset({"push", "sample", "admin"}),
}


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, made with openssl."""
    d = tmp_path_factory.mktemp("certs")
    ca_key, ca = str(d / "ca.key"), str(d / "ca.pem")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test CA",
             "-keyout", ca_key, "-out", ca)  # fmt: skip
    extensions = {"server": "subjectAltName=IP:127.0.0.1,DNS:localhost", "client": "extendedKeyUsage=clientAuth"}
    for name, ext in extensions.items():
        key, csr, pem, extfile = (str(d / f"{name}.{suffix}") for suffix in ("key", "csr", "pem", "ext"))
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", key, "-out", csr)
        Path(extfile).write_text(ext + "\n")
        _openssl("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-days", "2",
                 "-extfile", extfile, "-out", pem)  # fmt: skip
    return d


def test_tokens_and_scopes(start_server: Servers) -> None:
    server = start_server(tokens=TOKENS)
    target = f"127.0.0.1:{server.port}"
    with BufferClient(target, token="pusher-secret") as pusher:
        assert len(pusher.push(payload("grpo_group.trxp")).stored) == 8
        with pytest.raises(BufferError) as info:
            next(pusher.sample(num_groups=1, delivery="consume"))
        assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert "'sample' scope" in info.value.details
        # any token asks what the server is: a rollout worker's client, before it claims or
        # admits, which of its calls the server answers again (client/rpc/calls/repeats.py)
        assert "Claim" in pusher.server_info().repeats_answered
    with BufferClient(target, token="trainer-secret") as trainer:
        assert len(next(trainer.sample(num_groups=1, max_batches=1, delivery="consume")).uids) == 8
        with pytest.raises(BufferError) as info:
            trainer.create_table("mine")
        assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
    for token, message in ((None, "missing bearer token"), ("wrong", "unknown bearer token")):
        with BufferClient(target, token=token) as stranger, pytest.raises(BufferError) as info:
            stranger.push(payload("single_turn.trxp"))
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert message in info.value.details
    with BufferClient(target, token="ops") as ops:
        assert ops.create_table("mine").name == "mine"
        assert ops.stats()["default"].pushed == 8


@pytest.mark.parametrize(
    ("setting", "made"),
    [
        ("cert", lambda certs, bad: TlsConfig(cert=bad, key=str(certs / "server.key"))),
        ("key", lambda certs, bad: TlsConfig(cert=str(certs / "server.pem"), key=bad)),
        ("key", lambda certs, bad: TlsConfig(cert=str(certs / "server.pem"), key=str(certs / "client.key"))),
        ("client_ca", lambda certs, bad: TlsConfig(str(certs / "server.pem"), str(certs / "server.key"), bad)),
    ],
    ids=["certificate not PEM", "key not PEM", "key of another certificate", "client CA not PEM"],
)
def test_a_tls_file_that_does_not_load_is_named_at_start(
    tmp_path: Path, certs: Path, setting: str, made: Callable[[Path, str], TlsConfig]
) -> None:
    """A certificate, key or client CA that gRPC could not load (not PEM, a key of another
    certificate) refused the start as "cannot bind the gRPC port ...: in use, or not an address of
    this host": an operator looked for what held a port. The start is refused naming the TLS files
    and what the TLS library said of them, before any data directory is made."""
    bad = tmp_path / "bad.pem"
    bad.write_text("not a PEM file\n")
    tls = made(certs, str(bad))
    data = tmp_path / "data"
    with pytest.raises(StartupError, match=rf"TLS \[tls\] {setting}\b.*does not load") as refused:
        ExpbufServer(ServerConfig(data=str(data), port=0, metrics_port=0, tls=tls))
    assert "port" not in str(refused.value), refused.value
    assert not data.exists()


def test_tls_and_mutual_tls(tmp_path: Path, certs: Path, start_server: Servers) -> None:
    tls = TlsConfig(cert=str(certs / "server.pem"), key=str(certs / "server.key"))
    server = start_server(tmp_path / "tls", tls=tls)
    target = f"127.0.0.1:{server.port}"
    with BufferClient(target, tls=Tls(root_certificates=str(certs / "ca.pem"))) as c:
        assert len(c.push(payload("grpo_group.trxp")).stored) == 8
    with BufferClient(target, timeout=2, retries=0) as plain:  # plain text against TLS: the hint, and gRPC's words
        for call in (lambda: plain.push(payload("single_turn.trxp")), lambda: next(plain.sample(num_groups=1))):
            with pytest.raises(BufferError) as info:
                call()
            assert info.value.code == grpc.StatusCode.UNAVAILABLE
            assert "Socket closed" in info.value.details and TLS_HINT in info.value.details, info.value.details

    # Retried: the same words. Its retries' pauses span about 2 s (connection.BACKOFF), and a loaded
    # machine's handshakes more: a deadline of 2 s ended some runs first, DEADLINE_EXCEEDED.
    with BufferClient(target, timeout=15) as plain, pytest.raises(BufferError) as info:
        plain.push(payload("single_turn.trxp"))
    assert info.value.code == grpc.StatusCode.UNAVAILABLE and TLS_HINT in info.value.details, info.value.details

    async def plain_async() -> str:
        async with AsyncBufferClient(target, timeout=2, retries=0) as plain:
            with pytest.raises(BufferError) as info:
                await plain.push(payload("single_turn.trxp"))
            return info.value.details

    assert TLS_HINT in asyncio.run(plain_async())
    mutual = TlsConfig(cert=tls.cert, key=tls.key, client_ca=str(certs / "ca.pem"))
    server = start_server(tmp_path / "mtls", tls=mutual)
    target = f"127.0.0.1:{server.port}"
    client_tls = Tls(str(certs / "ca.pem"), str(certs / "client.pem"), str(certs / "client.key"))
    with BufferClient(target, tls=client_tls) as c:
        assert len(c.push(payload("grpo_group.trxp")).stored) == 8
    no_cert = Tls(root_certificates=str(certs / "ca.pem"))  # the CA only, against mutual TLS: the hint
    with BufferClient(target, tls=no_cert, timeout=2, retries=0) as c, pytest.raises(BufferError) as info:
        c.push(payload("single_turn.trxp"))
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert "Socket closed" in info.value.details and MUTUAL_TLS_HINT in info.value.details, info.value.details
    with BufferClient(target, tls=no_cert, timeout=1, wait_for_ready=True) as c, pytest.raises(BufferError) as info:
        c.stats()  # waits for a connection the server refuses each time, until the deadline: the target and the hint
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert target in info.value.details and MUTUAL_TLS_HINT in info.value.details, info.value.details


def test_config_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config_file = tmp_path / "expbuf.toml"
    config_file.write_text(
        'data = "/srv/expbuf"\nport = 6000\n\n[[tokens]]\ntoken_env = "PUSH_TOKEN"\nscopes = ["push"]\n\n'
        '[[tables]]\nname = "grpo8"\ngroup_size = 8\n'
    )
    monkeypatch.setenv("PUSH_TOKEN", "from-env")
    monkeypatch.setenv("EXPBUF_PORT", "7000")
    config = load(str(config_file), {"data": "/override", "host": None})
    assert (config.data, config.port, config.host) == ("/override", 7000, "127.0.0.1")
    assert config.tokens == {"from-env": frozenset({"push"})}
    assert [t.name for t in config.tables] == ["grpo8"] and config.tables[0].grouping.size == 8
    assert parse_tokens("a:push,sample; b:admin") == {"a": frozenset({"push", "sample"}), "b": frozenset({"admin"})}
    with pytest.raises(ConfigError, match="unknown token scope"):
        ServerConfig(tokens={"x": frozenset({"root"})})
    assert ServerConfig().sample_stream_limit == 48 and ServerConfig(workers=8).sample_stream_limit == 6
    with pytest.raises(ConfigError, match=r"max_sample_streams must be an integer from 1 to workers - 1 = 7"):
        ServerConfig(workers=8, max_sample_streams=8)
    monkeypatch.setenv("EXPBUF_MAX_SAMPLE_STREAMS", "5")
    monkeypatch.setenv("EXPBUF_METRICS_HOST", "127.0.0.2")
    assert (load().max_sample_streams, load().metrics_host) == (5, "127.0.0.2")
    config_file.write_text("prot = 1\n")
    with pytest.raises(ConfigError, match="unknown setting"):
        load(str(config_file))


def test_tokens_are_read_as_clients_send_them_and_each_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A token read from a secret ends in a newline, and one in EXPBUF_TOKENS may be spaced from its
    colon: the server took them as they were and no client could be let in ("tokens on" at start,
    every call UNAUTHENTICATED). A token given twice kept the last entry's scopes alone. Neither
    refusal shows the token."""
    config_file = tmp_path / "expbuf.toml"
    config_file.write_text('[[tokens]]\ntoken_env = "PUSH_TOKEN"\nscopes = ["push"]\n')
    monkeypatch.setenv("PUSH_TOKEN", "from-secret\n")
    assert load(str(config_file)).tokens == {"from-secret": frozenset({"push"})}
    assert parse_tokens("tok : sample ; other:admin") == {"tok": frozenset({"sample"}), "other": frozenset({"admin"})}
    with pytest.raises(ConfigError, match=r"^EXPBUF_TOKENS: token 2: the same token is given again") as info:
        parse_tokens("secret-1:sample;secret-1:admin")
    assert "secret-1" not in str(info.value)
    with pytest.raises(ConfigError, match=r"token 1: the token holds a space, a control or a non-ASCII character"):
        parse_tokens("two words:push")
    monkeypatch.setenv("PUSH_TOKEN", "caf\u00e9")
    with pytest.raises(ConfigError, match=r"\[\[tokens\]\] entry 1: the token holds .* non-ASCII"):
        load(str(config_file))
    twice = '[[tokens]]\ntoken = "x1"\nscopes = ["{}"]\n'
    config_file.write_text(twice.format("push") + twice.format("admin"))
    with pytest.raises(ConfigError, match=r"\[\[tokens\]\] entry 2: the same token is given again"):
        load(str(config_file))


def test_a_client_s_token_is_sent_as_the_server_reads_it(start_server: Servers) -> None:
    """A token read from a file or a secret with its newline: gRPC refused to send it ("INTERNAL:
    Invalid metadata", beside a log of its own); one that cannot be sent at all is a ValueError
    naming the problem, not the token."""
    server = start_server(tokens=TOKENS)
    with BufferClient(f"127.0.0.1:{server.port}", token="ops\n") as client:
        assert [table.name for table in client.list_tables()] == ["default"]
    with pytest.raises(ValueError, match="token holds a space, a control or a non-ASCII character") as info:
        BufferClient(f"127.0.0.1:{server.port}", token="op\ns")
    assert "op\ns" not in str(info.value)


def test_a_setting_out_of_range_is_refused_naming_where_it_came_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A setting out of its range was refused naming the setting alone, whichever of the config
    file, an EXPBUF_* variable or the command line set it: an operator at night looked in the
    wrong place. The refusal names the file, the variable or the command line."""
    config_file = tmp_path / "expbuf.toml"
    config_file.write_text("max_inflight_bytes = 5\n")
    with pytest.raises(
        ConfigError, match=rf"max_inflight_bytes.*\(set in the config file {re.escape(str(config_file))}\)"
    ):
        load(str(config_file))
    config_file.write_text("port = 6000\n")
    monkeypatch.setenv("EXPBUF_MAX_INFLIGHT_BYTES", "5")
    with pytest.raises(ConfigError, match=r"max_inflight_bytes.*\(set by EXPBUF_MAX_INFLIGHT_BYTES='5'\)"):
        load(str(config_file))
    monkeypatch.delenv("EXPBUF_MAX_INFLIGHT_BYTES")
    with pytest.raises(ConfigError, match=r"max_inflight_bytes.*\(set on the command line\)"):
        load(str(config_file), {"max_inflight_bytes": 5})


def _raw_push(
    target: str, metadata: tuple[tuple[str, str], ...], payload_bytes: bytes, table: str = ""
) -> grpc.RpcError | None:
    options = [("grpc.max_send_message_length", len(payload_bytes) + (1 << 20))]
    with grpc.insecure_channel(target, options=options) as channel:
        stub = pb_grpc.ExperienceBufferStub(channel)
        try:
            stub.Push(pb.PushRequest(payload=payload_bytes, table=table), timeout=60, metadata=metadata)
        except grpc.RpcError as exc:
            return exc
    return None


def test_authorization_header_must_be_one_well_formed_bearer(start_server: Servers) -> None:
    server = start_server(tokens=TOKENS)
    target = f"127.0.0.1:{server.port}"
    good = payload("single_turn.trxp")
    twice = (("authorization", "Bearer ops"), ("authorization", "Bearer pusher-secret"))
    malformed = (("authorization", "ops"),)
    for metadata, reason in ((twice, "2 authorization headers"), (malformed, "malformed authorization header")):
        refused = _raw_push(target, metadata, good)
        assert refused is not None and refused.code() == grpc.StatusCode.UNAUTHENTICATED
        assert reason in refused.details()
    assert _raw_push(target, (("authorization", "Bearer ops"),), good) is None
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read()
    refused_count = 'expbuf_rpc_duration_seconds_count{code="UNAUTHENTICATED",method="Push"} 2.0'
    assert refused_count in metrics.decode()  # refusals are still timed and counted by code


def test_a_restart_that_turns_tokens_off_or_on_names_it_where_it_refuses_what_was_taken_before(
    start_server: Servers,
) -> None:
    """A lease, grant or claim taken with a token is that token's: a server restarted with tokens
    off refuses to ack, renew or finish it (no caller can be that token), and one restarted with
    tokens on refuses a lease or claim taken with them off. The refusal says so, and what to do,
    where it said "another token", which the caller could not find."""
    ops = frozenset({"push", "sample", "admin"})
    server = start_server(tokens={"ops": ops})
    with BufferClient(f"127.0.0.1:{server.port}", token="ops", timeout=20) as c:
        c.push(payload("grpo_group.trxp"))
        batch = next(c.sample(num_groups=1, lease_seconds=600))
        c.create_table("t", estimator="none", max_staleness=0, batch_size=4)
        grant = c.admit("t", 2)
        c.create_table("p", group_size=2, estimator="none")
        c.create_dataset("p", "d", 2)
        (prompt,) = c.claim("p", "d", 1).prompts
    start_server.stop_all()
    server = start_server(tokens={})
    with BufferClient(f"127.0.0.1:{server.port}", timeout=20, retries=0) as c:
        for call in (
            lambda: c.ack(batch.lease_id),
            lambda: c.renew(batch.lease_id, 60),
            lambda: c.finish_grant(grant, accepted=0),
            lambda: c.renew_claims([prompt], 60),
        ):
            with pytest.raises(PermissionDeniedError, match="while this server had tokens on, which are off now"):
                call()
        c.push(payload("single_turn.trxp"))
        batch = next(c.sample(num_groups=1, lease_seconds=600))  # a group leased with tokens off
    start_server.stop_all()
    server = start_server(tokens={"ops": ops})
    turned_on = "no token while this server had tokens off, which are on now"
    with BufferClient(f"127.0.0.1:{server.port}", token="ops", timeout=20, retries=0) as c:
        with pytest.raises(PermissionDeniedError, match=turned_on):
            c.ack(batch.lease_id)
        with pytest.raises(PermissionDeniedError, match=turned_on):
            c.retire(batch.groups)


def _peak_rss_kib(pid: int) -> int:
    return int(re.search(r"VmHWM:\s+(\d+)", Path(f"/proc/{pid}/status").read_text()).group(1))


def test_unauthenticated_push_is_refused_before_its_body_is_read(tmp_path: Path) -> None:
    proc = ServerProcess(
        str(tmp_path), "--metrics-port", "-1", env={"EXPBUF_TOKENS": "ops:push,sample,admin"}, fresh=True
    )
    size = 96 << 20
    try:
        with BufferClient(proc.target, token="ops") as client:  # no advantages: torch does not load meanwhile
            client.create_table("plain", estimator="none")
        ops = (("authorization", "Bearer ops"),)
        assert _raw_push(proc.target, ops, payload("single_turn.trxp"), table="plain") is None
        before = _peak_rss_kib(proc.proc.pid)
        big = b"\0" * size
        for metadata in ((), (("authorization", "Bearer wrong"),)):
            refused = _raw_push(proc.target, metadata, big)
            assert refused is not None and refused.code() == grpc.StatusCode.UNAUTHENTICATED
        growth = (_peak_rss_kib(proc.proc.pid) - before) << 10
        assert growth < size // 2, f"peak RSS grew by {growth >> 20} MiB for refused {size >> 20} MiB pushes"
    finally:
        assert proc.stop(signal.SIGTERM) == 0


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return cli_forks.run(*args, env=env)


def test_health_and_stats_over_mutual_tls_with_a_token(certs: Path, start_server: Servers) -> None:
    tls = TlsConfig(cert=str(certs / "server.pem"), key=str(certs / "server.key"), client_ca=str(certs / "ca.pem"))
    server = start_server(tls=tls, tokens=TOKENS)
    target = f"127.0.0.1:{server.port}"
    client_pair = ["--tls-cert", str(certs / "client.pem"), "--tls-key", str(certs / "client.key")]
    done = _cli("health", "--target", target, "--tls-ca", str(certs / "ca.pem"), *client_pair)
    assert done.returncode == 0 and done.stdout.strip() == "SERVING", done.stderr
    env = {
        "EXPBUF_TLS_CA": str(certs / "ca.pem"),
        "EXPBUF_TLS_CLIENT_CERT": str(certs / "client.pem"),
        "EXPBUF_TLS_CLIENT_KEY": str(certs / "client.key"),
        "EXPBUF_TOKEN": "trainer-secret",
    }
    done = _cli("stats", "--target", target, env=env)
    assert done.returncode == 0 and done.stdout.count("default ") == 1, done.stderr
    done = _cli("stats", "--target", target, env=env | {"EXPBUF_TOKEN": "wrong"})
    assert done.returncode == 1 and "unknown bearer token" in done.stderr
    done = _cli("health", "--target", target, "--timeout", "2")  # plain text against TLS
    assert done.returncode == 1
    assert re.search(rf"^{re.escape(target)}: UNAVAILABLE: \S", done.stderr, re.M), done.stderr
    assert "--tls-ca" in done.stderr
    # a container's check reaches 127.0.0.1, which its server's certificate may not name: it names
    # one the certificate holds (here both are), and is checked against that name alone
    for name, code in (("localhost", 0), ("other.example", 1)):
        done = _cli("health", "--target", target, *client_pair, "--timeout", "5",
                    env={"EXPBUF_TLS_CA": str(certs / "ca.pem"), "EXPBUF_TLS_SERVER_NAME": name})  # fmt: skip
        assert done.returncode == code, (name, done.stdout, done.stderr)
    done = _cli("health", "--target", target, "--tls-server-name", "localhost")
    assert done.returncode == 2 and "needs TLS" in done.stderr, done.stderr


def test_a_start_with_an_unset_token_variable_names_it(tmp_path: Path) -> None:
    config = tmp_path / "expbuf.toml"
    config.write_text(
        '[[tokens]]\ntoken = "ops"\nscopes = ["admin"]\n\n'
        '[[tokens]]\ntoken_env = "EXPBUF_TEST_UNSET_TOKEN"\nscopes = ["push"]\n'
    )
    env = {k: v for k, v in os.environ.items() if k != "EXPBUF_TEST_UNSET_TOKEN"}
    command = [
        sys.executable,
        "-m",
        "expbuf.server.cli",
        "serve",
        "--config",
        str(config),
        "--data",
        str(tmp_path / "d"),
    ]
    done = subprocess.run(
        [*command, "--port", "0", "--metrics-port", "-1"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "EXPBUF_TEST_UNSET_TOKEN" in lines[0] and "[[tokens]] entry 2" in lines[0], lines[0]
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ('[tls]\ncert = "c.pem"\nkey = "k.pem"\nclient_cA = "ca.pem"\n', "[tls] has no setting client_cA"),
        ('[tls]\ncert = "c.pem"\nkey = 5\n', "[tls] key must be a file's path"),
        ('[[tokens]]\ntoken = "t"\nscope = ["push"]\n', "[[tokens]] entry 1 has no setting scope"),
        ('[[tokens]]\ntoken = "t"\n', "[[tokens]] entry 1 has no scopes"),
        ('[[tokens]]\ntoken = "t"\nscopes = []\n', "[[tokens]] entry 1 has no scopes"),
        ('[[tokens]]\ntoken = 5\nscopes = ["push"]\n', "[[tokens]] entry 1's token must be a string"),
        ('tokens = ["x"]\n', "tokens must be [[tokens]] blocks"),
    ],
)
def test_a_config_that_would_weaken_tls_or_tokens_is_refused_by_name(tmp_path: Path, text: str, said: str) -> None:
    """A misspelt [tls] key (client_cA) left TLS one-way and [[tokens]] entries of no scopes were
    taken without a word (a helper's audit): each is refused, naming the file, the block and what."""
    config = tmp_path / "expbuf.toml"
    config.write_text(text)
    with pytest.raises(ConfigError) as refused:
        load(str(config))
    assert str(config) in str(refused.value) and said in str(refused.value), refused.value


def test_the_environment_changes_the_files_tls_and_tokens_a_setting_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EXPBUF_SERVER_TLS_CLIENT_CA beside the file's [tls] was ignored, EXPBUF_SERVER_TLS_CERT and
    _KEY dropped the file's client_ca, a cert without a key failed at the start as "TLS key '': Is a
    directory", and an empty EXPBUF_TOKENS turned the file's tokens off (a helper's audit). Each
    variable sets its own setting over the file's; a pair left half set, and an EXPBUF_TOKENS that
    names no token, are refused by name."""
    config = tmp_path / "expbuf.toml"
    config.write_text(
        '[tls]\ncert = "c.pem"\nkey = "k.pem"\nclient_ca = "ca.pem"\n\n[[tokens]]\ntoken = "t"\nscopes = ["push"]\n'
    )
    for name in ("EXPBUF_SERVER_TLS_CERT", "EXPBUF_SERVER_TLS_KEY", "EXPBUF_SERVER_TLS_CLIENT_CA", "EXPBUF_TOKENS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("EXPBUF_SERVER_TLS_CLIENT_CA", "/etc/other-ca.pem")
    assert load(str(config)).tls == TlsConfig(str(tmp_path / "c.pem"), str(tmp_path / "k.pem"), "/etc/other-ca.pem")
    monkeypatch.delenv("EXPBUF_SERVER_TLS_CLIENT_CA")
    monkeypatch.setenv("EXPBUF_SERVER_TLS_CERT", "/etc/c.pem")
    monkeypatch.setenv("EXPBUF_SERVER_TLS_KEY", "/etc/k.pem")
    assert load(str(config)).tls == TlsConfig("/etc/c.pem", "/etc/k.pem", str(tmp_path / "ca.pem"))
    monkeypatch.delenv("EXPBUF_SERVER_TLS_KEY")
    assert load(str(config)).tls == TlsConfig("/etc/c.pem", str(tmp_path / "k.pem"), str(tmp_path / "ca.pem"))
    with pytest.raises(ConfigError, match="EXPBUF_SERVER_TLS_CERT is set without a key"):
        load()
    monkeypatch.delenv("EXPBUF_SERVER_TLS_CERT")
    for empty in ("", ";;", " "):
        monkeypatch.setenv("EXPBUF_TOKENS", empty)
        with pytest.raises(ConfigError, match="EXPBUF_TOKENS names no token"):
            load(str(config))
    monkeypatch.setenv("EXPBUF_TOKENS", "a:")
    with pytest.raises(ConfigError, match="EXPBUF_TOKENS: token 1 has no scopes"):
        load(str(config))


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("host = 5\n", "host must be a string"),
        ("data = 5\n", "data must be a string"),
        ('data = ""\n', "data must name a directory"),
        ("metrics_host = 5\n", "metrics_host must be a string"),
        ("port = true\n", "port must be an integer"),
        ("ingest_processes = true\n", "ingest_processes must be an integer"),
        ("max_sample_streams = true\n", "max_sample_streams must be an integer"),
        ("max_message_bytes = 2147483648\n", "max_message_bytes must be an integer from 65536 (a client's least"),
        ("max_message_bytes = 32768\n", "chunk of a push) to 2147483647 (gRPC's bound), got 32768"),
        ('tables = ["x"]\n', "tables must be [[tables]] blocks"),
    ],
)
def test_a_setting_of_the_wrong_type_is_one_line_naming_it(tmp_path: Path, text: str, said: str) -> None:
    """A setting of the wrong type ended the start in a traceback (host = 5, data = 5, port = true,
    tables = ["x"]; max_message_bytes past gRPC's int32 in an OverflowError), or was taken (a bool
    for an integer), and data = "" served the working directory (a helper's audit)."""
    config = tmp_path / "expbuf.toml"
    config.write_text(text)
    with pytest.raises(ConfigError) as refused:
        load(str(config))
    assert said in str(refused.value), refused.value


def test_a_config_file_that_is_not_utf_8_is_named(tmp_path: Path) -> None:
    config = tmp_path / "expbuf.toml"
    config.write_bytes(b'host = "\xff\xfe"\n')
    with pytest.raises(ConfigError, match=f"config file {re.escape(str(config))}: .*UTF-8"):
        load(str(config))
