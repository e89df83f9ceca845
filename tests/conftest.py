"""Shared fixtures: the TRXP payloads copied from shared/fixtures into tests/fixtures, the
factory of in-process servers with a default server, its target, client and raw stub, the
`expbuf serve` children and the one local Ray cluster.

A module that needs a server of other settings defines its own `server`; the `target`,
`client` and `stub` of its tests then reach that one."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import json
import logging
import os
import signal
import socket
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType

import grpc
import pytest
from hypothesis import settings

from expbuf.client import BufferClient
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc
from expbuf.server import logs
from expbuf.server.app import ExpbufServer
from expbuf.server.config import ServerConfig
from expbuf.server.store.schema.table_parts import DEFAULT_LAYOUT_VARIABLE, LAYOUTS

from helpers import ServerProcess, hold_port, release_held_ports, servers

# torch warns at import when NumPy is absent; expbuf does not use NumPy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

# No property test has a deadline: a generated example that ran slowly on a busy machine failed its
# test (hypothesis's 200 ms), and timing belongs in the benchmarks, not in a test's verdict.
settings.register_profile("expbuf", deadline=None)
settings.load_profile("expbuf")


AREAL_LOGGING = "areal.utils.logging"


def _keep_one_logging_tree(areal_logging: ModuleType) -> None:
    """AReaL 1.0.4's `areal.utils.logging.getLogger` replaces the logging module's manager and
    root at every call (to undo another library's configuration). Loggers made after such a call,
    expbuf's among them, hang off a root that no handler reads, and pytest's log capture then sets
    the level of one logger object while records go through another. Each call keeps its own
    loggers; the process's manager and root are put back afterwards."""
    make = areal_logging.getLogger

    def get_logger(*args: object, **kwargs: object) -> logging.Logger:
        manager, root = logging.Logger.manager, logging.Logger.root
        try:
            return make(*args, **kwargs)
        finally:
            logging.Logger.manager, logging.Logger.root = manager, root

    areal_logging.getLogger = get_logger


class _ArealLoggingFinder(importlib.abc.MetaPathFinder):
    """Applies _keep_one_logging_tree as `areal.utils.logging` is imported, before any other module
    of AReaL can call its getLogger, rather than importing AReaL here: its import takes 8 s of CPU
    (it loads transformers and more), which every pytest process paid at its start, the xdist
    controller and the workers of a run that holds no AReaL test among them."""

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != AREAL_LOGGING:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            manager, root = logging.Logger.manager, logging.Logger.root
            try:
                run(module)
            finally:
                logging.Logger.manager, logging.Logger.root = manager, root
            _keep_one_logging_tree(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if AREAL_LOGGING in sys.modules:
    _keep_one_logging_tree(sys.modules[AREAL_LOGGING])
else:
    sys.meta_path.insert(0, _ArealLoggingFinder())

FIXTURES = Path(__file__).parent / "fixtures"
TRXP_DIR = FIXTURES / "trxp"
BAD_DIR = FIXTURES / "bad"
MANIFEST = json.loads((TRXP_DIR / "manifest.json").read_text())
BAD_README = json.loads((BAD_DIR / "README.json").read_text())


# The modules whose tests share something outside their process, by what they share: one
# pytest-xdist worker runs each set (pytest_xdist_make_scheduler).
SHARED_MODULES = {
    "ray": (  # the local Ray cluster (ray_cluster): one, not one per worker
        "tests/test_ray.py",
        "tests/test_verl_buffer.py",
        "tests/test_tq_controller.py",
        "tests/test_tq_storage.py",
        "tests/faults/test_fault_tq.py",
    ),
    "trinity": (  # Trinity's plugin loader copies the plugin into its installed package
        "tests/test_trinity_plugin.py",
        "tests/test_trinity_jobs.py",
        "tests/test_trinity_taskset.py",
        "tests/faults/test_fault_trinity.py",
    ),
}
SHARING = {module: name for name, modules in SHARED_MODULES.items() for module in modules}
# The modules (or SHARED_MODULES sets) that take 20 s or more on 2 cores, the longest first: they
# are handed out first, so that the run does not end with one worker on one of them and the other
# idle (xdist hands out the others by their number of tests, which says little of their time).
LONG_FIRST = (
    "ray",
    "trinity",
    "tests/test_group_stop.py",
    "tests/test_verl_tq.py",
    "tests/faults/test_fault_push_memory.py",
    "tests/faults/test_fault_crash_loop.py",
    "tests/faults/test_fault_crash_loop_pending.py",
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--layout",
        choices=LAYOUTS,
        help="the storage layout of every table created without one, in this process and the servers "
        "it starts (issue 64: rows by default; `--layout records` runs the suite on records)",
    )


def pytest_configure(config: pytest.Config) -> None:
    """`--layout` set in the environment, where the store and `expbuf serve` children read it."""
    layout = config.getoption("--layout")
    if layout:
        os.environ[DEFAULT_LAYOUT_VARIABLE] = layout


@pytest.fixture(params=LAYOUTS)
def table_layout(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Tables created without a layout are of each layout in turn (or of the one a test's
    `indirect` parametrize names): for a rule both layouts keep."""
    layout: str = request.param
    monkeypatch.setenv(DEFAULT_LAYOUT_VARIABLE, layout)
    return layout


@pytest.fixture
def records_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tables created without a layout are records tables, whatever `--layout` says: for a test of
    what a records table writes (its item and group records, an upgrade of a format before rows)."""
    monkeypatch.setenv(DEFAULT_LAYOUT_VARIABLE, "records")


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, which a run may go without
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """With `--dist loadfile` (`make test` runs `-n 4 --dist loadfile`), each module's tests run on
    one worker, in their order, its shared servers started once; the modules of a SHARED_MODULES
    set run on one worker too."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ByModule(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            return SHARING.get(module, module)

        ordered = False

        def _assign_work_unit(self, node: object) -> None:
            if not self.ordered:  # the queue xdist made, the LONG_FIRST scopes moved to its front, longest first
                self.ordered = True
                for scope in reversed(LONG_FIRST):
                    if scope in self.workqueue:
                        self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return ByModule(config, log)


def payload(name: str) -> bytes:
    return (TRXP_DIR / name).read_bytes()


@pytest.fixture(params=sorted(MANIFEST["payloads"]))
def fixture_name(request: pytest.FixtureRequest) -> str:
    return request.param


class Servers:
    """Starts in-process servers, each on free ports (gRPC and metrics on port 0, read back as
    `server.port` and `server.metrics_port`), and stops every one it started.

    `start_server(data=None, **settings)`: `data` defaults to one directory per factory, so a
    second start is a restart on the same data; `settings` are ServerConfig's fields. A test
    server decodes every push in its own process (`ingest_processes=0`) unless the test asks
    for ingest processes (tests/test_ingest.py does): a lone push, and any below 256 KiB
    (ingest.SMALL), is decoded there anyway, and each worker is an interpreter to spawn. Its
    advantage worker starts at the start (`advantage_worker="at_start"`: this process has torch
    loaded already) unless the test asks otherwise, and it is returned once that has started: a
    push before that leaves its groups to the worker, where one after computes them itself on the
    CPU. A server that loads torch only when a table needs it, the default, is tested as an
    `expbuf serve` child (tests/test_advantage_start.py).
    """

    def __init__(self, data: Path) -> None:
        self.data = data
        self.started: list[ExpbufServer] = []
        self.held: dict[int, socket.socket] = {}  # ports kept for a server to start on (reserve_port, stop)

    def __call__(self, data: Path | str | None = None, **settings: object) -> ExpbufServer:
        settings = {"port": 0, "metrics_port": 0, "ingest_processes": 0, "advantage_worker": "at_start", **settings}
        port = settings["port"]
        held = self.held.pop(port, None) if isinstance(port, int) else None
        try:  # a held port is let go once the server listens on it (its bind shares it, as gRPC's does)
            server = ExpbufServer(ServerConfig(data=str(self.data if data is None else data), **settings))
            self.started.append(server.start())
        finally:
            if held is not None:
                held.close()
        if server.advantages.state != "not_needed":  # advantage_worker="when_needed" asked, and nothing needs it
            assert server.advantages.wait(60), "the advantage worker did not start"
        return server

    def reserve_port(self) -> int:
        """A free port, held until a server is started on it here (`port=`): a client that
        connects meanwhile is refused as by a server that is down, and no other test's server,
        started meanwhile on a free port, can take it and answer that client instead."""
        return self._hold(0)

    def stop(self, server: ExpbufServer, grace: float = 1) -> None:
        """Stop a server, its port held until one is started on it again here (reserve_port's)."""
        server.stop(grace=grace)
        self._hold(server.port)

    def stop_all(self, *, keep_ports: bool = False) -> None:
        """Stop every server started (a second stop of one the test stopped does nothing); with
        `keep_ports`, their ports held for the next (as `stop` holds them), else every port held
        let go."""
        try:
            while self.started:
                server = self.started.pop()
                server.stop(grace=1)
                if keep_ports and server.port not in self.held:
                    self._hold(server.port)
        finally:
            while self.held and not keep_ports:
                self.held.popitem()[1].close()

    def _hold(self, port: int) -> int:
        """Bind `port` (0: a free one) without listening: nothing else on the machine may bind it."""
        sock = hold_port(port)
        port = sock.getsockname()[1]
        self.held[port] = sock
        return int(port)


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Servers]:
    """The server factory of one test (data in tmp_path/data unless given)."""
    servers = Servers(tmp_path / "data")
    yield servers
    servers.stop_all()


@pytest.fixture(scope="module")
def start_module_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    """The same factory for a server that a module's tests share."""
    servers = Servers(tmp_path_factory.mktemp("server") / "data")
    yield servers
    servers.stop_all()


@pytest.fixture
def server(start_server: Servers) -> ExpbufServer:
    """The test's in-process server, with the default settings."""
    return start_server()


@pytest.fixture
def target(server: ExpbufServer) -> str:
    return f"127.0.0.1:{server.port}"


@pytest.fixture
def client(target: str, request: pytest.FixtureRequest) -> Iterator[BufferClient]:
    """A blocking client of the test's server. Its calls' timeout is 10 s unless the module
    marks another: `pytestmark = pytest.mark.client_timeout(20)`."""
    mark = request.node.get_closest_marker("client_timeout")
    with BufferClient(target, timeout=mark.args[0] if mark else 10) as c:
        yield c


@pytest.fixture
def stub(target: str) -> Iterator[pb_grpc.ExperienceBufferStub]:
    """A raw stub of the test's server, for requests the client would not build."""
    with grpc.insecure_channel(target) as channel:
        yield pb_grpc.ExperienceBufferStub(channel)


@pytest.fixture(autouse=True)
def _held_ports() -> Iterator[None]:
    """The ports of the test's `expbuf serve` children that exited, let go at its end (helpers.ServerProcess)."""
    yield
    release_held_ports()


@pytest.fixture(autouse=True)
def _root_logging() -> Iterator[None]:
    """expbuf's stderr handler taken off the root logger at the test's end, and the root's level put
    back, where the test installed them: one that runs an expbuf command in this process
    (`cli.main`) has it configure logging as a command's process does (logs.configure, INFO). Left
    there, the lines of in-process servers' threads that come after their test (the advantage
    worker's start, logged once it has frozen what torch loaded) went to the worker's stderr,
    outside any test's capture, and into the run's output. pytest's own handlers, added and
    removed around each phase, are left to it."""
    root = logging.getLogger()
    before, level = set(root.handlers), root.level
    yield
    for handler in [h for h in root.handlers if h not in before and isinstance(h, logs._StderrHandler)]:
        root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture
def serve() -> Iterator[Callable[..., ServerProcess]]:
    """Starts `expbuf serve` children for one test (helpers.servers); those still running after it are killed."""
    with servers() as start:
        yield start


@pytest.fixture(scope="module")
def child_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One `expbuf serve` child that a module's tests share, each with tables of its own; it
    must exit cleanly on SIGTERM."""
    proc = ServerProcess(str(tmp_path_factory.mktemp("child") / "data"))
    yield proc
    assert proc.stop(signal.SIGTERM) == 0, "".join(proc.log)


@pytest.fixture(scope="module", autouse=True)
def _import_frameworks(request: pytest.FixtureRequest) -> None:
    """A module's frameworks (TorchRL, Trinity-RFT, verl, AReaL, TRL...) imported as its tests
    start, by its `import_frameworks()`, which binds them as the module's globals: at the module's
    import they cost every pytest-xdist worker, which collects every module, 9 s of CPU."""
    import_frameworks = getattr(request.module, "import_frameworks", None)
    if import_frameworks is not None:
        import_frameworks()


RAY_MODULES: set[Path] = set()  # the modules with a test that needs ray_cluster (pytest_collection_modifyitems)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    RAY_MODULES.update(item.path for item in items if "ray_cluster" in getattr(item, "fixturenames", ()))


@pytest.fixture(scope="module")
def ray_cluster() -> ModuleType:
    """A local Ray cluster of two CPUs, started for the first module that needs one and kept for
    the modules after it that need one too (a start takes seconds); `ray` itself. It is stopped
    when the next test is of a module that needs none (pytest_runtest_teardown), where its daemons
    would take CPU from every test left on the worker. Each test module stops what it started on it."""
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    return ray


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After a test's teardown (its module's too, where the module ends): the Ray cluster stopped
    if the next test runs in a module that needs none, or none follows."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized() and (nextitem is None or nextitem.path not in RAY_MODULES):
        ray.shutdown()
