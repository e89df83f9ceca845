"""The docs site's generated pages, written at build time from the code (an MkDocs hook).

The gRPC API comes from buffer.proto's comments, the CLI from `expbuf`'s argparse parser, the
settings from the `ServerConfig` and `TableConfig` dataclasses and their comments, and the Python
client's page from `expbuf.client.__all__` (rendered by mkdocstrings from the docstrings). None
is written by hand, so none can drift from what it describes: `mkdocs build --strict` in
`make test` fails on a reference a page makes to something that has gone. The benchmarks'
figures are bench/RESULTS.md itself, which the benchmarks write, and their history bench/HISTORY.md.

The diagrams are drawn by mermaid's script shipped with the site (MERMAID, fetched from the npm
registry by `make docs-js`), so that a reader without the network sees them drawn.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import inspect
import tempfile
import textwrap
import types
import typing
from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTO = "expbuf/v1/buffer.proto"
# Where mkdocstrings finds the client's sources under its installed name (mkdocs.yml: paths);
# the install maps expbuf.client to client/, which a search by path cannot see.
SOURCES = ROOT / "build" / "docs-src"
# mermaid's script, as `make docs-js` unpacks it from its npm package, and where the site has it
# (mkdocs.yml: extra_javascript; the theme draws with it rather than fetch one from a CDN).
MERMAID = ROOT / "build" / "docs-js" / "mermaid.min.js"
MERMAID_ON_SITE = "javascripts/mermaid.min.js"


def cell(text: str) -> str:
    """One line of text, safe in a Markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")


# ---- the gRPC API ----------------------------------------------------------------------------


def proto_descriptor() -> descriptor_pb2.FileDescriptorProto:
    """buffer.proto compiled by protoc with its comments (source info) kept."""
    include = Path(protoc.__file__).resolve().parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", "--include_source_info", f"-o{out}", PROTO]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {PROTO}")
        files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    return next(f for f in files.file if f.name == PROTO)


def _comments(source: descriptor_pb2.FileDescriptorProto) -> dict[tuple[int, ...], str]:
    """Each element's comment (leading, then trailing) by its path in the descriptor."""
    found = {}
    for location in source.source_code_info.location:
        text = " ".join(part.strip() for part in (location.leading_comments, location.trailing_comments) if part)
        if text:
            found[tuple(location.path)] = " ".join(text.split())
    return found


def _type_name(field: descriptor_pb2.FieldDescriptorProto, maps: dict[str, descriptor_pb2.DescriptorProto]) -> str:
    if field.type_name.rsplit(".", 1)[-1] in maps:
        key, value = maps[field.type_name.rsplit(".", 1)[-1]].field
        return f"map<{_type_name(key, maps)}, {_type_name(value, maps)}>"
    if field.type_name:
        name = field.type_name.rsplit(".", 1)[-1]
        return f"[`{name}`](#{name.lower()})"
    kind = descriptor_pb2.FieldDescriptorProto.Type.Name(field.type)
    return f"`{kind.removeprefix('TYPE_').lower()}`"


def grpc_page(source: descriptor_pb2.FileDescriptorProto) -> str:
    """Services, RPCs, messages with their fields and enums with their values, as commented."""
    comments = _comments(source)
    lines = ["# gRPC API", "", f"Generated from `proto/{PROTO}` (package `{source.package}`).", ""]
    if (12,) in comments:  # the comment above `syntax`: the file's own
        lines += [comments[(12,)], ""]
    for s, service in enumerate(source.service):
        lines += [
            f"## Service `{service.name}`",
            "",
            "| RPC | request | reply | what it does |",
            "| --- | --- | --- | --- |",
        ]
        for m, method in enumerate(service.method):
            request = ("stream " if method.client_streaming else "") + method.input_type.rsplit(".", 1)[-1]
            reply = ("stream " if method.server_streaming else "") + method.output_type.rsplit(".", 1)[-1]
            note = cell(comments.get((6, s, 2, m), ""))
            lines.append(f"| `{method.name}` | `{request}` | `{reply}` | {note} |")
        lines.append("")
    lines += ["## Messages", ""]
    for i, message in enumerate(source.message_type):
        lines += _message(message, (4, i), comments, 3)
    lines += ["## Enums", ""]
    for i, enum in enumerate(source.enum_type):
        lines += _enum(enum, (5, i), comments, 3)
    return "\n".join(lines)


