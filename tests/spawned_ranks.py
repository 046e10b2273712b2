"""Run a function on several spawned gloo ranks and collect what each returns.

Each rank's value travels through a multiprocessing queue whose feeder thread is flushed before the rank tears its
process group down: gloo can abort a process whose peer is still closing its connections, and a value still in
the feeder thread's buffer would then be lost with it. A rank that raises sends its traceback; a rank that dies
without a value is reported with its exit code as soon as it is seen, not after the whole timeout."""

from __future__ import annotations

import datetime
import queue as queue_module
import time
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def _rank_main(target, rank: int, world: int, rendezvous: str, args: tuple, timeout_s: float, results) -> None:
    try:
        dist.init_process_group("gloo", init_method="file://" + rendezvous, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        results.put((rank, True, target(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - the parent reports it
        results.put((rank, False, traceback.format_exc()))
    results.close()
    results.join_thread()  # the value is in the pipe before anything below can end the process
    if dist.is_initialized():
        dist.destroy_process_group()


def run_ranks(target, world: int, rendezvous: str, args: tuple = (), timeout_s: float = 240.0) -> list:
    """`target(rank, world, *args)` on `world` spawned processes joined in one gloo group by the file
    `rendezvous`; returns the values by rank. `target` must be importable by name (a module-level function)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(target, r, world, rendezvous, args, timeout_s, results))
             for r in range(world)]
    for p in procs:
        p.start()
    values, deadline, gone_since, finished = {}, time.monotonic() + timeout_s, {}, False
    try:
        while len(values) < world:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue_module.Empty:
                now = time.monotonic()
                for r, p in enumerate(procs):
                    if r not in values and p.exitcode is not None:
                        gone_since.setdefault(r, now)
                        if now - gone_since[r] > 5.0:  # its value, if any, would have arrived by now
                            raise AssertionError(f"rank {r} of {world} ended with exit code {p.exitcode} and "
                                                 f"returned nothing (ranks returned: {sorted(values)})") from None
                if now > deadline:
                    raise AssertionError(f"ranks {sorted(set(range(world)) - set(values))} of {world} returned "
                                         f"nothing within {timeout_s:.0f} s") from None
                continue
            if not ok:
                codes = [p.exitcode for p in procs]  # a rank that died first shows here, its peer raising
                raise AssertionError(f"rank {rank} of {world} raised (exit codes so far: {codes}):\n{value}")
            values[rank] = value
        finished = True
    finally:  # a rank that failed leaves the others waiting in a collective: end them all
        for p in procs:
            p.join(timeout=30 if finished else 0)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    return [values[r] for r in range(world)]
