"""GAC on the optimizer's step (``GAC(target="step")``, methods gac-step and gac-step-calibrated), the
monitor's ``align/step_cos``, and the GRPO optimizer section: a hand computation with a copy of torch's
AdamW, checkpoint-resume exactness, two DDP processes against one, the calibration's trace, the settings'
checks."""

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from conftest import UserRegressor, flat_params, make_trainer  # noqa: E402

from gacbench import GAC, AlignmentMonitor, StalenessSimulator  # noqa: E402
from gacbench.functional.step_gac import StepGAC  # noqa: E402

HERE = os.path.dirname(__file__)


def flat(ts):
    return torch.cat([t.detach().reshape(-1) for t in ts])


def hand_rule(delta, ref, c_low, c_high, high_mode):
    """docs/design.md's rule on flat float64 vectors, written out: (applied step, action)."""
    c = float(delta @ ref / (delta.norm() * ref.norm()))
    par = float(delta @ ref) / float(ref @ ref) * ref  # the component along the previous applied step
    if c <= c_low:
        return delta, "keep"
    if c < c_high:
        return delta - (1 - c_low / c) * par, "shrink"
    if high_mode == "skip":
        return torch.zeros_like(delta), "skip"
    return delta - par, "project"


def batches(n_steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(3, 1, generator=gen)
    out = []
    for t in range(n_steps):
        x = torch.randn(8, 3, generator=gen)
        out.append((x, x @ w + 0.3 * torch.randn(8, 1, generator=gen) + (0.5 if t % 5 == 0 else 0.0)))
    return out


@pytest.mark.parametrize("high_mode, c_high", [("project", 0.5), ("skip", 0.9)])
def test_step_gac_equals_a_hand_computation_with_adamw(high_mode, c_high):
    """A tiny linear model and AdamW: StepGAC edits the parameters exactly as the rule written out by hand, on a
    copy of the model stepped by a copy of the optimizer; the run keeps, shrinks and projects (or skips)."""
    c_low = 0.1
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    hand = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    opt_h = torch.optim.AdamW(hand.parameters(), lr=0.05, weight_decay=0.01)
    gac = StepGAC(c_low, c_high, high_mode)
    gac.start(list(model.parameters()))
    ref, actions = None, []
    for x, y in batches(40):
        for m, o in ((model, opt), (hand, opt_h)):
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            if m is model:
                o.step()
                gac.step(list(model.parameters()))
        before = flat(hand.parameters()).double()
        opt_h.step()
        delta = flat(hand.parameters()).double() - before
        if ref is None:
            applied, action = delta, "keep"
        else:
            applied, action = hand_rule(delta, ref, c_low, c_high, high_mode)
        actions.append(action)
        if action != "skip":
            ref = applied
        new = before + applied
        with torch.no_grad():
            offset = 0
            for p in hand.parameters():
                p.copy_(new[offset: offset + p.numel()].view_as(p))
                offset += p.numel()
        torch.testing.assert_close(flat(model.parameters()), flat(hand.parameters()), rtol=0, atol=1e-6)
    high = "skip" if high_mode == "skip" else "project"
    assert {"keep", "shrink", high} <= set(actions), actions


def test_skip_restores_the_parameters_exactly():
    torch.manual_seed(1)
    p = nn.Parameter(torch.randn(50))
    opt = torch.optim.SGD([p], lr=0.1)
    gac = StepGAC(0.05, 0.3, "skip")
    gac.start([p])
    g = torch.randn(50)
    for _ in range(2):  # the same gradient twice: cos = 1, the second step is skipped
        before = p.detach().clone()
        p.grad = g.clone()
        opt.step()
        out = gac.step([p])
    assert out.cos == pytest.approx(1.0) and out.decision.action == 3
    assert torch.equal(p.detach(), before)


def test_a_non_finite_step_never_reaches_the_parameters_nor_the_reference():
    p = nn.Parameter(torch.arange(4.0))
    gac = StepGAC()
    gac.start([p])
    with torch.no_grad():
        p.add_(1.0)
    assert gac.step([p]).decision.action == 0 and gac.has_prev
    with torch.no_grad():
        p[2] = float("nan")
    out = gac.step([p])
    assert out.bad and torch.equal(p.detach(), torch.arange(4.0) + 1.0)
    assert torch.equal(gac.state_dict()["prev"], torch.ones(4))


class NaNAtStep(UserRegressor):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.trainer.global_step == 4 else loss


def test_a_non_finite_gradient_under_the_step_target_is_skipped_before_the_optimizer_or_raises():
    gac = GAC(target="step", warmup=0)
    trainer = make_trainer([gac], max_steps=10)
    model = NaNAtStep(optimizer="adamw")
    with pytest.warns(UserWarning, match="skipping step 4: its gradient is non-finite"):
        trainer.fit(model)
    assert torch.isfinite(flat_params(model)).all() and gac.bad == 1 and gac.steps == 10
    states = trainer.optimizers[0].state.values()
    assert all(torch.isfinite(st["exp_avg"]).all() for st in states)  # AdamW's moments never saw it
    with pytest.raises(FloatingPointError, match="the gradient at step 4 is non-finite"):
        make_trainer([GAC(target="step", on_bad_grad="raise")], max_steps=10).fit(NaNAtStep(optimizer="adamw"))


def test_calibrated_gac_on_the_step_reads_the_step_column(tmp_path):
    from gacbench.methods import CalibratedGAC

    csv = tmp_path / "metrics.csv"
    csv.write_text("step,align/cos,align/step_cos\n" + "".join(f"{i},0.01,{0.3 + 0.01 * i}\n" for i in range(20)))
    cb = CalibratedGAC(reference=csv, target="step")
    assert cb.target == "step" and cb.calibration["max_abs"] == pytest.approx(0.49)
    assert CalibratedGAC(reference=csv).calibration["max_abs"] == pytest.approx(0.01)


def test_a_step_that_moved_nothing_is_not_measured():
    p = nn.Parameter(torch.ones(4))
    gac = StepGAC()
    gac.start([p])
    assert gac.step([p]) is None and not gac.has_prev


class StepTap(pl.Callback):
    """The parameters after every optimizer step (on_train_batch_end comes after the step and its hooks)."""

    def __init__(self):
        self.params = []

    def on_train_start(self, trainer, pl_module):
        self.params.append(flat_params(pl_module).double())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.params.append(flat_params(pl_module).double())


def test_the_monitor_logs_the_cosine_of_consecutive_steps_whatever_the_callback_order():
    tap, mon = StepTap(), AlignmentMonitor(warmup=0, step_cos=True)
    trainer = make_trainer([mon, StalenessSimulator(2), tap], max_steps=10)  # the monitor before the simulator
    trainer.fit(UserRegressor(optimizer="adamw"))
    steps = [b - a for a, b in zip(tap.params, tap.params[1:])]
    expected = [float(s @ r / (s.norm() * r.norm())) for r, s in zip(steps, steps[1:])]
    assert trainer.logger.values("align/step_cos") == pytest.approx(expected, abs=1e-5)
    assert len(trainer.logger.values("align/cos")) == 9


def test_gac_step_in_a_trainer_follows_the_rule_on_the_applied_steps():
    """Inside a Trainer (with a staleness simulator): the logged step cosine is that of the raw step with the
    previous applied step, and every applied step is the rule's output."""
    c_low, c_high = 0.5, 0.9
    tap, mon = StepTap(), AlignmentMonitor(warmup=0, step_cos=True)
    gac = GAC(c_low=c_low, c_high=c_high, target="step", warmup=0)
    trainer = make_trainer([StalenessSimulator(2), mon, gac, tap], max_steps=16)
    trainer.fit(UserRegressor(optimizer="adamw"))
    applied = [b - a for a, b in zip(tap.params, tap.params[1:])]
    cos = trainer.logger.values("align/step_cos")
    assert len(cos) == 15 and gac.changed > 0 and mon.step_passive
    for t in range(1, 16):
        a, ref, c = applied[t], applied[t - 1], cos[t - 1]
        ca = float(a @ ref / (a.norm() * ref.norm()))
        # the rule, read off the applied step: kept (its cosine is c), shrunk so that <Delta~, u> = c_low ||Delta||
        # (then cos(Delta~, u) = c_low / sqrt(1 - c^2 + c_low^2)), or projected (orthogonal)
        expected = c if c <= c_low else c_low / math.sqrt(1 - c * c + c_low * c_low) if c < c_high else 0.0
        assert ca == pytest.approx(expected, abs=1e-4), (t, c)
    assert gac.steps == 16 and trainer.logger.last("align/proj_frac") == pytest.approx(gac.changed / 16)


def test_gac_step_refuses_settings_of_the_gradient_target():
    with pytest.raises(ValueError, match=r"reference='ema'.*belong to the gradient target"):
        GAC(target="step", reference="ema")
    with pytest.raises(ValueError, match="target='weights' is not one of 'grad', 'step'"):
        GAC(target="weights")


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
@pytest.mark.parametrize("high_mode", ["project", "skip"])
def test_resume_is_exact(high_mode, tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    def callbacks():
        return [StalenessSimulator(3, schedule="uniform", seed=5), AlignmentMonitor(warmup=0, step_cos=True),
                GAC(c_low=0.4, c_high=0.85, high_mode=high_mode, target="step", warmup=0)]

    total, cut = 16, 8
    ckpt_cb = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=cut, save_top_k=-1)
    full_cbs = callbacks()
    full = make_trainer([*full_cbs, ckpt_cb], max_steps=total, enable_checkpointing=True)
    model_full = UserRegressor(n=32, optimizer="adamw")
    full.fit(model_full)
    assert full_cbs[2].changed > 0
    ckpt = next(tmp_path.glob(f"*step={cut}.ckpt"))
    second = make_trainer(callbacks(), max_steps=total)
    model_b = UserRegressor(n=32, optimizer="adamw")
    with torch.no_grad():
        for p in model_b.parameters():
            p.add_(1.0)
    second.fit(model_b, ckpt_path=ckpt)
    assert torch.equal(flat_params(model_b), flat_params(model_full))
    for key in ("align/step_cos", "align/cos"):
        assert second.logger.values(key) == full.logger.values(key)[-(total - cut):]


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_monitor_step_cos_resumes_exactly(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    total, cut = 12, 8
    ckpt_cb = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=cut, save_top_k=-1)
    full = make_trainer([AlignmentMonitor(warmup=0, step_cos=True), ckpt_cb], max_steps=total,
                        enable_checkpointing=True)
    full.fit(UserRegressor(n=32, optimizer="adamw"))
    second = make_trainer([AlignmentMonitor(warmup=0, step_cos=True)], max_steps=total)
    second.fit(UserRegressor(n=32, optimizer="adamw"), ckpt_path=next(tmp_path.glob(f"*step={cut}.ckpt")))
    assert second.logger.values("align/step_cos") == full.logger.values("align/step_cos")[-(total - cut):]


def _ddp_fit(devices: int, strategy: str):
    gac = GAC(c_low=0.4, c_high=0.85, target="step", warmup=0)
    trainer = make_trainer([StalenessSimulator(2), gac], max_steps=12, strategy=strategy, devices=devices,
                           accelerator="cpu", use_distributed_sampler=False)  # every rank sees every batch
    model = UserRegressor(n=64, optimizer="adamw")
    trainer.fit(model)
    return trainer, gac, model


@pytest.mark.distributed
def test_two_ddp_processes_equal_one(tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, __file__, str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    trainer, gac, model = _ddp_fit(1, "auto")
    assert r0["cos"] == r1["cos"] == pytest.approx(gac.trace.values, abs=1e-6)
    assert r0["changed"] == r1["changed"] == gac.changed > 0
    assert r0["params"] == r1["params"]
    torch.testing.assert_close(torch.tensor(r0["params"]), flat_params(model), rtol=0, atol=1e-6)


def test_the_step_methods_are_registered_and_calibrate_from_the_step_trace(tmp_path):
    from gacbench.bench.cell import cell_dir
    from gacbench.bench.executors import reference_calibration
    from gacbench.methods import CalibratedGAC, method_callbacks, reference_trace, sync_cell

    (step,) = method_callbacks("gac-step")
    assert isinstance(step, GAC) and step.target == "step" and (step.transform.c_low, step.transform.c_high) == (
        0.05, 0.3)
    assert reference_trace("gac-step-calibrated") == "align/step_cos"
    assert reference_trace("gac-calibrated") == "align/cos"
    cell = {"task": "t", "objective": "sequence", "method": "gac-step-calibrated", "staleness": 16, "seed": 0}
    d = cell_dir(tmp_path, sync_cell(cell))
    d.mkdir(parents=True)
    steps = [0.6 + 0.01 * i for i in range(31)]  # |c| from 0.6 to 0.9
    rows = ["step,align/cos,align/step_cos"] + [f"{i},0.01,{c}" for i, c in enumerate(steps)]
    (d / "metrics.csv").write_text("\n".join(rows) + "\n")
    rec = reference_calibration(tmp_path, cell)
    assert rec["trace"] == "align/step_cos"
    assert rec["q_abs"] == pytest.approx(0.87) and rec["max_abs"] == pytest.approx(0.9)
    assert rec["c_low"] == pytest.approx(0.7)  # q0.9 = 0.87 capped at cap - gap = 0.95 - 0.25
    assert rec["c_high"] == pytest.approx(0.95) and rec["clipped"]  # c_low + gap
    (cb,) = method_callbacks("gac-step-calibrated", {**cell, "calibration": rec})
    assert isinstance(cb, CalibratedGAC) and cb.target == "step" and cb.transform.c_low == pytest.approx(0.7)
    rec_grad = reference_calibration(tmp_path, {**cell, "method": "gac-calibrated"})
    assert rec_grad["c_low"] == pytest.approx(0.01) and "trace" not in rec_grad
    (d / "metrics.csv").write_text("step,align/cos\n" + "".join(f"{i},0.01\n" for i in range(31)))
    with pytest.raises(ValueError, match="has no align/step_cos trace.*delete that cell's directory"):
        reference_calibration(tmp_path, cell)


# -- the GRPO optimizer section ------------------------------------------------------------------------------------
@pytest.mark.parametrize("section, message", [
    ({"betas": [0.9, 1.0]}, r"optimizer.betas\[1\]=1.0 must be a finite number in \[0, 1\)"),
    ({"betas": [-0.1, 0.999]}, r"optimizer.betas\[0\]=-0.1 must be"),
    ({"betas": [0.9]}, r"optimizer.betas=\[0.9\] must be two numbers"),
    ({"eps": 0.0}, r"optimizer.eps=0.0 must be a finite number > 0"),
    ({"weight_decay": -0.01}, r"optimizer.weight_decay=-0.01 must be a finite number >= 0"),
    ({"weight_decay": math.inf}, r"optimizer.weight_decay=inf must be"),
    ({"momentum": 0.9}, r"unknown optimizer setting\(s\) momentum"),
])
def test_the_grpo_optimizer_section_is_checked(section, message):
    from gacbench.llm.grpo import GRPOModule

    with pytest.raises(ValueError, match=message):
        GRPOModule.check_settings({"optimizer": section})
    GRPOModule.check_settings({"optimizer": {"betas": [0.0, 0.999], "eps": 1e-6, "weight_decay": 0.01}})


def test_the_grpo_optimizer_section_reaches_adamw():
    from gacbench.llm.grpo import GRPOModule, OptimizerConfig

    module = GRPOModule.__new__(GRPOModule)  # configure_optimizers alone: no model or engine
    nn.Module.__init__(module)
    module.policy, module.lr = nn.Linear(2, 2), 0.01
    module.optimizer_cfg = OptimizerConfig()
    group = module.configure_optimizers().param_groups[0]
    assert (group["betas"], group["eps"], group["weight_decay"]) == ((0.9, 0.999), 1e-8, 0.0)
    module.optimizer_cfg = OptimizerConfig(betas=[0.0, 0.99], eps=1e-6, weight_decay=0.01)
    group = module.configure_optimizers().param_groups[0]
    assert (group["betas"], group["eps"], group["weight_decay"]) == ((0.0, 0.99), 1e-6, 0.01)


if __name__ == "__main__":  # run by test_two_ddp_processes_equal_one: two DDP ranks write what they saw
    out_dir = sys.argv[1]
    trainer, gac, model = _ddp_fit(2, "ddp")
    with open(os.path.join(out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump({"cos": gac.trace.values, "changed": gac.changed, "params": flat_params(model).tolist()}, f)


# -- the headline suite's readings and the task-level grid keys ------------------------------------------------------
def test_the_headline_suite_adds_every_reading_at_16_and_32_and_keeps_its_cells():
    import copy as _copy

    from gacbench.bench.cell import cell_dir
    from gacbench.bench.runner import expand_cells
    from gacbench.bench.validate import load_suite
    from gacbench.methods import METHODS

    suite = load_suite("llm-headline")
    cells = expand_cells(suite)
    core = _copy.deepcopy(suite)  # the grid without the readings and the control: the 260 cells it had
    del core["tasks"]["arithmetic-beta1-0"], core["tasks"]["arithmetic"]["extra_methods"]
    del core["tasks"]["arithmetic"]["extra_staleness"]
    old = expand_cells(core)
    assert len(old) == 260 and len(cells) == 345
    by_dir = {cell_dir(Path("R"), c): c for c in cells}
    assert all(by_dir.get(cell_dir(Path("R"), c)) == c for c in old)
    readings = {"gac-skip", "gac-cosine", "gac-applied", "gac-update", "gac-ema", "gac-step", "gac-step-calibrated"}
    assert readings <= set(METHODS)
    for m in readings:
        assert sorted({c["staleness"] for c in cells if c["method"] == m}) == [16, 32]
        assert len([c for c in cells if c["method"] == m]) == 10
    control = [c for c in cells if c["task"] == "arithmetic-beta1-0"]
    assert sorted({(c["method"], c["staleness"]) for c in control}) == [("gac", 16), ("stale", 16), ("sync", 0)]
    assert all(c["params"]["optimizer"] == {"betas": [0.0, 0.999]} for c in control) and len(control) == 15
    params = {k: v for k, v in control[0]["params"].items() if k != "optimizer"}
    assert params == suite["tasks"]["arithmetic"]["params"]  # the same regime, momentum off


@pytest.mark.parametrize("task_keys, message", [
    ({"extra_methods": ["gac-step"], "extra_staleness": [8]},
     r"task 'a': extra_staleness: \[8\] not in the task's staleness"),
    ({"staleness": [0, 64]}, r"task 'a': staleness: \[64\] not in the suite's staleness"),
    ({"extra_staleness": [16]}, r"extra_staleness: is the staleness of the task's extra_methods, and the task has"),
    ({"methods": ["nosuch"]}, r"task 'a': methods:.*unknown method 'nosuch'"),
])
def test_the_task_level_grid_keys_are_checked(tmp_path, task_keys, message):
    import yaml

    from gacbench.bench.validate import load_suite
    from gacbench.usage import UsageError

    suite = {"name": "x", "steps": 40, "methods": ["sync", "stale"], "staleness": [0, 16, 32], "seeds": [0],
             "tasks": {"a": {"objective": "quadratic", "staleness": [0, 16], **task_keys}}}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(suite))
    with pytest.raises(UsageError, match=message):
        load_suite(str(path))


def test_a_task_with_its_own_methods_and_staleness_runs_only_those():
    from gacbench.bench.runner import expand_cells

    suite = {"name": "x", "steps": 40, "methods": ["sync", "stale"], "staleness": [0, 8, 16], "seeds": [0, 1],
             "ablation": {"staleness": 16, "c_low": [0.05], "c_high": [0.3]},
             "tasks": {"a": {"objective": "quadratic", "extra_methods": ["gac-step"], "extra_staleness": [16]},
                       "b": {"objective": "quadratic", "methods": ["gac"], "staleness": [8]}}}
    got = sorted((c["task"], c["method"], c["staleness"]) for c in expand_cells(suite) if c["seed"] == 0)
    assert got == [("a", "gac(c_low=0.05,c_high=0.3)", 16), ("a", "gac-step", 16), ("a", "stale", 8),
                   ("a", "stale", 16), ("a", "sync", 0), ("b", "gac", 8)]
    explicit = expand_cells(suite, methods=["stale", "gac"], staleness=[8, 16])
    assert sorted({(c["task"], c["method"], c["staleness"]) for c in explicit}) == [
        ("a", "gac", 8), ("a", "gac", 16), ("a", "stale", 8), ("a", "stale", 16), ("b", "gac", 8)]
