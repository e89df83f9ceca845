"""The docs site's reference pages, generated at build time (docs/hooks.py): each lists
everything it describes, with the comments and help the code carries."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import re
import sys
from types import ModuleType

from expbuf import client
from expbuf.client.schema.table_settings import SETTING_NAMES
from expbuf.proto.v1 import buffer_pb2
from expbuf.server import cli, config
from expbuf.server.rpc.interceptors import auth
from expbuf.server.store.schema import table_config
from expbuf.server.store.schema.table_parts import Shaping, flat_names, is_hidden

from pages import DOCS, ROOT, page


def load_hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


hooks = load_hooks()


def row(page: str, name: str) -> str:
    """The table row whose first cell is `name`."""
    found = re.search(rf"^\| `{re.escape(name)}` \|.*$", page, re.M)
    assert found, f"no row for {name}"
    return found.group(0)


def test_grpc_page_lists_every_rpc_message_field_and_enum_value_with_its_comment() -> None:
    page = hooks.grpc_page(hooks.proto_descriptor())
    for method in buffer_pb2.DESCRIPTOR.services_by_name["ExperienceBuffer"].methods:
        assert method.input_type.name in row(page, method.name)
        assert not row(page, method.name).endswith("|  |"), method.name  # one line that says what it is for
    for message in buffer_pb2.DESCRIPTOR.message_types_by_name.values():
        assert re.search(rf"^### {message.name}$", page, re.M)
    for enum in buffer_pb2.DESCRIPTOR.enum_types_by_name.values():
        assert re.search(rf"^### {enum.name}$", page, re.M)
        for value in enum.values:
            row(page, value.name)
    # Comments above an element and after it on its line, and streams and maps by their kind.
    assert "Store one TRXP payload. The reply acknowledges a durable (fsynced) commit." in row(page, "Push")
    assert "eid.tid: all runs of a task" in row(page, "GROUP_BY_TASK")
    assert "`stream SampleRequest` | `stream SampleReply`" in row(page, "Sample")
    assert "map<`string`, `double`>" in row(page, "params")


def test_cli_page_holds_every_command_and_option() -> None:
    page = hooks.cli_page(cli.build_parser())
    for name, command in hooks._commands(cli.build_parser(), "expbuf"):
        assert re.search(rf"^#+ `{name}`$", page, re.M), name
        for action in command._actions:
            for option in action.option_strings if action.help != argparse.SUPPRESS else ():
                assert option in page, (name, option)
    assert "--max-metadata-bytes" in page and "env EXPBUF_MAX_METADATA_BYTES" in page


def test_settings_page_has_a_row_for_every_setting_with_its_variables_and_flags() -> None:
    page = hooks.settings_page(config.ServerConfig, table_config.TableConfig, hooks.setting_sources())
    for cls in (config.ServerConfig, config.TlsConfig, table_config.TableConfig, *table_config.PARTS.values(), Shaping):
        assert re.search(rf"^## `{cls.__name__}`$", page, re.M)
        section = page.split(f"## `{cls.__name__}`")[1].split("\n## ")[0]
        for field in dataclasses.fields(cls):
            if is_hidden(field):  # not for users: not on the page (tests/test_table_config.py)
                assert f"| `{flat_names(cls)[field.name]}` |" not in section
                continue
            row(section, flat_names(cls)[field.name])  # a part's field under its flat name
    settings = re.findall(r"^\| `(\w+)` \|", page, re.M)
    assert len(settings) == len(set(settings)) > 70  # each setting once: the server's `tables` lists no table twice
    for setting in {*SETTING_NAMES, *settings}:  # each with one line that says what it is for
        assert not row(page, setting).endswith("|  |"), setting
    assert "(`Grouping.size` in Python)" in row(page, "group_size")
    for variable, (name, _) in config._ENV.items():
        assert f"`{variable}`" in row(page, name)
    assert "`EXPBUF_MAX_WAIT_SECONDS`, `--max-wait-seconds`" in row(page, "max_wait_seconds")
    assert "`EXPBUF_SERVER_TLS_CLIENT_CA`" in row(page, "client_ca")
    assert "| `max_inflight_bytes` | integer | `1073741824` |" in page  # plain types, as a TOML file has them
    assert "| `when_full` | one of: block, evict |" in page and "| `metrics_host` | text, optional |" in page


@dataclasses.dataclass
class Noted:
    plain: int = 1
    # Two lines above
    # the field.
    above: str = "a"
    inline: float = 0.5  # after it
    # Above and
    both: int | None = None  # after


def test_a_settings_note_is_the_comment_above_the_field_and_the_one_after_it() -> None:
    assert hooks.field_notes(Noted) == {
        "plain": "",
        "above": "Two lines above the field.",
        "inline": "after it",
        "both": "Above and after",
    }
    table = "\n".join(hooks.settings_tables(Noted, {"Noted.inline": "`X`"}))
    assert row(table, "both") == "| `both` | integer, optional | `None` |  | Above and after |"
    assert row(table, "inline") == "| `inline` | number | `0.5` | `X` | after it |"


def test_client_page_renders_every_export_of_expbuf_client() -> None:
    page = hooks.client_page(list(client.__all__))
    for name in client.__all__:
        assert f"::: expbuf.client.{name}\n" in page
    assert page.index("BufferClient") < page.index("Batch") < page.index("ExpbufError")


def test_the_client_page_draws_each_clients_declared_calls_as_its_own_methods() -> None:
    """griffe reads a declared call (client/rpc/declare.py) where it is written, on the class that
    declares it; the site's extension draws it on each client, with its parameters and docstring,
    async on an asyncio client."""
    import griffe

    hooks.link_sources()
    extensions = griffe.load_extensions(f"{DOCS / 'hooks.py'}:DeclaredCalls")
    package = griffe.GriffeLoader(extensions=extensions, search_paths=[str(hooks.SOURCES)]).load("expbuf")
    clients = {
        "client.client.BufferClient": False,
        "client.aio.AsyncBufferClient": True,
        "client.shards.blocking.ShardedBufferClient": False,
        "client.shards.aio.AsyncShardedBufferClient": True,
    }
    for path, awaited in clients.items():
        members = package[path].members
        claim = members["claim"]
        names = [p.name for p in claim.parameters]
        assert names == ["self", "table", "dataset", "count", "lease_seconds", "owner", "wait", "claim_id"], path
        assert claim.docstring is not None and claim.docstring.value.startswith("Up to `count` prompts")
        assert ("async" in claim.labels) == awaited, path
        assert {"put_values", "fail_runs", "create_table", "get_partials", "report_prompts"} <= members.keys()


def test_the_readmes_links_reach_files_in_the_tree() -> None:
    """The README is read on the forge, outside the site: each relative link names a file there."""
    readme = page("README")
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    assert len(links) > 20
    assert [link for link in links if not (ROOT / link).is_file()] == []
    assert len(readme.splitlines()) < 300


def test_the_tokens_page_gives_every_call_its_scope() -> None:
    """docs/operations/tls-and-tokens.md names each ExperienceBuffer call in the row of the scope
    the server asks for it (auth.scope_of), once."""
    text = (DOCS / "operations" / "tls-and-tokens.md").read_text()
    named: dict[str, str] = {}
    for scope, calls in re.findall(r"^\| `(\w+)` \| ([A-Za-z, ]+) \|$", text, re.M):
        for call in calls.split(", "):
            assert call not in named, call
            named[call] = scope
    methods = buffer_pb2.DESCRIPTOR.services_by_name["ExperienceBuffer"].methods_by_name
    assert named == {method: auth.scope_of(method) for method in methods}


def test_no_page_installs_expbuf_from_a_package_index() -> None:
    """No package index has expbuf: every `pip install` of it names a clone, a git URL or a wheel."""
    pages = ["README", *(str(path.relative_to(DOCS)) for path in sorted(DOCS.rglob("*.md")))]
    from_an_index = re.compile(r"pip install ['\"]?expbuf(?:\[[\w,]+\])?(?:['\"`\s]|$)(?! *@)", re.M)
    found = [f"{name}: {match.group(0)!r}" for name in pages for match in from_an_index.finditer(page(name))]
    assert not found, found
    assert 'pip install "./expbuf-src[trl]"' in page("frameworks/trl.md")


def test_the_estimators_table_is_written_from_the_registry() -> None:
    """docs/concepts/estimators.md holds no hand-written row: the hook writes one per registered
    estimator, with what it computes, its parameters' defaults and ranges, and its stages."""
    from expbuf.server.store.schema.estimator_registry import ESTIMATORS

    source = page("concepts/estimators.md")
    assert hooks.ESTIMATORS_HERE in source and "| `grpo`" not in source
    table = hooks.estimators_table(ESTIMATORS, "grpo")
    for name, estimator in ESTIMATORS.items():
        line = row(table, name) if name != "grpo" else table.splitlines()[2]
        assert line.startswith(f"| `{name}`") and estimator.value and estimator.value.split(";")[0][:20] in line
        for key in estimator.params:
            assert f"`{key}` (" in line, (name, key)
    assert "`epsilon` (1e-06): > 0" in row(table, "grpo_verl")
    assert row(table, "reinforceplusplus").endswith("| ingest + batch |")
    assert table.splitlines()[2].startswith("| `grpo` (the default) |")


