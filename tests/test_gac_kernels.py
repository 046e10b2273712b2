"""GAC's compiled kernels (kernels="compiled"): the same decisions, cosines and gradients as the eager path to
float32 rounding, over a run that takes every branch; overflow and non-finite gradients handled as the eager path
handles them; and the overhead benchmark's compiled rows. Each distinct parameter list compiles once per process
(about 10-30 s), so the tests share one list of shapes. Then kernels="auto": on the CPU the compile's crossover, on a
GPU the table of measured rows (synthetic tables, and the row the GPU run prints)."""

import math
import warnings

import pytest
import torch

from gacbench.bench.overhead import run_overhead, shape_for_params
from gacbench.functional.alignment import KEEP, PROJECT, SHRINK
from gacbench.functional.gac import GACTransform
from gacbench.functional.kernels import Measurement, choose_kernels, choose_measured

SHAPES = shape_for_params(200_000).shapes()


def _run(kernels: str, scale: float = 1.0, poison: float | None = None) -> list[tuple]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
    gac = GACTransform(c_low=0.05, c_high=0.3, kernels=kernels)
    prev, out = None, []
    for t, mix in enumerate((0.0, 0.0, 0.005, 0.008, 0.9, 0.0, 0.5)):  # keep, keep, shrink, shrink, project, ...
        g = [torch.randn(s, generator=gen) for s in SHAPES]
        if prev is not None:
            g = [x + mix * 20.0 * p for x, p in zip(g, prev)]
        prev = [x.clone() for x in g]
        for p, x in zip(params, g):
            p.grad = x * scale
        if poison is not None and t == 3:
            params[0].grad[0, 0] = poison
        d = gac.step(params, swap=True, keep_alias=True)
        out.append((d.decision.action, d.cos, d.bad, [p.grad.clone() for p in params]))
        gac.release(params)
    return out


def test_compiled_kernels_match_the_eager_path_on_every_branch():
    eager, compiled = _run("eager"), _run("compiled")
    assert {a for a, *_ in eager} >= {KEEP, SHRINK, PROJECT}
    for (a1, c1, b1, g1), (a2, c2, b2, g2) in zip(eager, compiled):
        assert a1 == a2 and b1 == b2
        assert (math.isnan(c1) and math.isnan(c2)) or c2 == pytest.approx(c1, abs=1e-6)
        for x, y in zip(g1, g2):
            # the compiled reductions sum in another order (it differs with the CPU's vector width), so c_t and
            # the shrink factor or projection coefficient round differently: a small error relative to the
            # tensor's scale (seen on an AVX2 machine: 2.5e-6 of it where c_t is small)
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5 * max(1.0, float(x.abs().max())))


def test_compiled_kernels_handle_overflow_and_non_finite_gradients_like_the_eager_path():
    # ||g||^2 ~ 1e44 overflows float32: the compiled sums are not finite, the eager path recomputes them exactly
    huge = _run("compiled", scale=1e20)
    assert not any(bad for _, _, bad, _ in huge)
    assert [a for a, *_ in huge] == [a for a, *_ in _run("eager", scale=1e20)]
    poisoned = _run("compiled", poison=float("nan"))
    assert poisoned[3][2] is True  # a NaN gradient is reported bad, as by the eager path
    assert torch.isnan(poisoned[3][3][0][0, 0])  # and left untouched for the caller


def test_unknown_kernels_are_refused():
    with pytest.raises(ValueError, match="kernels='fast' is not one of 'auto', 'eager', 'compiled', 'fused-adamw'"):
        GACTransform(kernels="fast")


