"""lr-scaled (arXiv 2607.01083, docs/baselines.md): the multiplier by hand, the learning rate the optimizer actually
uses at s = 16 on SGD and AdamW, bit-identity with the base method at s = 0, and its composition rules."""

import lightning.pytorch as pl
import pytest
import torch
from conftest import make_trainer

from gacbench.callbacks import StalenessSimulator
from gacbench.methods import canonical_method, method_callbacks
from gacbench.objectives import NoisyQuadratic, SoftmaxBandit
from gacbench.stabilizers import StalenessLR, staleness_lr_scale
from gacbench.stabilizers.lr_scaled import staleness_bound


def test_the_multiplier_by_hand():
    # form "min": min(1, s0 / S); form "smooth": 1 / (1 + S / s0); exactly 1 at S = 0
    assert staleness_lr_scale(16) == 1 / 16
    assert staleness_lr_scale(16, 4.0) == 0.25
    assert staleness_lr_scale(2, 4.0) == 1.0  # below s0 the stale-rollout constraint does not bind
    assert staleness_lr_scale(16, 4.0, "smooth") == pytest.approx(1 / (1 + 16 / 4))
    assert staleness_lr_scale(0, 1.0) == 1.0 and staleness_lr_scale(0, 3.0, "smooth") == 1.0
    with pytest.raises(ValueError, match="form"):
        staleness_lr_scale(4, 1.0, "linear")
    with pytest.raises(ValueError, match="s0"):
        StalenessLR(s0=0.0)


class StepProbe(pl.Callback):
    """Records, at every optimizer step, the first group's rate and, per parameter, (before, gradient, after) of the
    step. List it last: it reads the parameters and the rate after the other callbacks' ``on_before_optimizer_step``
    (the simulator has put theta_t back by then)."""

    def __init__(self) -> None:
        self.lrs, self.steps, self._state = [], [], None

    def on_train_start(self, trainer, pl_module) -> None:
        trainer.optimizers[0].register_step_post_hook(self._after)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self.lrs.append(optimizer.param_groups[0]["lr"])
        self._state = [(p, p.detach().clone(), p.grad.detach().clone()) for p in params]

    def _after(self, optimizer, args, kwargs) -> None:
        self.steps += [(before, g, p.detach().clone()) for p, before, g in self._state]


@pytest.mark.parametrize("s0,form,hand", [(1.0, "min", 0.1 / 16), (4.0, "smooth", 0.1 / (1 + 16 / 4))])
def test_sgd_uses_the_scaled_rate_at_s16_and_the_base_rate_is_restored(s0, form, hand):
    model = NoisyQuadratic(dim=20, steps=6, lr=0.1, optimizer="sgd")
    probe = StepProbe()
    trainer = make_trainer([StalenessSimulator(16), StalenessLR(s0=s0, form=form), probe], max_steps=6)
    trainer.fit(model)
    assert probe.lrs == [pytest.approx(hand, rel=1e-12)] * 6  # the bound S = 16 from the first step (s_t = min(16, t))
    for before, g, after in probe.steps:  # SGD without momentum or decay: theta_{t+1} = theta_t - lr g
        assert torch.allclose(after, before - hand * g, rtol=0, atol=1e-6)
        assert not torch.allclose(after, before - 0.1 * g, rtol=0, atol=1e-6)
    assert trainer.optimizers[0].param_groups[0]["lr"] == 0.1
    assert trainer.logger.values("lr/staleness_scale") == [pytest.approx(hand / 0.1)]


def test_adamw_on_the_bandit_at_s16_through_the_method_name():
    model = SoftmaxBandit(steps=5, staleness=16, lr=0.05)
    probe = StepProbe()
    trainer = make_trainer(method_callbacks("lr-scaled") + [probe], max_steps=5)
    trainer.fit(model)
    assert probe.lrs == [0.05 / 16] * 5
    assert trainer.optimizers[0].param_groups[0]["lr"] == 0.05
    assert trainer.logger.values("lr/staleness_bound") == [16.0]


def _bandit_weights(callbacks, staleness):
    pl.seed_everything(0, verbose=False)
    model = SoftmaxBandit(steps=25, staleness=staleness)
    make_trainer(callbacks, max_steps=25).fit(model)
    return model.W.detach().clone()


def _quadratic_theta(callbacks):
    pl.seed_everything(0, verbose=False)
    model = NoisyQuadratic(dim=20, steps=25, optimizer="adamw", lr=0.05)
    make_trainer(callbacks, max_steps=25).fit(model)
    return model.theta.detach().clone()


def test_bit_identical_to_the_base_method_at_s0():
    assert torch.equal(_bandit_weights([StalenessLR()], 0), _bandit_weights([], 0))
    assert torch.equal(_quadratic_theta([StalenessLR(form="smooth")]), _quadratic_theta([]))
    # and wherever the rule leaves the rate alone: S <= s0 in the "min" form
    assert torch.equal(_bandit_weights([StalenessLR(s0=16.0)], 16), _bandit_weights([], 16))
    assert not torch.equal(_bandit_weights([StalenessLR()], 16), _bandit_weights([], 16))


def test_the_bound_comes_from_the_rollout_module_or_the_simulator():
    trainer = make_trainer([StalenessSimulator(8)])
    assert staleness_bound(trainer, NoisyQuadratic(steps=2)) == 8
    assert staleness_bound(make_trainer([]), NoisyQuadratic(steps=2)) == 0
    assert staleness_bound(make_trainer([]), SoftmaxBandit(steps=2, staleness=5)) == 5

    class Rollouts(torch.nn.Module):
        rollout_staleness = True
        staleness = 12  # GRPO's module keeps the bound as an attribute

    assert staleness_bound(make_trainer([]), Rollouts()) == 12


def test_composes_with_a_loss_side_stabilizer_and_gac_but_not_with_vcpo():
    model = SoftmaxBandit(steps=20, staleness=8)
    start = model.metric()
    trainer = make_trainer(method_callbacks("lr-scaled(s0=4.0)+gac+m2po"), max_steps=20)
    trainer.fit(model)
    assert model.metric() > start and trainer.logger.values("lr/staleness_scale") == [0.5]
    with pytest.raises(ValueError, match="compound"):
        make_trainer(method_callbacks("lr-scaled+vcpo"), max_steps=2).fit(SoftmaxBandit(steps=2, staleness=4))
    assert canonical_method("lr-scaled(s0=1,form='min')") == "lr-scaled"
