"""Bad inputs and faults at GAC's edges: gradients too large for float32 products, the callback order
that reference='update' depends on, and skipped steps under DDP (docs/reliability.md lists them)."""

import json
import math
import os
import subprocess
import sys

import lightning.pytorch as pl
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from conftest import UserRegressor, flat_params, gac_oracle, make_trainer  # noqa: E402
from test_gac_callback import StepAudit  # noqa: E402

from gacbench import GAC, AlignmentMonitor, StalenessSimulator  # noqa: E402
from gacbench.functional import alignment_scalars, cosine_from_scalars, dot  # noqa: E402
from gacbench.functional.alignment import KEEP, PROJECT, SHRINK  # noqa: E402
from gacbench.functional.gac import GACTransform  # noqa: E402

BIG = 1e22  # ||g||^2 ~ 1e44 overflows float32 (max ~3.4e38); the gradient itself is finite


# -- gradients whose squared norm overflows float32 ------------------------------------------------


def test_scalars_of_a_huge_finite_vector_are_finite_and_exact():
    g = [torch.full((3, 4), BIG), torch.full((5,), -BIG)]
    r = [torch.ones(3, 4), torch.ones(5)]
    s = alignment_scalars(g, r)
    assert s.dtype == torch.float64
    big32 = float(torch.tensor(BIG))  # 1e22 as float32 holds it
    assert s.tolist() == pytest.approx([7 * big32, 17 * big32**2, 17.0], rel=1e-12)
    assert cosine_from_scalars(s) == pytest.approx(7 / 17, rel=1e-12)  # (12 - 5) / (sqrt(17) sqrt(17))
    assert float(dot(g, g)) == pytest.approx(17 * big32**2, rel=1e-12)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_scalars_of_a_non_finite_vector_stay_non_finite(bad):
    g = [torch.full((3, 4), BIG), torch.tensor([1.0, bad, 2.0])]
    s = alignment_scalars(g, [torch.ones(3, 4), torch.ones(3)])
    assert not math.isfinite(float(s[1]))


def _step(gac, p, grad, swap):
    p.grad = torch.tensor(grad)
    return gac.step([p], swap=swap, keep_alias=swap)


@pytest.mark.parametrize("swap", [False, True])
def test_transform_projects_and_keeps_huge_gradients(swap):
    """By hand, with r = (1, 0, 0, 0): g = 1e22 (1, 1, 0, 0) has c = 1/sqrt(2) >= c_high and loses its first
    coordinate; g = 1e22 (-1, 1, 0, 0) is orthogonal to that raw gradient and is kept bit for bit; a normal g
    against a 1e22 reference is projected too. An inf in the gradient is still reported bad, and leaves the
    reference alone."""
    big = float(torch.tensor(BIG))
    p = torch.nn.Parameter(torch.zeros(4))
    gac = GACTransform(c_low=0.05, c_high=0.3)
    _step(gac, p, [1.0, 0.0, 0.0, 0.0], swap)
    out = _step(gac, p, [BIG, BIG, 0.0, 0.0], swap)
    assert not out.bad and out.decision.action == PROJECT
    assert out.cos == pytest.approx(1 / math.sqrt(2), rel=1e-7) and out.grad_sq == pytest.approx(2 * big**2, rel=1e-7)
    assert p.grad.tolist() == [0.0, big, 0.0, 0.0]
    out = _step(gac, p, [-BIG, BIG, 0.0, 0.0], swap)  # the reference is now the raw 1e22 (1, 1, 0, 0)
    assert out.decision.action == KEEP and out.cos == 0.0
    assert p.grad.tolist() == [-big, big, 0.0, 0.0]
    out = _step(gac, p, [-1.0, 2.0, 0.0, 0.0], swap)  # against r = 1e22 (-1, 1, 0, 0): c = 3 / sqrt(10)
    assert out.decision.action == PROJECT and out.cos == pytest.approx(3 / math.sqrt(10), rel=1e-7)
    torch.testing.assert_close(p.grad, torch.tensor([0.5, 0.5, 0.0, 0.0]), rtol=1e-6, atol=1e-6)
    out = _step(gac, p, [float("inf"), 1.0, 0.0, 0.0], swap)
    assert out.bad and not out.zero
    out = _step(gac, p, [-2.0, 4.0, 0.0, 0.0], swap)  # the reference is still (-1, 2, 0, 0): c = 1, projected to 0
    assert out.decision.action == PROJECT and out.cos == pytest.approx(1.0, rel=1e-7)
    torch.testing.assert_close(p.grad, torch.zeros(4), rtol=0, atol=1e-6)


