"""Hostile inputs to the callbacks, the optimizer hooks and the TRL callback: models of mixed parameter dtypes,
all-zero gradients, GAC attached twice, sparse and complex parameters, and the settings shared by the three GAC
front ends."""

from __future__ import annotations

import math
import re

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from conftest import make_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gacbench import StalenessSimulator
from gacbench.functional.alignment import KEEP, PROJECT
from gacbench.functional.buffer import FlatBuffer
from gacbench.functional.gac import GACTransform
from gacbench.functional.step_gac import StepGAC
from gacbench.hooks import attach_alignment_monitor, attach_gac

# the first parameter is bfloat16, so that a buffer kept in the first parameter's dtype would round the others
MIXED = (torch.bfloat16, torch.float32, torch.float16, torch.float32)


def mixed_tensors(seed: int = 0, scale: float = 1.0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(7, 3), (5,), (4, 2), (300,)]
    return [(torch.randn(s, generator=gen, dtype=torch.float64) * scale).to(d) for s, d in zip(shapes, MIXED)]


def f64(ts) -> torch.Tensor:
    return torch.cat([t.detach().double().reshape(-1) for t in ts])


class MixedModel(pl.LightningModule):
    """A bfloat16 weight listed first, then float32 and float16 ones: the gradient of each keeps its dtype."""

    def __init__(self, lr: float = 0.05, steps: int = 12) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.a = nn.Parameter(torch.randn(4, generator=gen).bfloat16())
        self.w = nn.Parameter(torch.randn(4, generator=gen) + 1e-3 * torch.rand(4, generator=gen))
        self.h = nn.Parameter(torch.randn(4, generator=gen).half())
        self.x = torch.randn(steps * 4, 4, generator=gen)
        self.y = torch.randn(steps * 4, generator=gen)
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        pred = x @ (self.w + self.a.float() + self.h.float()) + (x * self.w).sum(1) ** 2 * 0.1
        return ((pred - y) ** 2).mean()

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.y), batch_size=4, shuffle=False)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


# -- mixed parameter dtypes ------------------------------------------------------------------------------------
def test_flat_buffer_keeps_each_parameters_dtype_bit_for_bit():
    params = mixed_tensors()
    before = [p.clone() for p in params]
    buf = FlatBuffer.like(params)
    assert [v.dtype for v in buf.views] == list(MIXED)
    buf.copy_from(params)
    for p in params:
        p.add_(1.0)  # the parameters move on
    buf.copy_to(params)
    assert all(torch.equal(p, b) and p.dtype == b.dtype for p, b in zip(params, before))
    # the checkpoint form holds every value exactly, and loads back bit for bit
    again = FlatBuffer.like(params)
    again.load_(buf.flat())
    assert all(torch.equal(v, b) for v, b in zip(again.views, before))
    assert buf.flat().dtype == torch.float32  # bfloat16 and float16 both fit in float32


class ThetaRecorder(pl.Callback):
    """Listed after the simulator: the iterate the forward pass runs on (``stale``), the one the update is applied
    to (``current``) and the parameters right after each optimizer step (``after``), all bit for bit."""

    def __init__(self, sim):
        self.sim, self.stale, self.current, self.after, self.lags = sim, [], [], [], []

    def on_train_start(self, trainer, pl_module):
        trainer.optimizers[0].register_step_post_hook(
            lambda *a: self.after.append([p.detach().clone() for p in pl_module.parameters()]))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.stale.append([p.detach().clone() for p in pl_module.parameters()])
        self.lags.append(self.sim.lag)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.current.append([p.detach().clone() for p in pl_module.parameters()])


def _same(xs, ys) -> bool:
    return all(torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(xs, ys))


def test_stale_snapshot_of_a_mixed_dtype_model_is_restored_bit_for_bit():
    """bfloat16 first, float32 and float16 after: the stale forward runs on theta_{t-s} exactly, and restoring
    theta_t gives back every float32 and float16 weight bit for bit (not rounded to bfloat16)."""
    model = MixedModel()
    sim = StalenessSimulator(2)
    rec = ThetaRecorder(sim)
    initial = [p.detach().clone() for p in model.parameters()]
    make_trainer([sim, rec], max_steps=10).fit(model)
    assert rec.lags == [0, 1] + [2] * 8
    assert _same(rec.current[0], initial)
    for t in range(1, 10):
        assert _same(rec.current[t], rec.after[t - 1])  # theta_t, restored exactly
        assert _same(rec.stale[t], rec.current[t - rec.lags[t]])  # the stale forward sees theta_{t-s} exactly


def test_stale_snapshot_with_zero_learning_rate_leaves_a_mixed_model_unchanged():
    model = MixedModel(lr=0.0)
    initial = [p.detach().clone() for p in model.parameters()]
    make_trainer([StalenessSimulator(3)], max_steps=8).fit(model)
    assert _same(list(model.parameters()), initial)


