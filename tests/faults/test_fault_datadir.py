"""The data directory under operators' mistakes and a failing disk: a lock file deleted under a
running server, random bytes written over a copy of `data.mdb`, a check of a read-only backup."""

from __future__ import annotations

import hashlib
import os
import queue
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from expbuf.client import BufferClient, trxp
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.server.store import Store
from expbuf.server.store.disk import layout
from expbuf.server.store.disk.environment import Environment
from expbuf.server.store.schema.errors import Damaged
from expbuf.server.store.schema.sample_spec import TakeSpec
from expbuf.server.store.schema.table_config import TableConfig
from expbuf.server.store.tables import integrity

import cli_forks
from faultkit import channel, payload, servers, stats, stub
from helpers import group_items, killed_while_opening

GROUPS = 120

pytestmark = pytest.mark.faults


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`expbuf ARGS` in a child process (tests/cli_forks.py); a server that starts when it should not
    times out here."""
    return cli_forks.run(*args, timeout=timeout)


def one_line_error(done: subprocess.CompletedProcess, *words: str) -> str:
    """Exit code 2 and one line on stderr, with no traceback, holding every word."""
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def test_deleting_the_lock_files_lets_no_second_server_in(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with servers() as start:
        first = start(str(data))
        chan = channel(first.target)
        buffer = stub(chan)
        for task in range(2):
            buffer.Push(pb.PushRequest(table="default", payload=payload("0", task)[0]), timeout=30)
        # A consume batch sent and not yet confirmed: held for the stream until it confirms.
        requests: queue.SimpleQueue[pb.SampleRequest | None] = queue.SimpleQueue()
        # (a push returns before its group's advantages are computed: the sample waits for them)
        requests.put(pb.SampleRequest(table="default", num_groups=1, max_batches=2, wait_seconds=30))
        call = buffer.Sample(iter(requests.get, None), timeout=60)
        held = next(call)
        assert stats(buffer).leased == 4

        for name in ("expbuf.lock", "lock.mdb"):  # whatever files a careless cleanup removes
            (data / name).unlink(missing_ok=True)
        done = cli("serve", "--data", str(data), "--port", "0", "--metrics-port", "-1")
        one_line_error(done, str(data), "another expbuf process")

        assert first.proc.poll() is None
        assert stats(buffer).leased == 4  # the second start did not release the first one's hold
        requests.put(pb.SampleRequest(received=1))  # the held batch is confirmed: consumed now
        second = next(call)
        assert not set(held.uids) & set(second.uids)
        requests.put(pb.SampleRequest(received=2))
        requests.put(None)
        assert list(call) == []
        after = stats(buffer)
        assert (after.consumed, after.leased, after.ready) == (8, 0, 0)
        chan.close()
    assert os.path.exists(data / "data.mdb")


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, trxp.RawItem]]:
    """A stopped server's directory with GROUPS groups of 4 ready, and what was pushed."""
    data = tmp_path_factory.mktemp("stored") / "data"
    pushed: dict[str, trxp.RawItem] = {}
    with Store(data) as store:
        store.create_table(TableConfig.of(name="t", group_size=4, estimator="none"))
        for task in range(GROUPS):
            items = group_items(0, task, 4, reward=float(task))
            store.put("t", items)
            pushed |= {item.uid: item for item in items}
    return data, pushed


def damage(source: Path, into: Path, rng: random.Random, writes: int) -> None:
    """A copy of a directory with random bytes written at random places of its data.mdb."""
    shutil.copytree(source, into)
    size = (into / "data.mdb").stat().st_size
    with open(into / "data.mdb", "r+b") as data:
        for _ in range(writes):
            data.seek(rng.randrange(size))
            data.write(rng.randbytes(rng.randint(1, 16)))


def check_report(data: Path) -> dict[str, list[str]]:
    """What `expbuf check` finds, read in-process."""
    environment = Environment(data, readonly=True)
    try:
        with environment.read() as txn:
            return integrity.scan(txn, environment.db, time.time())
    finally:
        environment.close()


def same_item(served: trxp.RawItem, pushed: trxp.RawItem) -> bool:
    tensors = {name: bytes(raw.data) for name, raw in served.tensors.items()}
    return served.meta == pushed.meta and tensors == {name: bytes(raw.data) for name, raw in pushed.tensors.items()}


