"""Distributed behaviour on CPU with gloo: every DDP rank takes the same decisions; the sharded
(FSDP-style) all-reduce of the three scalars gives the full-vector cosine and projection."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from spawned_ranks import run_ranks

from gacbench.functional.alignment import alignment_scalars, cosine_from_scalars
from gacbench.functional.gac import GACTransform

HERE = os.path.dirname(__file__)
pytestmark = pytest.mark.distributed


def test_ddp_ranks_take_the_same_decisions(tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, os.path.join(HERE, "ddp_script.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["world"] == r1["world"] == 2
    # same lag, cosine, projections and skips on both ranks, and the same AssumptionMonitor estimates (of the
    # global batch's gradients)
    assert r0["rows"] == r1["rows"]
    assert {"assume/sigma2", "assume/L", "assume/eta_max"} <= set(r0["rows"][-1]["assume"])
    for row in r0["rows"]:  # callback_metrics carry this step's values on every rank
        assert row["metric_cos"] == row["cos"] and row["metric_lag"] == row["lag"]
    assert r0["params"] == r1["params"]
    assert len({row["lag"] for row in r0["rows"][3:]}) > 1  # the uniform schedule varied


def _sharded_worker(rank: int, world: int) -> tuple:
    gen = torch.Generator().manual_seed(0)
    prev, cur = torch.randn(40, generator=gen), torch.randn(40, generator=gen)
    cur = cur + 0.8 * prev  # strongly aligned: GAC projects
    shard = slice(rank * 20, (rank + 1) * 20)

    def reduce(t):
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    p = torch.nn.Parameter(torch.zeros(20))
    gac = GACTransform(c_low=0.05, c_high=0.3)
    for g in (prev, cur):
        p.grad = g[shard].clone()
        out = gac.step([p], reduce=reduce, swap=False)
    return out.decision.cos, p.grad.tolist()  # plain lists: no shared memory outliving the worker


def test_sharded_scalars_match_the_full_vector(tmp_path):
    rendezvous = str(tmp_path / "rendezvous")  # a file, not a port another process could take meanwhile
    results = run_ranks(_sharded_worker, 2, rendezvous)
    gen = torch.Generator().manual_seed(0)
    prev, cur = torch.randn(40, generator=gen), torch.randn(40, generator=gen)
    cur = cur + 0.8 * prev
    full = GACTransform(c_low=0.05, c_high=0.3)
    q = torch.nn.Parameter(torch.zeros(40))
    for g in (prev, cur):
        q.grad = g.clone()
        out = full.step([q], swap=False)
    assert results[0][0] == pytest.approx(out.decision.cos, rel=1e-6) == results[1][0]
    assert out.decision.changed
    torch.testing.assert_close(torch.tensor(results[0][1] + results[1][1]), q.grad)
    assert cosine_from_scalars(alignment_scalars([cur], [prev])) == pytest.approx(out.decision.cos, rel=1e-6)


def _dtensor_lowp_worker(rank: int, world: int) -> tuple:
    """One rank: GAC(kernels="fused-adamw") with a bfloat16 reference on FSDP2's DTensor parameters."""
    import warnings

    from torch.distributed.fsdp import fully_shard

    from gacbench.functional import kernels

    torch.manual_seed(0)
    net = fully_shard(torch.nn.Linear(6, 3))
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.1)
    gac = GACTransform(c_low=0.05, c_high=0.3, kernels="fused-adamw", buffer_dtype="bfloat16")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(3):
            optimizer.zero_grad()
            net(torch.randn(4, 6)).square().mean().backward()
            gac.step(list(net.parameters()), keep_alias=True, optimizer=optimizer)
            optimizer.step()
    return list(kernels._FAILED), [str(w.message)[:200] for w in caught if "compile" in str(w.message)]


def test_fused_adamw_with_a_bfloat16_reference_runs_eager_on_dtensor_parameters(tmp_path):
    """Its compiled update is for plain tensors: on DTensor shards it is not tried (a failed compile would warn
    and turn the compiled kernels off for the rest of the process)."""
    [(failed, warned)] = run_ranks(_dtensor_lowp_worker, 1, str(tmp_path / "rendezvous"))
    assert failed == [] and warned == []


