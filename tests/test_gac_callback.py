"""GAC and AlignmentMonitor inside a Trainer: the logged c_t is the cosine of consecutive
gradients, the applied gradient follows the rule, the fast path equals the plain one,
bad gradients never reach the parameters."""

import math

import lightning.pytorch as pl
import pytest
import torch
from conftest import UserRegressor, flat_params, gac_oracle, make_trainer

from gacbench import GAC, AlignmentMonitor, StalenessSimulator
from gacbench.functional import gac_project
from gacbench.functional.gac import GACTransform


class GradTap(pl.Callback):
    """Copies the gradient as it is at this point of on_before_optimizer_step."""

    def __init__(self):
        self.grads = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        ps = [p for g in optimizer.param_groups for p in g["params"]]
        self.grads.append(None if all(p.grad is None for p in ps) else
                          [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in ps])


def cos(a, b):
    fa, fb = torch.cat([x.reshape(-1) for x in a]), torch.cat([x.reshape(-1) for x in b])
    return float(fa @ fb / (fa.norm() * fb.norm()))


def test_monitor_logs_the_cosine_of_consecutive_gradients():
    tap, mon = GradTap(), AlignmentMonitor(warmup=2)
    trainer = make_trainer([tap, mon, StalenessSimulator(2)], max_steps=12)
    trainer.fit(UserRegressor())
    logged = trainer.logger.values("align/cos")
    expected = [cos(tap.grads[t], tap.grads[t - 1]) for t in range(1, 12)]
    assert logged == pytest.approx(expected, abs=1e-5)
    norms = trainer.logger.values("grad/norm")
    assert norms == pytest.approx([math.sqrt(sum(float((x * x).sum()) for x in g)) for g in tap.grads], rel=1e-5)
    assert mon.summary["n"] == len(expected) - 2
    assert trainer.logger.last("align/q90_abs") == pytest.approx(mon.summary["q90_abs"])


@pytest.mark.parametrize("clip", [None, 0.5])
def test_gac_applies_the_rule_to_each_gradient(clip):
    """Raw gradient before GAC, applied gradient after: the applied one is gac_project(raw, previous raw)."""
    before, after = GradTap(), GradTap()
    gac = GAC(c_low=0.05, c_high=0.3)
    trainer = make_trainer([StalenessSimulator(3), before, gac, after], max_steps=15, gradient_clip_val=clip)
    trainer.fit(UserRegressor(optimizer="adamw"))
    changed = 0
    for t in range(1, 15):
        expected, d = gac_project(before.grads[t], before.grads[t - 1], 0.05, 0.3)
        changed += d.changed
        for e, a in zip(expected, after.grads[t]):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-7)
    assert changed > 0  # the stale run really exercised the projection
    assert trainer.logger.values("align/cos") == pytest.approx(
        [cos(before.grads[t], before.grads[t - 1]) for t in range(1, 15)], abs=1e-5)


@pytest.mark.parametrize("reference", ["grad", "applied", "update", "ema"])
def test_every_reference_keeps_parameters_finite_and_logs(reference):
    trainer = make_trainer([StalenessSimulator(4), GAC(reference=reference)], max_steps=12)
    model = UserRegressor(optimizer="adamw")
    trainer.fit(model)
    assert torch.isfinite(flat_params(model)).all()
    key = "align/cos" if reference == "grad" else "align/ref_cos"
    assert len(trainer.logger.values(key)) == 11
    assert 0.0 <= trainer.logger.last("align/proj_frac") <= 1.0


def test_swap_path_equals_copy_path():
    """The storage-swapping fast path and the plain copy path give the same parameters."""
    runs, swapped_steps = [], []
    for swap in (True, False):
        model = UserRegressor(optimizer="adamw")
        gac = GAC()
        t = gac.transform
        step, swapping, calls = t.step, t._step_swapping, []
        t._step_swapping = lambda *args: (calls.append(1), swapping(*args))[1]
        if not swap:
            t.step = lambda params, reduce, swap, keep_alias, optimizer=None, **kw: step(params, reduce, swap=False,
                                                                                       **kw)
        make_trainer([StalenessSimulator(3), gac], max_steps=15).fit(model)
        runs.append(flat_params(model))
        swapped_steps.append(len(calls))
    assert swapped_steps == [15, 0]  # the fast path really ran, at every step, in the first run only
    torch.testing.assert_close(runs[0], runs[1], rtol=1e-6, atol=1e-7)


def _flat(tensors):
    return torch.cat([t.detach().double().reshape(-1) for t in tensors])


class ThetaTap(pl.Callback):
    """Listed right after GAC: theta_t and the gradient the optimizer gets, per step (flat, float64)."""

    def __init__(self):
        self.theta, self.grads = [], []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        ps = [p for g in optimizer.param_groups for p in g["params"]]
        self.theta.append(_flat(ps))
        self.grads.append(_flat([p.grad for p in ps]))