def test_random_damage_is_refused_at_open_or_does_no_harm(
    stored: tuple[Path, dict[str, trxp.RawItem]], tmp_path: Path
) -> None:
    """Bytes written at random over a copy: the full check refuses to open it, naming `expbuf
    check`, and check finds the damage; or it serves every experience exactly as pushed."""
    source, pushed = stored
    rng = random.Random(20261122)
    outcomes = []
    for trial in range(24):
        copy = tmp_path / f"copy{trial}"
        damage(source, copy, rng, writes=rng.randint(1, 3))
        try:
            store = Store(copy, check_at_open="full")
        except Damaged as exc:
            assert "expbuf check --data" in str(exc)
            assert any(check_report(copy).values())  # check reports what open refused
            outcomes.append("refused")
            continue
        with store:
            served: dict[str, trxp.RawItem] = {}
            while (batch := store.sample(TakeSpec("t", num_groups=8))) is not None:
                for item in trxp.parse(batch.payload):
                    assert item.uid not in served
                    served[item.uid] = item
        assert served.keys() == pushed.keys()
        assert all(same_item(item, pushed[uid]) for uid, item in served.items())
        outcomes.append("served")
    assert set(outcomes) == {"refused", "served"}, outcomes  # both happened: the test can fail either way


def test_a_damaged_payload_stops_the_server_in_one_line_and_check_names_it(
    stored: tuple[Path, dict[str, trxp.RawItem]], tmp_path: Path
) -> None:
    """A payload whose tensor bytes changed still parses: only its digest shows the damage."""
    source, pushed = stored
    copy = tmp_path / "copy"
    shutil.copytree(source, copy)
    blob = trxp.pack_item(pushed["0/57/2/0/r2s0"])  # the one-item payload as stored
    raw = (copy / "data.mdb").read_bytes()
    assert raw.count(blob) == 1
    at = raw.index(blob) + len(blob) - 4  # the last tensor's last bytes
    with open(copy / "data.mdb", "r+b") as data:
        data.seek(at)
        data.write(bytes(b ^ 0xFF for b in blob[-4:]))

    done = cli("serve", "--data", str(copy), "--port", "0", "--metrics-port", "-1", "--check-at-open", "full")
    line = one_line_error(done, str(copy), "damaged", "expbuf check")
    assert "0/57/2/0/r2s0" in line
    checked = cli("check", "--data", str(copy))
    assert checked.returncode == 1 and not checked.stderr, checked.stderr
    assert "t: 1 problem(s)" in checked.stdout
    assert "item 0/57/2/0/r2s0: its payload does not match its digest" in checked.stdout
    # The quick check at open (the default) reads only the directory's structure: it opens, and
    # `expbuf check` still finds the damage, until a read or the scrub quarantines it.
    with Store(copy) as store:
        assert store.has_table("t")
    with pytest.raises(Damaged):
        Store(copy, check_at_open="full")


def test_check_reads_a_read_only_copy_and_writes_nothing(
    stored: tuple[Path, dict[str, trxp.RawItem]], tmp_path: Path
) -> None:
    """chmod keeps no root process from writing, so the copy is also made immutable (chattr +i,
    which binds root too) where the file system allows; either way nothing in it may change."""
    source, _ = stored
    copy = tmp_path / "backup"
    copy.mkdir()
    shutil.copy2(source / "data.mdb", copy / "data.mdb")
    damaged = tmp_path / "damaged-backup"
    damage(source, damaged, random.Random(5), writes=8)
    (damaged / "lock.mdb").unlink(missing_ok=True)
    directories = (copy, damaged)

    def state(directory: Path) -> dict[str, tuple[int, str]]:
        files = {
            p.name: (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest()) for p in directory.iterdir()
        }
        return files | {".": (directory.stat().st_mtime_ns, "")}

    before = {directory: state(directory) for directory in directories}
    paths = [path for directory in directories for path in (*directory.iterdir(), directory)]
    for path in paths:
        path.chmod(0o555 if path.is_dir() else 0o444)
    immutable = subprocess.run(["chattr", "+i", *map(str, paths)], capture_output=True, check=False)
    try:
        if immutable.returncode == 0:  # then not even root may open data.mdb for writing
            with pytest.raises(PermissionError):
                open(copy / "data.mdb", "r+b").close()
        clean = cli("check", "--data", str(copy))
        assert clean.returncode == 0 and not clean.stderr, clean.stderr
        assert clean.stdout.splitlines() == ["default: ok", "t: ok"]
        bad = cli("check", "--data", str(damaged))
        assert bad.returncode == 1 and not bad.stderr, bad.stderr
        assert "problem(s)" in bad.stdout
    finally:
        if immutable.returncode == 0:
            subprocess.run(["chattr", "-i", *map(str, paths)], check=True)
        for path in paths:
            path.chmod(0o755 if path.is_dir() else 0o644)
    assert {directory: state(directory) for directory in directories} == before


