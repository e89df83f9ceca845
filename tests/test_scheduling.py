"""The suite's own scheduling (conftest.py): every module a set or the long-first list names is
one of the suite's, so a rename cannot leave a long module to be handed out last unnoticed."""

from __future__ import annotations

from pathlib import Path

from conftest import LONG_FIRST, SHARED_MODULES

ROOT = Path(__file__).resolve().parent.parent


def test_every_module_the_schedule_names_exists() -> None:
    modules = [module for modules in SHARED_MODULES.values() for module in modules]
    modules += [scope for scope in LONG_FIRST if scope not in SHARED_MODULES]
    assert modules and all((ROOT / module).is_file() for module in modules), modules
    assert len(set(LONG_FIRST)) == len(LONG_FIRST)
