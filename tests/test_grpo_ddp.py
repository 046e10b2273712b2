"""GRPO across processes: under Lightning DDP (gloo, CPU, 2 processes) each rank generates its share of the prompts
with its own engine, and one optimizer step equals the single-process step on the same global batch: the loss,
the logged reward, the gradients after the all-reduce, GAC's c_t and the updated parameters (tolerance: float32
summation order, rtol 1e-4 / atol 1e-6). Also: the FSDP GPU configuration parses and is consistent."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("transformers")

import torch  # noqa: E402

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
from grpo_ddp_script import STEPS, settings  # noqa: E402

from gacbench.functional.alignment import alignment_scalars, cosine_from_scalars  # noqa: E402
from gacbench.llm.grpo import GRPOModule  # noqa: E402
from gacbench.rollout.engines import Rollout  # noqa: E402
from gacbench.stabilizers import GSPO, MIS  # noqa: E402

RTOL, ATOL = 1e-4, 1e-6


@pytest.mark.distributed
@pytest.mark.parametrize("agg,method", [("token-mean", "none"), ("seq-mean-token-mean", "none"), ("token-mean", "mis"),
                                        ("seq-mean-token-mean", "mis"), ("token-mean", "gspo")])
def test_a_ddp_grpo_step_equals_the_single_process_step_on_the_global_batch(tiny_llm_dir, tmp_path, agg, method):
    """With ``mis`` the ranks reject different numbers of tokens and sequences (grpo_ddp_script.py): the loss over
    the kept tokens of both ranks is still the single process's. ``gspo`` aggregates over sequences while the
    module's token-mean scales the ranks by their tokens."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, os.path.join(HERE, "grpo_ddp_script.py"), str(tmp_path), tiny_llm_dir, agg,
                           method],
                          capture_output=True, text=True, timeout=400, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["world"] == r1["world"] == 2
    for a, b in zip(r0["params"], r1["params"]):  # DDP kept the replicas identical
        assert torch.equal(a, b)

    # the single-process reference replays the global batches (rank 0's prompts, then rank 1's) from the same start
    m = GRPOModule(**settings(tiny_llm_dir, agg))
    m.loss_stabilizer = {"mis": MIS(), "gspo": GSPO()}.get(method)
    opt = torch.optim.AdamW(m.policy.parameters(), lr=m.lr, weight_decay=0.0)
    grads = []
    for t in range(STEPS):
        shares = [r0["rollouts"][t], r1["rollouts"][t]]
        # each rank generated its own contiguous half of step t's prompts, group by group
        for rank, share in enumerate(shares):
            prompts = [ids for ids, _, _ in share[::4]]
            want = [m.tok.encode(p.prompt, add_special_tokens=False)
                    for p in m.task.batch("train", t * 8, 8)[rank * 4 : (rank + 1) * 4]]
            assert prompts == want
        flat = [Rollout(list(p), list(c), list(lp), t) for share in shares for p, c, lp in share]
        rewards = torch.cat([r0["rewards"][t], r1["rewards"][t]])
        packed = m._pack(flat)
        engine_lp = torch.zeros(packed["mask"].shape)
        for i, x in enumerate(flat):
            engine_lp[i, : len(x.logprobs)] = torch.tensor(x.logprobs)
        data = {"packed": packed, "logp_behav": None, "engine_logp": engine_lp, "logp_ref": None,
                "adv": m.advantages(rewards).reshape(-1), "rewards": rewards}
        opt.zero_grad()
        loss, metrics = m.policy_loss(data)
        if method == "mis":  # rank 0 rejected a quarter of the global batch's sequences
            assert float(metrics["mis/masked_frac"]) > 0
        loss.backward()
        # the loss: the mean of the ranks' (scaled) losses is the global batch's loss
        assert (r0["losses"][t] + r1["losses"][t]) / 2 == pytest.approx(loss.item(), rel=RTOL, abs=ATOL)
        # the logged scalars are the global batch's, the same on both ranks: the reward and the response length
        # (means over the sequences, which the ranks share equally) and the largest ratio
        assert r0["logged"][t] == r1["logged"][t]
        logged = r0["logged"][t]
        assert logged["reward/mean"] == pytest.approx(float(rewards.mean()), rel=1e-12)
        assert logged["response/tokens_mean"] == pytest.approx(float(packed["mask"].sum(-1).float().mean()))
        assert logged["is/ratio_max"] == pytest.approx(float(metrics["is/ratio_max"]), rel=RTOL, abs=ATOL)
        g = [p.grad.detach().clone() for p in m.policy.parameters()]
        assert sum(float(x.abs().sum()) for x in g) > 0  # the step has a gradient to compare
        for ddp, ref in zip(r0["grads"][t], g):  # after the all-reduce, before GAC
            torch.testing.assert_close(ddp, ref, rtol=RTOL, atol=ATOL)
        grads.append(g)
        opt.step()
    # (step 1's gradients equal, so step 0's updates were equal)
    # GAC's c_t at step 1: the cosine of the all-reduced gradients, equal on both ranks and to the single process's
    cos = cosine_from_scalars(alignment_scalars(grads[1], grads[0]))
    assert len(r0["cos"]) == len(r1["cos"]) == 1
    assert r0["cos"] == r1["cos"]
    assert r0["cos"][0] == pytest.approx(cos, rel=1e-4, abs=1e-6)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_stale_ddp_run_resumed_from_a_checkpoint_continues_exactly(tiny_llm_dir, tmp_path):
    """Each rank's queue holds its own rollouts while Lightning writes the checkpoint from rank 0: every rank's
    queue goes into it, and on resume each rank trains on its own batches again (grpo_ddp_resume_script.py)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, os.path.join(HERE, "grpo_ddp_resume_script.py"), str(tmp_path),
                           tiny_llm_dir], capture_output=True, text=True, timeout=400, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        r = torch.load(tmp_path / f"resume{rank}.pt", weights_only=False)
        assert sorted(r["resumed_losses"]) == [4, 5, 6]
        assert all(r["resumed_losses"][t] == r["full_losses"][t] for t in (4, 5, 6))
        for a, b in zip(r["full"], r["resumed"]):
            assert torch.equal(a, b)
    queue = torch.load(next(tmp_path.glob("*step=3.ckpt")), weights_only=False)["rollout_queue"]
    assert len(queue["by_rank"]) == 2
    first = [q["items"][0][1]["packed"]["ids"] for q in queue["by_rank"]]  # (version, batch): each rank's own
    assert not torch.equal(*first)


def test_the_fsdp_gpu_config_is_the_gpu_config_sharded_over_its_devices():
    """tasks/llm/qwen3-1.7b-fsdp-gpu.yaml (parsed, not run: no GPU here): its strategy builds as Lightning's
    FSDPStrategy wrapping each Qwen3 decoder layer, the prompts split evenly over the ranks, and apart from the
    documented differences it is tasks/llm/qwen3-1.7b-gpu.yaml."""
    from jsonargparse import ArgumentParser
    from lightning.pytorch.strategies import FSDPStrategy
    from torch.distributed.fsdp import ShardingStrategy
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    root = Path(HERE).parent / "tasks" / "llm"
    fsdp = yaml.safe_load((root / "qwen3-1.7b-fsdp-gpu.yaml").read_text())
    single = yaml.safe_load((root / "qwen3-1.7b-gpu.yaml").read_text())
    parser = ArgumentParser()
    parser.add_argument("--strategy", type=FSDPStrategy)
    strategy = parser.instantiate(parser.parse_object({"strategy": fsdp["trainer"]["strategy"]})).strategy
    assert isinstance(strategy, FSDPStrategy) and strategy.sharding_strategy == ShardingStrategy.FULL_SHARD
    assert Qwen3DecoderLayer in strategy.kwargs["auto_wrap_policy"]._module_classes
    devices = fsdp["trainer"]["devices"]
    assert devices > 1 and fsdp["model"]["rollout"]["prompts"] % devices == 0  # each rank its share of the prompts
    assert fsdp["trainer"]["accelerator"] == "gpu" and fsdp["model"]["engine"]["name"] == "hf"
    for section in ("task", "loss"):
        assert fsdp["model"][section] == single["model"][section]
    # the strategy's activation checkpointing (each decoder layer) in place of transformers'
    assert single["model"]["model"].pop("gradient_checkpointing") is True
    assert fsdp["model"]["model"] == single["model"]["model"]
    differ = {k for k in fsdp["model"]["rollout"] if fsdp["model"]["rollout"][k] != single["model"]["rollout"][k]}
    assert differ == {"prompts"}
    assert {k: v for k, v in fsdp["trainer"].items() if k not in ("strategy", "devices", "num_nodes", "logger")} == \
        {k: v for k, v in single["trainer"].items() if k not in ("devices", "logger")}


def test_the_step_scalars_of_the_ranks_are_combined_into_one_value_per_key(monkeypatch):
    """metrics_over_ranks, with the all-gather stubbed to three ranks' values: a *_max key is the largest, a
    *_min key the smallest, another key the mean over the ranks that report it, a NaN on any rank NaN; one
    process's scalars pass unchanged."""
    import math
    from types import SimpleNamespace

    from gacbench.llm import data_parallel

    ranks = [{"reward/mean": 0.25, "is/ratio_max": 1.5, "gap_min": -0.1, "is/chi2": 0.1, "time/generate_s": 1.0},
             {"reward/mean": 0.75, "is/ratio_max": 3.0, "gap_min": -0.4, "is/chi2": float("nan"), "only/here": 2.0},
             {"reward/mean": 0.5, "is/ratio_max": 2.0, "gap_min": -0.2, "is/chi2": 0.3, "time/generate_s": 3.0}]

    def gather(out, local):
        assert local == {k: float(v) for k, v in mine.items()}
        out[:] = ranks

    module = SimpleNamespace(_trainer=SimpleNamespace(global_rank=0, world_size=3))
    monkeypatch.setattr(torch.distributed, "all_gather_object", gather)
    mine = {**ranks[0], "reward/mean": torch.tensor(0.25)}
    out = data_parallel.metrics_over_ranks(module, mine)
    assert out["reward/mean"] == pytest.approx(0.5) and out["is/ratio_max"] == 3.0 and out["gap_min"] == -0.4
    assert math.isnan(out["is/chi2"]) and out["time/generate_s"] == pytest.approx(2.0) and out["only/here"] == 2.0
    assert list(out)[:5] == list(mine)  # this rank's keys first, in its order
    one = {"reward/mean": 0.3}
    assert data_parallel.metrics_over_ranks(SimpleNamespace(_trainer=None), one) is one


