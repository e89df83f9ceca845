"""A difficulty order's prompts left to hand out in an epoch, by bin (orders.py), in the ledger's
transactions.

Each prompt the cursor hands out in epoch e enters epoch e + 1's bins, in the bin of its
statistics then (`enter`); the cursor draws a bin for each prompt it hands out in an epoch after
the first and takes the bin's first prompt (`take`), the epoch ending when its bins are empty;
a prompt whose statistics move it to another bin moves there (`move`). A bin is a key range,
T + "o" + name + 0 + epoch + bin + rank + index, the rank a hash of the seed, the epoch and the
index, so a bin hands out its prompts in an order of their own each epoch; the dataset record
counts each bin's prompts left (`DatasetRecord.binned`, for the cursor's epoch and the next),
so a draw reads no key it does not take.
"""

from __future__ import annotations

import hashlib
import itertools

from expbuf.client.schema.prompts import PromptStats

from ..core.table_state.state import TableState
from ..disk import layout
from ..disk.layout import U32, U64
from .orders import ClaimOrder
from .records import DatasetRecord

_TWO64 = float(2**64)


def _prefix(tt: TableState, ds: DatasetRecord, epoch: int, bin_: int) -> bytes:
    return bins_prefix(tt.table_id) + ds.name.encode() + b"\0" + U32.pack(epoch) + bytes([bin_])


def bins_prefix(table_id: int) -> bytes:
    return layout.table_prefix(table_id) + b"o"


def read_bin_key(key: bytes) -> tuple[str, int, int]:
    """(dataset, epoch, bin) of a bin's key."""
    name, _, rest = key[len(bins_prefix(0)) :].partition(b"\0")
    return name.decode(errors="replace"), U32.unpack_from(rest)[0], rest[4]


def _hash(ds: DatasetRecord, epoch: int, value: int, salt: bytes) -> bytes:
    key = U64.pack((ds.seed or 0) & (2**64 - 1)) + U32.pack(epoch) + salt
    return hashlib.blake2b(U64.pack(value), digest_size=8, key=key).digest()


def _key(tt: TableState, ds: DatasetRecord, epoch: int, bin_: int, index: int) -> bytes:
    rank = _hash(ds, epoch, index, b"rank") if ds.seed is not None else b""
    return _prefix(tt, ds, epoch, bin_) + rank + U64.pack(index)


def enter(tt: TableState, ds: DatasetRecord, order: ClaimOrder, epoch: int, index: int, stats: PromptStats) -> None:
    """The prompt is left to hand out in `epoch` (none past the dataset's last)."""
    if epoch >= ds.epochs:
        return
    bin_ = order.bin(stats)
    tt.txn.put(_key(tt, ds, epoch, bin_, index), b"", db=tt.db["ledger"])
    ds.binned.setdefault(str(epoch), [0] * order.bins)[bin_] += 1


def take(tt: TableState, ds: DatasetRecord, order: ClaimOrder, epoch: int) -> int | None:
    """The next prompt of `epoch`, from a bin drawn by the order's weights (the draw a hash of
    the seed, the epoch and the draws made, `ds.cursor_position`); None once every bin is empty."""
    if not left(ds, epoch):
        return None
    counts = ds.binned[str(epoch)]
    weights = order.weights(counts)
    draw = int.from_bytes(_hash(ds, epoch, ds.cursor_position, b"draw"), "big") / _TWO64 * sum(weights)
    bin_ = next(
        (k for k, upto in enumerate(itertools.accumulate(weights)) if draw < upto and weights[k]),
        max(k for k, weight in enumerate(weights) if weight),
    )
    prefix = _prefix(tt, ds, epoch, bin_)
    with tt.txn.cursor(db=tt.db["ledger"]) as cur:
        if not (cur.set_range(prefix) and bytes(cur.key()).startswith(prefix)):
            raise RuntimeError(f"dataset {ds.name}: epoch {epoch}'s bin {bin_} counts {counts[bin_]} and holds none")
        key = bytes(cur.key())
        cur.delete()
    counts[bin_] -= 1
    index: int = U64.unpack_from(key, len(key) - 8)[0]
    return index


def left(ds: DatasetRecord, epoch: int) -> bool:
    """Whether `epoch` has prompts left in its bins (its row is dropped once it has none)."""
    if any(ds.binned.get(str(epoch), ())):
        return True
    ds.binned.pop(str(epoch), None)
    return False


def move(tt: TableState, ds: DatasetRecord, order: ClaimOrder, index: int, was: PromptStats, now: PromptStats) -> None:
    """The prompt's statistics changed from `was` to `now`: it moves to its new bin, in the epoch
    it is left in (the cursor's, or, handed out in it already, the next)."""
    old, new = order.bin(was), order.bin(now)
    if old == new:
        return
    for epoch in (ds.cursor_epoch, ds.cursor_epoch + 1):
        if tt.txn.delete(_key(tt, ds, epoch, old, index), db=tt.db["ledger"]):
            tt.txn.put(_key(tt, ds, epoch, new, index), b"", db=tt.db["ledger"])
            counts = ds.binned[str(epoch)]
            counts[old] -= 1
            counts[new] += 1
            return
