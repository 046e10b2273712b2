"""GRPOModule with the HF engine on the tiny warm-started model: exact lag, behaviour log-probs,
weight sync every step, loss-side and gradient-side stabilizers, exact resume, errors."""

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from conftest import make_trainer  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from gacbench import GAC  # noqa: E402
from gacbench.llm.engines import sequence_logprobs  # noqa: E402
from gacbench.llm.grpo import GRPOModule  # noqa: E402
from gacbench.llm.model import tiny_config  # noqa: E402
from gacbench.llm.task import ArithmeticTask  # noqa: E402
from gacbench.llm.warmstart import warm_started_dir  # noqa: E402
from gacbench.stabilizers import M2PO  # noqa: E402

TASK = dict(max_ops=1, max_operand=4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    cfg = tiny_config(hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128)
    return str(warm_started_dir(cfg, ArithmeticTask(**TASK), steps=60, cache_dir=tmp_path_factory.mktemp("llm")))


def module(model_dir, **kw):
    args = dict(staleness=0, prompts=4, group=4, max_tokens=4, lr=3e-4, steps=8, **TASK)
    args.update(kw)
    return GRPOModule(model_dir, **args)


def test_consumed_batch_is_exactly_s_versions_old_and_engine_follows(model_dir):
    m = module(model_dir, staleness=3)
    trainer = make_trainer([], max_steps=8)
    trainer.fit(m)
    assert trainer.logger.values("stale/lag") == [min(3, t) for t in range(8)]
    assert m.engine.version == 8  # synced after every optimizer step
    assert max(abs(x) for x in trainer.logger.values("is/engine_mismatch_kl")) < 1e-5


def test_behaviour_log_probs_are_the_trainers_at_generation_time(model_dir):
    m = module(model_dir)
    make_trainer([], max_steps=1).fit(m)
    data = m.rollout()
    packed = data["packed"]
    for i in range(3):
        p = int(packed["prompt_len"][i])
        n = int(packed["mask"][i].sum())
        ids = packed["ids"][i, : p + n].tolist()
        ref = sequence_logprobs(m.policy, ids[:p], ids[p:])
        assert torch.allclose(data["logp_behav"][i, :n], ref, atol=1e-5)
        assert torch.allclose(data["engine_logp"][i, :n], ref, atol=1e-4)


def test_synchronous_ratio_is_one_and_nothing_is_clipped(model_dir):
    trainer = make_trainer([], max_steps=4)
    trainer.fit(module(model_dir))
    assert trainer.logger.values("is/ratio_mean") == pytest.approx([1.0] * 4, abs=1e-5)
    assert trainer.logger.values("pg/clipfrac") == [0.0] * 4


def test_gac_and_m2po_act_in_grpo(model_dir):
    trainer = make_trainer([GAC(warmup=0), M2PO()], max_steps=6)
    trainer.fit(module(model_dir, staleness=2))
    assert len(trainer.logger.values("m2po/m2")) == 6 and len(trainer.logger.values("align/cos")) == 5


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`", "ignore:You're resuming from a checkpoint")
def test_resume_in_the_middle_of_a_stale_run_is_exact(model_dir, tmp_path):
    full = module(model_dir, staleness=2)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)
    make_trainer([ckpt], max_steps=8, enable_checkpointing=True).fit(full)
    resumed = module(model_dir, staleness=2)
    trainer = make_trainer([], max_steps=8)
    trainer.fit(resumed, ckpt_path=next(tmp_path.glob("*step=4.ckpt")))
    assert trainer.logger.values("stale/lag") == [2, 2, 2, 2]
    for a, b in zip(full.policy.parameters(), resumed.policy.parameters()):
        assert torch.equal(a, b)


def test_bad_settings_are_refused(model_dir, tmp_path):
    with pytest.raises(ValueError, match="engine"):
        module(model_dir, engine="sglang")
    with pytest.raises(ValueError, match="staleness"):
        module(model_dir, staleness=-1)
    with pytest.raises(FileNotFoundError, match="not a local Hugging Face checkpoint"):
        module(str(tmp_path / "missing"))


def test_grpo_cells_run_through_the_bench_runner_with_their_engine(model_dir, tmp_path):
    from gacbench.bench.report import build_report
    from gacbench.bench.runner import run_grid

    base = {"task": "arith", "objective": "grpo", "steps": 4, "warmup": 0,
            "params": dict(model_path=model_dir, engine="hf", prompts=4, group=4, max_tokens=4, eval_every=2, eval_size=8, **TASK)}
    cells = [{**base, "method": "sync", "staleness": 0, "seed": 0}, {**base, "method": "gac", "staleness": 2, "seed": 0}]
    assert run_grid(cells, tmp_path)["failed"] == 0
    summary = build_report(tmp_path, cells)["summary"]
    assert {c["engine"] for c in summary["cells"]} == {"hf"}
    assert all(c["metric"] == "acc" and 0.0 <= c["final"] <= 1.0 for c in summary["cells"])
