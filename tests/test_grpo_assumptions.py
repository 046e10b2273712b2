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
    data = m._consumed[2]
    a, b = m.loss_on(data), m.loss_on([torch.tensor(3)])  # the loader batch of step 3 = the batch of step 2
    assert a.item() == pytest.approx(b.item()) and a.requires_grad
    assert a.item() == pytest.approx(m.policy_loss(data)[0].item())  # no loss-side stabilizer: the same loss
    assert (m.rollouts_made, m.engine.version, len(m.queue), m.queue.versions, sorted(m._consumed)) == before
    assert {k: len(v) for k, v in trainer.logger.series.items()} == logged
    with pytest.raises(ValueError, match="every >= 2"):
        m.loss_on([torch.tensor(1)])  # step 0's batch is no longer kept


def test_named_model_sizes():
    small = sized_config("small")
    assert (small.hidden_size, small.num_hidden_layers, small.head_dim) == (256, 6, 32)
    assert sized_config("tiny").to_dict() == sized_config().to_dict() and set(MODEL_SIZES) >= {"tiny", "small"}
    with pytest.raises(ValueError, match="model.size"):
        sized_config("huge")