def test_transform_shrinks_a_huge_gradient_by_the_rule():
    """c = 0.1 against r = (1, 0, 0, 0): the aligned component 0.1 ||g|| is brought down to c_low ||g||."""
    p = torch.nn.Parameter(torch.zeros(4))
    gac = GACTransform(c_low=0.05, c_high=0.3)
    _step(gac, p, [1.0, 0.0, 0.0, 0.0], True)
    g = BIG * torch.tensor([0.1, math.sqrt(1 - 0.01), 0.0, 0.0], dtype=torch.float64)
    out = _step(gac, p, g.float().tolist(), True)
    assert out.decision.action == SHRINK and out.cos == pytest.approx(0.1, rel=1e-6)
    expected = g.clone()
    expected[0] = 0.05 * float(g.norm())
    torch.testing.assert_close(p.grad.double(), expected, rtol=1e-6, atol=0)


class ScaledAt(UserRegressor):
    """The plain regressor whose loss is multiplied by ``scale`` at optimizer step ``at``."""

    def __init__(self, at, scale, **kw):
        super().__init__(**kw)
        self.at, self.scale = at, scale

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * self.scale if self.global_step == self.at else loss


class GradTap(pl.Callback):
    def __init__(self):
        self.grads = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append(torch.cat([p.grad.detach().double().reshape(-1) for p in pl_module.parameters()]))


def _rule(g, r, c_low=0.05, c_high=0.3):
    """docs/callbacks.md's rule in float64, by hand: (c, g_tilde) for high_mode='project', shrink='component'."""
    c = float(g @ r / (g.norm() * r.norm()))
    k = 0.0 if c <= c_low else (1.0 - c_low / c if c < c_high else 1.0)
    return c, g - k * (g @ r) / (r @ r) * r


def test_huge_gradient_inside_a_trainer_is_processed_not_skipped():
    """The last step's gradient is 1e22 times the usual one: GAC logs its c_t and applies the rule to it, and
    so does AlignmentMonitor; a NaN gradient is still skipped."""
    before, after = GradTap(), GradTap()
    gac = GAC(c_low=0.05, c_high=0.3, warmup=0)
    trainer = make_trainer([StalenessSimulator(3), before, gac, after], max_steps=8)
    trainer.fit(ScaledAt(at=7, scale=BIG))
    assert gac.bad == 0 and gac.steps == 8
    g, r = before.grads[7], before.grads[6]
    assert float(g.norm()) > 1e20  # ||g||^2 overflows float32
    c, expected = _rule(g, r)
    assert c >= 0.3  # stale gradients are aligned: the huge one is projected
    assert trainer.logger.values("align/cos")[-1] == pytest.approx(c, abs=1e-6)
    assert trainer.logger.values("grad/norm")[-1] == pytest.approx(float(g.norm()), rel=1e-6)
    torch.testing.assert_close(after.grads[7], expected, rtol=0, atol=1e-5 * float(g.norm()))

    tap, mon = GradTap(), AlignmentMonitor(warmup=0)
    make_trainer([StalenessSimulator(3), tap, mon], max_steps=8).fit(ScaledAt(at=7, scale=BIG))
    g, r = tap.grads[7], tap.grads[6]
    assert float(g.norm()) > 1e20
    assert mon.trace.values[-1] == pytest.approx(float(g @ r / (g.norm() * r.norm())), abs=1e-6)

    skipped = GAC()
    nan_model = ScaledAt(at=4, scale=float("nan"))
    with pytest.warns(UserWarning, match="skipping step 4"):
        make_trainer([skipped], max_steps=6).fit(nan_model)
    assert skipped.bad == 1 and torch.isfinite(flat_params(nan_model)).all()


