"""StalenessSimulator: the delayed gradient is exactly the gradient at theta_{t-s}; s = 0 is the identity."""

import copy
import math

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from conftest import UserRegressor, flat_params, make_trainer

from gacbench import StalenessSimulator
from gacbench.callbacks.staleness import staleness_schedule


class Recorder(pl.Callback):
    """Records, per optimizer step: the parameters the update is applied to (theta_t), the
    applied gradient, the batches of the accumulation window, and the simulator's lag."""

    def __init__(self, sim=None):
        self.sim, self.steps, self._batches = sim, [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._batches.append([b.clone() for b in batch])

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.steps.append({
            "theta": {n: p.detach().clone() for n, p in pl_module.named_parameters()},
            "grad": {n: p.grad.detach().clone() for n, p in pl_module.named_parameters()},
            "batches": self._batches,
            "lag": self.sim.lag if self.sim else 0,
        })
        self._batches = []


def grad_at(model: UserRegressor, theta: dict, batches, accumulate: int) -> dict:
    """The gradient a plain computation gets at parameters ``theta`` on ``batches``."""
    probe = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in probe.named_parameters():
            p.copy_(theta[n])
    probe.zero_grad()
    for batch in batches:
        (probe.loss_fn(batch) / accumulate).backward()
    return {n: p.grad.detach().clone() for n, p in probe.named_parameters()}


@pytest.mark.parametrize("schedule,s,accumulate",
                         [("fixed", 3, 1), ("uniform", 4, 1), ("fixed", 2, 3), ("uniform", 3, 2)])
def test_applied_gradient_is_the_gradient_at_theta_t_minus_s(schedule, s, accumulate):
    model = UserRegressor(n=96, batch_size=8, lr=0.05)
    sim = StalenessSimulator(s, schedule=schedule, seed=7)
    rec = Recorder(sim)
    make_trainer([sim, rec], max_steps=12, accumulate_grad_batches=accumulate).fit(model)
    lags = [st["lag"] for st in rec.steps]
    assert len(rec.steps) == 12
    for t, step in enumerate(rec.steps):
        lag = step["lag"]
        assert 0 <= lag <= min(s, t)
        if schedule == "fixed":
            assert lag == min(s, t)
        expected = grad_at(model, rec.steps[t - lag]["theta"], step["batches"], accumulate)
        for n in expected:
            torch.testing.assert_close(step["grad"][n], expected[n], rtol=1e-6, atol=1e-7)
    if schedule == "uniform":
        assert len(set(lags[s:])) > 1  # the schedule really varies


class WindowRecorder(Recorder):
    """Recorder that also keeps, for every micro-batch, the parameters its forward pass runs at."""

    def __init__(self, sim):
        super().__init__(sim)
        self._seen = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self._seen.append({n: p.detach().clone() for n, p in pl_module.named_parameters()})

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        super().on_before_optimizer_step(trainer, pl_module, optimizer)
        self.steps[-1]["seen"], self._seen = self._seen, []


@pytest.mark.parametrize("schedule,trace", [("fixed", None), ("uniform", None), ("trace", [0, 2, 1, 0, 2, 2, 1])])
def test_every_micro_batch_of_a_window_sees_the_same_stale_iterate(schedule, trace):
    """With accumulate_grad_batches=4 one s_t is drawn per optimizer step: all four micro-batches run at
    theta_{t-s_t}, and the accumulated gradient is the gradient there of the window's batches."""
    s, accumulate = 2, 4
    model = UserRegressor(n=128, batch_size=4, lr=0.05)
    sim = StalenessSimulator(s, schedule=schedule, seed=3, trace=trace)
    rec = WindowRecorder(sim)
    make_trainer([sim, rec], max_steps=14, accumulate_grad_batches=accumulate).fit(model)
    assert len(rec.steps) == 14
    lags = [step["lag"] for step in rec.steps]
    for t, step in enumerate(rec.steps):
        lag = step["lag"]
        assert 0 <= lag <= min(s, t)
        stale = rec.steps[t - lag]["theta"]
        assert len(step["seen"]) == len(step["batches"]) == accumulate
        for seen in step["seen"]:
            for n in stale:
                assert torch.equal(seen[n], stale[n]), (t, lag, n)
        expected = grad_at(model, stale, step["batches"], accumulate)
        for n in expected:
            torch.testing.assert_close(step["grad"][n], expected[n], rtol=1e-6, atol=1e-7)
    if schedule == "fixed":
        assert lags == [min(s, t) for t in range(14)]
    elif schedule == "trace":
        assert lags == [min(trace[t % len(trace)], t) for t in range(14)]
    else:  # the seeded draws: one per optimizer step, so the same seed replays the same lags
        rng = np.random.default_rng(3)
        assert lags == [staleness_schedule("uniform", s, t, rng) for t in range(14)]
        assert 0 in lags[s:] and len(set(lags[s:])) > 1


def test_optimizer_applies_the_stale_gradient_to_the_current_parameters():
    model = UserRegressor(lr=0.05)
    sim = StalenessSimulator(2)
    rec = Recorder(sim)
    make_trainer([sim, rec], max_steps=6).fit(model)
    for t in range(5):  # SGD: theta_{t+1} = theta_t - lr_group * g(theta_{t-s})
        for n in rec.steps[t]["theta"]:
            lr = 0.05 if n.startswith("net.0") else 0.025
            expected = rec.steps[t]["theta"][n] - lr * rec.steps[t]["grad"][n]
            torch.testing.assert_close(rec.steps[t + 1]["theta"][n], expected)


def test_zero_staleness_is_the_identity():
    plain, stale0 = UserRegressor(optimizer="adamw"), UserRegressor(optimizer="adamw")
    make_trainer([], max_steps=15).fit(plain)
    make_trainer([StalenessSimulator(0)], max_steps=15).fit(stale0)
    assert torch.equal(flat_params(plain), flat_params(stale0))


def test_stale_run_differs_from_plain_run():
    plain, stale = UserRegressor(), UserRegressor()
    make_trainer([], max_steps=10).fit(plain)
    make_trainer([StalenessSimulator(3)], max_steps=10).fit(stale)
    assert not torch.allclose(flat_params(plain), flat_params(stale))


@pytest.mark.parametrize("accumulate", [1, 2])
def test_lag_is_logged_every_step(accumulate):
    trainer = make_trainer([StalenessSimulator(3)], max_steps=8, accumulate_grad_batches=accumulate)
    trainer.fit(UserRegressor())
    assert trainer.logger.values("stale/lag") == [0, 1, 2, 3, 3, 3, 3, 3]
    synchronous = make_trainer([StalenessSimulator(0)], max_steps=8, accumulate_grad_batches=accumulate)
    synchronous.fit(UserRegressor())
    assert synchronous.logger.values("stale/lag") == [0] * 8  # once per optimizer step at s = 0 too


def test_schedules_stay_within_bounds():
    rng = np.random.default_rng(0)
    for t in range(50):
        assert staleness_schedule("fixed", 8, t, rng) == min(8, t)
        assert 0 <= staleness_schedule("uniform", 8, t, rng) <= min(8, t)
        assert staleness_schedule("trace", 8, t, rng, [5, 0, 8]) == min([5, 0, 8][t % 3], t)


@pytest.mark.parametrize("kwargs,match", [
    ({"staleness": -1}, "must be >= 0"),
    ({"staleness": 2.5}, "integer"),
    ({"staleness": 2, "schedule": "gaussian"}, "schedule"),
    ({"staleness": 2, "schedule": "trace"}, "needs trace"),
    ({"staleness": 2, "schedule": "trace", "trace": [1, 3]}, "outside 0..staleness"),
    ({"staleness": 3, "schedule": "trace", "trace": [2.9, 1]}, "trace\\[0\\]=2.9 must be an integer"),
    ({"staleness": 3, "schedule": "trace", "trace": [1, -1]}, "outside 0..staleness"),
    ({"staleness": 3, "schedule": "trace", "trace": [True, 2]}, "trace\\[0\\]=True must be an integer"),
    ({"staleness": 3, "schedule": "trace", "trace": [1, float("nan")]}, "trace\\[1\\]=nan must be an integer"),
])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        StalenessSimulator(**kwargs)


class ManualModule(UserRegressor):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(self.loss_fn(batch))
        opt.step()


def test_a_trace_may_be_a_numpy_array_of_lags():
    trace = np.array([0, 3, 1, 2])
    sim = StalenessSimulator(3, schedule="trace", trace=trace)
    assert sim.trace == [0, 3, 1, 2] and all(type(v) is int for v in sim.trace)
    trainer = make_trainer([sim], max_steps=8)
    trainer.fit(UserRegressor())
    assert trainer.logger.values("stale/lag") == [min(trace[t % 4], t) for t in range(8)]


def test_manual_optimization_is_refused():
    with pytest.raises(RuntimeError, match="automatic optimization"):
        make_trainer([StalenessSimulator(2)], max_steps=2).fit(ManualModule())


def test_bf16_mixed_precision_stays_exact():
    """Under bf16 autocast the applied gradient is the one an autocast computation gets at theta_{t-s}."""
    model = UserRegressor()
    sim = StalenessSimulator(2)
    rec = Recorder(sim)
    make_trainer([sim, rec], max_steps=6, precision="bf16-mixed").fit(model)
    assert [s["lag"] for s in rec.steps] == [0, 1, 2, 2, 2, 2]
    for t, step in enumerate(rec.steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = grad_at(model, rec.steps[t - step["lag"]]["theta"], step["batches"], 1)
        for n in expected:
            torch.testing.assert_close(step["grad"][n], expected[n], rtol=1e-6, atol=1e-7)
    assert torch.isfinite(flat_params(model)).all()


def test_clipping_applies_to_the_stale_gradient():
    """Lightning clips after on_before_optimizer_step: the update is theta_t - lr * clip(g(theta_{t-s}))."""
    model = UserRegressor(lr=0.05)
    sim = StalenessSimulator(2)
    rec = Recorder(sim)
    clip = 0.01
    make_trainer([sim, rec], max_steps=6, gradient_clip_val=clip).fit(model)
    for t in range(5):
        step = rec.steps[t]
        expected_grad = grad_at(model, rec.steps[t - step["lag"]]["theta"], step["batches"], 1)
        norm = math.sqrt(sum(float((g * g).sum()) for g in expected_grad.values()))
        assert norm > clip  # clipping really acts
        scale = clip / (norm + 1e-6)  # torch.nn.utils.clip_grad_norm_
        for n, theta in step["theta"].items():
            lr = 0.05 if n.startswith("net.0") else 0.025
            torch.testing.assert_close(rec.steps[t + 1]["theta"][n], theta - lr * scale * expected_grad[n])


class _StopAtBatch(pl.Callback):
    """Sets trainer.should_stop after micro-batch ``batch`` (what Lightning's Timer does when time is up)."""

    def __init__(self, batch: int) -> None:
        self.batch = batch

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.fit_loop.total_batch_idx == self.batch:
            trainer.should_stop = True


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_fit_stopped_inside_an_accumulation_window_ends_at_theta_t(tmp_path, checkpointing):
    # micro-batch 21 is the second of step 5's window of 4: the model holds theta_{5-3} when the stop comes
    model, sim = UserRegressor(n=256, batch_size=4), StalenessSimulator(3)
    thetas = []
    trainer = make_trainer([sim, _StopAtBatch(21)], max_steps=50, accumulate_grad_batches=4,
                           enable_checkpointing=checkpointing, default_root_dir=tmp_path)
    model.on_train_start = lambda: trainer.optimizers[0].register_step_post_hook(
        lambda *a: thetas.append(flat_params(model).clone()))
    trainer.fit(model)  # with a ModelCheckpoint: its save at the epoch's end sees theta_t, not a window
    assert trainer.global_step == 5 and sim.step == 5
    assert torch.equal(flat_params(model), thetas[-1])


def test_a_simulator_reused_for_a_new_fit_starts_that_fit_at_t_0():
    sim = StalenessSimulator(3)
    make_trainer([sim], max_steps=6).fit(UserRegressor(seed=0))
    second, fresh = UserRegressor(seed=1), UserRegressor(seed=1)
    trainer = make_trainer([sim], max_steps=5)
    trainer.fit(second)
    assert trainer.logger.values("stale/lag") == [0, 1, 2, 3, 3]
    make_trainer([StalenessSimulator(3)], max_steps=5).fit(fresh)  # no iterate of the first model is used
    assert torch.equal(flat_params(second), flat_params(fresh))


@pytest.mark.parametrize("objective", ["bandit", "sequence"])
def test_a_rollout_objective_refuses_gradient_accumulation(objective):
    # its queue would advance k times a step: about s / k staleness, every batch of a step on the same rollouts
    from gacbench.objectives import objective_class

    model = objective_class(objective)(steps=8, staleness=4)
    with pytest.raises(ValueError, match="accumulate_grad_batches=2 must be 1 .*make each step's batch larger"):
        make_trainer([], max_steps=8, accumulate_grad_batches=2).fit(model)
    trainer = make_trainer([], max_steps=8)
    trainer.fit(objective_class(objective)(steps=8, staleness=4))
    assert trainer.logger.values("stale/lag") == [0, 1, 2, 3, 4, 4, 4, 4]


class WithExtra(UserRegressor):
    """A module with a parameter the optimizer leaves out until a callback adds it as a new param group."""

    def __init__(self, optimizer: str = "sgd"):
        super().__init__(optimizer=optimizer)
        self.extra = torch.nn.Parameter(torch.zeros(1))

    def loss_fn(self, batch):
        return super().loss_fn(batch) + (self.extra - 1.0).pow(2).sum()


class AddGroupAt(pl.Callback):
    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step and len(trainer.optimizers[0].param_groups) == 2:
            trainer.optimizers[0].add_param_group({"params": [pl_module.extra]})


def _callback(name: str):
    from gacbench import GAC, AlignmentMonitor, AssumptionMonitor

    return {"simulator": lambda: StalenessSimulator(2), "gac": lambda: GAC(), "monitor": lambda: AlignmentMonitor(),
            "assumptions": lambda: AssumptionMonitor(every=2, loss_fn=lambda m, b: m.loss_fn(b))}[name]()


@pytest.mark.parametrize("name", ["simulator", "gac", "monitor", "assumptions"])
def test_a_param_group_added_during_the_fit_is_refused(name):
    """The callbacks take the optimizer's parameters when the fit starts: a group added later (Lightning's
    BaseFinetuning.unfreeze_and_add_param_group) would be neither delayed nor measured, so its next step is refused."""
    trainer = make_trainer([AddGroupAt(3), _callback(name)], max_steps=8)
    with pytest.raises(RuntimeError, match="parameter groups changed during the fit .*add_param_group at step 3"):
        trainer.fit(WithExtra())
    assert trainer.global_step == 3


class WithLBFGS(UserRegressor):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3)


@pytest.mark.parametrize("name", ["simulator", "gac", "monitor"])
def test_an_optimizer_that_evaluates_its_closure_several_times_a_step_is_refused(name):
    """Lightning runs on_before_optimizer_step after every closure evaluation: with LBFGS only the first would be
    stale, and GAC would measure the cosines between the evaluations of one step."""
    with pytest.raises(RuntimeError, match="ran twice in optimizer step 0: the optimizer \\(LBFGS\\)"):
        make_trainer([_callback(name)], max_steps=4).fit(WithLBFGS())


class _WeightSeen(pl.LightningModule):
    """One weight pulled toward 1; records the weight each training micro-batch saw."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[tuple[int, int, float]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append((self.global_step, batch_idx, float(self.w)))
        return ((self.w - batch[0]) ** 2).mean()

    def validation_step(self, batch, batch_idx):
        return None

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(12, 1)), batch_size=1)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(1, 1)), batch_size=1)


def test_a_validation_inside_an_accumulation_window_leaves_the_window_on_the_stale_iterate():
    """s = 1 with two micro-batches a step and a validation after every third batch (inside a window): validation
    sees θ_t, and the window's remaining micro-batch again sees θ_{t-1}, so every micro-batch sees what it sees in
    the same run without validation."""
    runs = {}
    for label, val in (("validated", dict(val_check_interval=3)), ("plain", dict(limit_val_batches=0))):
        m = _WeightSeen()
        make_trainer([StalenessSimulator(1)], max_steps=6, accumulate_grad_batches=2, **val).fit(m)
        runs[label] = m.seen
    assert runs["validated"] == runs["plain"] and len(runs["plain"]) == 12
    for k in range(6):  # both micro-batches of a window see one iterate
        assert runs["plain"][2 * k][2] == runs["plain"][2 * k + 1][2]
    assert [w for _, _, w in runs["plain"][::2]][:3] == [0.0, 0.0, 1.0]  # θ_0, θ_{1-1}, θ_{2-1} (θ_1 = 1)