def _message(
    message: descriptor_pb2.DescriptorProto, path: tuple[int, ...], comments: dict[tuple[int, ...], str], depth: int
) -> list[str]:
    lines = [f"{'#' * depth} {message.name}", ""]
    if path in comments:
        lines += [comments[path], ""]
    if message.field:
        lines += ["| field | number | type | meaning |", "| --- | --- | --- | --- |"]
        maps = {nested.name: nested for nested in message.nested_type if nested.options.map_entry}
        for f, field in enumerate(message.field):
            kind = _type_name(field, maps)
            if field.label == descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED and not kind.startswith("map<"):
                kind = "repeated " + kind
            elif field.proto3_optional:
                kind = "optional " + kind
            lines.append(f"| `{field.name}` | {field.number} | {kind} | {cell(comments.get((*path, 2, f), ''))} |")
        lines.append("")
    for e, enum in enumerate(message.enum_type):
        lines += _enum(enum, (*path, 4, e), comments, depth + 1)
    for n, nested in enumerate(message.nested_type):
        if not nested.options.map_entry:
            lines += _message(nested, (*path, 3, n), comments, depth + 1)
    return lines


def _enum(
    enum: descriptor_pb2.EnumDescriptorProto, path: tuple[int, ...], comments: dict[tuple[int, ...], str], depth: int
) -> list[str]:
    lines = [f"{'#' * depth} {enum.name}", ""]
    if path in comments:
        lines += [comments[path], ""]
    lines += ["| value | number | meaning |", "| --- | --- | --- |"]
    for v, value in enumerate(enum.value):
        lines.append(f"| `{value.name}` | {value.number} | {cell(comments.get((*path, 2, v), ''))} |")
    return [*lines, ""]


# ---- the command line ------------------------------------------------------------------------