def test_bf16_gac_with_a_parameter_without_gradient_keeps_the_float32_cosine():
    """bfloat16 gradients, shrunk or projected at most steps (c_low 0.05, c_high 0.3), with and without a frozen
    parameter (no gradient) in the optimizer: c_t is the cosine of the bfloat16 gradients given, computed in
    float64, to float32 rounding (the reference is the raw gradient itself, never g~ + alpha r rebuilt in
    bfloat16), and the two runs log the same c_t."""

    def run(with_frozen: bool, n: int = 16, steps: int = 40):
        gen = torch.Generator().manual_seed(0)
        a = nn.Parameter(torch.zeros(n, dtype=torch.bfloat16))
        params = [a] + ([nn.Parameter(torch.zeros(3), requires_grad=False)] if with_frozen else [])
        opt = torch.optim.SGD(params, lr=0.0)
        gac = attach_gac(opt, kernels="eager", warmup=0)
        prev, errors = None, []
        for t in range(steps):
            g = torch.randn(n, generator=gen, dtype=torch.float64)
            if prev is not None:  # aligned with the previous gradient: c_t mostly in (0.05, 1)
                g = g + [0.6, -0.6, 0.3, 1.5][t % 4] * prev * (g.norm() / prev.norm())
            g = g.to(torch.bfloat16).double()  # exactly the bfloat16 gradient given
            a.grad = g.to(torch.bfloat16)
            opt.step()
            if prev is not None:
                errors.append(abs(gac.metrics["align/cos"] - float(g @ prev / (g.norm() * prev.norm()))))
            prev = g
        return gac.values, max(errors), gac.changed

    alone, err_alone, changed = run(False)
    frozen, err_frozen, _ = run(True)
    assert changed > 10
    assert err_alone < 2e-7 and err_frozen < 2e-7
    assert frozen == alone


def test_gac_cosine_and_projection_on_mixed_dtypes_match_float64():
    """GAC's c_t against the previous gradient, and the projected gradient, on bfloat16 / float32 / float16
    parameters, against the rule written out in float64 (the gradients are exact there)."""
    params = [nn.Parameter(t) for t in mixed_tensors(0)]
    g1, g2 = mixed_tensors(1), mixed_tensors(2)
    g2 = [(a.double() + 0.8 * b.double()).to(a.dtype) for a, b in zip(g2, g1)]  # aligned: c near 0.6
    gac = GACTransform(c_low=0.05, c_high=0.9, kernels="eager")
    for p, g in zip(params, g1):
        p.grad = g.clone()
    gac.step(params)
    assert [r.dtype for r in gac.state.ref] == list(MIXED)
    assert torch.equal(f64(gac.state.ref), f64(g1))  # the reference is g_1 exactly, in each part's dtype
    for p, g in zip(params, g2):
        p.grad = g.clone()
    out = gac.step(params)
    a, b = f64(g2), f64(g1)
    c = float(a @ b / (a.norm() * b.norm()))
    assert 0.3 < c < 0.9 and out.cos == pytest.approx(c, rel=1e-6, abs=1e-7)
    coef = 1.0 - 0.05 / c
    want = a - coef * float(a @ b) / float(b @ b) * b
    offset = 0
    for p in params:
        n = p.numel()
        got, exp = p.grad.double().reshape(-1), want[offset : offset + n]
        assert p.grad.dtype == p.dtype
        assert torch.allclose(got, exp, rtol=2 * torch.finfo(p.dtype).eps, atol=1e-6), p.dtype
        offset += n
    # the state round trip keeps every part of the reference bit for bit
    again = GACTransform(c_low=0.05, c_high=0.9, kernels="eager")
    again.load_state_dict(gac.state_dict())
    again._buffer(params)
    assert _same(again.state.ref, gac.state.ref)


def test_monitor_hook_cosine_on_mixed_dtypes_matches_float64():
    params = [nn.Parameter(t) for t in mixed_tensors(0)]
    opt = torch.optim.SGD(params, lr=0.0)
    mon = attach_alignment_monitor(opt)
    grads = [mixed_tensors(1), mixed_tensors(2)]
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
    a, b = f64(grads[1]), f64(grads[0])
    assert mon.metrics["align/cos"] == pytest.approx(float(a @ b / (a.norm() * b.norm())), rel=1e-6, abs=1e-7)


def test_step_gac_skip_restores_a_mixed_dtype_model_bit_for_bit():
    """GAC(target="step") with high_mode="skip": a skipped step puts back theta_t exactly, every dtype."""
    params = [t.clone() for t in mixed_tensors(0)]
    sg = StepGAC(c_low=0.05, c_high=0.3, high_mode="skip")
    sg.start(params)
    step = mixed_tensors(3, scale=0.01)
    for p, d in zip(params, step):
        p.add_(d)
    sg.step(params)  # the first step: kept, becomes the reference
    theta = [p.clone() for p in params]
    for p, d in zip(params, step):
        p.add_(d)  # the same step again: c = 1, skipped
    out = sg.step(params)
    assert out.cos == pytest.approx(1.0, abs=1e-3)
    assert _same(params, theta)


# -- zero and non-finite gradients: no c_t, never a reference ------------------------------------------------------
def _grads(seed: int, shapes=((6, 3), (4,))) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in shapes]


def _cos(a, b) -> float:
    a, b = f64(a), f64(b)
    return float(a @ b / (a.norm() * b.norm()))