# -- the callback order reference='update' depends on -----------------------------------------------


class Swapper(pl.Callback):
    """A third-party callback that declares it swaps the parameters (and does nothing)."""

    swaps_parameters = True


@pytest.mark.parametrize("swapper", [lambda: StalenessSimulator(3), Swapper])
def test_update_reference_listed_before_a_parameter_swapper_is_refused(swapper):
    with pytest.raises(ValueError, match="must be listed after (StalenessSimulator|Swapper).*Move GAC after"):
        make_trainer([GAC(reference="update"), swapper()], max_steps=2).fit(UserRegressor())


def test_update_reference_listed_after_the_simulator_runs():
    make_trainer([StalenessSimulator(3), GAC(reference="update")], max_steps=4).fit(UserRegressor())
    # s = 0 swaps nothing (swaps_parameters is False), so the order does not matter
    make_trainer([GAC(reference="update"), StalenessSimulator(0)], max_steps=2).fit(UserRegressor())


@pytest.mark.parametrize("kernels", ["eager", "fused-adamw"])
@pytest.mark.parametrize("reference", ["grad", "applied", "ema"])
def test_gradient_references_do_not_depend_on_the_order(reference, kernels):
    """These references read only gradients, which the simulator never touches: GAC may come first. With
    kernels="fused-adamw" GAC listed before the simulator leaves the step to the optimizer (taken inside GAC's
    hook, it would start from the stale iterate that the simulator then overwrites with theta_t)."""
    runs = []
    for gac_first in (False, True):
        sim, gac = StalenessSimulator(3), GAC(reference=reference, c_low=0.0, c_high=0.3, kernels=kernels)
        model = UserRegressor(optimizer="adamw")
        make_trainer([gac, sim] if gac_first else [sim, gac], max_steps=12).fit(model)
        assert gac.changed > 0
        runs.append(flat_params(model))
    if kernels == "eager":
        assert torch.equal(runs[0], runs[1])
    else:  # AdamW's fused step and its own step round differently
        torch.testing.assert_close(runs[0], runs[1], rtol=1e-5, atol=1e-6)


def test_fused_adamw_leaves_the_step_to_the_optimizer_before_a_callback_that_scales_the_learning_rate():
    """A learning-rate scale applied in a later callback's on_before_optimizer_step must reach the shrunk and
    projected steps too: listed before it, the fused path leaves those steps to the optimizer."""
    from gacbench.stabilizers import StalenessLR

    runs = []
    for kernels in ("eager", "fused-adamw"):
        gac = GAC(c_low=0.0, c_high=0.3, kernels=kernels)
        model = UserRegressor(optimizer="adamw")
        make_trainer([StalenessSimulator(4), gac, StalenessLR()], max_steps=12).fit(model)
        assert gac.changed > 0
        runs.append(flat_params(model))
    torch.testing.assert_close(runs[0], runs[1], rtol=1e-5, atol=1e-6)


class RawGradients(pl.Callback):
    """Listed before GAC: the raw gradient of every step, as float64."""

    def __init__(self):
        self.grads = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append(torch.cat([p.grad.detach().reshape(-1).double() for p in pl_module.parameters()]))


class ClipsInItsHook(UserRegressor):
    """Clips its gradients in place in its own on_before_optimizer_step, which Lightning calls after the callbacks'."""

    def on_before_optimizer_step(self, optimizer):
        torch.nn.utils.clip_grad_norm_(self.parameters(), 0.05)


