"""Build expbuf's hot modules with mypyc from their own sources: in the tree (`make setup` runs
this file, for an editable install) and into a wheel (setup.py's build_ext calls compile_into).

Each compiled package gets a `_native/` folder beside its sources: the extension modules
and a manifest of the SHA-256 of every source they were built from. expbuf.client.native
puts that folder ahead of the sources at import only while every digest still matches, so
an edited source is never shadowed by a module compiled from its older self; a wheel carries
the sources and the modules of one build, so they match where it is installed.

Where there is no C compiler, or the build fails, the `_native/` folders are removed and
one line says expbuf runs as pure Python: a working install, so the exit status is 0 and a
wheel is built, unless EXPBUF_REQUIRE_NATIVE=1 asks for the compiled modules.

    python client/native_build.py
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent  # the source tree
# package folder -> (package as installed, modules compiled). Each package is one mypyc group,
# so its modules call each other directly. What paid in bench/bench_native.py: the parse and its
# checks and pickle scan, about twice as fast; the packing of each pushed experience (build),
# 1.2-1.35x; the stored payloads' splice into a sample reply and its columns, 1.1-1.24x
# (bench/bench_reply_instructions.py). The store's records did not (their cost is in struct and the dataclass's
# construction, already C), so they stay as written.
COMPILED = {
    "client/trxp/codec": (
        "expbuf.client.trxp.codec",
        ("build", "canonical", "checks", "common", "measure", "parse", "pickles", "shown"),
    ),
    "client/trxp/stored": ("expbuf.client.trxp.stored", ("columns", "entries", "pieces", "splice")),
}
# package folder -> the compiled packages its modules call into (mypyc links the groups of one build):
# its manifest names them, and it is used only where they are in use too (native.use_compiled).
CALLS = {"client/trxp/stored": ("expbuf.client.trxp.codec",)}
# The folders the compiled modules import from, under their installed names (pyproject.toml's package-dir).
LINKS = {"client": "client"}
NATIVE = "_native"
# Where it builds: the same path each time, so that mypy's cache there spares most of a rebuild.
WORK = ROOT / "build" / "native"
MANIFEST = "manifest.json"
# The objects of the last build, by what each compiled (objects_key): a build of the same sources
# with the same compiler and flags takes them instead of compiling again (the C of the parse group
# takes half a minute of CPU at -O3). A wheel's build keeps its own, unless this names another folder.
OBJECTS = "EXPBUF_NATIVE_OBJECTS"
# Set to 1 (CI, the Docker image's build), a build that cannot compile the modules fails instead.
REQUIRE = "EXPBUF_REQUIRE_NATIVE"


class NativeBuildError(RuntimeError):
    """The compiled modules could not be built and EXPBUF_REQUIRE_NATIVE asks for them."""


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def in_tree(folder: str, package: str) -> Path:
    """Where `make setup` puts a package's compiled modules: beside its sources in the tree."""
    return ROOT / folder / NATIVE


def in_lib(lib: Path) -> Callable[[str, str], Path]:
    """Where a wheel's build puts them: beside the package's sources in the build's tree `lib`."""
    return lambda folder, package: lib.joinpath(*package.split("."), NATIVE)


def objects_key(compiler: Any, source: str, args: dict[str, Any]) -> str | None:
    """What compiling `source` with `args` makes an object of: the translation unit as the compile
    command sees it (preprocessed by that command, without line markers, so the folder it was built
    in does not count), the command and its flags, and the compiler's executable; None where it
    cannot be told (no compiler found, the preprocessing fails), and then the source is compiled."""
    executable = shutil.which(compiler.compiler_so[0])
    if executable is None:
        return None
    # The macros and include folders as the compiler adds its own and writes them (distutils' ccompiler).
    macros = [*compiler.macros, *(args["macros"] or [])]
    flags = [*(args["extra_preargs"] or [])]
    flags += [f"-U{m[0]}" if len(m) == 1 else f"-D{m[0]}" + ("" if m[1] is None else f"={m[1]}") for m in macros]
    flags += [f"-I{include}" for include in [*(args["include_dirs"] or []), *compiler.include_dirs]]
    flags += ["-g"] if args["debug"] else []
    with tempfile.TemporaryDirectory(prefix="expbuf-native-") as folder:
        unit = Path(folder) / "unit.i"
        command = [*compiler.compiler_so, *flags, "-E", "-P", source, "-o", str(unit), *(args["extra_postargs"] or [])]
        if subprocess.run(command, capture_output=True, check=False).returncode != 0:
            return None
        digest = hashlib.sha256(unit.read_bytes())
    stat = os.stat(executable)
    how = [compiler.compiler_so, executable, stat.st_size, stat.st_mtime_ns, macros, args["debug"]]
    digest.update(json.dumps([*how, args["extra_preargs"], args["extra_postargs"]]).encode())
    return digest.hexdigest()