def test_overhead_times_the_compiled_kernels_beside_the_eager_ones():
    record = run_overhead(params=200_000, repeats=1, kernels=("eager", "compiled", "fused-adamw"))
    # each path's ratios divide by the AdamW step timed in its own rounds (paired), not by the first path's
    assert {k for k in record if k.startswith("adamw_step")} == {
        "adamw_step_s", "adamw_step_eager_s", "adamw_step_compiled_s", "adamw_step_fused_s"}
    assert record["adamw_step_s"] == record["adamw_step_eager_s"]  # the floors' reference: the first path's
    for name, path in (("gac", "eager"), ("gac_keep", "eager"), ("gac_compiled", "compiled"),
                       ("gac_keep_compiled", "compiled"), ("gac_keep_fused", "fused")):
        assert record[f"{name}_over_adamw"] == pytest.approx(record[f"{name}_s"] / record[f"adamw_step_{path}_s"])
        assert record[f"{name}_took_the_step"] is False
    # GAC took the shrunk step itself: its cost is what it adds to the AdamW update it includes
    assert record["gac_fused_took_the_step"] is True and record["gac_fused_case"] == "shrink"
    assert record["gac_fused_over_adamw"] == pytest.approx(record["gac_fused_s"] / record["adamw_step_fused_s"] - 1)
    assert record["gac_compiled_case"] == "shrink" and record["gac_keep_compiled_case"] == "keep"
    # the first round's extra time, per kernel path: the warm-up rounds minus the medians of both branches
    assert set(k for k in record if k.startswith("first_round_extra")) == {
        "first_round_extra_eager_s", "first_round_extra_compiled_s", "first_round_extra_fused_s"}
    with pytest.raises(ValueError, match="need a float32 reference buffer"):
        run_overhead(params=200_000, repeats=1, buffer_dtype="bfloat16", kernels=("compiled",))
    low = run_overhead(params=200_000, repeats=1, buffer_dtype="bfloat16", kernels=("fused-adamw",))
    assert low["gac_fused_took_the_step"] and low["gac_keep_fused_took_the_step"]  # every step, kept ones too