class NesterovRegressor(UserRegressor):
    """SGD with Nesterov momentum on the foreach path (torch's default on CUDA), which adds the momentum into p.grad
    in place during the step."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, nesterov=True, foreach=True)


@pytest.mark.parametrize("model_cls", [ClipsInItsHook, NesterovRegressor])
def test_c_t_is_that_of_the_raw_gradients_when_p_grad_is_edited_in_place_after_gac(model_cls):
    """A kept step's reference may be p.grad itself only while nothing writes p.grad before the next step: the
    module's own hook (clipping) or the optimizer's step (foreach Nesterov SGD) would change the reference, and c_t
    with it."""
    raw, gac = RawGradients(), GAC(c_low=0.05, c_high=0.3, warmup=0)
    make_trainer([raw, gac], max_steps=20).fit(model_cls(n=160, batch_size=8))
    want = [float(a @ b / (a.norm() * b.norm())) for a, b in zip(raw.grads[1:], raw.grads[:-1])]
    assert gac.trace.values == pytest.approx(want, abs=1e-6)


# -- parameters without a gradient on a step (a conditional branch): the rule reads the full vectors ----


class BranchRegressor(UserRegressor):
    """UserRegressor with a side branch the forward pass takes on every third batch only: on the other
    steps the side layer has no gradient (``p.grad`` is None)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.side = torch.nn.Linear(5, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x) + (self.side(x) if batch_idx % 3 == 0 else 0.0)
        return torch.nn.functional.mse_loss(out, y)

    def configure_optimizers(self):
        groups = [{"params": [*self.net[0].parameters(), *self.side.parameters()]},
                  {"params": self.net[2].parameters(), "lr": self.lr / 2}]
        return torch.optim.AdamW(groups, lr=self.lr)


class MaskedTap(pl.Callback):
    """Per step: the gradient as a flat float64 vector (zeros where ``p.grad`` is None), which parameters had
    one (a flat bool mask), and theta_t."""

    def __init__(self):
        self.grads, self.masks, self.theta = [], [], []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        ps = [p for g in optimizer.param_groups for p in g["params"]]
        self.grads.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).double().reshape(-1)
                                     for p in ps]))
        self.masks.append(torch.cat([torch.full((p.numel(),), p.grad is not None) for p in ps]))
        self.theta.append(torch.cat([p.detach().double().reshape(-1) for p in ps]))


@pytest.mark.parametrize("reference,kernels", [("grad", "eager"), ("applied", "eager"), ("update", "eager"),
                                               ("ema", "eager"), ("grad", "compiled"), ("grad", "fused-adamw")])
def test_a_parameter_without_a_gradient_counts_as_zero_in_the_full_vector(reference, kernels):
    """On the steps where the side branch is not taken, the logged cosine and the applied gradient are the
    full-vector rule's (the side layer's part of the reference counts in ||r||); the side layer gets no
    gradient. The live-only cosine differs on those steps, so the test tells the two apart."""
    c_low, c_high, decay = 0.05, 0.25, 0.7
    before, after = MaskedTap(), MaskedTap()
    gac = GAC(c_low=c_low, c_high=c_high, reference=reference, ema_decay=decay, warmup=0, kernels=kernels)
    trainer = make_trainer([StalenessSimulator(3), before, gac, after], max_steps=16)
    trainer.fit(BranchRegressor(lr=0.05))
    masks = before.masks
    assert not all(bool(m.all()) for m in masks) and any(bool(m.all()) for m in masks)
    cos, applied = gac_oracle(reference, before.grads, after.theta, c_low, c_high, decay, masks=masks)
    key = "align/cos" if reference == "grad" else "align/ref_cos"
    assert trainer.logger.values(key) == pytest.approx(cos[1:], abs=1e-5)
    for t, (got, want, live, seen) in enumerate(zip(after.grads, applied, masks, after.masks)):
        assert torch.equal(seen, live), f"step {t}: a parameter without a gradient was given one"
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=f"step {t}")
    if reference == "grad":  # the cosine over the parameters with a gradient only is another number
        restricted = [float((g * r)[m].sum() / ((g * g)[m].sum() * (r * r)[m].sum()).sqrt())
                      for g, r, m in zip(before.grads[1:], before.grads, masks[1:])]
        assert max(abs(a - b) for a, b in zip(restricted, cos[1:])) > 1e-3
    # the rule changed gradients on steps where the side layer had none
    assert any(c > c_low and not bool(m.all()) for c, m in zip(cos[1:], masks[1:]))