@pytest.mark.parametrize("reference", ["grad", "applied", "update", "ema"])
def test_each_reference_matches_the_hand_written_oracle(reference):
    """Over 16 stale steps of AdamW, the logged cosine and the gradient handed to the optimizer equal the
    oracle's at every step: the EMA's weights, the applied (not raw) gradient and the sign of the parameter
    step are each pinned."""
    c_low, c_high, decay = 0.05, 0.25, 0.7
    before, after = GradTap(), ThetaTap()
    gac = GAC(c_low=c_low, c_high=c_high, reference=reference, ema_decay=decay, warmup=0)
    trainer = make_trainer([StalenessSimulator(3), before, gac, after], max_steps=16)
    trainer.fit(UserRegressor(optimizer="adamw"))
    raw = [_flat(g) for g in before.grads]
    cos, applied = gac_oracle(reference, raw, after.theta, c_low, c_high, decay)
    key = "align/cos" if reference == "grad" else "align/ref_cos"
    assert trainer.logger.values(key) == pytest.approx(cos[1:], abs=1e-5)
    for t, (got, want) in enumerate(zip(after.grads, applied)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=f"step {t}")
    regimes = {"keep" if c <= c_low else "shrink" if c < c_high else "project" for c in cos[1:]}
    assert {"shrink", "project"} <= regimes  # the run exercised the rule, not only the keep branch


class StepAudit(pl.Callback):
    """Listed after GAC: snapshots the parameters and the optimizer state just before each optimizer
    step and compares them just after it, noting whether GAC skipped that step."""

    def __init__(self, gac):
        self.gac, self.rows, self._skips = gac, [], 0

    @staticmethod
    def _snapshot(pl_module, optimizer):
        params = [p.detach().clone() for p in pl_module.parameters()]
        state = [{k: v.clone() for k, v in optimizer.state[p].items()} for p in pl_module.parameters()]
        return params, state

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        skipped, self._skips = self.gac.skipped > self._skips, self.gac.skipped
        self._before = (skipped, *self._snapshot(pl_module, optimizer))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        skipped, params, state = self._before
        params_after, state_after = self._snapshot(pl_module, trainer.optimizers[0])
        self.rows.append({
            "skipped": skipped,
            "params_equal": all(torch.equal(a, b) for a, b in zip(params, params_after)),
            "state_equal": all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
                               for a, b in zip(state, state_after)),
            "state_nonempty": all(state),
        })


def test_skip_mode_leaves_parameters_and_optimizer_state_untouched():
    gac = GAC(c_low=0.0, c_high=1e-6, high_mode="skip")  # any positive alignment skips
    audit = StepAudit(gac)
    trainer = make_trainer([StalenessSimulator(4), gac, audit], max_steps=10)
    trainer.fit(UserRegressor(optimizer="adamw"))
    skipped = [r for r in audit.rows if r["skipped"]]
    applied = [r for r in audit.rows if not r["skipped"]]
    assert len(skipped) == gac.skipped == sum(trainer.logger.values("align/skip")) > 0
    assert applied and applied[0] is audit.rows[0]  # the first step has no reference and is applied
    # AdamW has state (exp_avg, exp_avg_sq, step) by the first skip; a skipped step changes none of it
    assert all(r["state_nonempty"] for r in skipped)
    assert all(r["params_equal"] and r["state_equal"] for r in skipped)
    assert not any(r["params_equal"] or r["state_equal"] for r in applied)  # the audit sees real steps


class NaNAt(UserRegressor):
    def __init__(self, bad_step, **kw):
        super().__init__(**kw)
        self.bad_step = bad_step

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_step == self.bad_step else loss


def test_non_finite_gradient_is_skipped_with_a_warning():
    model = NaNAt(bad_step=4, optimizer="adamw")
    gac = GAC()
    with pytest.warns(UserWarning, match="skipping step 4"):
        make_trainer([gac], max_steps=8).fit(model)
    assert torch.isfinite(flat_params(model)).all()
    assert gac.bad == 1


def test_non_finite_gradient_can_stop_the_run():
    with pytest.raises(FloatingPointError, match="on_bad_grad='skip'"):
        make_trainer([GAC(on_bad_grad="raise")], max_steps=8).fit(NaNAt(bad_step=3))


class ZeroGrad(UserRegressor):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * 0.0


def test_zero_gradient_passes_through_untouched_by_default():
    """Nothing to project: the optimizer sees exactly what it would see without GAC."""
    with_gac, without = ZeroGrad(optimizer="adamw"), ZeroGrad(optimizer="adamw")
    gac = GAC()
    make_trainer([gac], max_steps=3).fit(with_gac)
    make_trainer([], max_steps=3).fit(without)
    assert torch.equal(flat_params(with_gac), flat_params(without))  # AdamW's weight decay ran in both
    assert gac.zero == 3 and gac.skipped == 0