def objects_kept(folder: Path) -> type:
    """setuptools' build_ext whose compiler copies an object from `folder` where one was made from
    the same translation unit the same way (objects_key), and keeps each object it compiles there;
    objects this build did not use are removed from it."""
    from setuptools.command.build_ext import build_ext  # type: ignore[import-untyped]

    class KeptObjects(build_ext):
        def build_extensions(self) -> None:
            compiler, compile_all = self.compiler, self.compiler.compile
            used: set[str] = set()

            def compile_each(sources: list[str], output_dir: str | None = None, **args: Any) -> list[str]:
                args = {"macros": None, "include_dirs": None, "debug": False, "extra_preargs": None,
                        "extra_postargs": None, **args}  # fmt: skip
                objects = compiler.object_filenames(sources, output_dir=output_dir)
                for source, obj in zip(sources, objects, strict=True):
                    key = objects_key(compiler, source, args)
                    kept = folder / f"{key}.o"
                    if key is not None and kept.exists():
                        Path(obj).parent.mkdir(parents=True, exist_ok=True)
                        shutil.copyfile(kept, obj)
                    else:
                        compile_all([source], output_dir=output_dir, **args)
                        if key is not None:
                            folder.mkdir(parents=True, exist_ok=True)
                            shutil.copyfile(obj, f"{kept}.part")
                            os.replace(f"{kept}.part", kept)
                    if key is not None:
                        used.add(kept.name)
                return objects

            compiler.compile = compile_each
            super().build_extensions()
            for stale in folder.glob("*.o") if folder.is_dir() else ():
                if stale.name not in used:
                    stale.unlink()

    return KeptObjects


def build(work: Path, target: Callable[[str, str], Path]) -> None:
    """Compile every group in `work`, then copy each package's modules and manifest to `target`."""
    from mypyc.build import mypycify
    from setuptools import Distribution  # type: ignore[import-untyped]

    work = work.absolute()  # a wheel's build names it relative to the tree; mypyc runs in src
    # mypy finds modules by path: link the packages under the names they are installed as.
    src = work / "src"
    (src / "expbuf").mkdir(parents=True)
    for name, folder in LINKS.items():
        (src / "expbuf" / name).symlink_to(ROOT / folder, target_is_directory=True)
    # Each module named relative to `src`, where mypyc runs: the C it writes (which names each
    # module's file for tracebacks) is then the same whichever folder it is built in. Its mypy cache
    # is not the one of earlier builds, which named them by absolute path and would keep those.
    groups: list[tuple[list[str], str | None]] = [
        ([f"expbuf/{folder}/{module}.py" for module in modules], f"{package}.native")
        for folder, (package, modules) in COMPILED.items()
    ]
    paths = [path for files, _ in groups for path in files]
    os.environ["MYPYPATH"] = str(src)
    with contextlib.chdir(src):
        extensions = mypycify(
            # Only the compiled modules are read: what they import from elsewhere is Any to them, which
            # spares the build a type check of all that expbuf imports (tests/typecheck.py does that).
            [
                "--config-file",
                "",
                "--follow-imports",
                "skip",
                "--python-version",
                "3.11",
                "--cache-dir",
                str(work / "mypy-cache"),
                "--explicit-package-bases",
                *paths,
            ],
            opt_level="3",
            separate=groups,
            target_dir=str(work / "c"),
        )
    objects = Path(os.environ.get(OBJECTS) or work / "objects")
    dist = Distribution(
        {"name": "expbuf-native", "ext_modules": extensions, "cmdclass": {"build_ext": objects_kept(objects)}}
    )
    dist.script_args = ["-q", "build_ext", "--build-lib", str(work / "lib"), "--build-temp", str(work / "tmp")]
    dist.parse_command_line()
    dist.run_commands()
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    for folder, (package, modules) in COMPILED.items():
        built = work / "lib" / package.replace(".", "/")
        native = target(folder, package)
        native.mkdir(parents=True)
        for module in built.glob(f"*{suffix}"):
            shutil.copy2(module, native / module.name)
        manifest = {
            "abi": suffix,
            "sources": {module: digest(ROOT / folder / f"{module}.py") for module in modules},
            "needs": list(CALLS.get(folder, ())),
        }
        (native / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def why(exc: BaseException) -> str:
    """The reason a build failed, in a few words: a compiler that fails is named, not its whole command."""
    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, subprocess.CalledProcessError):
        cause = cause.__cause__ or cause.__context__
    if isinstance(cause, subprocess.CalledProcessError) and isinstance(cause.cmd, list | tuple) and cause.cmd:
        return f"{type(exc).__name__}: the C compiler {cause.cmd[0]} exited with status {cause.returncode}"
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")


def compile_into(target: Callable[[str, str], Path], work: Path) -> None:
    """Build the compiled modules into `target` (in_tree or in_lib) and say so in one line. Where
    they cannot be, none are left there (not even an earlier build's) and one line says expbuf runs
    as pure Python, unless EXPBUF_REQUIRE_NATIVE=1, which makes that an error naming the reason."""
    natives = [target(folder, package) for folder, (package, _) in COMPILED.items()]
    for native in natives:
        shutil.rmtree(native, ignore_errors=True)
    try:
        for stale in ("src", "lib"):  # links and modules of the last build; its mypy cache and objects stay
            shutil.rmtree(work / stale, ignore_errors=True)
        build(work, target)
    except (Exception, SystemExit) as exc:  # mypyc exits on a type error; a missing compiler raises
        for native in natives:
            shutil.rmtree(native, ignore_errors=True)
        if os.environ.get("EXPBUF_NATIVE_VERBOSE"):
            traceback.print_exc()
        reason = why(exc)
        if os.environ.get(REQUIRE, "") not in ("", "0"):
            message = f"expbuf: compiled modules not built ({reason}) and {REQUIRE}=1 requires them"
            raise NativeBuildError(message) from exc
        print(f"expbuf: compiled modules not built ({reason}); expbuf runs as pure Python")
        return
    names = ", ".join(f"{package}.{module}" for package, modules in COMPILED.values() for module in modules)
    print(f"expbuf: compiled with mypyc: {names}")


def main() -> int:
    try:
        compile_into(in_tree, WORK)
    except NativeBuildError as exc:
        print(exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
