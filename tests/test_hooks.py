"""attach_gac / attach_alignment_monitor: the callbacks' code as optimizer step pre-hooks in a plain loop.
The same model, data and seed give the same parameters as the Lightning callbacks; closures are refused
before anything is touched; skips leave the optimizer state alone; GradScaler and clipping act first."""

import math

import pytest
import torch
import torch.distributed as dist
from conftest import UserRegressor, flat_params, make_trainer
from spawned_ranks import run_ranks

import gacbench
from gacbench import GAC, AlignmentMonitor, attach_alignment_monitor, attach_gac
from gacbench.usage import UsageError

# c_t of this regressor (batch 4, lr 0.1) spreads over [-0.9, 0.95]: keep, shrink and project all occur
SETTINGS = dict(c_low=0.1, c_high=0.5, warmup=0)


def regressor(opt="adamw", seed=0):
    return UserRegressor(batch_size=4, lr=0.1, optimizer=opt, seed=seed)


def plain_loop(model, optimizer, steps, accumulate=1):
    """zero_grad, backward, step, over the module's own batches in order, as Lightning feeds them."""
    batches = list(model.train_dataloader())
    for t in range(steps):
        optimizer.zero_grad()
        for k in range(accumulate):
            model.loss_fn(batches[(t * accumulate + k) % len(batches)]).backward()
        optimizer.step()


def test_settings_are_exactly_the_callbacks():
    import inspect
    cb = set(inspect.signature(GAC.__init__).parameters) - {"self"}
    hook = set(inspect.signature(gacbench.hooks.GACHook.__init__).parameters)
    # steps: what the trainer tells the callback; target: the step reading is the callback's alone (a post-step hook)
    assert hook - {"self", "optimizer", "distributed", "steps"} == cb - {"target"}


