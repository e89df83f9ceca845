"""expbuf as a Trinity-RFT experience buffer (needs trinity-rft; `import expbuf.client` never loads this).

With TRINITY_PLUGIN_DIRS pointing at plugin_dir(), Trinity's own factories
`trinity.buffer.get_buffer_writer` and `get_buffer_reader` return ExpbufWriter and
ExpbufReader for a buffer whose path is `expbuf://HOST:PORT/TABLE`, ExpbufTaskset for a
taskset whose path names a dataset of prompts (`?dataset=NAME&source=PATH`), and Trinity's
for any other path; the advantage function `expbuf` takes the buffer's advantages as they
are, the sample strategy `expbuf` tells the buffer the trainer's policy version, and the data
selector `expbuf` picks a file taskset's tasks by an expbuf dataset's claim order (Trinity's
TasksetScheduler wrapped so that each step's feedback reaches it: scheduler.py).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from expbuf.client.kit.location import Location, is_expbuf_path, parse

from . import scheduler
from .advantage import ExpbufAdvantageFn
from .buffer import ExpbufReader, ExpbufWriter
from .sample_strategy import ExpbufSampleStrategy
from .selector import SELECTOR_NAME, ExpbufSelector
from .settings import is_taskset, refuse_taskset
from .taskset import ExpbufTaskset

__all__ = [
    "ExpbufAdvantageFn",
    "ExpbufReader",
    "ExpbufSampleStrategy",
    "ExpbufSelector",
    "ExpbufTaskset",
    "ExpbufWriter",
    "Location",
    "install",
    "is_expbuf_path",
    "parse",
    "plugin_dir",
]

ADVANTAGE_FN_NAME = "expbuf"
SAMPLE_STRATEGY_NAME = "expbuf"


def plugin_dir() -> str:
    """The directory to put in TRINITY_PLUGIN_DIRS (installed with expbuf)."""
    return str(Path(__file__).parent / "plugin")


def _routed(original: Callable[[Any], Any], expbuf_cls: type, taskset_cls: type | None) -> Callable[[Any], Any]:
    @functools.wraps(original)
    def factory(config: Any) -> Any:
        path = getattr(config, "path", None)
        if isinstance(path, str) and path.lower().startswith("expbuf:") and not is_expbuf_path(path):
            raise ValueError(f"buffer path {path[:80]!r} is not an expbuf path: expbuf://HOST:PORT/TABLE")
        if is_expbuf_path(path):
            from trinity.common.config import StorageConfig
            from trinity.common.constants import StorageType

            storage = config if isinstance(config, StorageConfig) else config.to_storage_config()
            if storage.storage_type not in {kind.value for kind in StorageType}:  # as Trinity's factories refuse it
                raise ValueError(f"{storage.storage_type} not supported.")
            if taskset_cls is not None and is_taskset(config):
                return taskset_cls(storage)
            refuse_taskset(config)
            return expbuf_cls(storage)
        return original(config)

    factory.__expbuf_original__ = original  # type: ignore[attr-defined]
    return factory


def install() -> None:
    """Route Trinity's buffer factories to expbuf for expbuf:// paths and register `expbuf`
    (an advantage function, a sample strategy and a taskset's data selector), whose feedback
    Trinity's TasksetScheduler gives at every step (scheduler.install).

    Trinity picks a writer by storage type in `get_buffer_writer` (no registry), and its
    modules hold the factories under their own names, often imported before plugins load;
    so every binding of the two factories in the loaded `trinity` modules is replaced by a
    wrapper that handles expbuf:// paths and calls Trinity's own function for any other.
    Modules imported later get the wrapper from `trinity.buffer.buffer`. Idempotent.
    """
    import trinity.buffer.buffer as factories
    from trinity.algorithm.advantage_fn import ADVANTAGE_FN
    from trinity.algorithm.sample_strategy import SAMPLE_STRATEGY
    from trinity.buffer.selector import SELECTORS

    if ADVANTAGE_FN_NAME not in ADVANTAGE_FN.modules:
        ADVANTAGE_FN.register_module(ADVANTAGE_FN_NAME, ExpbufAdvantageFn)
    if SAMPLE_STRATEGY_NAME not in SAMPLE_STRATEGY.modules:
        SAMPLE_STRATEGY.register_module(SAMPLE_STRATEGY_NAME, ExpbufSampleStrategy)
    if SELECTOR_NAME not in SELECTORS.modules:
        SELECTORS.register_module(SELECTOR_NAME, ExpbufSelector)
    scheduler.install()
    replace = {}
    for name, expbuf_cls, taskset_cls in (
        ("get_buffer_writer", ExpbufWriter, None),
        ("get_buffer_reader", ExpbufReader, ExpbufTaskset),
    ):
        current = getattr(factories, name)
        if not hasattr(current, "__expbuf_original__"):
            replace[current] = _routed(current, expbuf_cls, taskset_cls)
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").split(".")[0] != "trinity":
            continue
        namespace = vars(module)
        for name in ("get_buffer_writer", "get_buffer_reader"):
            for original, wrapper in replace.items():
                if namespace.get(name) is original:
                    namespace[name] = wrapper
