"""The modules compiled with mypyc (client/native_build.py, expbuf.client.native): used where built
and current, never when stale or when EXPBUF_PURE_PYTHON=1, and held to the same verdicts as
their source. The fuzzers run the compiled parse and scan side by side with the same
source executed as Python (native.source_module), on the fuzz suite's payloads, hostile
pickles included: the same items, or the same error class and message, and the same work; and the
compiled packing makes the same bytes as its source.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import re
import struct
import sys
import sysconfig
import types
import warnings
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_trxp_fuzz import FUZZ, OPCODES, payloads, shared_levels, tensor_blob, with_metadata
from test_trxp_scan import batch

from expbuf.client import native
from expbuf.client.trxp.codec import build as compiled_build
from expbuf.client.trxp.codec import common as compiled_common
from expbuf.client.trxp.codec import pickles as compiled_pickles

ROOT = Path(__file__).resolve().parent.parent
# package folder -> the modules client/native_build.py compiles there
COMPILED = {
    "client/trxp/codec": ("build", "canonical", "checks", "common", "measure", "parse", "pickles", "shown"),
    "client/trxp/stored": ("columns", "entries", "pieces", "splice"),
}
PACKAGES = {"client/trxp/codec": "expbuf.client.trxp.codec", "client/trxp/stored": "expbuf.client.trxp.stored"}

compiled_parse = sys.modules["expbuf.client.trxp.codec.parse"]
source_parse = native.source_module("expbuf.client.trxp.codec.parse")
source_pickles = native.source_module("expbuf.client.trxp.codec.pickles")
source_build = native.source_module("expbuf.client.trxp.codec.build")
in_use = native.compiled("expbuf.client.trxp.codec.parse")
side_by_side = pytest.mark.skipif(not in_use, reason="the compiled modules are not in use (not built, or pure Python)")


@pytest.mark.parametrize("folder", sorted(COMPILED))
def test_the_compiled_modules_are_used_exactly_where_built_and_current(folder: str) -> None:
    built = native.stale(ROOT / folder) == []
    for module in COMPILED[folder]:
        assert native.compiled(f"{PACKAGES[folder]}.{module}") == (built and not native.pure_python()), module
    assert not native.compiled("expbuf.client.trxp.codec.convert")  # the rest of the package stays as written


def test_the_build_compiles_what_the_tests_expect() -> None:
    from expbuf.client import native_build

    assert {folder: modules for folder, (_, modules) in native_build.COMPILED.items()} == COMPILED
    # make setup rebuilds whenever one of them changes (the import guard covers any it would miss)
    listed = re.search(r"^NATIVE_SOURCES := ((?:.*\\\n)*.*)$", (ROOT / "Makefile").read_text(), re.M)
    assert listed is not None
    sources = {f"{folder}/{module}.py" for folder, modules in COMPILED.items() for module in modules}
    assert set(listed.group(1).replace("\\\n", " ").split()) == {"client/native_build.py", *sources}


def package(tmp_path: Path, digest: str, abi: str | None = None, needs: list[str] | None = None) -> Path:
    """A package folder with one source and a manifest claiming it compiled from `digest` (and,
    with `needs`, calling those packages' compiled modules)."""
    (tmp_path / "hot.py").write_text("VALUE = 1\n")
    (tmp_path / native.NATIVE).mkdir()
    manifest: dict[str, object] = {"abi": abi or sysconfig.get_config_var("EXT_SUFFIX"), "sources": {"hot": digest}}
    if needs is not None:
        manifest["needs"] = needs
    (tmp_path / native.NATIVE / native.MANIFEST).write_text(json.dumps(manifest))
    return tmp_path


def test_a_current_build_goes_ahead_of_the_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(native.PURE_PYTHON, raising=False)
    folder = package(tmp_path, hashlib.sha256(b"VALUE = 1\n").hexdigest())
    path = [str(folder)]
    assert native.use_compiled("pkg", path)
    assert path == [str(folder / native.NATIVE), str(folder)]


@pytest.mark.parametrize("why", ["edited", "other python", "pure python"])
def test_a_stale_build_or_the_switch_leaves_the_sources(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, why: str
) -> None:
    monkeypatch.delenv(native.PURE_PYTHON, raising=False)
    digest = hashlib.sha256(b"VALUE = 0\n" if why == "edited" else b"VALUE = 1\n").hexdigest()
    folder = package(tmp_path, digest, abi=".cpython-39-x86_64-linux-gnu.so" if why == "other python" else None)
    if why == "pure python":
        monkeypatch.setenv(native.PURE_PYTHON, "1")
    path = [str(folder)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not native.use_compiled("pkg", path)
    assert path == [str(folder)]
    messages = [str(warning.message) for warning in caught]
    if why == "pure python":
        assert messages == []
    else:
        assert messages == [
            "expbuf: the compiled modules of pkg do not match their sources (hot changed); "
            "using the pure-Python modules (run `make setup`, or reinstall expbuf, to rebuild them)"
        ]


@pytest.mark.parametrize("needed_in_use", [True, False])
def test_a_build_that_calls_another_package_goes_ahead_only_with_that_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, needed_in_use: bool
) -> None:
    """The stored payloads' compiled modules call the codec's by their compiled names: with the
    codec's stale (pure Python), using them would fail expbuf's import; they stay pure instead."""
    monkeypatch.delenv(native.PURE_PYTHON, raising=False)
    needed = types.ModuleType("needed_pkg")
    needed.__path__ = [str(tmp_path / "needed" / native.NATIVE)] * needed_in_use + [str(tmp_path / "needed")]
    monkeypatch.setitem(sys.modules, "needed_pkg", needed)
    (tmp_path / "pkg").mkdir()
    folder = package(tmp_path / "pkg", hashlib.sha256(b"VALUE = 1\n").hexdigest(), needs=["needed_pkg"])
    path = [str(folder)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert native.use_compiled("pkg", path) is needed_in_use
    if needed_in_use:
        assert path == [str(folder / native.NATIVE), str(folder)] and caught == []
    else:
        assert path == [str(folder)]
        assert [str(warning.message) for warning in caught] == [
            "expbuf: the compiled modules of pkg call those of needed_pkg, which are not in use; "
            "using the pure-Python modules (run `make setup`, or reinstall expbuf, to rebuild them)"
        ]


def test_the_stored_payloads_build_names_the_codec_it_calls() -> None:
    """Where built, the stored payloads' manifest names the codec (client/native_build.CALLS)."""
    stored = ROOT / "client/trxp/stored"
    if native.stale(stored) is None:
        pytest.skip("no compiled modules in this tree (EXPBUF_PURE_PYTHON's pass or no build)")
    manifest = json.loads((stored / native.NATIVE / native.MANIFEST).read_text())
    assert manifest["needs"] == ["expbuf.client.trxp.codec"]


def test_a_package_without_a_build_stays_pure(tmp_path: Path) -> None:
    path = [str(tmp_path)]
    assert native.stale(tmp_path) is None
    assert not native.use_compiled("pkg", path)
    assert path == [str(tmp_path)]


# ---- the same verdicts -----------------------------------------------------------------


def outcome(parse_module: Any, data: bytes) -> tuple[Any, ...]:
    """What a parse makes of a payload: the items (metadata pickled, so NaN and sharing compare)
    and tensors, or the error's class and message; and the work it counted either way."""
    work = parse_module.Work.for_payload(len(data))
    try:
        items = parse_module.parse(data, work=work)
    except Exception as exc:
        return type(exc).__name__, str(exc), work.used
    shown = [
        (
            pickle.dumps(item.meta, protocol=5),
            {key: (t.dtype, t.shape, bytes(t.data)) for key, t in item.tensors.items()},
        )
        for item in items
    ]
    return "parsed", shown, work.used


def same_parse(data: bytes) -> None:
    assert outcome(compiled_parse, data) == outcome(source_parse, data)


def same_scan(meta: bytes) -> None:
    verdicts = []
    for module, work_type in ((compiled_pickles, compiled_common.Work), (source_pickles, source_pickles.Work)):
        work = work_type(1 << 40)
        try:
            module.scan_pickle(memoryview(meta), work)
            verdicts.append(("passed", work.used))
        except Exception as exc:
            verdicts.append((type(exc).__name__, str(exc)))
    assert verdicts[0] == verdicts[1]


@side_by_side
@given(payloads())
@FUZZ
def test_structured_payloads_get_the_same_verdict(data: bytes) -> None:
    same_parse(data)


@side_by_side
@given(payloads(), st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=6))
@FUZZ
def test_mutated_pickles_get_the_same_verdict(data: bytes, edits: list[tuple[int, int]]) -> None:
    (meta_len,) = struct.unpack_from("<Q", data, 5)
    meta = bytearray(data[21 : 21 + meta_len])
    for position, value in edits:
        meta.insert(position % (len(meta) + 1), value)
    same_parse(with_metadata(bytes(meta), data[21 + meta_len :]))
    same_scan(bytes(meta))


@side_by_side
@given(st.lists(OPCODES, max_size=60))
@FUZZ
def test_hostile_opcode_sequences_get_the_same_verdict(ops: list[bytes]) -> None:
    meta = b"\x80\x05" + b"".join(ops) + b"."
    same_scan(meta)
    same_parse(with_metadata(meta))


@side_by_side
@given(st.integers(1, 40), st.integers(2, 6), st.integers(0, 5))
@FUZZ
def test_memo_towers_get_the_same_verdict(levels: int, refs: int, protocol: int) -> None:
    meta = {
        "eid": {"batch": 0, "task": 0, "run": 0, "step": 0, "suffix": "s"},
        "info": {"x": shared_levels(levels, refs)},
    }
    pickled = pickle.dumps({"version": 1, "num_items": 1, "items": [meta]}, protocol=protocol)
    tensors = tensor_blob({"0:tokens": {"dtype": "I32", "shape": [2], "data_offsets": [0, 8]}}, bytes(8))
    same_parse(with_metadata(pickled, tensors))


@side_by_side
@given(st.integers(20, 200), st.booleans(), st.integers(0, 1 << 20), st.binary(min_size=1, max_size=3))
@FUZZ
def test_batches_the_scan_replays_get_the_same_verdict(count: int, memo: bool, position: int, edit: bytes) -> None:
    """Trinity-RFT's batches, whose repeated items the scan replays, edited at one place."""
    meta = batch(count, {"model_version": 3, "tags": ["a", "b"]}, memo=memo)
    at = position % len(meta)
    same_scan(meta)
    same_scan(meta[:at] + edit + meta[at + len(edit) :])


@side_by_side
@given(payloads())
@FUZZ
def test_the_packing_makes_the_same_bytes(data: bytes) -> None:
    """What the server stores of each pushed experience (pack_item) and a client's payload (build)
    are byte for byte the same, compiled or not: a digest that differed would make a retried push
    a conflict."""
    try:
        items = compiled_parse.parse(data)
    except Exception:
        return
    assert [compiled_build.pack_item(item) for item in items] == [source_build.pack_item(item) for item in items]
    assert compiled_build.build(items) == source_build.build(items)