def _sequence():
    """g1, a zero gradient, g3 (aligned with g1), an inf gradient, g5: the usable ones are g1, g3, g5."""
    g1, g3, g5 = _grads(1), _grads(3), _grads(5)
    g3 = [a + 0.7 * b for a, b in zip(g3, g1)]
    zero = [torch.zeros_like(t) for t in g1]
    inf = [t.clone() for t in g1]
    inf[1][2] = float("inf")
    return [g1, zero, g3, inf, g5], [float("nan"), _cos(g3, g1), float("nan"), _cos(g5, g3)]


def _same_trace(got, want) -> bool:
    return len(got) == len(want) and all(
        (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-6) for a, b in zip(got, want))


def test_monitor_hook_gives_zero_and_non_finite_gradients_no_cosine_and_no_reference():
    """A zero gradient logs c_t = NaN (not 0) and the next c_t is measured against the last usable gradient (not
    0 or NaN against zeros); an inf gradient likewise, so a non-finite reference is never kept."""
    params = [nn.Parameter(torch.zeros_like(t)) for t in _grads(0)]
    opt = torch.optim.SGD(params, lr=0.0)
    mon = attach_alignment_monitor(opt, warmup=0)
    seq, want = _sequence()
    logged = []
    for gs in seq:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
        logged.append(mon.metrics.get("align/cos"))
    assert logged[0] is None and _same_trace(logged[1:], want)
    assert _same_trace(mon.values, want)
    s = mon.summary()
    assert s["n"] == 2 and s["skipped"] == 2
    assert s["max_abs"] == pytest.approx(max(abs(want[1]), abs(want[3])), rel=1e-6)


class ScriptedGradients(pl.LightningModule):
    """The gradient of step t is ``seq[t]`` exactly (the loss is <theta, g_t>); SGD at lr 0."""

    def __init__(self, seq):
        super().__init__()
        self.seq = seq
        self.ps = nn.ParameterList([nn.Parameter(torch.zeros_like(t)) for t in seq[0]])

    def training_step(self, batch, batch_idx):
        g = self.seq[self.global_step]
        return sum((p * torch.nan_to_num(t, posinf=0.0)).sum() for p, t in zip(self.ps, g)) + 0.0 * batch[0].sum()

    def on_after_backward(self):
        for p, t in zip(self.ps, self.seq[self.global_step]):
            p.grad = t.clone()  # inf included, exactly

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.zeros(len(self.seq), 1)), batch_size=1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.ps, lr=0.0)