def test_each_rank_takes_its_own_share_of_the_prompts_and_its_own_seed_stream():
    """Two ranks of 8 prompts: rank 0 the first 4 with offset 0 (the one-process stream), rank 1 the last 4 with the
    stride; one process keeps every prompt and offset 0."""
    from types import SimpleNamespace

    from gacbench.llm.data_parallel import RANK_SEED_STRIDE, rank_share

    def module(rank, world):
        return SimpleNamespace(_trainer=SimpleNamespace(global_rank=rank, world_size=world))

    assert [rank_share(module(r, 2), list(range(8))) for r in (0, 1)] == [([0, 1, 2, 3], 0),
                                                                           ([4, 5, 6, 7], RANK_SEED_STRIDE)]
    assert rank_share(module(0, 1), list(range(8))) == (list(range(8)), 0)


def test_a_nan_on_any_rank_of_a_max_or_min_key_is_nan(monkeypatch):
    """The NaN comes from the second rank, on the keys that take the largest and the smallest value."""
    import math
    from types import SimpleNamespace

    from gacbench.llm import data_parallel

    ranks = [{"is/ratio_max": 1.0, "gap_min": 1.0}, {"is/ratio_max": math.nan, "gap_min": math.nan}]
    monkeypatch.setattr(torch.distributed, "all_gather_object", lambda out, local: out.__setitem__(slice(None), ranks))
    out = data_parallel.metrics_over_ranks(SimpleNamespace(_trainer=SimpleNamespace(global_rank=0, world_size=2)),
                                           ranks[0])
    assert math.isnan(out["is/ratio_max"]) and math.isnan(out["gap_min"])
