"""How whole groups of a step are spread over a trainer's data-parallel ranks, so that the ranks'
loads are as equal as the groups allow: a step waits for its slowest rank.

`parts(costs, ranks)` is the Karmarkar-Karp largest differencing method, k-way: each group starts
as a partial split with it alone on one rank, and the two splits that differ most are merged
repeatedly, the heaviest rank of one with the lightest of the other, until one split is left;
then groups are moved or swapped between the heaviest and the lightest rank while that brings
them nearer (on long-tailed groups of 8 over 8 ranks: within 0.3% of the total over the ranks,
against 0.2-3% for Karmarkar-Karp alone). A step of more than WORK groups x ranks (whose
Karmarkar-Karp lists would take gigabytes) starts from the greedy split instead, the heaviest
group onto the lightest rank. It is deterministic (ties go by the groups' order), so
every process that splits the same groups gets the same parts: a rank that dies and comes back
reads its part again.

A group's cost is the sum of its runs', each a function of the run's tokens (its whole sequence)
named in `COSTS`: the tokens, 1 (a split by runs), or the FLOPs of a forward and backward pass
over them for a model of a given shape. The server reads each run's tokens from its stored header
(ReadFields with a lease and a rank). A cost of one's own is one `register_cost`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

MAX_RANKS = 1 << 16
# The most groups x ranks a split works through with Karmarkar-Karp, or pairs of groups it tries
# to swap; a larger step is split greedily, and only moves are tried.
WORK = 1 << 20


@dataclass(frozen=True)
class ModelShape:
    """What a FLOP estimate needs of the model: its parameters, layers and hidden size."""

    params: int
    layers: int
    hidden: int

    def __post_init__(self) -> None:
        if min(self.params, self.layers, self.hidden) < 1:
            raise ValueError(f"a model's shape is positive numbers, got {self}")


# A run's cost from its tokens (and the model's shape, for the costs that need it).
RunCost = Callable[[int, ModelShape | None], int]


def _tokens(length: int, model: ModelShape | None) -> int:
    return length


def _runs(length: int, model: ModelShape | None) -> int:
    return 1


def _flops(length: int, model: ModelShape | None) -> int:
    """6 N L + 12 l h L^2 for L tokens: the weights' matmuls, forward and backward (6 N a token),
    and attention's scores and weighted values over the causal sequence (12 l h L^2)."""
    if model is None:
        raise ValueError("balance 'flops' needs the model's shape (params, layers, hidden)")
    return 6 * model.params * length + 12 * model.layers * model.hidden * length * length


# What a group weighs, by the name a request gives: the sum of its runs' costs.
COSTS: dict[str, RunCost] = {"tokens": _tokens, "count": _runs, "flops": _flops}


def register_cost(name: str, cost: RunCost) -> None:
    """A run's cost of one's own under `name`, for the requests that name it (on the server: before
    it serves)."""
    if name in COSTS:
        raise ValueError(f"a cost named {name!r} is registered already")
    COSTS[name] = cost


def group_cost(balance: str, lengths: Sequence[int], model: ModelShape | None = None) -> int:
    """A group's cost by `balance` (a name in COSTS), its runs of `lengths` tokens."""
    cost = COSTS[balance]
    return sum(cost(length, model) for length in lengths)


def split_groups(
    groups: Mapping[str, Sequence[int]],
    ranks: int,
    balance: str = "tokens",
    model: ModelShape | None = None,
    equal: bool = False,
) -> list[list[str]]:
    """The groups of each rank, for groups given in a step's order with their runs' tokens: each
    group's cost by `balance` (group_cost), split by `parts`. The one rule a server's read_part,
    a sharded client's and a batch's own `rank_parts` follow, so that all of them agree."""
    order = list(groups)
    costs = [group_cost(balance, groups[group], model) for group in order]
    return [[order[at] for at in part] for part in parts(costs, ranks, equal)]


def split_runs(
    uids: Sequence[str],
    group_ids: Sequence[str],
    lengths: Sequence[int],
    ranks: int,
    balance: str = "tokens",
    model: ModelShape | None = None,
    equal: bool = False,
) -> list[list[str]]:
    """The uids of each rank, for a step's runs (their groups, in the order they first come, and
    tokens): `split_groups` of their groups."""
    members: dict[str, list[str]] = {}
    tokens: dict[str, list[int]] = {}
    for uid, group, length in zip(uids, group_ids, lengths, strict=True):
        members.setdefault(group, []).append(uid)
        tokens.setdefault(group, []).append(length)
    return [
        [uid for group in part for uid in members[group]] for part in split_groups(tokens, ranks, balance, model, equal)
    ]


