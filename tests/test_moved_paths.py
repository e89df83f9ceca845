"""Import paths the docs gave before the storage engine took in these modules still work for one
release: each name is the moved module's own, read with a DeprecationWarning that names the new
path and points at the line that read it (server/moved.py)."""

from __future__ import annotations

import importlib
import warnings

import pytest

# The old path, the new one, and the names the docs told users to import from the old one.
MOVED = [
    (
        "expbuf.server.estimator_registry",
        "expbuf.server.store.schema.estimator_registry",
        ["Estimator", "Param", "register"],
    ),
    ("expbuf.server.ready_indexes", "expbuf.server.store.schema.ready_indexes", ["KeyedIndex", "u64", "version_key"]),
    ("expbuf.server.selection", "expbuf.server.store.schema.selection", ["Order", "register"]),
]


@pytest.mark.parametrize(("old", "new", "names"), MOVED)
def test_an_old_path_reads_the_moved_module_with_a_warning(old: str, new: str, names: list[str]) -> None:
    module, moved = importlib.import_module(old), importlib.import_module(new)
    for name in names:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            found = getattr(module, name)
        assert found is getattr(moved, name)
        assert [(w.category, w.filename) for w in caught] == [(DeprecationWarning, __file__)]
        said = f"{old} moved to {new}: import {name} from there ({old} goes in the next release)"
        assert str(caught[0].message) == said
    with pytest.raises(AttributeError):
        module.no_such_name  # noqa: B018