def test_monitor_counts_a_missing_gradient_as_zero():
    tap, mon = MaskedTap(), AlignmentMonitor(warmup=0)
    trainer = make_trainer([StalenessSimulator(3), tap, mon], max_steps=10)
    trainer.fit(BranchRegressor())
    g = tap.grads
    expected = [float(g[t] @ g[t - 1] / (g[t].norm() * g[t - 1].norm())) for t in range(1, 10)]
    assert trainer.logger.values("align/cos") == pytest.approx(expected, abs=1e-6)


def test_the_monitor_hook_counts_a_missing_gradient_as_zero():
    """attach_alignment_monitor in a plain loop over the same branchy model: c_t of the full vectors."""
    from gacbench import attach_alignment_monitor

    model = BranchRegressor()
    optimizer = model.configure_optimizers()
    hook = attach_alignment_monitor(optimizer, warmup=0)
    flat, cos, batches = [], [], list(model.train_dataloader())
    for i in range(10):
        optimizer.zero_grad()
        model.training_step(batches[i % len(batches)], i).backward()
        flat.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).double().reshape(-1)
                               for group in optimizer.param_groups for p in group["params"]]))
        optimizer.step()
        if i:
            cos.append(hook.metrics["align/cos"])
    expected = [float(flat[t] @ flat[t - 1] / (flat[t].norm() * flat[t - 1].norm())) for t in range(1, 10)]
    assert any(float(x.abs().min()) == 0.0 for x in flat)  # some steps do leave the side branch out
    assert cos == pytest.approx(expected, abs=1e-6)


def test_scalars_with_the_rest_of_the_reference_equal_the_full_vectors_bit_for_bit():
    """<g, r>, ||g||^2, ||r||^2 with r's tensors of missing gradients passed as ``ref_rest`` are exactly the
    sums over the full vectors with those gradients written out as zeros (tensors above a CPU block too)."""
    gen = torch.Generator().manual_seed(1)
    shapes = [(300, 700), (5,), (1 << 18,), (3, 4)]
    g = [torch.randn(s, generator=gen) for s in shapes]
    r = [torch.randn(s, generator=gen) for s in shapes]
    full = alignment_scalars([g[0], torch.zeros(shapes[1]), g[2], torch.zeros(shapes[3])], r)
    part = alignment_scalars([g[0], g[2]], [r[0], r[2]], ref_rest=[r[1], r[3]])
    assert torch.equal(full, part)
    assert float(part[2]) == pytest.approx(sum(float((x.double() ** 2).sum()) for x in r), rel=1e-5)
    assert float(part[1]) == pytest.approx(sum(float((x.double() ** 2).sum()) for x in (g[0], g[2])), rel=1e-5)
    bf = [x.bfloat16() for x in r]  # a lower-precision reference: upcast, the same sums
    assert torch.equal(alignment_scalars([g[0], g[2]], [bf[0], bf[2]], ref_rest=[bf[1], bf[3]]),
                       alignment_scalars([g[0], torch.zeros(shapes[1]), g[2], torch.zeros(shapes[3])], bf))


# -- high_mode='skip' under DDP: on a skipped step no rank's optimizer applies the gradient ----------