def parts(costs: Sequence[int], ranks: int, equal: bool = False) -> list[list[int]]:
    """The groups (indexes of `costs`) of each of `ranks` ranks, each rank's in increasing order;
    a rank may get none where there are fewer groups than ranks. With `equal`, every rank gets
    as many groups as the others, or one fewer (a trainer whose ranks must step in lockstep
    through as many micro-batches), and loads as equal as that allows."""
    if not 1 <= ranks <= MAX_RANKS:
        raise ValueError(f"ranks: {ranks}; a step is spread over 1 to {MAX_RANKS} ranks")
    if any(cost < 0 for cost in costs):
        raise ValueError("a group's cost is never negative")
    used = max(1, min(ranks, len(costs)))  # more ranks than groups: the others get none
    groups = _greedy(costs, used, equal) if len(costs) * used > WORK else _differenced(costs, used, equal)
    _refine(costs, groups, moves=not equal)
    split = sorted((sorted(found) for found in groups), key=lambda found: found[0] if found else len(costs))
    return split + [[] for _ in range(ranks - used)]


def _differenced(costs: Sequence[int], ranks: int, equal: bool) -> list[list[int]]:
    """Karmarkar-Karp's split: its work and memory grow as groups x ranks. With `equal`, each
    partial split starts as `ranks` groups of consecutive cost, one a rank (the last fewer), so
    every merge keeps the ranks' counts within one of each other."""
    # A partial split: (-(its largest load - its smallest), the order it was made in, its loads
    # from the largest down, each load's groups).
    heap: list[tuple[int, int, list[int], list[list[int]]]] = []
    if equal:
        order = sorted(range(len(costs)), key=lambda at: (-costs[at], at))
        for made, start in enumerate(range(0, len(order), ranks)):
            block = order[start : start + ranks]
            loads = [costs[at] for at in block] + [0] * (ranks - len(block))
            heap.append(
                (-(loads[0] - loads[-1]), made, loads, [[at] for at in block] + [[] for _ in range(ranks - len(block))])
            )
    else:
        for index, cost in enumerate(costs):
            loads = [cost] + [0] * (ranks - 1)
            heap.append((-cost, index, loads, [[index]] + [[] for _ in range(ranks - 1)]))
    heapq.heapify(heap)
    made = len(costs)
    while len(heap) > 1:
        _, _, loads_a, groups_a = heapq.heappop(heap)
        _, _, loads_b, groups_b = heapq.heappop(heap)
        merged = sorted(
            ((loads_a[at] + loads_b[-1 - at], groups_a[at] + groups_b[-1 - at]) for at in range(ranks)),
            key=lambda load: -load[0],
        )
        loads, groups = [load for load, _ in merged], [found for _, found in merged]
        heapq.heappush(heap, (-(loads[0] - loads[-1]), made, loads, groups))
        made += 1
    return heap[0][3] if heap else [[] for _ in range(ranks)]


def _greedy(costs: Sequence[int], ranks: int, equal: bool) -> list[list[int]]:
    """The heaviest group first, each onto the lightest rank (with `equal`, one that has fewer
    than its share: G // ranks groups, one more for G % ranks of them): for a step too large for
    Karmarkar-Karp's groups x ranks, in time that grows as groups x log ranks."""
    base, extra = divmod(len(costs), ranks) if equal else (len(costs), 0)
    heap = [(0, rank) for rank in range(ranks)]
    groups: list[list[int]] = [[] for _ in range(ranks)]
    for index in sorted(range(len(costs)), key=lambda at: (-costs[at], at)):
        load, rank = heapq.heappop(heap)
        while len(groups[rank]) >= base and not extra:  # at its share, and no rank may take one more
            load, rank = heapq.heappop(heap)
        groups[rank].append(index)
        extra -= len(groups[rank]) == base + 1
        if len(groups[rank]) <= base:
            heapq.heappush(heap, (load + costs[index], rank))
    return groups


def _refine(costs: Sequence[int], groups: list[list[int]], moves: bool = True) -> None:
    """Lower the heaviest rank's load where a group moved to the lightest rank (with `moves`), or
    a pair swapped between them, does so: Karmarkar-Karp leaves a few percent over the ideal on
    long-tailed groups, most of which one such step between the two ends takes back. Pairs are
    tried only where the two ranks' groups are few enough (WORK)."""
    loads = [sum(costs[i] for i in found) for found in groups]
    for _ in range(2 * len(groups)):
        high = max(range(len(groups)), key=lambda rank: (loads[rank], -rank))
        low = min(range(len(groups)), key=lambda rank: (loads[rank], rank))
        gap = loads[high] - loads[low]
        swaps = len(groups[high]) * len(groups[low]) <= WORK
        best, change = gap, None  # how far the shift leaves the two loads apart: the nearer, the better
        for i in groups[high]:
            for j in ([None] if moves else []) + (groups[low] if swaps else []):
                shift = costs[i] - (0 if j is None else costs[j])
                if 0 < shift < gap and abs(gap - 2 * shift) < best:
                    best, change = abs(gap - 2 * shift), (i, j)
        if change is None:
            return
        i, j = change
        groups[high].remove(i)
        groups[low].append(i)
        if j is not None:
            groups[low].remove(j)
            groups[high].append(j)
        shift = costs[i] - (0 if j is None else costs[j])
        loads[high] -= shift
        loads[low] += shift