_RELEASE_SCRIPT = """
import atexit, os, sys
import torch.distributed as dist
from gacbench.functional.collective import release_process_group_at_exit

atexit.register(lambda: print("initialized at exit:", dist.is_available() and dist.is_initialized(), flush=True))
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
release_process_group_at_exit()
release_process_group_at_exit()  # registered once
if sys.argv[2] == "destroyed-by-user":
    dist.destroy_process_group()
"""


@pytest.mark.parametrize("case", ["left-open", "destroyed-by-user"])
def test_the_process_group_is_destroyed_at_exit_while_the_interpreter_is_whole(tmp_path, case):
    """A gloo group left open at exit can abort a finished DDP run (SIGABRT in finalization); the atexit
    handler destroys it first, and is a no-op when the user already did."""
    proc = subprocess.run([sys.executable, "-c", _RELEASE_SCRIPT, str(tmp_path / "store"), case], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "initialized at exit: False"


# M2PO's Algorithm 1 over the whole update's batch: (log r) per token, A = +1 (every r > 1 token is in the trust
# region). Trust-region (log r)^2: five .09, five .01, one .0025 (the -0.3 token is outside), mean .0457 > .035;
# one argmax at a time the mean falls to .0413, .0358, .0291: three of the five tied .09 go, the first three in
# batch order, (0, 1), (1, 0) on rank 0 and (2, 0) on rank 1. Masking them together drops all five.
M2PO_LOG_R = [[0.1, 0.3, 0.1], [0.3, 0.1, -0.3], [0.3, 0.3, 0.1], [0.1, 0.3, 0.05]]
M2PO_SPLIT = [[True, False, True], [False, True, True], [False, True, True], [True, True, True]]
M2PO_TOGETHER = [[True, False, True], [False, True, True], [False, False, True], [True, False, True]]


def _m2po_worker(rank: int, world: int) -> dict:
    from gacbench.stabilizers.m2po import m2po_mask, m2po_mask_areal

    lr = torch.tensor(M2PO_LOG_R, dtype=torch.float64)[2 * rank: 2 * rank + 2]
    ones = torch.ones_like(lr)
    masks = {ties: m2po_mask(lr, ones, ones.bool(), 0.035, ties=ties).tolist() for ties in ("split", "together")}
    masks["areal"] = m2po_mask_areal(lr**2, ones.bool(), 0.035).tolist()
    return masks


@pytest.mark.slow  # two spawned processes that import torch and gacbench: 30-55 s on a loaded 2-core machine
def test_m2po_masks_over_the_batch_of_all_ranks_with_ties_in_rank_order(tmp_path):
    from gacbench.stabilizers.m2po import m2po_mask, m2po_mask_areal

    lr = torch.tensor(M2PO_LOG_R, dtype=torch.float64)
    ones = torch.ones_like(lr)
    assert m2po_mask(lr, ones, ones.bool(), 0.035).tolist() == M2PO_SPLIT
    assert m2po_mask(lr, ones, ones.bool(), 0.035, ties="together").tolist() == M2PO_TOGETHER
    # AReaL's rule over all 12 tokens (the -0.3 token counts too): sum .5925, mean .0494; dropping the six tied .09
    # in stable sort order gives .0457, .0413, .0358, .0291 < .035: four go, the first four .09 in batch order,
    # three of them on rank 0 (each rank alone would drop (0, 1), (1, 0) and (2, 0), (2, 1))
    areal = m2po_mask_areal(lr**2, ones.bool(), 0.035).tolist()
    assert areal == [[True, False, True], [False, True, False], [False, True, True], [True, True, True]]
    m0, m1 = run_ranks(_m2po_worker, 2, str(tmp_path / "rendezvous"))
    assert m0["split"] + m1["split"] == M2PO_SPLIT
    assert m0["together"] + m1["together"] == M2PO_TOGETHER
    assert m0["areal"] + m1["areal"] == areal