def test_every_hand_written_page_has_sections_a_reader_can_jump_to() -> None:
    """Each page of docs/ written by hand has `##` sections, which make its table of contents."""
    bare = [p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md") if not re.search(r"^## ", p.read_text(), re.M)]
    assert bare == []


def test_the_clients_examples_are_code_blocks_the_site_draws_as_code() -> None:
    """mkdocstrings reads docstrings as Markdown: a reST literal block (a line ending `::`) shows
    as prose, so the examples are fenced."""
    reST = []
    for path in (ROOT / "client").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node, clean=False) or ""
                reST += [
                    f"{path.relative_to(ROOT)}: {line.strip()}" for line in doc.splitlines() if line.endswith("::")
                ]
    assert reST == []


LONGEST_PARAGRAPH = 400  # words: past that a reader skims; a list or a section serves better


def test_no_hand_written_paragraph_runs_on_past_what_a_reader_scans() -> None:
    """A paragraph (or a list item) of docs/ written by hand holds at most LONGEST_PARAGRAPH
    words; code blocks and tables aside."""
    long = []
    for path in sorted(DOCS.rglob("*.md")):
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
        for block in re.split(r"\n\s*\n", text):
            for part in re.split(r"\n(?=[-*] |\d+\. )", block):  # each list item of a block
                words = len(part.split())
                if words > LONGEST_PARAGRAPH and not part.lstrip().startswith("|"):
                    long.append(f"{path.relative_to(DOCS).as_posix()}: {words} words from {part.split()[:6]}")
    assert long == []