def test_zero_gradient_can_skip_or_stop():
    model = ZeroGrad(optimizer="adamw")
    start = flat_params(model)
    gac = GAC(on_zero_grad="skip")
    with pytest.warns(UserWarning, match="is zero"):
        make_trainer([gac], max_steps=3).fit(model)
    assert torch.equal(flat_params(model), start)  # skipped: not even weight decay
    with pytest.raises(FloatingPointError, match="on_zero_grad='pass'"):
        make_trainer([GAC(on_zero_grad="raise")], max_steps=2).fit(ZeroGrad())


@pytest.mark.parametrize("kwargs,match", [
    ({"c_low": 0.3, "c_high": 0.1}, "c_low < c_high"),
    ({"c_low": -0.1}, "c_low < c_high"),
    ({"c_high": 1.5}, "c_high"),
    ({"high_mode": "clip"}, "high_mode"),
    ({"reference": "momentum"}, "reference"),
    ({"shrink": "half"}, "shrink"),
    ({"on_bad_grad": "ignore"}, "on_bad_grad"),
    ({"on_zero_grad": "ignore"}, "on_zero_grad"),
    ({"ema_decay": 1.0}, "ema_decay"),
    ({"buffer_dtype": "int8"}, "buffer_dtype"),
    ({"warmup": -1}, "warmup"),
])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GAC(**kwargs)


def test_update_reference_refuses_a_low_precision_buffer():
    with pytest.raises(ValueError, match="reference='update'"):
        make_trainer([GAC(reference="update", buffer_dtype="bfloat16")], max_steps=2).fit(UserRegressor())


@pytest.fixture(scope="module")
def stale_mlp_gradients():
    """The raw gradients of a real run: the MLP objective at staleness 16 under GAC, 150 AdamW steps."""
    from gacbench.objectives.mlp import MLPClassifier

    model = MLPClassifier(steps=150)
    tap = GradTap()
    make_trainer([StalenessSimulator(16), tap, GAC()], max_steps=150, log_every_n_steps=50).fit(model)
    return [p.shape for p in model.parameters()], tap.grads


@pytest.mark.parametrize("reference", ["grad", "applied", "ema"])
def test_bf16_reference_buffer_gives_the_float32_cosine(stale_mlp_gradients, reference):
    """Replaying identical gradients, a bfloat16 reference gives every c_t within 1e-3 of the float32 one,
    the same decisions, in half the memory."""
    shapes, grads = stale_mlp_gradients
    cos, actions, nbytes = {}, {}, {}
    for dtype in ("float32", "bfloat16"):
        t = GACTransform(reference=reference, buffer_dtype=dtype)
        params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
        steps = []
        for g in grads:
            for p, gi in zip(params, g):
                p.grad = gi.clone()
            steps.append(t.step(params))
        cos[dtype] = [st.cos for st in steps[1:]]
        actions[dtype] = [st.decision.action for st in steps]
        nbytes[dtype] = sum(r.numel() * r.element_size() for r in t.state.ref)
    assert max(abs(a - b) for a, b in zip(cos["float32"], cos["bfloat16"])) <= 1e-3
    assert actions["float32"] == actions["bfloat16"] and len(set(actions["float32"])) > 1
    assert 2 * nbytes["bfloat16"] == nbytes["float32"]


def test_monitor_is_passive_beside_gac_and_gac_reports_the_summary():
    mon, gac = AlignmentMonitor(warmup=1), GAC(warmup=1)
    trainer = make_trainer([StalenessSimulator(2), mon, gac], max_steps=8)
    trainer.fit(UserRegressor())
    assert mon.passive and gac.summary["n"] == 6
    assert len(trainer.logger.values("align/cos")) == 7  # one writer, one value per step after the first


class RawAlignmentLogger(pl.Callback):
    """A third-party gradient-side callback that declares it logs c_t of the raw gradient."""

    logs_raw_alignment = True


def test_monitor_goes_passive_on_the_declared_capability_not_the_class():
    mon = AlignmentMonitor(warmup=0)
    trainer = make_trainer([StalenessSimulator(2), mon, RawAlignmentLogger()], max_steps=5)
    trainer.fit(UserRegressor())
    assert mon.passive and mon.trace.values == []
    assert trainer.logger.values("align/cos") == []  # the monitor left align/cos to the declaring callback


def test_monitor_stays_active_beside_gac_with_another_reference():
    mon, gac = AlignmentMonitor(warmup=0), GAC(reference="applied", warmup=0)
    assert not gac.logs_raw_alignment and GAC().logs_raw_alignment
    trainer = make_trainer([StalenessSimulator(2), mon, gac], max_steps=6)
    trainer.fit(UserRegressor())
    assert not mon.passive
    assert trainer.logger.values("align/cos") == mon.trace.values and len(mon.trace.values) == 5
    assert len(trainer.logger.values("align/ref_cos")) == 5  # GAC's own cosine, under its own name