def test_auto_kernels_choose_from_the_parameters_and_the_runs_steps():
    from gacbench.functional.kernels import AUTO_COMPILE_PARAM_STEPS, AUTO_MIN_PARAMS

    big = [torch.nn.Parameter(torch.zeros(AUTO_MIN_PARAMS))]
    for steps, expected in ((None, "eager"), (10, "eager"), (int(AUTO_COMPILE_PARAM_STEPS // AUTO_MIN_PARAMS) + 1,
                                                             "fused-adamw")):
        optimizer = torch.optim.SGD(big, lr=0.0)
        hook = attach_gac(optimizer, steps=steps)
        big[0].grad = torch.zeros_like(big[0])
        optimizer.step()
        assert hook.transform.kernels == expected  # the compiled path itself is tested in test_gac_kernels.py
        hook.remove()


def _hooked_loop(model, steps, **settings):
    """A plain training loop over ``model``'s batches with ``attach_gac``: (model, hook, actions, metrics per step)."""
    optimizer = model.configure_optimizers()
    hook = attach_gac(optimizer, **SETTINGS, **settings)
    actions, logged = [], []
    batches = list(model.train_dataloader())
    for t in range(steps):
        optimizer.zero_grad()
        model.loss_fn(batches[t % len(batches)]).backward()
        optimizer.step()
        actions.append(hook.action)
        logged.append(hook.metrics)
    return model, hook, actions, logged


@pytest.mark.parametrize("opt,reference", [("adamw", "grad"), ("sgd", "grad"), ("adamw", "update"),
                                           ("adamw", "ema")])
def test_plain_loop_with_attach_gac_equals_the_lightning_callback(opt, reference):
    steps = 60
    model, hook, actions, logged = _hooked_loop(regressor(opt), steps, reference=reference)

    lit = regressor(opt)
    gac = GAC(reference=reference, **SETTINGS)
    trainer = make_trainer([gac], max_steps=steps)
    trainer.fit(lit)

    assert {"keep", "shrink", "project"} <= set(actions) if reference == "grad" else {"keep", "shrink"} <= set(actions)
    assert torch.equal(flat_params(model), flat_params(lit))
    key = hook.cos_key
    assert [m[key] for m in logged[1:]] == trainer.logger.values(key)
    assert [m["grad/norm"] for m in logged] == trainer.logger.values("grad/norm")
    assert [m["gac/coef"] for m in logged] == trainer.logger.values("gac/coef")
    assert (hook.steps, hook.changed, hook.skipped) == (gac.steps, gac.changed, gac.skipped)
    if reference == "grad":
        trainer_summary = gac.summary
        assert hook.summary() == trainer_summary


def test_monitor_hook_equals_the_monitor_callback():
    steps = 30
    model = regressor()
    optimizer = model.configure_optimizers()
    mon = attach_alignment_monitor(optimizer, warmup=5)
    plain_loop(model, optimizer, steps)

    lit = regressor()
    cb = AlignmentMonitor(warmup=5)
    trainer = make_trainer([cb], max_steps=steps)
    trainer.fit(lit)
    assert torch.equal(flat_params(model), flat_params(lit))
    assert mon.values == trainer.logger.values("align/cos") and len(mon.values) == steps - 1
    assert mon.summary() == cb.summary and mon.summary()["n"] == steps - 1 - 5
    assert mon.metrics["grad/norm"] == trainer.logger.values("grad/norm")[-1]


def test_a_closure_is_refused_before_anything_is_touched():
    """The previous step's gradients are still in p.grad: step(closure) must not act on them."""
    model = regressor()
    optimizer = model.configure_optimizers()
    hook = attach_gac(optimizer, **SETTINGS)
    mon = attach_alignment_monitor(optimizer)
    plain_loop(model, optimizer, 3)  # p.grad holds step 3's gradient (no zero_grad after the step)
    params, state = flat_params(model).clone(), hook.state_dict()
    grads = [p.grad.clone() for p in model.parameters()]
    called = []

    def closure():
        called.append(1)
        optimizer.zero_grad()
        loss = model.loss_fn(next(iter(model.train_dataloader())))
        loss.backward()
        return loss

    for call in (lambda: optimizer.step(closure), lambda: optimizer.step(closure=closure)):
        with pytest.raises(UsageError, match=r"step\(closure\).*gacbench.GAC"):
            call()
    assert not called
    assert torch.equal(flat_params(model), params)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    after = hook.state_dict()
    assert after["steps"] == state["steps"] == 3 and torch.equal(after["transform"]["ref"], state["transform"]["ref"])
    assert len(mon.values) == 2


def test_attach_gac_under_lightning_points_to_the_callback():
    class Attached(UserRegressor):
        def configure_optimizers(self):
            opt = super().configure_optimizers()
            attach_gac(opt)
            return opt

    with pytest.raises(UsageError, match="use the callback gacbench.GAC"):
        make_trainer([], max_steps=2).fit(Attached())


def test_skip_leaves_parameters_and_adamw_state_untouched():
    model = regressor()
    optimizer = model.configure_optimizers()
    hook = attach_gac(optimizer, c_low=0.0, c_high=1e-6, high_mode="skip", warmup=0)  # any positive c_t skips
    batches = list(model.train_dataloader())
    skipped = applied = 0
    for t in range(20):
        optimizer.zero_grad()
        model.loss_fn(batches[t % len(batches)]).backward()
        before = flat_params(model).clone()
        state = [{k: v.clone() for k, v in optimizer.state[p].items()} for p in model.parameters()]
        optimizer.step()
        same_state = all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
                         for a, b in zip(state, (optimizer.state[p] for p in model.parameters())))
        if hook.action == "skip":
            skipped += 1
            assert hook.metrics["align/skip"] == 1.0
            assert torch.equal(flat_params(model), before) and same_state and all(state)
        else:
            applied += 1
            assert not torch.equal(flat_params(model), before) and not same_state
    assert skipped == hook.skipped > 0 and applied > 1


def test_non_finite_gradient_is_skipped_with_a_warning_or_raises():
    model = regressor()
    optimizer = model.configure_optimizers()
    hook = attach_gac(optimizer)
    plain_loop(model, optimizer, 2)
    before = flat_params(model).clone()
    optimizer.zero_grad()
    (model.loss_fn(next(iter(model.train_dataloader()))) * float("nan")).backward()
    with pytest.warns(UserWarning, match="non-finite"):
        optimizer.step()
    assert torch.equal(flat_params(model), before)
    cos = hook.metrics.pop("align/cos")  # the step has no c_t: NaN, counted as skipped in the summary
    assert cos != cos and hook.values[-1] != hook.values[-1]
    assert hook.metrics == {"align/skip": 1.0, "gac/bad_grad": 1.0} and hook.action == "skip"

    strict = regressor()
    opt2 = strict.configure_optimizers()
    attach_gac(opt2, on_bad_grad="raise")
    (strict.loss_fn(next(iter(strict.train_dataloader()))) * float("inf")).backward()
    with pytest.raises(FloatingPointError, match="on_bad_grad='skip'"):
        opt2.step()