def _commands(parser: argparse.ArgumentParser, name: str) -> list[tuple[str, argparse.ArgumentParser]]:
    """The parser and every sub-command below it, depth first."""
    found = [(name, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                found += _commands(sub, f"{name} {sub_name}")
    return found


def cli_page(parser: argparse.ArgumentParser) -> str:
    """Each command's help, as `expbuf COMMAND --help` prints it."""
    lines = ["# Command line", "", "Generated from `expbuf`'s parser (`expbuf.server.cli.build_parser`).", ""]
    for name, command in _commands(parser, parser.prog):
        command.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=100)
        level = "#" * min(2 + name.count(" "), 4)
        lines += [f"{level} `{name}`", "", "```text", command.format_help().rstrip(), "```", ""]
    return "\n".join(lines)


# ---- the settings ----------------------------------------------------------------------------


def field_notes(cls: type) -> dict[str, str]:
    """Each field's comment in the class's source: the comment lines above it and the one after it."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    notes = {}
    body = ast.parse(source).body[0]
    assert isinstance(body, ast.ClassDef)
    for node in body.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above = []
        row = node.lineno - 2
        while row >= 0 and lines[row].strip().startswith("#"):
            above.insert(0, lines[row].strip().lstrip("#").strip())
            row -= 1
        _, _, inline = lines[node.end_lineno - 1].partition("  # ")
        notes[node.target.id] = " ".join([*above, inline.strip()]).strip()
    return notes


def _default(field: dataclasses.Field[Any]) -> str:
    if field.default is not dataclasses.MISSING:
        return f"`{field.default!r}`"
    if field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
        return f"`{value!r}`" if not dataclasses.is_dataclass(value) else "its defaults"
    return "required"


def _dataclasses_in(hint: Any) -> list[type]:
    """The dataclasses a field's type names (`X`, `X | None`, `tuple[X, ...]`)."""
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return [hint]
    return [cls for arg in typing.get_args(hint) for cls in _dataclasses_in(arg)]


# A setting's type in the words of its TOML file.
_PLAIN = {bool: "true or false", int: "integer", float: "number", str: "text"}


def _hint_text(hint: Any) -> str:
    """A setting's type as a reader of the TOML file needs it: "integer", "text, optional",
    "one of: block, evict", "list of text", or the table of settings below that holds it."""
    args = typing.get_args(hint)
    if hint in _PLAIN:
        return _PLAIN[hint]
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return f"the settings of `{hint.__name__}` below"
    if typing.get_origin(hint) is typing.Literal:
        return "one of: " + ", ".join(str(arg) for arg in args)
    if isinstance(hint, types.UnionType) and type(None) in args:
        (kept,) = [arg for arg in args if arg is not type(None)]
        return f"{_hint_text(kept)}, optional"
    if typing.get_origin(hint) is tuple:
        return f"list of {_hint_text(args[0])}"
    if typing.get_origin(hint) is dict:
        key, value = args
        return f"table of {_hint_text(key)} to {_hint_text(value)}"
    if typing.get_origin(hint) is frozenset:
        return f"list of {_hint_text(args[0])}"
    raise TypeError(f"a setting of type {hint!r} has no words in docs/hooks.py: add them")


def settings_tables(cls: type, where: dict[str, str], seen: set[type] | None = None) -> list[str]:
    """A table of cls's fields (type, default, where else it is set, comment), then one for each
    dataclass a field holds. where: "Class.field" -> the variables and flags that set it."""
    seen = set() if seen is None else seen
    seen.add(cls)
    hints = typing.get_type_hints(cls)
    notes = field_notes(cls)
    lines = [f"## `{cls.__name__}`", ""]
    if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("):
        lines += [" ".join(cls.__doc__.split()), ""]
    lines += ["| setting | type | default | also from | note |", "| --- | --- | --- | --- | --- |"]
    nested: list[type] = []
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        if field.metadata.get("hidden"):  # a setting the store keeps for its own development (table_parts.HIDDEN)
            continue
        hint = hints[field.name]
        nested += [c for c in _dataclasses_in(hint) if c not in seen and c not in nested]
        also = where.get(f"{cls.__name__}.{field.name}", "")
        # A table part's field under its flat setting name (table_parts.SETTING), the one users write.
        name = field.metadata.get("setting", field.name)
        note = notes[field.name] + (f" (`{cls.__name__}.{field.name}` in Python)" if name != field.name else "")
        lines.append(f"| `{name}` | {cell(_hint_text(hint))} | {_default(field)} | {also} | {cell(note.strip())} |")
    lines.append("")
    for inner in nested:
        lines += settings_tables(inner, where, seen)
    return lines


def settings_page(server: type, table: type, where: dict[str, list[str]]) -> str:
    """ServerConfig's and TableConfig's fields, each with the variables and flags that set it."""
    lines = [
        "# Settings",
        "",
        "Generated from `expbuf.server.config.ServerConfig` and `expbuf.server.store.schema.table_config.TableConfig`.",
        "The server's settings come from its TOML file (`--config`), the environment and its flags (the last",
        "wins); a table's from the file's `[[tables]]`, `create_table` or `expbuf table create`, each under",
        "the flat name its part's table below gives it (`group_size`, `when_full`). In Python a `TableConfig`",
        "is composed of those parts, or made from the flat names with `TableConfig.of(name, **settings)`. See",
        "[Serving](../operations/serving.md) for what they do together.",
        "",
    ]
    sources = {name: ", ".join(f"`{s}`" for s in found) for name, found in where.items()}
    seen: set[type] = set()
    lines += settings_tables(server, sources, seen)
    if table not in seen:  # the server's `tables` holds tables: their settings are listed once, from there
        lines += settings_tables(table, sources, seen)
    return "\n".join(lines)


def setting_sources() -> dict[str, list[str]]:
    """The environment variables and `expbuf serve` flags that set each setting, by "Class.field"."""
    from expbuf.server import cli, config

    where: dict[str, list[str]] = {}
    for variable, (name, _) in config._ENV.items():
        where.setdefault(f"ServerConfig.{name}", []).append(variable)
    for name, (variable, _) in config.SERVER_TLS_ENV.items():
        where.setdefault(f"TlsConfig.{name}", []).append(variable)
    serve = next(p for n, p in _commands(cli.build_parser(), "expbuf") if n == "expbuf serve")
    settings = {field.name for field in dataclasses.fields(config.ServerConfig)}
    for action in serve._actions:
        if action.option_strings and action.dest in settings:
            where.setdefault(f"ServerConfig.{action.dest}", []).append(action.option_strings[0])
    return where


# ---- the estimators --------------------------------------------------------------------------

ESTIMATORS_HERE = "<!-- the estimators: a table docs/hooks.py writes from the registry -->"


def _param(name: str, param: Any) -> str:
    default = (
        "unset"
        if param.default is None
        else f'"{param.default}"'
        if isinstance(param.default, str)
        else f"{param.default:g}"
    )
    return f"`{name}` ({default}): {param.describe()}"


def estimators_table(estimators: dict[str, Any], default: str) -> str:
    """Every registered estimator: what it computes, its parameters with their defaults and
    allowed values, and where it runs (at ingest, and over each sampled batch)."""
    lines = ["| estimator | value | parameters (default): allowed | stage |", "| --- | --- | --- | --- |"]
    for name, estimator in estimators.items():
        params = "; ".join(_param(key, param) for key, param in estimator.params.items())
        stage = "" if estimator.ingest is None else "ingest"
        if estimator.batch is not None:
            stage += f"; batch with {estimator.batch_when}" if estimator.batch_when else " + batch"
        named = f"`{name}`" + (" (the default)" if name == default else "")
        lines.append(f"| {named} | {cell(estimator.value)} | {cell(params)} | {cell(stage)} |")
    return "\n".join(lines)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if ESTIMATORS_HERE not in markdown:
        return markdown
    from expbuf.server.store.schema import estimator_registry, table_parts

    default = table_parts.Estimation().estimator
    return markdown.replace(ESTIMATORS_HERE, estimators_table(estimator_registry.ESTIMATORS, default))


# ---- the Python client -----------------------------------------------------------------------


class DeclaredCalls:
    """A griffe extension (mkdocs.yml): each client's declared calls (client/rpc/declare.py) drawn as
    its own methods. griffe reads a declaration where it is written, on the class that declares it
    (rpc/api.py's Calls), and a client inherits it; here each client class gets it as that client
    has it at run time: the declaration's parameters and docstring, async for an asyncio client."""

    def on_package(self, *, pkg: Any, loader: Any, **kwargs: Any) -> None:
        import griffe

        from expbuf.client import AsyncBufferClient, BufferClient
        from expbuf.client.rpc.declare import declared_calls
        from expbuf.client.shards.blocking import AsyncShardedBufferClient, ShardedBufferClient

        if pkg.path != "expbuf":
            return
        for kind in (BufferClient, AsyncBufferClient, ShardedBufferClient, AsyncShardedBufferClient):
            owner = loader.modules_collection[f"{kind.__module__}.{kind.__qualname__}"]
            for at, (name, call) in enumerate(declared_calls(kind).items(), start=owner.endlineno + 1):
                declared = loader.modules_collection[f"{call.plan.__module__}.{call.plan.__qualname__}"]
                method = getattr(kind, name)
                parameters = griffe.Parameters(
                    *(
                        griffe.Parameter(p.name, annotation=p.annotation, kind=p.kind, default=p.default)
                        for p in declared.parameters
                    )
                )
                docstring = declared.docstring
                made = griffe.Function(
                    name,
                    lineno=at,  # after the class's own methods, in the order declared
                    endlineno=at,
                    parameters=parameters,
                    returns=str(inspect.signature(method).return_annotation),
                    docstring=griffe.Docstring(
                        docstring.value, parser=docstring.parser, parser_options=docstring.parser_options
                    ),
                    parent=owner,
                )
                if inspect.iscoroutinefunction(method):
                    made.labels.add("async")
                owner.set_member(name, made)


def client_page(exported: list[str]) -> str:
    """Every name `expbuf.client` exports, rendered by mkdocstrings from its docstrings."""
    lines = ["# Python client", "", "Generated from the docstrings of what `expbuf.client` exports.", ""]
    for name in sorted(exported, key=lambda n: (not n.endswith("Client"), n.endswith("Error"), n.lower())):
        lines += [f"::: expbuf.client.{name}", ""]
        if name == "BufferClient":  # its connection's own methods (clone, push_stream) are its base's
            lines[-1:] = ["    options:", "      inherited_members: true", ""]
    sharded = "expbuf.client.shards.blocking"
    lines += [f"::: {sharded}.ShardedBufferClient", "", f"::: {sharded}.AsyncShardedBufferClient"]
    return "\n".join(lines) + "\n"


# ---- the hook --------------------------------------------------------------------------------


def link_sources() -> None:
    """Lay out expbuf's installed packages under SOURCES by their import names, for mkdocstrings."""
    root = SOURCES / "expbuf"
    root.mkdir(parents=True, exist_ok=True)
    # A package, not a namespace: griffe would take proto/expbuf (a package on the path) first.
    (root / "__init__.py").write_text("")
    for name in ("client", "server", "proto"):
        spec = importlib.util.find_spec(f"expbuf.{name}")
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError(f"expbuf.{name} is not installed: run `make setup` first")
        link = root / name
        link.unlink(missing_ok=True)
        link.symlink_to(Path(spec.submodule_search_locations[0]).resolve(), target_is_directory=True)


def pages() -> dict[str, str]:
    """The generated pages by their path under docs/."""
    from expbuf import client
    from expbuf.server import cli, config
    from expbuf.server.store.schema import table_config

    return {
        "reference/grpc.md": grpc_page(proto_descriptor()),
        "reference/cli.md": cli_page(cli.build_parser()),
        "reference/settings.md": settings_page(config.ServerConfig, table_config.TableConfig, setting_sources()),
        "reference/python-client.md": client_page(list(client.__all__)),
        "bench/RESULTS.md": (ROOT / "bench" / "RESULTS.md").read_text(),
        "bench/HISTORY.md": (ROOT / "bench" / "HISTORY.md").read_text(),
    }


def on_startup(command: str, dirty: bool) -> None:
    link_sources()


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for path, text in pages().items():
        files.append(File.generated(config, path, content=text))
    if not MERMAID.is_file():
        raise RuntimeError(f"{MERMAID.relative_to(ROOT)} is missing: run `make docs-js` (mermaid, from npm)")
    files.append(File.generated(config, MERMAID_ON_SITE, abs_src_path=str(MERMAID)))
    return files
