"""How the local pool's worker processes start: forked from a fork server that has imported the cell code once.

A spawned worker starts a fresh interpreter and imports torch, Lightning (which pulls in torchmetrics,
transformers and scipy) and the cell code before its first cell: seconds of CPU per worker, paid by
every worker of every grid. On Linux the pool uses Python's ``forkserver`` start method instead: one
server process imports :data:`PRELOAD` (the modules a spawned worker imports before its first cell,
and nothing more) and forks each worker from itself, so that a grid pays the imports once rather than
once per worker. A forked worker runs the same code from the same imports as a spawned one (its cells'
numbers are the same, bit for bit); elsewhere the pool spawns (:data:`START_METHOD`).

``gacbench bench`` starts the server before it imports the runner (:func:`start_fork_server`), so that
the server's imports run beside the runner's own imports and its planning of the grid. This module
imports only the standard library, so that starting the server costs the command line nothing. The
server ends when the process that started it ends (it reads end-of-file on a pipe that process holds;
a server still importing finishes its imports first), and its workers end with it; until then it holds
its imports' memory (about 0.5 GB resident on the development machine, its pages shared with the workers
it forks).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from multiprocessing import get_context
from multiprocessing.context import BaseContext

#: the modules the fork server imports: those a spawned worker imports before its first cell (unpickling
#: its initializer, :func:`gacbench.bench.executors.init_worker`)
PRELOAD = ["gacbench.bench.executors"]

#: the pool's start method: a fork server on Linux, else spawn
START_METHOD = "forkserver" if sys.platform.startswith("linux") else "spawn"


def pool_context() -> BaseContext:
    """The multiprocessing context of the local pool (:data:`START_METHOD`), with the fork server's preload."""
    ctx = get_context(START_METHOD)
    if START_METHOD == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


def runner_pid() -> int | None:
    """This process's id when it is the parent of the pool's workers (they are spawned), else None (they are
    forked by the fork server): what :func:`gacbench.bench.executors.die_with_parent` compares with."""
    return os.getpid() if START_METHOD == "spawn" else None


def start_fork_server() -> None:
    """Start the fork server now if the pool uses one and it is not running yet (its imports run in the
    background), with SIGINT ignored: a Ctrl-C reaches the whole process group, the server ignores it only
    once its imports are done, and the runner stops the grid itself."""
    if START_METHOD != "forkserver":
        return
    pool_context()
    from multiprocessing import forkserver

    if threading.current_thread() is not threading.main_thread():
        forkserver.ensure_running()
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server inherits it across exec
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, previous)