class DropGradients(pl.Callback):
    """Listed after the monitor: leaves the optimizer no gradient, so that an inf one cannot reach the weights."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        for p in pl_module.parameters():
            p.grad = None


def test_alignment_monitor_gives_zero_and_non_finite_gradients_no_cosine_and_no_reference():
    from gacbench import AlignmentMonitor

    seq, want = _sequence()
    mon = AlignmentMonitor(warmup=0)
    trainer = make_trainer([mon, DropGradients()], max_steps=len(seq))
    trainer.fit(ScriptedGradients(seq))
    assert _same_trace(mon.trace.values, want)
    assert mon.summary["n"] == 2 and mon.summary["skipped"] == 2
    assert float(trainer.callback_metrics["align/skipped"]) == 2.0


@pytest.mark.parametrize("mode", ["pass", "skip", "raise"])
def test_attach_gac_zero_gradient_follows_on_zero_grad_and_keeps_the_reference(mode):
    """``on_zero_grad`` on the hook: "pass" hands the zero gradient to AdamW (which moves on momentum), "skip"
    leaves parameters and AdamW's state untouched, "raise" stops; c_t of the zero step is NaN, and the next c_t
    is against g_1 (the reference is kept)."""
    g1, _, g3 = _sequence()[0][:3]
    params = [nn.Parameter(torch.ones_like(t)) for t in g1]
    opt = torch.optim.AdamW(params, lr=0.1, weight_decay=0.0)
    gac = attach_gac(opt, on_zero_grad=mode, warmup=0, c_low=0.99, c_high=1.0)  # keep every step
    for p, g in zip(params, g1):
        p.grad = g.clone()
    opt.step()
    after_one = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    if mode == "raise":
        with pytest.raises(FloatingPointError, match="on_zero_grad='pass'"):
            opt.step()
        return
    opt.step()
    moved = not _same(list(params), after_one)
    assert moved == (mode == "pass")
    assert [int(opt.state[p]["step"]) for p in params] == ([2, 2] if mode == "pass" else [1, 1])
    assert math.isnan(gac.metrics["align/cos"]) and gac.zero == 1 and gac.action == ("keep" if mode == "pass"
                                                                                       else "skip")
    for p, g in zip(params, g3):
        p.grad = g.clone()
    opt.step()
    assert gac.metrics["align/cos"] == pytest.approx(_cos(g3, g1), rel=1e-6)
    assert gac.summary()["skipped"] == 1 and gac.summary()["n"] == 1


def test_gac_callback_zero_gradient_has_no_cosine_and_keeps_the_reference():
    from gacbench import GAC

    seq, want = _sequence()
    gac = GAC(warmup=0, c_low=0.99, c_high=1.0)
    trainer = make_trainer([gac], max_steps=len(seq))
    with pytest.warns(UserWarning, match="non-finite"):
        trainer.fit(ScriptedGradients(seq))
    assert _same_trace(gac.trace.values, want)
    assert gac.summary["skipped"] == 2 and gac.zero == 1 and gac.bad == 1


def test_table3_statistics_and_calibration_ignore_missing_cosines(tmp_path):
    from gacbench.functional.calibration import calibration_record
    from gacbench.functional.stats import alignment_summary
    from gacbench.methods import _reference_trace

    gen = torch.Generator().manual_seed(0)
    clean = [float(v) for v in torch.rand(40, generator=gen) * 0.4 - 0.2]
    holed = list(clean)
    for i in (3, 17, 30):
        holed.insert(i, float("nan"))
    a, b = alignment_summary(clean, warmup=0), alignment_summary(holed, warmup=0)
    assert b["skipped"] == 3 and a["skipped"] == 0
    assert {k: v for k, v in a.items() if k != "skipped"} == {k: v for k, v in b.items() if k != "skipped"}
    # a metrics.csv with NaN c_t (as CSVLogger writes them) calibrates as the clean trace does
    csv = tmp_path / "metrics.csv"
    csv.write_text("step,align/cos\n" + "".join(f"{i},{v}\n" for i, v in enumerate(holed)))
    trace = _reference_trace(csv, 0)
    assert sum(math.isnan(v) for v in trace) == 3
    assert calibration_record(trace) == calibration_record(clean)


def test_a_float16_reference_that_overflows_is_not_kept():
    """buffer_dtype="float16" and a finite gradient above 65504: the copy would be inf; it is not a reference."""
    params = [nn.Parameter(torch.zeros(4))]
    opt = torch.optim.SGD(params, lr=0.0)
    mon = attach_alignment_monitor(opt, buffer_dtype="float16", warmup=0)
    gac = GACTransform(buffer_dtype="float16", kernels="eager")
    big = torch.tensor([1e6, 1.0, 2.0, 3.0])
    for g in (big, torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([1.0, 2.0, 3.0, 5.0])):
        params[0].grad = g.clone()
        if g is big:
            with pytest.warns(RuntimeWarning, match="overflows"):
                opt.step()
        else:
            opt.step()
        params[0].grad = g.clone()
        if g is big:
            with pytest.warns(RuntimeWarning, match="overflows"):
                gac.step(params)
            assert not gac.state.has_ref
        else:
            out = gac.step(params)
    assert math.isfinite(out.cos) and out.cos == pytest.approx(_cos([torch.tensor([1.0, 2.0, 3.0, 5.0])],
                                                                    [torch.tensor([1.0, 2.0, 3.0, 4.0])]), rel=1e-3)
    assert len(mon.values) == 1 and mon.values[0] == pytest.approx(out.cos, rel=1e-3)


def test_a_reference_rounded_to_zero_gives_no_cosine():
    """buffer_dtype="float16" and a gradient of 1e-10 (below float16's smallest value, 6e-8): the stored reference is
    zero. A zero reference has no direction: the next c_t is NaN (counted as skipped), not 0, for the monitor hook
    and for GAC, which keeps the gradient; the step after it is measured against the usable gradient."""
    params = [nn.Parameter(torch.zeros(4))]
    opt = torch.optim.SGD(params, lr=0.0)
    mon = attach_alignment_monitor(opt, buffer_dtype="float16", warmup=0)
    gac = attach_gac(opt, buffer_dtype="float16", kernels="eager", warmup=0, c_low=0.05, c_high=0.3)
    grads = [torch.full((4,), 1e-10), torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([4.0, -3.0, 2.0, -1.0])]
    for g in grads:
        params[0].grad = g.clone()
        opt.step()
        if g is grads[1]:
            assert math.isnan(mon.metrics["align/cos"]) and math.isnan(gac.metrics["align/cos"])
            assert gac.action == "keep" and torch.equal(params[0].grad, grads[1])
    assert math.isnan(mon.values[0]) and mon.values[1] == 0.0  # <g_3, g_2> = 4 - 6 + 6 - 4 = 0
    assert math.isnan(gac.values[0]) and gac.values[1] == 0.0
    assert mon.summary()["skipped"] == gac.summary()["skipped"] == 1


def test_gac_callback_update_reference_of_parameters_that_did_not_move_gives_no_cosine():
    """GAC(reference="update") in Lightning with SGD at lr 0: theta_{t-1} - theta_t is zero at every step, so no
    step has a c_t: the trace holds NaN (counted as skipped), never 0, and no gradient is changed."""
    from gacbench import GAC

    seq = [_grads(t) for t in range(4)]
    gac = GAC(reference="update", warmup=0, kernels="eager")
    make_trainer([gac], max_steps=len(seq)).fit(ScriptedGradients(seq))
    assert len(gac.trace.values) == 3 and all(math.isnan(v) for v in gac.trace.values)
    assert gac.changed == 0 and gac.trace.summary()["skipped"] == 3


def test_step_gac_against_a_zero_applied_step_gives_no_cosine():
    """StepGAC (target="step"): Delta_2 = 2 Delta_1 is projected onto nothing (Delta~_2 = 0 exactly, with these
    small integers), so the reference of step 3 is zero: c^Delta_3 is NaN (``zero_ref``), not 0, and the step is
    kept."""
    p = nn.Parameter(torch.zeros(3))
    gac = StepGAC(0.05, 0.3)
    gac.start([p])
    outs = []
    for delta in ([1.0, 2.0, 0.0], [2.0, 4.0, 0.0], [0.0, 1.0, 1.0]):
        with torch.no_grad():
            p.add_(torch.tensor(delta))  # the optimizer's step
        outs.append(gac.step([p]))
    assert math.isnan(outs[0].cos) and not outs[0].zero_ref
    assert outs[1].cos == pytest.approx(1.0, rel=1e-15) and outs[1].decision.action == PROJECT and not outs[1].zero_ref
    assert math.isnan(outs[2].cos) and outs[2].zero_ref and outs[2].decision.action == KEEP
    assert torch.equal(p.detach(), torch.tensor([1.0, 3.0, 1.0]))


# -- GAC attached twice -------------------------------------------------------------------------------------------
def test_attach_gac_twice_on_one_optimizer_is_refused_naming_the_first():
    from gacbench.usage import UsageError

    params = [nn.Parameter(torch.zeros(3))]
    opt = torch.optim.SGD(params, lr=0.1)
    first = attach_gac(opt, c_low=0.1)
    with pytest.raises(UsageError, match=r"already has GAC, attached by attach_gac\(c_low=0.1\)") as err:
        attach_gac(opt)
    assert "\n" not in str(err.value)
    assert len(opt._optimizer_step_pre_hooks) == 1  # nothing of the refused hook stays
    first.remove()
    attach_gac(opt).remove()  # after remove() the optimizer takes GAC again
    attach_gac(torch.optim.SGD(params, lr=0.1))  # another optimizer is another matter


def test_two_trl_callbacks_on_one_trainer_are_refused_naming_the_first():
    pytest.importorskip("transformers")
    from transformers import TrainerState

    from gacbench.integrations.trl import GACCallback
    from gacbench.usage import UsageError

    opt = torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1)
    one, two = GACCallback(c_low=0.1), GACCallback(reference="ema")
    one.on_train_begin(None, TrainerState(), None, optimizer=opt)
    with pytest.raises(UsageError, match=r"already has GAC, attached by GACCallback\(c_low=0.1\)"):
        two.on_train_begin(None, TrainerState(), None, optimizer=opt)
    assert two.monitor is None and len(opt._optimizer_step_pre_hooks) == 1  # the second attached nothing
    one.on_train_begin(None, TrainerState(), None, optimizer=opt)  # a second train() of the same callback is fine
    one.on_train_end(None, TrainerState(), None)
    two.on_train_begin(None, TrainerState(), None, optimizer=opt)  # once the first has let go


# -- one settings object for the three front ends ----------------------------------------------------------------
SETTINGS_CASES = [
    {"c_low": 0.3, "c_high": 0.1}, {"c_low": -0.1}, {"c_high": 1.5}, {"c_low": True}, {"c_high": float("nan")},
    {"high_mode": "clip"}, {"reference": "momentum"}, {"shrink": "half"}, {"on_bad_grad": "ignore"},
    {"on_zero_grad": "ignore"}, {"ema_decay": 1.0}, {"ema_decay": "0.5"}, {"buffer_dtype": "int8"},
    {"buffer_dtype": torch.int8}, {"warmup": -1}, {"warmup": True}, {"warmup": 2.5}, {"tol": 0.0},
    {"tol": "0.1"}, {"kernels": "fast"},
    {"c_low": 0.1, "c_high": 0.2, "high_mode": "skip", "reference": "ema", "ema_decay": 0.5, "shrink": "cosine",
     "buffer_dtype": "bfloat16", "on_bad_grad": "raise", "on_zero_grad": "skip", "warmup": 0, "tol": 0.1,
     "kernels": "eager"},
]


def _outcome(make, settings):
    try:
        return "ok", make(settings)
    except ValueError as e:  # UsageError is a ValueError
        return "refused", str(e)


@pytest.mark.parametrize("settings", SETTINGS_CASES, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_the_three_gac_front_ends_accept_and_refuse_the_same_settings(settings):
    """GAC (Lightning), attach_gac and the TRL GACCallback: the same verdict and the same message for each
    setting, and for an accepted one the same settings object."""
    pytest.importorskip("transformers")
    from gacbench import GAC
    from gacbench.integrations.trl import GACCallback

    def hook(s):
        h = attach_gac(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), **s)
        h.remove()
        return h.config

    got = [_outcome(lambda s: GAC(**s).config, settings), _outcome(hook, settings),
           _outcome(lambda s: GACCallback(**s).config, settings)]
    assert got[0] == got[1] == got[2], got
    assert got[0][0] == ("ok" if len(settings) > 3 else "refused")


def test_the_three_gac_front_ends_have_the_same_defaults():
    import inspect

    from gacbench import GAC
    from gacbench.functional.settings import GACSettings
    from gacbench.hooks import GACHook

    pytest.importorskip("transformers")
    from gacbench.integrations.trl import GACCallback

    defaults = GACSettings().as_dict()
    for fn in (GAC.__init__, GACHook.__init__):
        sig = inspect.signature(fn).parameters
        assert {k: sig[k].default for k in defaults} == defaults
    assert GAC().config == GACSettings() == GACCallback().config
    assert attach_gac(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)).config == GACSettings()


def test_a_setting_given_as_any_real_number_is_stored_as_a_python_number():
    """A numpy scalar (float32, float64, int64) or a 0-d tensor is a number like any other: each front end takes it
    and stores the Python float (warmup: int) it holds, so that a state saved with the settings loads with
    torch.load(weights_only=True); a bool, a tensor with elements or an integer setting given as a float is
    refused naming the setting."""
    import io

    import numpy as np

    from gacbench import GAC
    from gacbench.functional.settings import GACSettings

    pytest.importorskip("transformers")
    from gacbench.integrations.trl import GACCallback

    given = dict(c_low=np.float32(0.05), c_high=torch.tensor(0.25, dtype=torch.float64), ema_decay=np.float64(0.5),
                 warmup=np.int64(3), tol=torch.tensor(0.125))
    want = GACSettings(c_low=float(np.float32(0.05)), c_high=0.25, ema_decay=0.5, warmup=3, tol=0.125)
    hook = attach_gac(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), **given)
    for config in (GACSettings(**given), GAC(**given).config, hook.config, GACCallback(**given).config):
        assert config == want
        assert {k: type(v) for k, v in config.as_dict().items() if k in given} == {
            "c_low": float, "c_high": float, "ema_decay": float, "warmup": int, "tol": float}
        buf = io.BytesIO()
        torch.save(config.as_dict(), buf)
        buf.seek(0)
        assert torch.load(buf, weights_only=True) == config.as_dict()
    assert hook.warmup == 3 and type(hook.tol) is float
    for name, bad in (("c_low", np.bool_(True)), ("c_low", torch.tensor([0.05])), ("warmup", np.float64(3.0)),
                      ("tol", torch.tensor(0.1j))):
        with pytest.raises(ValueError, match=f"^GAC: {name}="):
            GACSettings(**{name: bad})


# -- sparse and complex parameters ---------------------------------------------------------------------------------
class EmbeddingModel(pl.LightningModule):
    def __init__(self, sparse: bool = False, complex_weight: bool = False):
        super().__init__()
        self.emb = nn.Embedding(10, 3, sparse=sparse)
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.complex64 if complex_weight else torch.float32))

    def training_step(self, batch, batch_idx):
        out = self.emb(batch[0]) * self.scale
        return out.abs().sum() if out.is_complex() else out.sum()

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.arange(8) % 10), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("who", ["GAC", "AlignmentMonitor"])
def test_a_sparse_gradient_is_refused_in_one_line_naming_the_parameter(who):
    import gacbench
    from gacbench.usage import UsageError

    with pytest.raises(UsageError, match=rf"^{who}: parameter 'emb.weight' \(shape \(10, 3\)\) has a sparse "
                                         r"gradient .*sparse=False") as err:
        make_trainer([getattr(gacbench, who)()], max_steps=2).fit(EmbeddingModel(sparse=True))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("who", ["GAC", "AlignmentMonitor"])
def test_a_complex_parameter_is_refused_in_one_line_naming_it(who):
    import gacbench
    from gacbench.usage import UsageError

    with pytest.raises(UsageError, match=rf"^{who}: parameter 'scale' \(shape \(3,\)\) is complex .*view_as_real"):
        make_trainer([getattr(gacbench, who)()], max_steps=2).fit(EmbeddingModel(complex_weight=True))


def test_the_hooks_refuse_sparse_gradients_and_complex_parameters():
    from gacbench.usage import UsageError

    with pytest.raises(UsageError, match=r"^attach_gac: parameter 1 of the optimizer's .* is complex"):
        attach_gac(torch.optim.SGD([nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2, dtype=torch.cfloat))],
                                   lr=0.1))
    emb = nn.Embedding(10, 3, sparse=True)
    for attach in (attach_gac, attach_alignment_monitor):
        opt = torch.optim.SGD(emb.parameters(), lr=0.1)
        hook = attach(opt)
        emb.zero_grad()
        emb(torch.tensor([1, 2])).sum().backward()
        with pytest.raises(UsageError, match=r"parameter 0 of the optimizer's .* has a sparse gradient"):
            opt.step()
        hook.remove()


class SparseParameter(EmbeddingModel):
    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.eye(3).to_sparse())

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) + torch.sparse.sum(self.table)


def test_the_staleness_simulator_copies_complex_parameters_and_refuses_sparse_ones():
    from gacbench.usage import UsageError

    model = EmbeddingModel(complex_weight=True)
    make_trainer([StalenessSimulator(1)], max_steps=2).fit(model)  # copies are exact for complex tensors too
    with pytest.raises(UsageError, match=r"^StalenessSimulator: parameter 'table' \(shape \(3, 3\)\) is a sparse "
                                         r"tensor"):
        make_trainer([StalenessSimulator(1)], max_steps=2).fit(SparseParameter())


# -- the TRL callback's summary --------------------------------------------------------------------------------------
def test_trl_summary_is_the_monitors_when_gac_measures_another_reference():
    """reference="ema": GAC's trace is the cosine against the EMA; Table 3's statistics are c_t's, the monitor's."""
    pytest.importorskip("transformers")
    from transformers import TrainerState

    from gacbench.integrations.trl import GACCallback

    params = [nn.Parameter(torch.zeros(5))]
    opt = torch.optim.SGD(params, lr=0.0)
    cb = GACCallback(reference="ema", ema_decay=0.5, warmup=0, c_low=0.9, c_high=0.95)
    cb.on_train_begin(None, TrainerState(), None, optimizer=opt)
    gen = torch.Generator().manual_seed(0)
    raw = [torch.randn(5, generator=gen) for _ in range(6)]
    for g in raw:
        params[0].grad = g.clone()
        opt.step()
    cb.on_train_end(None, TrainerState(), None)
    want = [_cos([raw[t]], [raw[t - 1]]) for t in range(1, 6)]
    assert cb.summary["n"] == 5
    assert cb.summary["max_abs"] == pytest.approx(max(abs(c) for c in want), rel=1e-6)
    assert cb.summary["median"] == pytest.approx(sorted(want)[2], rel=1e-6)


# -- the spectrum readings: the largest curvature, not the smallest -------------------------------------------------
def test_logistic_smoothness_reads_the_top_of_the_spectrum():
    """L = sigma_max(X / sqrt(n))^2 / 4 + l2, from numpy's singular values (sorted largest first), and at least
    the Rayleigh quotient of any direction: reading the other end of the spectrum gives a far smaller L."""
    import numpy as np

    from gacbench.objectives import LogisticRegression

    model = LogisticRegression(n=64, dim=6, l2=1e-3, steps=2)
    x = model.x.double().numpy()
    sv = np.linalg.svd(x / np.sqrt(len(x)), compute_uv=False)
    assert model.L == pytest.approx(sv[0] ** 2 / 4 + 1e-3, rel=1e-5)
    assert sv[0] > 2 * sv[-1]  # the two ends differ: the test tells them apart
    h = x.T @ x / len(x) / 4
    gen = np.random.default_rng(0)
    for v in gen.standard_normal((20, 6)):
        assert model.L >= v @ h @ v / (v @ v)


def test_quadratic_curvatures_span_mu_to_l():
    from gacbench.objectives import NoisyQuadratic

    q = NoisyQuadratic(dim=7, L=2.0, kappa=50.0, steps=2)
    assert float(q.eigs.max()) == pytest.approx(q.L) and float(q.eigs.min()) == pytest.approx(q.mu)
    assert q.mu == pytest.approx(2.0 / 50.0)


# -- docs/integrations.md ------------------------------------------------------------------------------------------
def test_the_plain_pytorch_snippet_of_the_integrations_doc_runs_as_written(tmp_path, monkeypatch, capsys):
    code = _doc_block("## Plain PyTorch")
    monkeypatch.chdir(tmp_path)
    scope: dict = {"__name__": "snippet"}
    exec(compile(code, "docs/integrations.md", "exec"), scope)
    gac = scope["gac"]
    assert gac.steps == 20 and gac.summary()["n"] == 14  # 19 c_t values, 5 of them in the warm-up
    assert (tmp_path / "ckpt.pt").is_file() and "align/cos" in capsys.readouterr().out
    assert not scope["opt"]._optimizer_step_pre_hooks  # removed


def _doc_block(heading: str) -> str:
    from pathlib import Path

    doc = (Path(__file__).parent.parent / "docs" / "integrations.md").read_text()
    section = doc[doc.index(heading):]
    start = section.index("```python\n") + len("```python\n")
    return section[start:section.index("\n```", start)]


def test_the_trainer_snippet_of_the_integrations_doc_runs_as_written(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    scope: dict = {"__name__": "snippet"}
    exec(compile(_doc_block("## TRL (and any"), "docs/integrations.md", "exec"), scope)
    cb, trainer = scope["cb"], scope["trainer"]
    assert cb.gac.steps == 10 and cb.summary["n"] == 7  # 9 c_t values, 2 of them in the warm-up
    logged = [h["align/cos"] for h in trainer.state.log_history if "align/cos" in h]
    assert len(logged) == 9 and all(math.isfinite(c) for c in logged)


@pytest.mark.parametrize("settings", [{"reference": "grad"}, {"reference": "applied"}, {"reference": "update"},
                                      {"reference": "ema"}, {"target": "step"}])
def test_gac_on_a_stale_mixed_dtype_model_keeps_each_dtype(settings):
    """Every reference (and the step target) on the bfloat16-first model under staleness: the reference keeps each
    parameter's dtype, the parameters keep theirs, and every logged cosine is finite."""
    from gacbench import GAC

    model = MixedModel()
    gac = GAC(warmup=0, c_low=0.05, c_high=0.5, **settings)
    make_trainer([StalenessSimulator(2), gac], max_steps=10).fit(model)
    assert [p.dtype for p in model.parameters()] == [torch.bfloat16, torch.float32, torch.float16]
    if "target" in settings:
        assert [v.dtype for v in gac.step_transform.theta.views] == [torch.bfloat16, torch.float32, torch.float16]
    else:
        assert [r.dtype for r in gac.transform.state.ref] == [torch.bfloat16, torch.float32, torch.float16]
    assert len(gac.trace.values) >= 8 and all(math.isfinite(c) for c in gac.trace.values)


@pytest.mark.filterwarnings("ignore:.*non-finite.*", "ignore:.*skip.*")
def test_the_trl_callback_logs_no_cosine_for_zero_and_non_finite_gradients():
    """The TRL callback reports the monitor's c_t (reference="update" attaches it): the zero and the inf step log
    NaN, the steps after them are measured against the last usable gradient, and its summary counts them skipped."""
    from transformers import TrainerState

    from gacbench.integrations.trl import GACCallback

    params = [nn.Parameter(torch.zeros_like(t)) for t in _grads(0)]
    opt = torch.optim.SGD(params, lr=0.0)
    cb = GACCallback(reference="update", warmup=0)
    state = TrainerState()
    cb.on_train_begin(None, state, None, optimizer=opt)
    seq, want = _sequence()
    logged = []
    for t, gs in enumerate(seq):
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
        state.global_step = t + 1
        logs = {}
        state.log_history.append({"step": state.global_step})
        cb.on_log(None, state, None, logs=logs)
        logged.append(logs.get("align/cos"))
    cb.on_train_end(None, state, None)
    assert logged[0] is None and _same_trace(logged[1:], want), logged
    assert cb.summary["n"] == 2 and cb.summary["skipped"] == 2


@pytest.mark.parametrize("who", ["GAC", "AlignmentMonitor", "DriftMonitor"])
def test_a_callbacks_sharded_state_is_not_restored_from_rank_0s_shard_on_every_rank(who):
    """Under a sharded strategy each rank holds its own shard of the reference, and Lightning saves a callback's
    part of the checkpoint from rank 0 only: restoring it on several ranks is refused in one line; one rank, or
    no stored state, restores as before."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import ModelParallelStrategy

    import gacbench
    from gacbench.callbacks._common import CKPT_TENSORS_KEY

    callback = getattr(gacbench, who)()
    sharded = SimpleNamespace(strategy=ModelParallelStrategy(), world_size=2)
    stored = {key: {"stored": True} for key in (callback.state_key, callback.state_key + "/start",
                                                callback.state_key + "/prev")}
    with pytest.raises(RuntimeError, match=f"^{who}: cannot resume its state under ModelParallelStrategy with 2 "
                                           "ranks: the checkpoint holds rank 0's shard"):
        callback.on_load_checkpoint(sharded, None, {CKPT_TENSORS_KEY: stored})
    callback.on_load_checkpoint(sharded, None, {})  # nothing stored: nothing to refuse


def test_a_parameter_replicated_over_several_ranks_is_refused_naming_its_placements(monkeypatch, tmp_path):
    """Tensor parallelism's replicated parameters (and HSDP's replicas) would be counted once per replica in the
    sharded sums: refused when the callbacks collect the optimizer's parameters."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from gacbench.callbacks._common import check_no_replicated_shards

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        sharded = torch.nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]))
        replicated = torch.nn.Parameter(distribute_tensor(torch.ones(4), mesh, [Replicate()]))
        check_no_replicated_shards([sharded, replicated], "GAC")  # a mesh of one rank: nothing counted twice
        monkeypatch.setattr(DeviceMesh, "size", lambda self, mesh_dim=None: 2)  # the same tensors on two ranks
        check_no_replicated_shards([sharded], "GAC")
        with pytest.raises(RuntimeError, match=r"^GAC: a parameter of shape \(4,\) is replicated over 2 ranks of "
                                               r"its device mesh \(placements \(Replicate\(\),\)\)"):
            check_no_replicated_shards([sharded, replicated], "GAC")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("warmup,tol,verdict", [
    (np.int64(3), torch.tensor(0.125), "ok"), (-1, 0.05, "warmup=-1"), (True, 0.05, "warmup=True"),
    (2.5, 0.05, "warmup=2.5"), (3, 0.0, "tol=0.0"), (3, "0.1", "tol='0.1'"),
])
def test_the_monitors_accept_and_refuse_the_summary_settings_as_gac_does(warmup, tol, verdict):
    """AlignmentMonitor, its hook and GAC read warmup and tol by one rule: any real number (stored as a Python int
    and float), each refusal naming the class."""
    from gacbench import GAC, AlignmentMonitor

    def hook(**kw):
        return attach_alignment_monitor(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), **kw)

    for make, who in ((AlignmentMonitor, "AlignmentMonitor"), (hook, "attach_alignment_monitor"), (GAC, "GAC")):
        if verdict == "ok":
            made = make(warmup=warmup, tol=tol)
            trace = getattr(made, "trace", made)  # the callbacks keep warmup and tol in their CosineTrace
            assert (trace.warmup, trace.tol) == (3, 0.125) and type(trace.warmup) is int and type(trace.tol) is float
        else:
            with pytest.raises(ValueError, match=f"^{who}: {re.escape(verdict)}"):
                make(warmup=warmup, tol=tol)
