"""Child process of the index-build kill test: opens a store whose table `t` lacks its lazy
indexes, so their builds start in the background, and pushes one group at a time meanwhile,
printing after each push (durable when it returns) the tasks pushed and the builds under way
as one JSON line, until it is killed.

Usage: index_build_child.py DATA_DIR FIRST_TASK
"""

from __future__ import annotations

import json
import sys

from expbuf.server.store import Store
from expbuf.server.store.core.ordering import ready as core_ready

from helpers import small_groups


def main(path: str, first: int) -> None:
    core_ready.BUILD_CHUNK = 32  # many chunks: the kill lands inside a build
    with Store(path) as store:
        task = first
        while True:
            store.put_entries("t", small_groups(task, 1))
            task += 1
            builds = [[build.index, build.indexed, build.ready] for build in store.index_builds()]
            print(json.dumps({"pushed": task, "builds": builds}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
