"""Each call is declared once a side: the store's façade forwards the calls its services answer as
they are (server/store/forward.py) instead of writing their signatures again, and the house
review's calls have at most three definitions in server/ and client/ together (issue #65)."""

from __future__ import annotations

import ast
import inspect
from collections.abc import Iterator
from pathlib import Path

import pytest

from expbuf.server.store import Store
from expbuf.server.store.forward import Forwarded

ROOT = Path(__file__).resolve().parent.parent
CALLS = ("put_values", "fail_runs", "create_table", "get_partials", "report_prompts", "read_part", "claim")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store(tmp_path / "db") as opened:
        yield opened


def forwarded() -> dict[str, Forwarded]:  # type: ignore[type-arg]
    return {name: attr for cls in Store.__mro__ for name, attr in vars(cls).items() if isinstance(attr, Forwarded)}


def test_a_forwarded_call_is_its_services_own_method(store: Store) -> None:
    calls = forwarded()
    assert {"claim", "put_values", "get_partials", "create_table", "sample", "put_in_order"} <= set(calls)
    for name, declared in calls.items():
        method = getattr(store, name)
        assert inspect.ismethod(method) and method.__self__ is not store, name
        assert method.__func__ is declared.__wrapped__, name
        assert getattr(Store, name).__doc__ == method.__doc__ and method.__doc__, name


def test_a_forwarded_call_answers_as_its_service() -> None:
    """The façade's call reaches the service the store holds then, as a method of the store would."""

    class Service:
        def echo(self, value: int, *, twice: bool = False) -> int:
            """The value, or twice it."""
            return value * (2 if twice else 1)

    class Facade:
        echo = Forwarded("inner.service", Service.echo)

        def __init__(self) -> None:
            self.inner = type("Inner", (), {"service": Service()})()

    facade = Facade()
    assert (facade.echo(3), facade.echo(3, twice=True)) == (3, 6)
    assert Facade.echo.__doc__ == "The value, or twice it."
    with pytest.raises(TypeError, match="undocumented"):
        Forwarded("inner", lambda self: None)
    facade.inner.service = type("Other", (), {"echo": lambda self, value, twice=False: -value})()
    assert facade.echo(3) == -3


def test_each_call_of_the_review_has_at_most_three_definitions() -> None:
    found: dict[str, list[str]] = {name: [] for name in CALLS}
    for path in sorted([*ROOT.joinpath("server").rglob("*.py"), *ROOT.joinpath("client").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name in found:
                found[node.name].append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert {name: places for name, places in found.items() if len(places) > 3} == {}
    assert all(found.values()), found