# A sequence diagram's participants are modules or rooms of the tree ("server/rpc/interceptors/auth.py",
# "server/store/core/"), or lmdb; a call (a solid arrow) is labelled with the names the receiver
# holds ("pushes.put" in server/store/rules/ is put in rules/pushes.py), or "rpc Push" for an RPC.
MERMAID = re.compile(r"^```mermaid\n(.*?)^```", re.M | re.S)
PARTICIPANT = re.compile(r"^\s*(?:participant|actor)\s+(\w+)(?:\s+as\s+(.+?))?\s*$", re.M)
ARROW = re.compile(r"^\s*(\w+)\s*(--?)(?:>>|>|x|\))[+-]?\s*(\w+)\s*:\s*(.*)$", re.M)
CALLED = re.compile(r"^(rpc\s+)?([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")
DOTTED = re.compile(r"(?<![\w./])[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")


def participant_module(where: str) -> tuple[str, bool] | None:
    """The module a participant names and whether it is a room (a folder of modules);
    None for one that is no module (a trainer, a rollout worker)."""
    if where == "lmdb":
        return "lmdb", False
    found = re.fullmatch(r"((?:client|server)(?:/\w+)*)(\.py|/)", where)
    return None if found is None else ("expbuf." + found[1].replace("/", "."), found[2] == "/")


