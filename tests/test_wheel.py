"""A wheel built from the tree carries the compiled codec (setup.py, client/native_build.py).

The wheel is built from a copy of the sources in a temporary directory (nothing is written to the
tree), installed, not editable, into a fresh virtualenv (its dependencies read from this one), and
a child process there imports expbuf: it must run the compiled modules, built from the very sources
installed beside them, without mypy at run time, and parse Trinity-RFT's payloads and the hostile
ones exactly as the same sources run as Python do.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# What a wheel is built from: the packaging files and the packages' folders (pyproject.toml's package-dir).
SOURCES = ("pyproject.toml", "setup.py", "README.md", "client", "server", "proto")
# package under expbuf.client.trxp -> the modules compiled there (client/native_build.py's COMPILED)
COMPILED = {
    "codec": ("build", "canonical", "checks", "common", "measure", "parse", "pickles", "shown"),
    "stored": ("columns", "entries", "pieces", "splice"),
}
MODULES = [f"{package}.{module}" for package, modules in COMPILED.items() for module in modules]
PAYLOADS = sorted([*(ROOT / "tests/fixtures/trxp").glob("*.trxp"), *(ROOT / "tests/fixtures/bad").glob("*.bin")])
REQUIRE = "EXPBUF_REQUIRE_NATIVE"
OBJECTS = "EXPBUF_NATIVE_OBJECTS"
NATIVE_WORK = ROOT / "build" / "native"  # where `make setup` builds them (client/native_build.py's WORK)

# What a user's process imports first: the server's command line and app, the store, the clients.
ENTRY_POINTS = ("expbuf.server.cli", "expbuf.server.app", "expbuf.server.store", "expbuf.client", "expbuf.ray")

# Run by the installed package: where it was imported from, what is compiled, and the verdict of the
# compiled parse and of its source run as Python on every payload.
CHILD = """
import hashlib, json, sys
import importlib
import expbuf.client.trxp.codec as codec
import expbuf.client.trxp.stored as stored
from expbuf.client import native

def verdict(parse_module, data):
    work = parse_module.Work.for_payload(len(data))
    try:
        items = parse_module.parse(data, work=work)
    except Exception as exc:
        return [type(exc).__name__, str(exc), work.used]
    shown = [(i.meta, {k: (t.dtype, t.shape, bytes(t.data)) for k, t in i.tensors.items()}) for i in items]
    # repr, not a pickle: the same values whether or not the parse shares one object between items
    return ["parsed", hashlib.sha256(repr(shown).encode()).hexdigest(), work.used]

