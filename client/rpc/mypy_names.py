"""A mypy plugin: a declared call's method named in mypy's messages, as a def's is.

mypy reads a client's declared call (rpc/declare.py) through Declared.__get__: a Callable of the
declaration's parameters, which has no name. A wrong argument is refused all the same, but its
message would say only `Argument "when_full" has incompatible type ...`; this names the call and
the client it is read from: `Argument "when_full" to "create_table" of "BufferClient" ...`.
expbuf's own check loads it (pyproject.toml, [tool.mypy] plugins); a user's mypy may load it too.
mypy imports it, nothing else does.
"""

from __future__ import annotations

from collections.abc import Callable

from mypy.nodes import Decorator
from mypy.plugin import AttributeContext, Plugin
from mypy.types import CallableType, Instance, Type, get_proper_type

DECLARED = "expbuf.client.rpc.declare.Declared"


class DeclaredCallNames(Plugin):
    """Names the method of each declared call after the call and its client."""

    def get_attribute_hook(self, fullname: str) -> Callable[[AttributeContext], Type] | None:
        symbol = self.lookup_fully_qualified(fullname)
        node = symbol.node if symbol is not None else None
        if not isinstance(node, Decorator):
            return None
        declared, name = get_proper_type(node.var.type), node.name
        if not isinstance(declared, Instance) or declared.type.fullname != DECLARED:
            return None

        def named(ctx: AttributeContext) -> Type:
            method, client = get_proper_type(ctx.default_attr_type), get_proper_type(ctx.type)
            if isinstance(method, CallableType) and isinstance(client, Instance):
                return method.copy_modified(name=f"{name} of {client.type.name}")
            return ctx.default_attr_type

        return named


def plugin(version: str) -> type[Plugin]:
    return DeclaredCallNames
