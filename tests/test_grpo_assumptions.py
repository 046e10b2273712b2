"""GRPO's side-effect-free loss_on, AssumptionMonitor on the GRPO workload, and the named model sizes."""

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from conftest import TINY_TASK, make_trainer  # noqa: E402

from gacbench import AssumptionMonitor  # noqa: E402
from gacbench.llm.grpo import GRPOModule  # noqa: E402
from gacbench.llm.model import MODEL_SIZES, sized_config  # noqa: E402


def grpo(model_dir, staleness=2, steps=6, **kw):
    return GRPOModule(model={"path": model_dir}, engine={"name": "hf"}, task=dict(TINY_TASK),
                      rollout={"prompts": 4, "group": 4, "max_tokens": 4}, staleness=staleness, lr=3e-4, steps=steps,
                      **kw)


@pytest.mark.parametrize("staleness", [0, 2])
def test_assumption_monitor_runs_on_grpo_and_logs_eta_max(tiny_llm_dir, staleness):
    m = grpo(tiny_llm_dir, staleness=staleness)
    trainer = make_trainer([AssumptionMonitor(every=2)], max_steps=6)
    trainer.fit(m)
    log = trainer.logger
    # estimates at steps 2 and 4: sigma^2 from the batches consumed at steps 1 and 0 (then 3 and 2) at theta_2,
    # L from the step-1 batch at theta_2 and theta_1
    assert [s for s, _ in log.series["assume/eta_max"]] == [2, 4]
    assert all(v > 0 and torch.isfinite(torch.tensor(v)) for v in log.values("assume/eta_max"))
    assert all(v > 0 for v in log.values("assume/sigma2")) and all(v > 0 for v in log.values("assume/L"))
    assert log.values("assume/staleness")[-1] == staleness


def test_loss_on_has_no_side_effects_and_matches_the_training_loss(tiny_llm_dir):
    m = grpo(tiny_llm_dir, staleness=2, steps=3)
    trainer = make_trainer([], max_steps=3)
    trainer.fit(m)
    before = (m.rollouts_made, m.engine.version, len(m.queue), m.queue.versions, sorted(m._consumed))
    logged = {k: len(v) for k, v in trainer.logger.series.items()}
    data = m._consumed[2][1]
    a, b = m.loss_on(data), m.loss_on([torch.tensor(3)])  # the loader batch of step 3 = the batch of step 2
    assert a.item() == pytest.approx(b.item()) and a.requires_grad
    assert a.item() == pytest.approx(m.policy_loss(data)[0].item())  # no loss-side stabilizer: the same loss
    assert (m.rollouts_made, m.engine.version, len(m.queue), m.queue.versions, sorted(m._consumed)) == before
    assert {k: len(v) for k, v in trainer.logger.series.items()} == logged
    with pytest.raises(ValueError, match="every >= 2"):
        m.loss_on([torch.tensor(1)])  # step 0's batch is no longer kept


@pytest.mark.filterwarnings("ignore:.*resuming from a checkpoint", "ignore:.*ckpt_path")
def test_assumption_monitor_on_grpo_after_a_resume_and_past_the_loaders_end(tiny_llm_dir, tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    # trainer.max_steps beyond the module's steps: the loader starts over; the estimates go on at every 2nd step
    m = grpo(tiny_llm_dir, steps=3)
    trainer = make_trainer([AssumptionMonitor(every=2)], max_steps=7)
    trainer.fit(m)
    assert [s for s, _ in trainer.logger.series["assume/sigma2"]] == [2, 4, 6]
    assert [s for s, _ in trainer.logger.series["assume/eta_max"]] == [2, 4, 6]
    # a resume: the loader starts again at its first item while the steps go on from the checkpoint's
    full = grpo(tiny_llm_dir, steps=8)
    checkpoints = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)
    first = make_trainer([AssumptionMonitor(every=2), checkpoints], max_steps=8, enable_checkpointing=True)
    first.fit(full)
    resumed = make_trainer([AssumptionMonitor(every=2)], max_steps=8)
    resumed.fit(grpo(tiny_llm_dir, steps=8), ckpt_path=str(next(tmp_path.glob("*step=4.ckpt"))))
    # the first estimate after the resume (step 4) has no earlier batch or iterate; step 6 pairs the batches
    # consumed at steps 5 and 4, as the uninterrupted run does. The logged sigma^2 is the running mean of the
    # samples (the checkpoint's: step 2's), so the uninterrupted run's samples are read off its means
    m2, m4, m6 = first.logger.values("assume/sigma2")
    assert [s for s, _ in resumed.logger.series["assume/sigma2"]] == [6]
    assert resumed.logger.values("assume/sigma2") == [pytest.approx((m2 + (3 * m6 - 2 * m4)) / 2, rel=1e-5)]


def test_grpo_refuses_gradient_accumulation(tiny_llm_dir):
    with pytest.raises(ValueError, match="GRPOModule: accumulate_grad_batches=2 must be 1"):
        make_trainer([], max_steps=2, accumulate_grad_batches=2).fit(grpo(tiny_llm_dir, steps=2))


def test_named_model_sizes():
    small = sized_config("small")
    assert (small.hidden_size, small.num_hidden_layers, small.head_dim) == (256, 6, 32)
    assert sized_config("tiny").to_dict() == sized_config().to_dict() and set(MODEL_SIZES) >= {"tiny", "small"}
    with pytest.raises(ValueError, match="model.size"):
        sized_config("huge")