ENTRY_POINTS = {entry_points!r}
COMPILED = {compiled!r}
source = native.source_module("expbuf.client.trxp.codec.parse")
payloads = [open(path, "rb").read() for path in sys.argv[1:]]
modules = [*(f"{package}.{module}" for package, names in COMPILED.items() for module in names), "codec.convert"]
print(json.dumps({
    "path": [codec.__path__[0], stored.__path__[0]],
    "compiled": {module: native.compiled(importlib.import_module(f"expbuf.client.trxp.{module}").__name__)
                 for module in modules},
    "entry_points": [importlib.import_module(name).__name__ for name in ENTRY_POINTS],
    "build_tools": sorted({name.split(".")[0] for name in sys.modules} & {"mypy", "mypyc", "librt", "setuptools"}),
    "compiled_verdicts": [verdict(sys.modules["expbuf.client.trxp.codec.parse"], data) for data in payloads],
    "source_verdicts": [verdict(source, data) for data in payloads],
}))
""".replace("{entry_points!r}", repr(ENTRY_POINTS)).replace("{compiled!r}", repr(COMPILED))


def packages_in(tree: Path) -> set[str]:
    """The package folders of a source tree, as an installed expbuf lays them out (pyproject's package-dir)."""
    roots = {"client": "expbuf/client", "server": "expbuf/server", "proto/expbuf": "expbuf/proto"}
    found = set()
    for folder, installed in roots.items():
        for init in (tree / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(tree / folder).as_posix()
            found.add(f"{installed}/{rel}".removesuffix("/."))
    # expbuf.ray lives in server/ray
    return {name.replace("expbuf/server/ray", "expbuf/ray", 1) for name in found}


def has_compiler() -> bool:
    compiler = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(compiler) is not None


needs_compiler = pytest.mark.skipif(not has_compiler(), reason="no C compiler to build the compiled codec with")


def copy_sources(into: Path) -> Path:
    """The files a wheel is built from, without compiled modules or caches of this checkout."""
    into.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, into / name, ignore=shutil.ignore_patterns("_native", "__pycache__"))
        else:
            shutil.copy2(ROOT / name, into / name)
    return into


def build_wheel(src: Path, out: Path, **env: str) -> subprocess.CompletedProcess:
    """`pip wheel` of the copied tree, offline: the build requirements are this virtualenv's."""
    command = [sys.executable, "-m", "pip", "wheel", "-v", "--no-build-isolation", "--no-deps", "--no-index"]
    return subprocess.run(
        [*command, "--wheel-dir", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "PIP_NO_CACHE_DIR": "1", **env},
    )


def build_lines(done: subprocess.CompletedProcess) -> list[str]:
    """What the build said about the compiled modules (pip -v passes the backend's output on)."""
    return [line.strip() for line in (done.stdout + done.stderr).splitlines() if line.strip().startswith("expbuf:")]


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One copy of the sources for every build here: a later build finds the last one's build folder."""
    return copy_sources(tmp_path_factory.mktemp("tree") / "src")


@pytest.fixture(scope="module")
def objects(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A copy of the objects `make setup` compiled in the tree, for the compiled wheel's build:
    the same sources with the same compiler and flags, so it links them rather than compiling the
    parse group's C again (half a minute of CPU); a tree never built gives none to copy."""
    kept = NATIVE_WORK / "objects"
    if not kept.is_dir():
        return {}
    copy = tmp_path_factory.mktemp("objects") / "objects"
    shutil.copytree(kept, copy)
    return {OBJECTS: str(copy)}


@pytest.fixture(scope="module")
def wheel(tree: Path, objects: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    done = build_wheel(tree, out, **{REQUIRE: "1"}, **objects)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    names = ", ".join(f"expbuf.client.trxp.{module}" for module in MODULES)
    assert build_lines(done) == [f"expbuf: compiled with mypyc: {names}"]
    (built,) = out.glob("expbuf-*.whl")
    return built


@needs_compiler
def test_the_wheel_holds_the_compiled_modules_and_their_manifest(wheel: Path) -> None:
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        manifests = {name: archive.read(f"expbuf/client/trxp/{name}/_native/manifest.json") for name in COMPILED}
        tag = archive.read(next(name for name in names if name.endswith(".dist-info/WHEEL"))).decode()
    for package, modules in COMPILED.items():
        for module in (*modules, "native__mypyc"):
            assert f"expbuf/client/trxp/{package}/_native/{module}{suffix}" in names, module
        for module in modules:
            assert f"expbuf/client/trxp/{package}/{module}.py" in names, module  # the pure-Python fallback ships too
        manifest = json.loads(manifests[package])
        assert manifest["abi"] == suffix and sorted(manifest["sources"]) == sorted(modules)
    assert "Root-Is-Purelib: false" in tag  # a wheel for this Python and platform only
    assert not any(name.startswith("expbuf/client/trxp/") and name.endswith(".c") for name in names)


@needs_compiler
def test_the_wheel_holds_every_package_of_the_tree(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        shipped = {name.removesuffix("/__init__.py") for name in archive.namelist() if name.endswith("/__init__.py")}
    assert packages_in(ROOT) - shipped == set()


@needs_compiler
def test_an_installed_wheel_runs_the_compiled_modules_and_parses_as_pure_python(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            capture_output=True, text=True, check=True, timeout=60,
        ).stdout.strip()
    )  # fmt: skip
    # expbuf's dependencies are read from this virtualenv (a path line, so its editable expbuf stays out)
    (site / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)]
    subprocess.run(install, capture_output=True, check=True, timeout=300)

    env = {key: value for key, value in os.environ.items() if key != "EXPBUF_PURE_PYTHON"}
    done = subprocess.run(
        [str(python), "-c", CHILD, *map(str, PAYLOADS)],
        capture_output=True, text=True, timeout=300, check=False, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["path"] == [str(site / f"expbuf/client/trxp/{package}/_native") for package in COMPILED]
    assert seen["compiled"] == {**dict.fromkeys(MODULES, True), "codec.convert": False}
    assert seen["build_tools"] == []
    assert seen["entry_points"] == list(ENTRY_POINTS)
    assert seen["compiled_verdicts"] == seen["source_verdicts"]
    kinds = [verdict[0] for verdict in seen["compiled_verdicts"]]
    assert kinds.count("parsed") == len(list((ROOT / "tests/fixtures/trxp").glob("*.trxp")))
    assert kinds.count("TrxpError") == len(list((ROOT / "tests/fixtures/bad").glob("*.bin")))


@needs_compiler
def test_a_kept_object_is_found_by_what_was_compiled_and_how_not_by_where(tmp_path: Path) -> None:
    """client/native_build.py's key of a kept object: the same C, with a header of the same
    content, built in two folders is one object; other flags, a header that differs or a compiler
    that fails is not that object."""
    from setuptools._distutils.ccompiler import new_compiler  # type: ignore[import-untyped]
    from setuptools._distutils.sysconfig import customize_compiler  # type: ignore[import-untyped]

    from expbuf.client.native_build import objects_key

    compiler = new_compiler()
    customize_compiler(compiler)
    sources = []
    for folder, value in (("one", 1), ("two", 1), ("three", 2)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "value.h").write_text(f"#define VALUE {value}\n")
        source = tmp_path / folder / "unit.c"
        source.write_text('#include "value.h"\n#include <assert.h>\nint value(int x) { assert(x); return VALUE; }\n')
        sources.append((str(source), str(tmp_path / folder)))

    def key(source: str, folder: str, **changed: object) -> str | None:
        args = {"macros": None, "include_dirs": [folder], "debug": False, "extra_preargs": None}
        return objects_key(compiler, source, {**args, "extra_postargs": ["-O2"], **changed})

    one, two, other = (key(*source) for source in sources)
    assert one is not None and one == two  # the folder (and assert's __FILE__ under NDEBUG) does not count
    assert other != one  # the header's content does
    assert key(*sources[0], extra_postargs=["-O3"]) != one
    assert key(*sources[0], macros=[("VALUE_TOO", "1")]) != one
    compiler.compiler_so = ["false", *compiler.compiler_so[1:]]
    assert key(*sources[0]) is None  # compiled as without kept objects: its failure is the build's


def native_files(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        return [name for name in archive.namelist() if "/_native/" in name]


# After the compiled build (when there is a compiler), in the same tree: what that build left in the
# build folder must not reach a wheel built without a compiler.
@pytest.mark.usefixtures(*(["wheel"] if has_compiler() else []))
def test_without_a_compiler_the_wheel_is_pure_python_and_the_build_says_so(tree: Path, tmp_path: Path) -> None:
    done = build_wheel(tree, tmp_path, CC="false")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert build_lines(done) == [
        "expbuf: compiled modules not built (CompileError: the C compiler false exited with status 1); "
        "expbuf runs as pure Python"
    ]
    (built,) = tmp_path.glob("expbuf-*.whl")
    assert native_files(built) == []


def test_without_a_compiler_the_build_fails_when_the_compiled_modules_are_required(tree: Path, tmp_path: Path) -> None:
    done = build_wheel(tree, tmp_path, CC="false", **{REQUIRE: "1"})
    assert done.returncode != 0
    assert (
        "expbuf: compiled modules not built (CompileError: the C compiler false exited with status 1) and "
        "EXPBUF_REQUIRE_NATIVE=1 requires them"
    ) in done.stdout + done.stderr
    assert list(tmp_path.glob("*.whl")) == []
