"""Pickles that run no code of their writer's choosing when they are loaded.

The TransferQueue backend keeps what is not a tensor (a NonTensorStack's items: strings, numbers,
lists, dicts, numpy arrays), and the controller its journal and snapshots, as pickles in an expbuf
table. `pickle.loads` calls whatever a pickle names, and a table's keyed values are written by
tokens of the push scope, so a plain load would run a writer's code in the controller and in every
consumer. `loads` resolves only the names of ALLOWED: Python's containers and numbers, numpy's
arrays, scalars and dtypes, torch's tensors (their storage read by torch's weights-only loader),
dtypes and sizes, and TransferQueue's controller records; a pickle naming anything else is refused
(UnsafePickle, naming it) before anything of it is called. `dumps` refuses at the put, naming
the type, what `loads` would refuse, so a value stored is one that reads back.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import pickle
from collections.abc import Iterator
from typing import Any

# The names a pickle may call or make, as pickle writes them (module, name); those of a module
# that is not installed are left out.
ALLOWED = (
    *(("builtins", name) for name in ("bool", "bytearray", "bytes", "complex", "dict", "float", "frozenset", "int",
                                      "list", "range", "set", "slice", "str", "tuple")),
    ("collections", "OrderedDict"), ("collections", "defaultdict"), ("collections", "deque"),
    ("numpy", "ndarray"), ("numpy", "dtype"),
    *((f"numpy.{core}.multiarray", name) for core in ("_core", "core") for name in ("_reconstruct", "scalar")),
    *((f"numpy.{core}.numeric", "_frombuffer") for core in ("_core", "core")),
    ("torch", "Size"), ("torch", "device"), ("torch._utils", "_rebuild_tensor_v2"),
    ("torch.storage", "_load_from_bytes"),
    ("transfer_queue.controller", "DataPartitionStatus"), ("transfer_queue.controller", "FieldMeta"),
)  # fmt: skip
STORAGE = ("torch.storage", "_load_from_bytes")  # read by torch's weights-only loader, never torch's own


class UnsafePickle(pickle.UnpicklingError):
    """A pickle naming what `loads` does not make: not one this backend wrote."""


def _storage(data: bytes) -> Any:
    """A tensor's storage as torch pickles it (torch.save's bytes), read by torch's weights-only
    loader, which makes tensors and nothing else."""
    import torch

    return torch.load(io.BytesIO(data), weights_only=True)


def _module(name: str) -> Any:
    """A module by name; numpy 1's `numpy.core` as numpy 2 names it, `numpy._core` (importing
    the old name warns)."""
    if name.startswith("numpy.core."):
        with contextlib.suppress(ImportError):
            return importlib.import_module(name.replace("numpy.core.", "numpy._core.", 1))
    return importlib.import_module(name)


def _resolved() -> Iterator[tuple[tuple[str, str], Any]]:
    for module, name in ALLOWED:
        try:
            yield (module, name), getattr(_module(module), name)
        except (ImportError, AttributeError):  # numpy's other core path, a package not installed
            continue
    torch = importlib.import_module("torch")
    for name, value in vars(torch).items():
        if isinstance(value, torch.dtype):
            yield ("torch", name), value


@functools.cache
def _by_name() -> dict[tuple[str, str], Any]:
    """What each allowed name loads as."""
    made = dict(_resolved())
    if STORAGE in made:
        made[STORAGE] = _storage
    return made


@functools.cache
def _known() -> dict[int, Any]:
    """The objects a pickle may name, by id (each kept, so that no id is reused)."""
    return {id(value): value for value in dict(_resolved()).values()}


@functools.cache
def _plain() -> tuple[type, ...]:
    """The types whose objects pickle by their own reduction: what it names comes back to
    `_Checked.reducer_override`, and is checked there."""
    import collections

    import numpy
    import torch

    kinds: list[type] = [complex, range, slice, collections.OrderedDict, collections.defaultdict, collections.deque]
    kinds += [numpy.ndarray, numpy.generic, numpy.dtype, torch.Tensor, torch.Size, torch.device]
    kinds += [torch.storage.TypedStorage, torch.storage.UntypedStorage]
    kinds += [value for (module, _), value in _by_name().items() if module == "transfer_queue.controller"]
    return tuple(kinds)


class _Checked(pickle.Pickler):
    """A pickler that refuses what `loads` would: a class, function or named object not allowed,
    or an object of a type whose reduction is not one of the plain types'."""

    def reducer_override(self, obj: Any) -> Any:
        if id(obj) in _known() or (not isinstance(obj, type) and isinstance(obj, _plain())):
            return NotImplemented  # pickled as pickle does: what its reduction names comes back here
        named = obj if hasattr(obj, "__qualname__") else type(obj)  # a class or function, else its type
        raise TypeError(
            f"expbuf's TransferQueue backend stores None, booleans, numbers, strings, bytes, lists, tuples, sets, "
            f"dicts, numpy arrays and scalars and torch tensors (and these inside one another), not "
            f"{named.__module__}.{named.__qualname__}: a stored pickle is loaded only with the names it allows"
        )


class _Restricted(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _by_name().get((module, name))
        if found is None:
            raise UnsafePickle(
                f"a pickle naming {module}.{name}, which expbuf's TransferQueue backend never loads: it loads only "
                "the names a TransferQueue value needs (a pickle of anything else, which any token of the push scope "
                "could have put, would run what it names)"
            )
        return found


def dumps(value: Any) -> bytes:
    """`value` pickled; a TypeError naming a type whose pickle `loads` would refuse."""
    out = io.BytesIO()
    _Checked(out, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return out.getvalue()


def loads(data: bytes | memoryview, what: str) -> Any:
    """A pickle `dumps` wrote, loaded; UnsafePickle naming `what` for one that names anything
    else (nothing of it is called), or that is not a pickle."""
    try:
        return _Restricted(io.BytesIO(data)).load()
    except UnsafePickle as exc:
        raise UnsafePickle(f"{what}: {exc}") from None
    except Exception as exc:
        raise UnsafePickle(f"{what}: not a pickle this backend wrote ({type(exc).__name__}: {exc})") from None
