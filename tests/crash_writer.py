"""Child process of the crash test: writes through the store until it is killed.

After every put returns (the commit is durable), it prints the stored uids as one
JSON line, so the parent knows exactly what was acknowledged before the SIGKILL.
Usage: crash_writer.py DATA_DIR RUN_ID
"""

from __future__ import annotations

import copy
import json
import sys
import threading
from pathlib import Path

from expbuf.client import trxp
from expbuf.server.store import Store
from expbuf.server.store.schema.table_config import TableConfig

# A group of 8 made by Trinity-RFT; re-labelled per task so no torch import is needed here.
TEMPLATE = trxp.parse((Path(__file__).parent / "fixtures" / "trxp" / "grpo_group.trxp").read_bytes())


def group_items(batch: str, task: int, size: int) -> list[trxp.RawItem]:
    items = []
    for run in range(size):
        meta = copy.deepcopy(TEMPLATE[run].meta)
        meta["eid"].update(batch=batch, task=task, run=run)
        items.append(trxp.RawItem(meta, TEMPLATE[run].tensors))
    return items


def main(path: str, run: int) -> None:
    store = Store(path, map_size=256 << 10)
    store.create_table(TableConfig.of(name="g4", group_size=4), exist_ok=True)
    lock = threading.Lock()

    def writer(worker: int) -> None:
        task = 0
        while True:
            batch = f"{run}-{worker}"
            full = store.put("default", group_items(batch, task, 8))
            halves = [store.put("g4", group_items(batch, task, 4)[i : i + 2]) for i in (0, 2)]
            with lock:
                for result in (full, *halves):
                    print(json.dumps(result.stored), flush=True)
            task += 1

    threads = [threading.Thread(target=writer, args=(w,), daemon=True) for w in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