def damage_payloads(
    source: Path, into: Path, pushed: dict[str, trxp.RawItem], rng: random.Random, count: int
) -> list[str]:
    """A copy of a directory with one random byte changed in the stored payloads of `count`
    random experiences (of those whose bytes lie once in the file, not also in a freed page);
    their uids."""
    shutil.copytree(source, into)
    raw = (into / "data.mdb").read_bytes()
    once = [uid for uid in sorted(pushed) if raw.count(trxp.pack_item(pushed[uid])) == 1]
    damaged = sorted(rng.sample(once, count))
    with open(into / "data.mdb", "r+b") as data:
        for uid in damaged:
            blob = trxp.pack_item(pushed[uid])
            at = raw.index(blob) + rng.randrange(len(blob))
            data.seek(at)
            data.write(bytes([raw[at] ^ rng.randrange(1, 256)]))
    return damaged


def group_of(uid: str) -> str:
    return uid.rsplit("/", 3)[0]


def test_a_quick_open_never_serves_a_damaged_payload(
    stored: tuple[Path, dict[str, trxp.RawItem]], tmp_path: Path
) -> None:
    """Random bytes over the payloads of a few experiences of a closed directory, opened with
    the quick check (which reads no payload): a sample checks each payload's digest, serves
    every undamaged group exactly as pushed, never a damaged experience; it quarantines each
    damaged one and fails its group, whose other members Get still returns as pushed; `expbuf
    check` then reports the quarantined ones as known, not as damage."""
    source, pushed = stored
    copy = tmp_path / "copy"
    damaged = damage_payloads(source, copy, pushed, random.Random(20261123), 6)
    bad_groups = {group_of(uid) for uid in damaged}
    kept = sorted(uid for uid in pushed if group_of(uid) in bad_groups and uid not in damaged)
    before = cli("check", "--data", str(copy))
    assert before.returncode == 1
    assert all(f"item {uid}: its payload does not match its digest" in before.stdout for uid in damaged)
    with Store(copy, check_at_open="quick") as store:
        served: dict[str, trxp.RawItem] = {}
        while (batch := store.sample(TakeSpec("t", num_groups=8, allow_partial=True))) is not None:
            served |= {item.uid: item for item in trxp.parse(batch.payload)}
        stats = store.stats("t")
        payload, missing = store.get_payload("t", damaged + kept)
        assert store.verify("t") == []
    assert not set(damaged) & served.keys()
    assert served.keys() == {uid for uid in pushed if group_of(uid) not in bad_groups}
    assert all(same_item(item, pushed[uid]) for uid, item in served.items())
    assert (stats["damaged"], stats["quarantined"]) == (len(damaged), len(damaged))
    assert (stats["groups_failed"], stats["failed"]) == (len(bad_groups), len(kept))
    assert missing == damaged  # nor by Get; the good members of their groups are
    assert {item.uid: same_item(item, pushed[item.uid]) for item in trxp.parse(payload)} == dict.fromkeys(kept, True)
    checked = cli("check", "--data", str(copy))
    assert checked.returncode == 0, checked.stdout
    assert checked.stdout.splitlines() == [
        "default: ok",
        f"t: ok ({len(damaged)} experience(s) quarantined: damaged, never served)",
    ]


