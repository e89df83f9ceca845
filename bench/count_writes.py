"""LMDB writes per experience, counted by database: what each stored experience costs the
writer in puts and deletes on a push (each experience its own group, and groups of 8), a
consume, and a lease then its ack.

    .venv/bin/python bench/count_writes.py [--experiences 512]

Counts every put (one row of a putmulti is a put) and every delete the store's transactions
make, through a counting wrapper around the writer's transaction; the bytes are small
experiences (the counts do not depend on payload size).
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lmdb

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from expbuf.client import EID, Experience, trxp  # noqa: E402
from expbuf.server.sample_spec import SampleSpec  # noqa: E402
from expbuf.server.store import Entry, Store  # noqa: E402
from expbuf.server.store.environment import Environment  # noqa: E402
from expbuf.server.tables import TableConfig  # noqa: E402

Counts = collections.Counter[str]


class _Cursor:
    def __init__(self, cur: lmdb.Cursor, name: str, counts: Counts) -> None:
        self._cur, self._name, self._counts = cur, name, counts

    def putmulti(self, rows: Any, *args: Any, **kwargs: Any) -> Any:
        rows = list(rows)
        self._counts["put " + self._name] += len(rows)
        return self._cur.putmulti(rows, *args, **kwargs)

    def put(self, *args: Any, **kwargs: Any) -> Any:
        self._counts["put " + self._name] += 1
        return self._cur.put(*args, **kwargs)

    def delete(self, *args: Any, **kwargs: Any) -> Any:
        self._counts["del " + self._name] += 1
        return self._cur.delete(*args, **kwargs)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._cur)

    def __enter__(self) -> _Cursor:
        return self

    def __exit__(self, *exc: object) -> None:
        self._cur.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cur, name)


class _Txn:
    """A write transaction that counts what it writes, by database."""

    def __init__(self, txn: lmdb.Transaction, names: dict[int, str], counts: Counts) -> None:
        self._txn, self._names, self._counts = txn, names, counts

    def _name(self, db: Any) -> str:
        return self._names.get(id(db), "?")

    def put(self, key: bytes, value: bytes, *args: Any, db: Any = None, **kwargs: Any) -> Any:
        self._counts["put " + self._name(db)] += 1
        return self._txn.put(key, value, *args, db=db, **kwargs)

    def delete(self, key: bytes, *args: Any, db: Any = None, **kwargs: Any) -> Any:
        done = self._txn.delete(key, *args, db=db, **kwargs)
        self._counts["del " + self._name(db)] += bool(done)
        return done

    def cursor(self, db: Any = None) -> _Cursor:
        return _Cursor(self._txn.cursor(db=db), self._name(db), self._counts)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._txn, name)


def counting(store: Store, counts: Counts) -> None:
    """Make every request of the store's writer count its writes into `counts`."""
    env: Environment = store.environment
    names = {id(db): name for name, db in env.db.items()}

    def run(op: Any, txn: lmdb.Transaction) -> tuple[bool, Any]:
        fn: Callable[[Any], Any] = op.fn
        try:
            return True, fn(_Txn(txn, names, counts))
        except lmdb.MapFullError:
            raise
        except Exception as exc:
            return False, exc

    env._run = run  # type: ignore[method-assign]


def entries(n: int, group: int, start: int = 0) -> list[Entry]:
    out = []
    for i in range(start, start + n):
        exp = Experience(
            eid=EID(batch=0, task=i // group, run=i % group, suffix=f"s{start}"),
            tokens=[1, 2, 3, 4, 5, 6, 7, 8],
            prompt_length=4,
            reward=float(i % 2),
            info={"model_version": 1},
        )
        out.append(Entry.of(trxp.from_experience(exp)))
    return out


def measure(n: int, group: int) -> dict[str, Counts]:
    """The writes per experience of a push, a consume, and a lease and its ack, by database."""
    stages: dict[str, Counts] = {}
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "d")
        store.create_table(TableConfig(name="t", estimator="none", group_size=group, drop_zero_variance=False))
        counts: Counts = collections.Counter()
        counting(store, counts)
        for at in range(0, 2 * n, 64):
            store.put_entries("t", entries(64, group, at))
        stages["push"] = +counts
        counts.clear()
        spec = SampleSpec(table="t", batch_size=64, delivery="consume", wait_seconds=0)
        for _ in range(n // 64):
            assert store.sample(spec) is not None
        stages["consume"] = +counts
        counts.clear()
        lease = SampleSpec(table="t", batch_size=64, delivery="lease", wait_seconds=0)
        leases = []
        for _ in range(n // 64):
            batch = store.sample(lease)
            assert batch is not None
            leases.append(batch.lease_id)
        stages["lease"] = +counts
        counts.clear()
        for lease_id in leases:
            store.ack(lease_id)
        stages["ack"] = +counts
        store.close()
    return {
        stage: Counts({k: v / (2 * n if stage == "push" else n) for k, v in c.items()}) for stage, c in stages.items()
    }


def table(results: dict[int, dict[str, Counts]]) -> str:
    lines = ["| group size | stage | puts / exp | deletes / exp | by database |", "| --- | --- | --- | --- | --- |"]
    for group, stages in results.items():
        for stage, c in stages.items():
            puts = sum(v for k, v in c.items() if k.startswith("put"))
            dels = sum(v for k, v in c.items() if k.startswith("del"))
            detail = ", ".join(f"{k} {v:.2f}" for k, v in sorted(c.items()) if v >= 0.005)
            lines.append(f"| {group} | {stage} | {puts:.2f} | {dels:.2f} | {detail} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--experiences", type=int, default=512, help="per stage (a multiple of 64)")
    args = parser.parse_args()
    print(table({group: measure(args.experiences, group) for group in (1, 8)}))


if __name__ == "__main__":
    main()
