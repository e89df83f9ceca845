"""The selection orders, one registered `Order` class each: the registry a new order joins with
one `register` call, before the store opens, and the built-in orders (fifo, lifo, uniform,
priority).

An order declares the index it reads (indexes.py): the store opens that index's databases,
keeps it as groups become ready, leave ready or change priority (ready.py), and the table's
check verifies it, all without naming it. The registry tells the rooms below what it holds
(schema/order_names.py: the names a request may give, the databases the store opens).
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING, ClassVar, TypeVar

from expbuf.client.schema.orders import NAME, NAME_FORM

from ...schema import order_names
from .indexes import Index, PriorityIndex, ReadyOrder, Slots, VersionIndex

if TYPE_CHECKING:
    from .ready import ReadyIndex

O = TypeVar("O", bound="type[Order]")  # noqa: E741


class Order(ABC):
    """One way to take ready groups, from the index it declares."""

    name: ClassVar[str]
    index: ClassVar[type[Index]]  # the index it reads; several orders may read one (fifo and lifo)

    @abstractmethod
    def candidates(self, ready: ReadyIndex, rng: random.Random) -> Iterator[bytes]:
        """Ready group keys, each at most once, lazily (a generator, which the caller closes): a
        caller that needs k groups reads about k."""

    def fresh(self, ready: ReadyIndex, min_version: int, rng: random.Random) -> Iterator[bytes]:
        """The candidates whose lowest version is at least `min_version`: the fresh groups
        read from the version index, then this order's candidates until each was met."""
        wanted = {gkey for _, _, gkey in ready.versions.at_least(min_version)}
        for gkey in self.candidates(ready, rng):
            if not wanted:
                return
            if gkey in wanted:
                wanted.discard(gkey)
                yield gkey


# Every order by name, in the order error messages list them.
ORDERS: dict[str, type[Order]] = {}
# indexes(), made anew at each (un)registration: every request reads it (as orders.KEPT, since
# it is bound anew).
KEPT: list[type[Index]] = []


def register(order: O, *, replace: bool = False) -> O:
    """Make an order available to sample requests under its name (a class decorator too);
    a name taken already is refused unless `replace`. A store opened from now on opens and
    keeps the order's index."""
    global KEPT
    if not (isinstance(order, type) and issubclass(order, Order)):
        raise TypeError(f"{order!r} is not an Order class")
    if not isinstance(getattr(order, "name", None), str) or not NAME.fullmatch(order.name):
        raise ValueError(f"an order's name is {NAME_FORM}, not {order.name!r}")
    if not (isinstance(getattr(order, "index", None), type) and issubclass(order.index, Index)):
        raise TypeError(f"order {order.name} declares no Index class as its `index`")
    if order.name in ORDERS and not replace:
        raise ValueError(f"order {order.name} is registered already")
    for other in KEPT:
        shared = set(other.databases) & set(order.index.databases)
        if shared and other is not order.index:
            raise ValueError(f"order {order.name}: database(s) {', '.join(sorted(shared))} belong to {other.__name__}")
    ORDERS[order.name] = order
    KEPT = _indexes()
    _named()
    return order


def unregister(name: str) -> None:
    """Remove an order (a store opened from now on drops its index unless another order reads it)."""
    global KEPT
    ORDERS.pop(name, None)
    KEPT = _indexes()
    _named()


def indexes() -> list[type[Index]]:
    """The indexes a store opens: the ready order, the version index, then those the registered
    orders read. A table keeps those of them it was read with (`in_use`)."""
    return list(KEPT)


def _named() -> None:
    """Tell the rooms below what the registry holds now (order_names.py)."""
    order_names.kept(list(ORDERS), tuple(name for index in KEPT for name in index.databases))


def _indexes() -> list[type[Index]]:
    found: list[type[Index]] = [ReadyOrder, VersionIndex]
    for order in ORDERS.values():
        if order.index not in found:
            found.append(order.index)
    return found


class Arrival(Order):
    """Completed groups in the order they became ready, oldest first or (`newest`) newest first:
    a scan of the ready order one way or the other."""

    index = ReadyOrder
    newest: ClassVar[bool]

    def candidates(self, ready: ReadyIndex, rng: random.Random) -> Iterator[bytes]:
        return ready.of(ReadyOrder).scan(reverse=self.newest)

    def fresh(self, ready: ReadyIndex, min_version: int, rng: random.Random) -> Iterator[bytes]:
        return ready.versions.in_ready_order(min_version, newest=self.newest)


@register
class Fifo(Arrival):
    """Oldest completed group first."""

    name = "fifo"
    newest = False


@register
class Lifo(Arrival):
    """Newest completed group first."""

    name = "lifo"
    newest = True


@register
class Uniform(Order):
    """Random groups without replacement: random slots of the dense slot array."""

    name = "uniform"
    index = Slots

    def candidates(self, ready: ReadyIndex, rng: random.Random) -> Iterator[bytes]:
        slots = ready.of(Slots)
        count, seen = slots.count(), set[int]()
        while len(seen) < count:
            slot = rng.randrange(count)
            if slot not in seen:
                seen.add(slot)
                yield slots.slot(slot)

    def fresh(self, ready: ReadyIndex, min_version: int, rng: random.Random) -> Iterator[bytes]:
        """The fresh groups, read once and shuffled (a cost of the fresh groups)."""
        fresh = [gkey for _, _, gkey in ready.versions.at_least(min_version)]
        rng.shuffle(fresh)
        yield from fresh


@register
class Priority(Order):
    """Highest info["priority"] first, ties oldest first."""

    name = "priority"
    index = PriorityIndex

    def candidates(self, ready: ReadyIndex, rng: random.Random) -> Iterator[bytes]:
        return ready.of(PriorityIndex).scan(reverse=False)

    def fresh(self, ready: ReadyIndex, min_version: int, rng: random.Random) -> Iterator[bytes]:
        """The fresh groups, read once and sorted by priority, ties oldest first."""
        fresh = sorted((pkey, key[8:], gkey) for key, pkey, gkey in ready.versions.at_least(min_version))
        for _, _, gkey in fresh:
            yield gkey