def test_with_default_settings_no_damaged_experience_is_served_and_the_scrub_finds_the_rest(
    stored: tuple[Path, dict[str, trxp.RawItem]], tmp_path: Path
) -> None:
    """Random bytes over the payloads of a closed directory, then `expbuf serve` with default
    settings (a quick open, the scrub in the background), and reads of everything: Gets of half
    the groups, the scrub's first pass, then samples of all that is ready. No damaged experience
    is served; each is quarantined, counted and logged once (those no read asked for, by the
    scrub); every undamaged experience is served exactly as pushed, by a sample or, in a group
    failed for a damaged member, by Get; `expbuf check` then reports the quarantined as known."""
    source, pushed = stored
    copy = tmp_path / "copy"
    damaged = damage_payloads(source, copy, pushed, random.Random(20261129), 12)
    bad_groups = {group_of(uid) for uid in damaged}
    groups = sorted({group_of(uid) for uid in pushed})
    asked = set(groups[: len(groups) // 2])
    assert bad_groups & asked and bad_groups - asked  # reads find some, only the scrub the others
    with servers() as start:
        server = start(str(copy))
        chan = channel(server.target)
        buffer = stub(chan)
        served: dict[str, trxp.RawItem] = {}

        def get(uids: list[str]) -> list[str]:
            reply = buffer.Get(pb.GetRequest(table="t", uids=uids), timeout=30)
            served.update((item.uid, item) for item in trxp.parse(reply.payload))
            return list(reply.missing_uids)

        missing = get(sorted(uid for uid in pushed if group_of(uid) in asked))
        assert sorted(missing) == sorted(uid for uid in damaged if group_of(uid) in asked)
        deadline = time.monotonic() + 120
        while (scrub := buffer.ServerInfo(pb.ServerInfoRequest(), timeout=10).scrub).passes < 1:
            assert time.monotonic() < deadline, "the scrub made no pass in two minutes"
            time.sleep(0.1)
        # Those no read asked for, the scrub found (it may have met the others before the Gets did).
        unasked = len([uid for uid in damaged if group_of(uid) not in asked])
        assert scrub.found == scrub.last_pass_found and unasked <= scrub.found <= len(damaged)
        after_scrub = stats(buffer, "t")
        assert (after_scrub.damaged, after_scrub.quarantined) == (len(damaged), len(damaged))
        good = len(groups) - len(bad_groups)
        assert after_scrub.groups_ready == good
        with BufferClient(server.target, timeout=30) as client:
            for batch in client.sample("t", num_groups=1, max_batches=good, timeout=10, delivery="consume"):
                served.update((item.uid, item) for item in trxp.parse(batch.payload))
        kept = sorted(uid for uid in pushed if group_of(uid) in bad_groups and uid not in damaged)
        assert get(kept + damaged) == damaged
        final = stats(buffer, "t")
        chan.close()
        assert server.stop(signal.SIGTERM) == 0
    assert not set(damaged) & served.keys()
    assert served.keys() == set(pushed) - set(damaged)
    assert all(same_item(item, pushed[uid]) for uid, item in served.items())
    assert (final.ready, final.damaged, final.quarantined) == (0, len(damaged), len(damaged))
    assert final.groups_failed == len(bad_groups)
    logged = "".join(server.log)
    assert all(logged.count(f"experience {uid} quarantined") == 1 for uid in damaged)
    checked = cli("check", "--data", str(copy))
    assert checked.returncode == 0, checked.stdout
    assert f"t: ok ({len(damaged)} experience(s) quarantined: damaged, never served)" in checked.stdout


def test_a_kill_during_the_format_upgrade_leaves_format_3_or_the_current_one_and_check_finds_no_damage(
    tmp_path: Path,
) -> None:
    """`expbuf serve` SIGKILLed at moments spread over its upgrade of a copy of a format-3
    directory (from the moment LMDB opens, when the upgrade starts): each time, `expbuf check`
    exits 0 saying either that the next start upgrades it or that every table is ok, and the
    next start serves it. Where in the upgrade a kill lands depends on the machine's load;
    the verdict may not."""
    fixture = Path(__file__).parent.parent / "fixtures" / "datadir_v3"
    tables = ["default", "grpo4", "plain", "small", "turns"]
    for trial, delay in enumerate((0.0, 0.0005, 0.001, 0.0015, 0.002, 0.004)):
        data = tmp_path / f"copy{trial}"
        data.mkdir()
        shutil.copy(fixture / "data.mdb", data / "data.mdb")
        killed_while_opening(data, delay)
        checked = cli("check", "--data", str(data))
        assert checked.returncode == 0 and not checked.stderr, (trial, checked.stdout, checked.stderr)
        lines = checked.stdout.splitlines()
        upgrade = [
            f"{data}: data directory format 3, which the next expbuf serve upgrades to format {layout.FORMAT};"
            " run expbuf check after that to check its tables"
        ]
        assert lines in (upgrade, [f"{table}: ok" for table in tables]), (trial, checked.stdout)
        with Store(data) as store:
            assert sorted(table.name for table in store.list_tables()) == tables
            assert all(store.verify(table) == [] for table in tables)