def test_gradient_accumulation_runs_once_per_step_on_the_summed_gradient():
    model = regressor()
    optimizer = model.configure_optimizers()
    hook = attach_gac(optimizer)
    batches = list(model.train_dataloader())
    optimizer.zero_grad()
    for b in batches[:3]:
        model.loss_fn(b).backward()
    total = math.sqrt(sum(float((p.grad ** 2).sum()) for p in model.parameters()))
    optimizer.step()
    assert hook.steps == 1 and hook.metrics["grad/norm"] == pytest.approx(total, rel=1e-6)


def test_clipping_before_step_is_seen_by_the_hook():
    model = regressor()
    optimizer = model.configure_optimizers()
    hook = attach_gac(optimizer)
    optimizer.zero_grad()
    model.loss_fn(next(iter(model.train_dataloader()))).backward()
    raw = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e-3))
    optimizer.step()
    assert raw > 1e-2 and hook.metrics["grad/norm"] == pytest.approx(1e-3, rel=1e-4)


def test_grad_scaler_hands_the_hook_unscaled_gradients_and_skips_overflow_steps():
    """GradScaler.step unscales first and calls optimizer.step only on finite gradients: with a power-of-two
    scale the run equals the unscaled one bit for bit, and an overflow step never reaches the hook."""
    runs = []
    for scaled in (False, True):
        model = regressor()
        optimizer = model.configure_optimizers()
        hook = attach_gac(optimizer, **SETTINGS)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000, enabled=scaled)
        batches = list(model.train_dataloader())
        norms = []
        for t in range(12):
            optimizer.zero_grad()
            scaler.scale(model.loss_fn(batches[t % len(batches)])).backward()
            scaler.step(optimizer)
            scaler.update()
            norms.append(hook.metrics["grad/norm"])
        runs.append((flat_params(model), norms, hook.state_dict()))
        if scaled:  # an overflow: the scaler skips the step, the hook is not called
            before, steps = flat_params(model).clone(), hook.steps
            optimizer.zero_grad()
            scaler.scale(model.loss_fn(batches[0]) * float("inf")).backward()
            scaler.step(optimizer)
            scaler.update()
            assert hook.steps == steps and torch.equal(flat_params(model), before)
            assert scaler.get_scale() < 2.0 ** 10
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]


