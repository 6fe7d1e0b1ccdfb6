"""``python -m tests.hf_scripts.forked WORLD OUT NAME...``: ``tests.hf_scripts.parallel`` on WORLD local ranks.

The ranks are copies of one interpreter that imported the Trainer stacks once (Note [forked ranks]), each given
the environment torchrun would give it; upstream's launchers themselves are run by the examples' tests.
"""

from __future__ import annotations

import os
import socket
import sys

from seqpar.runtime.spawn import spawn_ranks, start_method_for


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world_size: int, port: int, out: str, names: list[str]) -> None:
    from tests.hf_scripts.parallel import main

    torchrun = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world_size, "LOCAL_WORLD_SIZE": world_size}
    os.environ.update({k: str(v) for k, v in torchrun.items()}, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    main(out, names)


if __name__ == "__main__":
    import tests.hf_scripts.parallel  # noqa: F401
    from tests.hf_scripts import import_stacks

    import_stacks()  # before the ranks are forked: once for all of them
    world, out, names = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    spawn_ranks(_rank, world, _free_port(), out, names, backend=None, start_method=start_method_for("gloo"))
