"""The façade's calls that a service answers as it is, declared once: on the service.

`Store.claim = Forwarded("claims", Claims.claim)` makes the Store's `claim` its claims service's
`claim`, with that method's parameters, defaults and docstring: mypy and an IDE read them through
the ParamSpec, and a new call of a service is one line on the façade, not its signature again.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, Concatenate, Generic, ParamSpec, Self, TypeVar, overload

P = ParamSpec("P")
R = TypeVar("R")


class Forwarded(Generic[P, R]):
    """A façade method that is `method` of the object at `service` (a dotted attribute path)."""

    def __init__(self, service: str, method: Callable[Concatenate[Any, P], R]) -> None:
        if not method.__doc__:
            raise TypeError(f"{method.__qualname__} is undocumented: a call of the store says what it does")
        self._service = operator.attrgetter(service)
        self._name = method.__name__
        self.__doc__ = method.__doc__
        self.__wrapped__ = method

    @overload
    def __get__(self, obj: None, owner: type) -> Self: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> Callable[P, R]: ...
    def __get__(self, obj: object, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(self._service(obj), self._name)