def test_a_fused_optimizer_under_grad_scaler_needs_unscale_first():
    """A fused AdamW takes the scaler's scale and found_inf into its own step: without unscale_ the hook would see
    scaled gradients (refused); after unscale_ it sees the true ones, and an overflow step is left alone."""
    model = regressor()
    batch = next(iter(model.train_dataloader()))
    raw = torch.autograd.grad(model.loss_fn(batch), list(model.parameters()))
    norm = math.sqrt(sum(float((g * g).sum()) for g in raw))

    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    attach_gac(opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    scaler.scale(model.loss_fn(batch)).backward()
    with pytest.raises(UsageError, match=r"scaler.unscale_\(optimizer\) before scaler.step"):
        scaler.step(opt)

    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    hook = attach_gac(opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    for loss_scale in (1.0, float("inf")):
        opt.zero_grad()
        scaler.scale(model.loss_fn(batch) * loss_scale).backward()
        scaler.unscale_(opt)
        before = flat_params(model).clone()
        scaler.step(opt)
        scaler.update()
        if loss_scale == 1.0:
            assert hook.steps == 1 and hook.metrics["grad/norm"] == pytest.approx(norm, rel=1e-6)
    assert hook.steps == 1 and hook.metrics == {} and torch.equal(flat_params(model), before)


def _scripted_steps(opt, param, grads, hook):
    """One optimizer step per gradient; the hook's action and logged c_t of each."""
    out = []
    for g in grads:
        param.grad = None if g is None else torch.tensor(g)
        opt.step()
        out.append((hook.action, hook.metrics.get(hook.cos_key)))
    return out


def test_update_reference_keeps_the_last_update_across_skipped_steps():
    """reference="update", high_mode="skip", SGD at lr 1 from theta_0 = 0: a skipped step (by the rule or for a
    zero gradient) leaves theta where it is, and the next c_t is measured against the last update that moved it
    (theta_{t-1} - theta_t of the last step taken), never against the zero difference of the skipped step. By
    hand: r = e_1 after step 1; steps 2, 3 and 4 are skipped; step 5 is kept (c = 0) and moves theta by -2 e_4,
    which is the reference of step 6. The held update travels in state_dict."""
    p = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([p], lr=1.0)
    gac = attach_gac(opt, reference="update", high_mode="skip", on_zero_grad="skip", warmup=0, kernels="eager")
    with pytest.warns(UserWarning, match="its gradient is zero"):
        first = _scripted_steps(opt, p, [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], gac)
    assert first[0] == ("keep", None) and first[1] == ("skip", 1 / math.sqrt(2.0))  # <g, r> = 1, ||g|| = sqrt 2
    assert first[2][0] == "skip" and math.isnan(first[2][1])  # the zero gradient: no c_t
    saved, theta = gac.state_dict(), p.detach().clone()
    assert saved["transform"]["held"] and torch.equal(saved["transform"]["ref"], torch.tensor([1.0, 0.0, 0.0, 0.0]))
    later = [[3.0, 0.0, 4.0, 0.0], [0.0, 0.0, 0.0, 2.0], [0.0, 1.0, 0.0, 1.0]]
    rest = _scripted_steps(opt, p, later, gac)
    assert rest == [("skip", 3 / 5), ("keep", 0.0), ("skip", 2 / (math.sqrt(2.0) * 2.0))]
    assert torch.equal(p.detach(), torch.tensor([-1.0, 0.0, 0.0, -2.0]))
    assert gac.values[0] == 1 / math.sqrt(2.0) and math.isnan(gac.values[1])
    assert gac.values[2:] == [3 / 5, 0.0, 2 / (math.sqrt(2.0) * 2.0)]
    assert gac.summary()["n"] == 4 and gac.summary()["skipped"] == 1

    q = torch.nn.Parameter(theta)  # resumed at the held update: the same steps and c_t
    opt2 = torch.optim.SGD([q], lr=1.0)
    again = attach_gac(opt2, reference="update", high_mode="skip", on_zero_grad="skip", warmup=0, kernels="eager")
    again.load_state_dict(saved)
    assert _scripted_steps(opt2, q, later, again) == rest and torch.equal(q.detach(), p.detach())


def test_update_reference_follows_a_zero_gradient_that_is_passed_on():
    """reference="update" with on_zero_grad="pass": the optimizer still steps on a zero gradient, and its weight
    decay moves theta, so that move is the next reference. SGD, lr 1, weight decay 0.5, theta_0 = (2, 0): step 1
    (g = (0, 2)) moves theta to (1, -2); step 2 (g = 0, passed on) decays it to (0.5, -1); step 3's c_t is
    measured against theta_1 - theta_2 = (0.5, -1): cos((1, -2), (0.5, -1)) = 1, not against the update before it,
    theta_0 - theta_1 = (1, 2), which would give -0.6."""
    p = torch.nn.Parameter(torch.tensor([2.0, 0.0]))
    opt = torch.optim.SGD([p], lr=1.0, weight_decay=0.5)
    gac = attach_gac(opt, reference="update", on_zero_grad="pass", warmup=0, kernels="eager")
    steps = _scripted_steps(opt, p, [[0.0, 2.0], [0.0, 0.0], [1.0, -2.0]], gac)
    assert steps[0] == ("keep", None) and math.isnan(steps[1][1])
    assert steps[2][1] == pytest.approx(1.0)
    # the same zero gradient skipped instead: theta stays at theta_1, and the reference stays theta_0 - theta_1
    q = torch.nn.Parameter(torch.tensor([2.0, 0.0]))
    opt2 = torch.optim.SGD([q], lr=1.0, weight_decay=0.5)
    held = attach_gac(opt2, reference="update", on_zero_grad="skip", warmup=0, kernels="eager")
    with pytest.warns(UserWarning, match="its gradient is zero"):
        again = _scripted_steps(opt2, q, [[0.0, 2.0], [0.0, 0.0], [1.0, -2.0]], held)
    assert again[2][1] == pytest.approx(-0.6)


def test_update_reference_of_parameters_that_did_not_move_gives_no_c_t():
    """reference="update" with SGD at lr 0: theta never moves, so every reference theta_{t-1} - theta_t is zero.
    A zero reference has no direction: c_t is NaN (counted as skipped, like a zero gradient), not 0, and the
    gradient is kept."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.0)
    gac = attach_gac(opt, reference="update", warmup=0, kernels="eager")
    steps = _scripted_steps(opt, p, [[1.0, 2.0, 3.0]] * 4, gac)
    assert steps[0] == ("keep", None)
    assert all(action == "keep" and math.isnan(c) for action, c in steps[1:])
    assert len(gac.values) == 3 and all(math.isnan(v) for v in gac.values)
    assert gac.summary()["n"] == 0 and gac.summary()["skipped"] == 3 and gac.changed == 0


def test_state_dict_resumes_exactly():
    full = regressor()
    opt = full.configure_optimizers()
    attach_gac(opt, **SETTINGS)
    plain_loop(full, opt, 20)

    first = regressor()
    opt1 = first.configure_optimizers()
    h1 = attach_gac(opt1, **SETTINGS)
    plain_loop(first, opt1, 10)
    saved = {"model": first.state_dict(), "opt": opt1.state_dict(), "gac": h1.state_dict()}

    resumed = regressor(seed=1)
    resumed.x, resumed.y = first.x, first.y
    resumed.load_state_dict(saved["model"])
    opt2 = resumed.configure_optimizers()
    opt2.load_state_dict(saved["opt"])
    h2 = attach_gac(opt2, **SETTINGS)
    h2.load_state_dict(saved["gac"])
    batches = list(resumed.train_dataloader())
    for t in range(10, 20):
        opt2.zero_grad()
        resumed.loss_fn(batches[t % len(batches)]).backward()
        opt2.step()
    assert torch.equal(flat_params(resumed), flat_params(full))
    with pytest.raises(UsageError, match="state_dict"):
        h2.load_state_dict({"steps": 1})


def test_remove_restores_the_plain_optimizer():
    plain, hooked = regressor(), regressor()
    o1, o2 = plain.configure_optimizers(), hooked.configure_optimizers()
    attach_gac(o2, c_low=0.0, c_high=1e-6).remove()
    plain_loop(plain, o1, 8)
    plain_loop(hooked, o2, 8)
    assert torch.equal(flat_params(plain), flat_params(hooked))


@pytest.mark.parametrize("call,match", [
    (lambda o: attach_gac(o, c_lo=0.1), "unknown setting.*c_lo"),
    (lambda o: attach_gac(o, c_low=0.5, c_high=0.1), "c_low"),
    (lambda o: attach_gac(o, high_mode="drop"), "high_mode"),
    (lambda o: attach_gac(o, warmup=-1), "warmup"),
    (lambda o: attach_gac(torch.nn.Linear(2, 2)), "torch.optim.Optimizer"),
    (lambda o: attach_alignment_monitor(o, buffer_dtype="int8"), "buffer_dtype"),
    (lambda o: attach_gac(o, distributed=True), "not initialized"),
    (lambda o: attach_gac(o, steps="x"), r"^attach_gac: steps='x' must be None \(unknown\), a positive integer"),
    (lambda o: attach_gac(o, steps=-5), r"^attach_gac: steps=-5 must be None"),
    (lambda o: attach_gac(o, buffer_dtype=5), r"^GAC: buffer_dtype=5 must be None, one of 'float32'"),
    (lambda o: attach_alignment_monitor(o, buffer_dtype=torch.int32),
     r"^attach_alignment_monitor: buffer_dtype=torch.int32 must be None, one of 'float32', 'bfloat16', 'float16', "
     r"or a floating-point torch.dtype$"),
])
def test_bad_settings_are_named(call, match):
    """Refused when attached (not at the first step), in one line naming the setting and the value."""
    optimizer = regressor().configure_optimizers()
    with pytest.raises(UsageError, match=match) as err:
        call(optimizer)
    assert "\n" not in str(err.value) and not optimizer._optimizer_step_pre_hooks


def test_adding_parameters_after_attaching_is_refused():
    model = regressor()
    opt = model.configure_optimizers()
    attach_gac(opt)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    model.loss_fn(next(iter(model.train_dataloader()))).backward()
    with pytest.raises(UsageError, match="add_param_group"):
        opt.step()


# -- torch.distributed: 2 ranks on gloo against 1 process -------------------------------------------------------

def _dist_worker(rank: int, world: int, steps: int, wrap: str) -> tuple:
    model = regressor()
    if wrap == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model.net)
    else:  # FSDP2: parameters and gradients are DTensor shards
        from torch.distributed.fsdp import fully_shard

        net = fully_shard(model.net)
    optimizer = model.configure_optimizers()
    hook = attach_gac(optimizer, **SETTINGS)
    calls = []  # the hook's collectives: one 3-element float64 tensor per step
    originals = {name: getattr(dist, name) for name in ("broadcast", "all_reduce")}

    def counting(name):
        def call(tensor, *a, **k):
            if tensor.dtype == torch.float64 and tensor.numel() == 3:
                calls.append(name)
            return originals[name](tensor, *a, **k)
        return call

    for name in originals:
        setattr(dist, name, counting(name))
    batches = list(model.train_dataloader())
    actions, cos = [], []
    for t in range(steps):
        x, y = batches[t % len(batches)]
        half = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(net(x[half]), y[half]).backward()
        optimizer.step()
        actions.append(hook.action)
        cos.append(hook.metrics.get("align/cos"))
    for name, fn in originals.items():
        setattr(dist, name, fn)
    params = torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1)
                        for p in model.parameters()])
    return actions, cos, params.tolist(), calls


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("wrap,collective", [("ddp", "broadcast"), ("fsdp2", "all_reduce")])
def test_two_ranks_agree_and_match_one_process(wrap, collective, tmp_path):
    """DDP (replicated gradients: rank 0's scalars are broadcast) and FSDP2 fully_shard (DTensor gradient shards:
    the partial scalars are summed), each with half the batch per rank, against one process with all of it."""
    steps, world = 30 if wrap == "ddp" else 12, 2
    rendezvous = str(tmp_path / "rendezvous")  # a file, not a port another process could take meanwhile
    results = run_ranks(_dist_worker, world, rendezvous, (steps, wrap))
    (a0, c0, p0, n0), (a1, c1, p1, n1) = results
    assert a0 == a1 and c0 == c1 and p0 == p1  # every rank took the same decision from the same scalars
    assert n0 == n1 == [collective] * steps  # one collective per optimizer step

    model, _, actions, logged = _hooked_loop(regressor(), steps)
    cos = [m.get("align/cos") for m in logged]
    assert a0 == actions and {"keep", "project"} <= set(actions)
    assert c0[1:] == pytest.approx(cos[1:], abs=1e-5)
    torch.testing.assert_close(torch.tensor(p0), flat_params(model), rtol=1e-4, atol=1e-5)


# attach_gac's align/proj_frac is the fraction of the steps so far that GAC changed
def test_attach_gac_proj_frac_is_changed_over_steps():
    """reference "grad": step 0 has no reference (kept), step 1 repeats g (c = 1 >= c_high: projected), step 2 is
    orthogonal to it (c = 0: kept): proj_frac 0, 1/2, 1/3."""
    from gacbench import attach_gac

    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.1)
    hook = attach_gac(opt, kernels="eager")
    fracs = []
    for g in ([1.0, 0.0], [1.0, 0.0], [0.0, 1.0]):
        p.grad = torch.tensor(g)
        opt.step()
        fracs.append(hook.metrics["align/proj_frac"])
    assert fracs == [0.0, 0.5, pytest.approx(1 / 3)]
    assert hook.action == "keep" and hook.changed == 1
