"""The fast paths of the TRXP checks accept only what the detailed checks accept, with the same result."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from expbuf.client import EID, trxp
from expbuf.client.trxp import TrxpError
from expbuf.client.trxp.codec import checks

_VALUES: list[Any] = [0, 7, -1, 2**63 - 1, -(2**63), 2**63, 2**31, True, 1.5, "", "a", "3/eval", "é", "x\0", "a" * 400]


def _detailed(eid: Any) -> str:
    """_check_eid with its fast path bypassed."""
    plain = checks._plain_uid
    checks._plain_uid = lambda eid: None
    try:
        return checks._check_eid(0, eid)
    finally:
        checks._plain_uid = plain


def _outcome(check: Any, eid: Any) -> str:
    """The uid a check returns for an eid, or its refusal's message."""
    try:
        return check(eid)
    except TrxpError as exc:
        return f"refused: {exc}"


@pytest.mark.parametrize("batch", _VALUES)
def test_plain_uid_agrees_with_the_detailed_checks(batch: Any) -> None:
    for task, run, step, suffix in itertools.product(_VALUES, _VALUES[:9], _VALUES[:9], ["s", "a/b", 3, "é"]):
        eid = {"batch": batch, "task": task, "run": run, "step": step, "suffix": suffix}
        fast = checks._plain_uid(eid)
        if fast is not None:
            assert fast == _detailed(eid) == EID(**eid).uid, eid
        assert _outcome(lambda eid: checks._check_eid(0, eid), eid) == _outcome(_detailed, eid), eid


def test_plain_uid_leaves_odd_eids_to_the_detailed_checks() -> None:
    assert checks._plain_uid({"batch": 1, "task": 2, "run": 3, "step": 4}) is None
    assert checks._plain_uid({"batch": "3/eval", "task": 2, "run": 3, "step": 4, "suffix": "s"}) is None
    assert checks._plain_uid([1]) is None
    assert checks._plain_uid({"batch": 1, "task": 2, "run": 3, "step": 4, "suffix": "s"}) == "1/2/3/4/s"


@pytest.mark.parametrize("empty", [[], {}, ()])
def test_a_shared_empty_container_is_counted_once_like_any_container(empty: Any) -> None:
    """Each container costs work at its first reference only, wherever it sits: counting a
    shared empty field again at each reference would refuse, within a tight budget, a payload
    the detailed walk accepts."""
    shared = [1]
    expected = trxp.Work(1 << 40)
    measure = checks.Shape(expected, 1 << 40, check_keys=True)
    measure.item(0, "u", {"a": shared, "b": shared, "c": [shared]})
    work = trxp.Work(1 << 40)
    shape = checks.Shape(work, 1 << 40, check_keys=True)
    shape.item(0, "u", {"a": empty, "b": empty, "c": [empty]})
    assert work.used == expected.used - 1  # [1] takes a step more than an empty container: its one entry
    assert shape.size == 3 + 3 + (3 + 3) + 3 * (5 + 1)


def test_a_shared_empty_field_passes_within_the_steps_the_walk_counts() -> None:
    empty: list[Any] = []
    item = {"a": empty, "b": empty, "c": empty}
    work = trxp.Work(1)  # one step: the list, counted at its first reference
    checks.Shape(work, 1 << 40, check_keys=True).item(0, "u", item)
    assert work.used == 1


@pytest.mark.parametrize("value", [(1 << 62) - 1, 1 << 62, -(1 << 62) + 1, -(1 << 62), 2**63 - 1, -(2**63)])
def test_plain_uid_leaves_ints_past_a_machine_word_to_the_detailed_checks(value: int) -> None:
    """_plain_uid takes ints compiled code compares in a word; the rest of int64 still passes, in detail."""
    for part in ("batch", "task", "run"):
        number = min(abs(value), 2**63 - 1) if part == "run" else value  # run: 0 to 2**63 - 1
        eid = {"batch": 1, "task": 2, "run": 3, "step": 4, "suffix": "s", part: number}
        plain = checks._plain_uid(eid)
        assert plain is None if abs(number) >= (1 << 62) else plain == EID(**eid).uid
        assert checks._check_eid(0, eid) == _detailed(eid) == EID(**eid).uid


def test_an_empty_container_deeper_than_the_nesting_limit_is_refused_wherever_met_first() -> None:
    """Empty containers are counted apart from the others; depth still bounds each reference."""
    empty: list[Any] = []
    deep: list[Any] = [empty]
    for _ in range(32):
        deep = [deep]
    for item in ({"a": empty, "b": deep}, {"b": deep, "a": empty}, {"b": [empty], "c": deep}):
        with pytest.raises(TrxpError, match="nested deeper than 32 levels"):
            checks.Shape(trxp.Work(1 << 40), 1 << 40, check_keys=True).item(0, "u", item)


def test_a_field_name_measured_once_is_measured_as_the_detailed_walk_measures_it() -> None:
    """Field names are measured once a payload (ASCII: a byte a character; other text: at most 4)."""
    shape = checks.Shape(trxp.Work(1 << 40), 1 << 40, check_keys=True)
    for index in range(3):
        shape.item(index, "u", {"é": None, "ab": 1.0, b"raw": None})
    assert shape.size == 3 * ((5 + 4) + 9 + (5 + 2) + 9 + (5 + 3) + 9)