def _ddp_skip_run(out_dir: str) -> None:
    gac = GAC(c_low=0.0, c_high=1e-6, high_mode="skip", warmup=0)  # any positive alignment skips
    audit = StepAudit(gac)
    trainer = make_trainer([StalenessSimulator(3), gac, audit], max_steps=10, strategy="ddp", devices=2,
                           accelerator="cpu")
    model = UserRegressor(n=128, optimizer="adamw")
    trainer.fit(model)
    with open(os.path.join(out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump({"rows": audit.rows, "skipped": gac.skipped, "params": flat_params(model).tolist()}, f)


@pytest.mark.distributed
def test_ddp_skip_leaves_parameters_and_optimizer_state_untouched_on_every_rank(tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), str(tmp_path)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["rows"] == ranks[1]["rows"] and ranks[0]["params"] == ranks[1]["params"]
    rows = ranks[0]["rows"]
    skipped = [row for row in rows if row["skipped"]]
    applied = [row for row in rows if not row["skipped"]]
    assert len(skipped) == ranks[0]["skipped"] > 0 and applied
    assert all(row["params_equal"] and row["state_equal"] for row in skipped)
    assert not any(row["params_equal"] or row["state_equal"] for row in applied)


if __name__ == "__main__":  # the DDP run of the test above (Lightning starts the second rank from this script)
    _ddp_skip_run(sys.argv[1])


def test_a_tiny_gradient_has_a_cosine_like_any_other():
    # consecutive gradients parallel, norms 3e-16: c = 1, a projection, not the 0 of a zero norm
    g = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 1e-17
    p = torch.nn.Parameter(torch.zeros(1000))
    t = GACTransform(kernels="eager")
    for _ in range(2):
        p.grad = g.clone()
        out = t.step([p])
    assert out.cos == pytest.approx(1.0, abs=1e-6) and out.decision.action == PROJECT
    assert cosine_from_scalars(torch.tensor([0.0, 1e-300, 0.0], dtype=torch.float64)) == 0.0
    assert cosine_from_scalars(torch.tensor([1e-300, 1e-300, 1e-300], dtype=torch.float64)) == pytest.approx(1.0)


class _ClipsItself(pl.LightningModule):
    """Linear regression on one fixed batch at lr 0: every gradient is the same, so c_t = 1 from step 2 on.
    ``own_clip``: the module clips in its own configure_gradient_clipping, which Lightning calls after the
    callbacks' on_before_optimizer_step."""

    def __init__(self, own_clip: bool) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)
        self.lin = torch.nn.Linear(8, 1)
        self.own_clip = own_clip

    def training_step(self, batch, i):
        return torch.nn.functional.mse_loss(self.lin(self.x), self.y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(range(4), batch_size=1)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        if self.own_clip:
            torch.nn.utils.clip_grad_norm_(self.parameters(), 0.01)
        else:
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)


@pytest.mark.parametrize("own_clip", [True, False])
def test_clipping_in_the_modules_own_hook_leaves_the_reference_unclipped(own_clip):
    gac = GAC(kernels="eager", c_low=0.05, c_high=0.5)
    trainer = make_trainer(max_steps=4, callbacks=[gac], gradient_clip_val=None if own_clip else 0.01)
    trainer.fit(_ClipsItself(own_clip))
    # c_t is taken before clipping against a reference that was not clipped: 1, and every step projected
    assert gac.trace.values == pytest.approx([1.0] * 3, abs=1e-9)  # steps 2-4 (step 1 has no reference)
    assert gac.changed == 3


def _channels_last_conv():
    conv = torch.nn.Conv2d(3, 8, 3)
    with torch.no_grad():
        for p in conv.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    return conv, x


@pytest.mark.parametrize("reference", ["grad", "ema"])
def test_a_bfloat16_reference_of_channels_last_parameters_equals_the_contiguous_run(reference):
    runs = []
    for layout in (torch.contiguous_format, torch.channels_last):
        conv, x = _channels_last_conv()
        conv = conv.to(memory_format=layout)
        t = GACTransform(kernels="eager", buffer_dtype="bfloat16", reference=reference)
        seen = []
        for i in range(4):
            conv.zero_grad(set_to_none=True)
            conv(x.to(memory_format=layout) * (1.0 + 0.1 * i)).square().mean().backward()
            out = t.step(list(conv.parameters()))
            seen.append((out.cos, out.decision.action, [p.grad.contiguous().clone() for p in conv.parameters()]))
        runs.append(seen)
    assert not conv.weight.grad.is_contiguous()  # the channels_last run's gradient kept its layout
    for (c0, a0, g0), (c1, a1, g1) in zip(*runs):
        assert (math.isnan(c0) and math.isnan(c1)) or c0 == pytest.approx(c1, abs=1e-6)
        assert a0 == a1
        for x0, x1 in zip(g0, g1):
            torch.testing.assert_close(x1, x0, rtol=1e-5, atol=1e-7)
    assert any(a == PROJECT or a == SHRINK for _, a, _ in runs[1][1:])


def test_step_gac_on_channels_last_parameters_equals_the_contiguous_run():
    from gacbench.functional.step_gac import StepGAC

    runs = []
    for layout in (torch.contiguous_format, torch.channels_last):
        conv, x = _channels_last_conv()
        conv = conv.to(memory_format=layout)
        params = list(conv.parameters())
        opt = torch.optim.SGD(params, lr=0.1)
        gac = StepGAC()
        gac.start(params)
        seen = []
        for _ in range(4):
            opt.zero_grad()
            conv(x.to(memory_format=layout)).square().mean().backward()
            opt.step()
            out = gac.step(params)
            seen.append((out.cos, out.decision.action, [p.detach().contiguous().clone() for p in params]))
        runs.append(seen)
        assert conv.weight.is_contiguous() == (layout == torch.contiguous_format)
    for (c0, a0, p0), (c1, a1, p1) in zip(*runs):
        assert (math.isnan(c0) and math.isnan(c1)) or c0 == pytest.approx(c1, abs=1e-6)
        assert a0 == a1
        for x0, x1 in zip(p0, p1):
            torch.testing.assert_close(x1, x0, rtol=1e-5, atol=1e-7)
    assert any(a != KEEP for _, a, _ in runs[1][1:])


@pytest.mark.parametrize("reference", ["grad", "ema"])
def test_gac_and_the_monitor_reused_for_a_second_fit_start_it_fresh(reference):
    """An instance passed to a second Trainer.fit carries no reference, trace or count of the first fit into it:
    the second fit equals one with new instances."""
    def fit(gac, monitor):
        model = UserRegressor(optimizer="adamw", seed=1)
        make_trainer([monitor, gac], max_steps=10).fit(model)
        return flat_params(model)

    gac, monitor = GAC(reference=reference, c_low=0.0, c_high=0.3, warmup=0), AlignmentMonitor(warmup=0)
    make_trainer([monitor, gac], max_steps=10).fit(UserRegressor(optimizer="adamw", seed=0))
    again = fit(gac, monitor)
    fresh_gac, fresh_monitor = GAC(reference=reference, c_low=0.0, c_high=0.3, warmup=0), AlignmentMonitor(warmup=0)
    assert torch.equal(again, fit(fresh_gac, fresh_monitor))
    assert gac.trace.values == fresh_gac.trace.values and gac.steps == fresh_gac.steps == 10
    assert gac.summary == fresh_gac.summary and gac.changed == fresh_gac.changed
    if reference != "grad":  # the monitor logs c_t of the raw gradient beside GAC
        assert monitor.trace.values == fresh_monitor.trace.values and monitor.summary == fresh_monitor.summary
