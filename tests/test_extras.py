"""Each framework adapter imports where only its own framework is installed, as after
`pip install "expbuf[verl]"`: a verl user has no Trinity-RFT, a TRL user no AReaL.

`make setup` installs every framework, so an import of another adapter's framework would pass
every other test. Here each adapter, every module of it, is imported in a child whose import
system refuses the other adapters' frameworks as an environment without them would
(ModuleNotFoundError; tests/import_adapter.py), each child forked from one process that has loaded
torch and the libraries several frameworks share, and no framework, so that those are loaded once,
not six times. `make check-extras` imports each in a real virtualenv per extra.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

# The top-level packages each adapter's extra brings, its framework's own requirements among them
# (trinity-rft requires verl), and so what a child importing that adapter may load.
FRAMEWORKS = {
    "trinity": ("trinity", "verl"),
    "verl": ("verl", "transfer_queue"),
    "areal": ("areal",),
    "trl": ("trl",),
    "torchrl": ("torchrl",),
    "transferqueue": ("transfer_queue",),
}
EVERY = sorted({name for names in FRAMEWORKS.values() for name in names})

IMPORT = Path(__file__).parent / "import_adapter.py"


def refused_by(adapter: str) -> list[str]:
    return [name for name in EVERY if name not in FRAMEWORKS[adapter]]


def installed(adapter: str) -> bool:
    return all(importlib.util.find_spec(name) is not None for name in FRAMEWORKS[adapter])


@pytest.fixture(scope="module")
def imports() -> dict[str, dict[str, object]]:
    """Every installed adapter imported by one child, each in a process of its own forked from it
    (import_adapter.py --each): what each printed and how it exited, by adapter module."""
    asked = [f"expbuf.client.{a}={','.join(refused_by(a))}" for a in sorted(FRAMEWORKS) if installed(a)]
    done = subprocess.run(
        [sys.executable, str(IMPORT), "--each", *asked], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results: dict[str, dict[str, object]] = json.loads(done.stdout)
    return results


@pytest.mark.parametrize("adapter", sorted(FRAMEWORKS))
def test_an_adapter_imports_without_the_other_frameworks(adapter: str, imports: dict[str, dict[str, object]]) -> None:
    if not installed(adapter):
        missing = [name for name in FRAMEWORKS[adapter] if importlib.util.find_spec(name) is None]
        pytest.skip(f"{', '.join(missing)} not installed here (make setup installs it)")
    done = imports[f"expbuf.client.{adapter}"]
    stdout, stderr = str(done["stdout"]), str(done["stderr"])
    refused = ", ".join(refused_by(adapter))
    assert done["returncode"] == 0, f"expbuf.client.{adapter} without {refused}:\n{stderr[-3000:]}"
    imported = re.fullmatch(rf"expbuf\.client\.{adapter}: (\d+) modules imported\n", stdout)
    assert imported and int(imported.group(1)) > 1, stdout


def test_the_verl_extra_pins_the_tensordict_verl_runs_with_in_the_tests() -> None:
    """verl is installed without its own requirements (they pull GPU packages), so its tensordict
    range is never applied, and TransferQueue asks only for >=0.10: `pip install "expbuf[verl]"`
    took the newest tensordict, not one verl 0.9.1 was run with. The extra pins the range `make
    setup` installs for verl (the Makefile's VERL_NEEDS), which holds the tensordict the tests run."""
    root = Path(__file__).parent.parent
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = [req for req in map(Requirement, extras["verl"]) if req.name == "tensordict"]
    needs = re.search(r"^VERL_NEEDS := (.*)$", (root / "Makefile").read_text(), re.M)
    assert needs is not None
    installed = [Requirement(spec.strip("'")) for spec in needs.group(1).split()]
    (made,) = [req.specifier for req in installed if req.name == "tensordict"]
    assert [pin.specifier for pin in pins] == [made]
    if importlib.util.find_spec("tensordict") is not None:
        assert importlib.metadata.version("tensordict") in made