def resolves(module: str, room: bool, name: str) -> bool:
    """Whether `name` is there in `module`: its attributes, or in a room its modules' (the
    first parts of `name` naming the module)."""
    parts = name.split(".")
    for split in range(len(parts) - 1, 0, -1) if room else (0,):
        try:
            found: object = importlib.import_module(".".join([module, *parts[:split]]))
        except ModuleNotFoundError:
            continue
        for part in parts[split:]:
            if not hasattr(found, part):
                return False
            found = getattr(found, part)
        return True
    return False


def diagram_calls(text: str) -> tuple[list[str], int]:
    """Each call of each sequence diagram of a page that names nothing there is, and how many
    names were checked."""
    rpcs = buffer_pb2.DESCRIPTOR.services_by_name["ExperienceBuffer"].methods_by_name
    wrong, checked = [], 0
    for diagram in MERMAID.findall(text):
        if not diagram.lstrip().startswith("sequenceDiagram"):
            continue
        modules = {alias: participant_module(where or alias) for alias, where in PARTICIPANT.findall(diagram)}
        for sender, dashes, receiver, label in ARROW.findall(diagram):
            assert sender in modules and receiver in modules, f"{sender}->{receiver}: undeclared participant"
            module = modules[receiver]
            if dashes == "--" or module is None:  # a reply, or a call into a trainer or a worker
                continue
            called = CALLED.match(label)
            assert called, f"{label!r}: a call's label starts with what it calls"
            if called[1]:
                checked += 1
                if called[2] not in rpcs:
                    wrong.append(f"{label!r}: no RPC {called[2]}")
                continue
            for name in dict.fromkeys([called[2], *DOTTED.findall(label)]):
                checked += 1
                if not resolves(*module, name):
                    wrong.append(f"{label!r}: {name} is not in {module[0]}")
    return wrong, checked


def test_every_name_a_sequence_diagram_gives_is_in_the_code() -> None:
    """The diagrams of a push and of a sample (docs/internals/push-and-sample.md) name the
    modules, functions and RPCs they pass through: each one exists, so a change that renames or
    moves one fails here until its diagram follows."""
    text = page("internals/push-and-sample.md")
    assert len(re.findall(r"^```mermaid\nsequenceDiagram", text, re.M)) == 4
    for path in DOCS.rglob("*.md"):
        wrong, checked = diagram_calls(path.read_text())
        assert wrong == [], f"{path.relative_to(DOCS)}: {wrong}"
        if path.name == "push-and-sample.md":
            assert checked > 100
    made_up = "```mermaid\nsequenceDiagram\n  participant A as server/store/rules/\n  A->>A: groups.put_all\n```"
    assert diagram_calls(made_up) == (["'groups.put_all': groups.put_all is not in expbuf.server.store.rules"], 1)


def test_the_docs_build_fails_on_what_it_warns_of() -> None:
    """The tests build the site with --strict (tests/test_site.py), as `make docs-look` does, which
    fails on a warning (a broken link, an anchor no page has). MkDocs counts the warnings it logs,
    and --quiet keeps it from logging them: with both, a broken link built without a word."""
    builds = [line for line in (ROOT / "Makefile").read_text().splitlines() if "mkdocs build" in line]
    assert len(builds) >= 1
    assert [line.strip() for line in builds if "--strict" not in line or "--quiet" in line] == []
    site = (ROOT / "tests" / "test_site.py").read_text()  # the build `make test` runs
    assert '"build", "--strict",' in site and '"--quiet"' not in site