def _adamw(params, fused_ok: bool = True):
    groups = [{"params": params[: len(params) // 2]},
              {"params": params[len(params) // 2:], "lr": 3e-3, "weight_decay": 0.1, "betas": (0.8, 0.99)}]
    return torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.01, foreach=False)


@pytest.mark.parametrize("buffer_dtype", [None, "bfloat16"])
def test_fused_adamw_takes_the_step_adamw_would_take_on_the_projected_gradient(buffer_dtype):
    """kernels="fused-adamw" against the eager GAC followed by torch's own AdamW step, over a run that keeps,
    shrinks and projects, with two parameter groups of different lr, weight decay and betas; with a bfloat16
    reference GAC takes every step after the first (kept ones too) and stores the rounded gradient as it goes."""
    gen = torch.Generator().manual_seed(1)
    init = [torch.randn(s, generator=gen) for s in SHAPES]
    runs = {}
    for kernels in ("eager", "fused-adamw"):
        params = [torch.nn.Parameter(x.clone()) for x in init]
        opt = _adamw(params)
        gac = GACTransform(c_low=0.05, c_high=0.3, kernels=kernels, buffer_dtype=buffer_dtype)
        g_gen = torch.Generator().manual_seed(2)
        prev, actions, stepped = None, [], []
        for mix in (0.0, 0.0, 0.005, 0.008, 0.9, 0.0, 0.5, 0.9):
            g = [torch.randn(s, generator=g_gen) for s in SHAPES]
            if prev is not None:
                g = [x + mix * 20.0 * p for x, p in zip(g, prev)]
            prev = [x.clone() for x in g]
            for p, x in zip(params, g):
                p.grad = x.clone()
            d = gac.step(params, swap=True, keep_alias=True, optimizer=opt if kernels != "eager" else None)
            actions.append(d.decision.action)
            stepped.append(d.stepped)
            opt.step()
            gac.release(params)
            for p in params:
                p.grad = None
        runs[kernels] = (params, opt, actions, stepped, gac.state.ref)
    (pe, oe, ae, _, re), (pf, of, af, sf, rf) = runs["eager"], runs["fused-adamw"]
    assert ae == af and {SHRINK, PROJECT} <= set(af)
    if buffer_dtype is None:
        assert sf == [a in (SHRINK, PROJECT) for a in af]  # exactly the changed steps were taken by GAC
    else:
        assert sf == [False] + [True] * (len(af) - 1)  # the first step creates AdamW's moments
        assert all(torch.equal(a, b) and b.dtype == torch.bfloat16 for a, b in zip(re, rf))  # the same rounding
    # Equal up to float32 rounding of g - alpha r (formed in registers here, written to memory by the eager path).
    # Adam divides by sqrt(v): where the projection cancels g almost exactly, a rounding difference can move one
    # element's step visibly, so the parameters are compared by the distance they travelled, not element by element.
    def rel(x: list, y: list) -> float:
        return float(torch.cat([(u - w).reshape(-1) for u, w in zip(x, y)]).norm()
                     / torch.cat([w.reshape(-1) for w in y]).norm())

    travelled = [a.detach() - x for a, x in zip(pe, init)]
    assert rel([b.detach() - x for b, x in zip(pf, init)], travelled) < 1e-4
    for key in ("exp_avg", "exp_avg_sq"):
        assert rel([of.state[b][key] for b in pf], [oe.state[a][key] for a in pe]) < 1e-4
    assert all(int(of.state[b]["step"]) == int(oe.state[a]["step"]) == len(af) for a, b in zip(pe, pf))


def test_fused_adamw_in_a_trainer_matches_the_eager_path():
    from conftest import UserRegressor, flat_params, make_trainer

    from gacbench import GAC, StalenessSimulator

    finals = {}
    for kernels in ("eager", "fused-adamw"):
        model = UserRegressor(optimizer="adamw", lr=0.05)
        gac = GAC(c_low=0.05, c_high=0.3, warmup=0, kernels=kernels)
        make_trainer([StalenessSimulator(4), gac], max_steps=40).fit(model)
        finals[kernels] = (flat_params(model), gac.changed)
    assert finals["eager"][1] == finals["fused-adamw"][1] > 0
    torch.testing.assert_close(finals["fused-adamw"][0], finals["eager"][0], rtol=1e-4, atol=1e-5)


def test_fused_adamw_leaves_other_optimizers_to_the_compiled_projection():
    params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
    sgd = torch.optim.SGD(params, lr=0.1)
    gac = GACTransform(c_low=0.05, c_high=0.3, kernels="fused-adamw")
    gen = torch.Generator().manual_seed(3)
    g0 = [torch.randn(s, generator=gen) for s in SHAPES]
    for g in (g0, [2.0 * x for x in g0]):  # the second is fully aligned with the first: projected
        for p, x in zip(params, g):
            p.grad = x.clone()
        d = gac.step(params, swap=True, keep_alias=True, optimizer=sgd)
        gac.release(params)
    assert d.decision.action == PROJECT and not d.stepped
    assert all(p.grad is not None for p in params)  # the projected gradient, for SGD's own step


def test_a_compile_failure_falls_back_to_the_eager_path_with_one_warning(monkeypatch):
    from gacbench.functional import kernels

    def broken(*args):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(kernels, "_COMPILED", {"scalars": broken, "project": broken, "adamw": broken})
    monkeypatch.setattr(kernels, "_FAILED", [])
    monkeypatch.setattr(kernels, "_DIRECT", {})  # no kernel compiled by an earlier test is called directly
    with pytest.warns(RuntimeWarning, match="torch.compile failed .*no C.. compiler.*eager kernels"):
        compiled = _run("compiled")
    eager = _run("eager")
    assert [a for a, *_ in compiled] == [a for a, *_ in eager]
    for (_, _, _, g1), (_, _, _, g2) in zip(eager, compiled):
        for x, y in zip(g1, g2):
            assert torch.equal(x, y)  # the eager kernels ran: bit for bit
    assert not kernels.compiled_available()


def _products(g: list[torch.Tensor], r: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([sum((a.double() * b.double()).sum() for a, b in zip(g, r)),
                        sum((a.double() ** 2).sum() for a in g)])


def test_a_signature_seen_before_is_called_without_torch_compile_and_shapes_are_still_checked(monkeypatch):
    """The direct call into Inductor's code: a repeated signature does not go through torch.compile, and a list
    with the same length and dtypes but other shapes or strides (or a tensor passed twice) is compiled, not run
    through code built for other shapes."""
    from gacbench.functional import kernels

    monkeypatch.setattr(kernels, "_COMPILED", {})
    monkeypatch.setattr(kernels, "_DIRECT", {})
    gen = torch.Generator().manual_seed(3)
    calls = []
    kernels._get("scalars", kernels._scalars)
    real = kernels._COMPILED["scalars"]
    kernels._COMPILED["scalars"] = lambda *a: (calls.append(1), real(*a))[1]

    def close(g, r):
        got = kernels.compiled_scalars(g, r)
        assert torch.allclose(got, _products(g, r), rtol=1e-5), (got, _products(g, r))

    a = [torch.randn(s, generator=gen) for s in ((24, 16), (16,), (8, 4))]
    ra = [torch.randn(x.shape, generator=gen) for x in a]
    close(a, ra)
    assert len(calls) == 1
    close(a, ra)
    close([x * 2 for x in a], ra)  # new tensors, same shapes: direct
    assert len(calls) == 1
    b = [torch.randn(s, generator=gen) for s in ((4, 6), (2,), (3, 3))]  # same signature, other shapes
    close(b, [torch.randn(x.shape, generator=gen) for x in b])
    assert len(calls) == 2
    t = [torch.randn(16, 24, generator=gen).t(), a[1], a[2]]  # a's shapes, another stride
    close(t, ra)
    assert len(calls) == 3
    close(a, ra)  # the entry compiled first is kept
    assert len(calls) == 3
    close(a, a)  # one tensor passed twice: Dynamo compiles aliased inputs apart
    assert len(calls) == 4


def test_no_direct_call_without_inductors_shape_asserts(monkeypatch):
    from torch._inductor import config as inductor_config

    from gacbench.functional import kernels

    monkeypatch.setattr(kernels, "_COMPILED", {})
    monkeypatch.setattr(kernels, "_DIRECT", {})
    g = [torch.randn(5, 7), torch.randn(3)]
    r = [torch.randn(5, 7), torch.randn(3)]
    with inductor_config.patch(size_asserts=False):  # the config's own patch: put back whole for later compiles
        for _ in range(2):
            assert torch.allclose(kernels.compiled_scalars(g, r), _products(g, r), rtol=1e-5)
    assert kernels._DIRECT == {}


def test_a_graph_without_dynamos_sources_gets_no_direct_call():
    from gacbench.functional import kernels

    gm = torch.fx.symbolic_trace(lambda x, y: (x * y).sum())  # no grapharg metadata: other torch versions
    assert kernels._input_order(gm, ["x", "y"], None, 1) is None


# -- kernels="auto": the choice rule, and what the callback feeds it ----------------------------------------


def test_auto_compiles_only_where_parameters_times_steps_reach_the_crossover():
    from gacbench.functional.kernels import AUTO_COMPILE_PARAM_STEPS, AUTO_MIN_PARAMS, choose_kernels

    assert choose_kernels(5_508, 300) == "eager"  # a synthetic objective
    assert choose_kernels(1_700_000_000, 10_000) == "fused-adamw"  # a 1.7B model over a long run
    n = 20_000_000
    steps = math.ceil(AUTO_COMPILE_PARAM_STEPS / n)
    assert choose_kernels(n, steps) == "fused-adamw" and choose_kernels(n, steps - 1) == "eager"
    assert choose_kernels(n, math.inf) == "eager"  # a run without an end: its steps are unknown
    assert choose_kernels(n, -1) == "eager" and choose_kernels(0, 10**12) == "eager"
    # below the size where the compiled step is faster at all, no run is long enough
    assert choose_kernels(AUTO_MIN_PARAMS - 1, 10**9) == "eager"
    assert choose_kernels(AUTO_MIN_PARAMS, math.ceil(AUTO_COMPILE_PARAM_STEPS / AUTO_MIN_PARAMS)) == "fused-adamw"
    assert choose_kernels(1_700_000_000, 10_000, device_type="cuda") == "eager"  # not measured off the CPU


def test_auto_picks_eager_for_every_model_and_run_length_the_shipped_suites_use():
    """The shipped suites' cells stay on the eager path, so their published results do not move."""
    transformers = pytest.importorskip("transformers")
    from gacbench.bench.validate import load_suite, suite_path
    from gacbench.functional.kernels import choose_kernels
    from gacbench.llm.model import sized_config
    from gacbench.objectives.registry import objective_class

    checked = 0
    for path in sorted(suite_path("synthetic").parent.glob("*.yaml")):
        suite = load_suite(path.stem)
        for task in suite["tasks"].values():
            steps = task.get("steps") or suite["steps"]
            if task["objective"] == "grpo":
                with torch.device("meta"):
                    model = transformers.Qwen3ForCausalLM(sized_config(task["params"]["model"].get("size", "tiny")))
            else:
                model = objective_class(task["objective"])(**task.get("params", {}))
            n = sum(p.numel() for p in model.parameters())
            assert choose_kernels(n, steps) == "eager", (path.stem, task, n, steps)
            checked += 1
    assert checked >= 20


def test_the_callback_chooses_from_the_optimizers_parameters_and_the_runs_steps(monkeypatch):
    from conftest import UserRegressor, make_trainer

    import gacbench.functional.gac as gac_module
    from gacbench import GAC

    seen = []
    monkeypatch.setattr(gac_module, "choose_kernels", lambda n, steps, device, name: seen.append((n, steps, device,
                                                                                                 name)) or "eager")
    gac = GAC()
    assert gac.transform.requested_kernels == "auto" and gac.kernels_used == "eager"
    make_trainer([gac], max_steps=14, accumulate_grad_batches=2).fit(UserRegressor())
    assert seen == [(5 * 8 + 8 + 8 + 1, 14.0, "cpu", None)]  # Linear(5, 8) and Linear(8, 1); 14 optimizer steps
    fixed = GAC(kernels="compiled")
    make_trainer([fixed], max_steps=1).fit(UserRegressor())  # one step: no reference yet, nothing compiles
    assert len(seen) == 1 and fixed.kernels_used == "compiled"  # a path given by name is not re-chosen


def test_auto_runs_the_eager_path_on_a_small_model():
    from conftest import UserRegressor, make_trainer

    from gacbench import GAC

    runs = []
    for kernels in ("auto", "eager"):
        model, gac = UserRegressor(optimizer="adamw"), GAC(kernels=kernels)
        make_trainer([gac], max_steps=8).fit(model)
        runs.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        assert gac.kernels_used == "eager"
    assert torch.equal(runs[0], runs[1])


# -- kernels="auto" off the CPU: from the table of measurements ------------------------------------------------

H200, N = "NVIDIA H200", 1_720_574_976


def _row(kernels, keep, shrink, first=2.0, gpu=H200, params=N, shape="qwen3-1.7b") -> Measurement:
    return Measurement("cuda", gpu, "2.11", shape, params, kernels, 16.3, keep, shrink, first)


def test_auto_on_cuda_is_eager_until_a_faster_path_is_measured_there():
    assert choose_kernels(N, 10_000, "cuda", H200) == "eager"  # the shipped table: the eager figures only
    eager = _row("eager", 1.01, 1.33, first=0.0)
    table = (eager, _row("triton", 0.30, 0.60))
    assert choose_measured(N, 10_000, "cuda", H200, table) == "triton"
    assert choose_kernels(N, 10_000, "cuda", H200, table=table) == "triton"  # choose_kernels reads the table
    assert choose_measured(N, 10_000, "cuda", "NVIDIA A100-SXM4-80GB", table) == "eager"  # another GPU
    assert choose_measured(N, 10_000, "cuda", None, table) == "eager"  # a GPU of unknown name
    assert choose_measured(N // 2, 10_000, "cuda", H200, table) == "eager"  # smaller than anything measured
    assert choose_measured(N, math.inf, "cuda", H200, table) == "eager"  # the run's length unknown
    assert choose_measured(N, 10_000, "cuda", H200, (_row("triton", 0.30, 0.60),)) == "eager"  # no eager row
    assert choose_measured(N, 10_000, "cuda", H200, (eager, _row("triton", 0.30, 1.40))) == "eager"  # shrink slower
    assert choose_kernels(N, 10_000, "cpu", None, table=table) == "fused-adamw"  # the CPU keeps its own rule


def test_auto_on_cuda_repays_the_first_call_and_takes_the_path_that_saves_most():
    eager = _row("eager", 1.01, 1.33, first=0.0)
    slow_compile = _row("compiled", 0.50, 0.80, first=60.0)  # saves min(0.51, 0.53) x 16.3 ms = 8.313 ms a step
    steps = math.ceil(60.0 / (0.51 * 16.3e-3))
    table = (eager, slow_compile)
    assert choose_measured(N, steps, "cuda", H200, table) == "compiled"
    assert choose_measured(N, steps - 1, "cuda", H200, table) == "eager"
    both = (eager, slow_compile, _row("triton", 0.30, 0.60, first=1.0))
    assert choose_measured(N, 10 * steps, "cuda", H200, both) == "triton"
    assert choose_measured(N, 10 * steps, "cuda", H200, both[::-1]) == "triton"  # the order of rows does not matter


def _record(keep: float, shrink: float) -> dict:
    """An overhead record at the 1.7B shape on an H200, as run_overhead writes it, with eager's figures from the
    last GPU run and the Triton path's ``keep`` and ``shrink``."""
    return {"params": N, "gpu": H200, "torch": "2.11.0+cu128", "shape_name": "qwen3-1.7b", "adamw_step_s": 0.0163,
            "gac_keep_over_adamw": 1.01, "gac_over_adamw": 1.33, "gac_case": "shrink", "gac_keep_case": "keep",
            "first_round_extra_eager_s": 0.4, "gac_keep_triton_over_adamw": keep, "gac_triton_over_adamw": shrink,
            "gac_triton_case": "shrink", "gac_keep_triton_case": "keep", "first_round_extra_triton_s": 3.2,
            "floor_keep_over_adamw": 0.36, "floor_project_over_adamw": 0.72}


def test_the_printed_row_is_the_measurement_and_adding_it_lets_auto_choose_triton():
    from gacbench.functional.kernels import MEASURED, measurement_row

    record = _record(0.31, 0.74)
    line = measurement_row(record, "triton", "_triton")
    row = eval(line.rstrip(","), {"Measurement": Measurement})
    assert row == Measurement("cuda", H200, "2.11.0", "qwen3-1.7b", N, "triton", 16.3, 0.31, 0.74, 3.2)
    eager = eval(measurement_row(record, "eager", "").rstrip(","), {"Measurement": Measurement})
    assert (eager.keep, eager.shrink, eager.adamw_ms) == (MEASURED[0].keep, MEASURED[0].shrink, MEASURED[0].adamw_ms)
    assert choose_kernels(N, 1_000, "cuda", H200, table=MEASURED + (row,)) == "triton"
    assert measurement_row({**record, "gpu": None}, "triton", "_triton") is None  # a CPU record has no row


def test_a_reference_rounded_to_zero_gives_no_c_t_on_the_fused_path():
    """A float16 reference of a tiny gradient rounds to zero: the fused AdamW path reports the zero reference
    (no c_t, counted as skipped) as the eager path does, and both keep the gradient."""
    from gacbench.functional import kernels as kernel_module

    assert kernel_module.compiled_available()  # the fused path below runs compiled
    outs = {}
    for kernels in ("eager", "fused-adamw"):
        p = torch.nn.Parameter(torch.zeros(SHAPES[0]))
        opt = torch.optim.AdamW([p], lr=1e-3)
        gac = GACTransform(kernels=kernels, buffer_dtype="float16")
        for g in (torch.full(SHAPES[0], 1e-9), torch.ones(SHAPES[0])):  # 1e-9 is 0 in float16
            p.grad = g
            out = gac.step([p], swap=True, keep_alias=True, optimizer=opt if kernels != "eager" else None)
            opt.step()
            gac.release([p])
            p.grad = None
        outs[kernels] = out
    for out in outs.values():
        assert out.zero_ref and math.isnan(out.decision.cos) and out.decision.action == KEEP
    assert outs["fused-adamw"].stepped


def test_adamws_step_counts_are_read_at_once_and_advanced_in_place():
    """The fused AdamW step reads and advances every parameter's step count: tensors (a fused or capturable AdamW
    keeps them on the parameters' device) in one read and one multi-tensor add, plain numbers as numbers."""
    from gacbench.functional.kernels import _advance_steps, _step_counts

    states = [{"step": torch.tensor(3.0)}, {"step": 3}, {"step": torch.tensor(3.0)}]
    kept = states[0]["step"]
    assert _step_counts(states) == [3.0, 3.0, 3.0]
    _advance_steps(states, 1)
    assert _step_counts(states) == [4.0, 4.0, 4.0] and states[0]["step"] is kept  # in place: the optimizer's tensor
    _advance_steps(states, -1)
    assert [float(s["step"]) for s in states] == [3.0, 3.0, 3.0]
    states[2]["step"] += 1
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in states]
    opt = torch.optim.AdamW(params)
    opt.state.update({p: {"step": st["step"], "exp_avg": torch.zeros(2), "exp_avg_sq": torch.zeros(2)}
                      for p, st in zip(params, states)})
    from gacbench.functional.kernels import adamw_group_fusable

    assert not adamw_group_fusable(opt, params)  # unequal counts: one bias correction cannot serve the group
    opt.state[params[2]]["step"] -= 1
    assert adamw_group_fusable(opt, params)


def test_a_kernel_compiled_for_more_signatures_than_dynamos_default_limit_stays_compiled(monkeypatch):
    """A process that compiles a kernel for many signatures (a bench worker whose cells train models of several
    shapes, the test suite) passes Dynamo's default of 8 recompiles: that limit is raised while the kernels compile,
    so the compiled path keeps running and keeps its results instead of falling back to eager for the process."""
    from gacbench.functional import kernels

    monkeypatch.setattr(kernels, "_FAILED", [])
    monkeypatch.setattr(kernels, "_DIRECT", {})
    monkeypatch.setattr(kernels, "_COMPILED", {})
    gen = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a compile failure warns
        for n in range(1, 12):  # eleven list lengths: eleven signatures
            g = [torch.randn(3, generator=gen) for _ in range(n)]
            r = [torch.randn(3, generator=gen) for _ in range(n)]
            two = kernels.compiled_scalars(g, r)
            assert two is not None, f"fell back to eager at {n} tensors"
            want = (sum(float((a.double() * b.double()).sum()) for a, b in zip(g, r)),
                    sum(float((a.double() ** 2).sum()) for a in g))
            assert two.tolist() == pytest.approx(want, rel=1e-6)
    assert kernels.compiled_available()
