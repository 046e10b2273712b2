"""GAC's compiled kernels (kernels="compiled"): the same decisions, cosines and gradients as the eager path to
float32 rounding, over a run that takes every branch; overflow and non-finite gradients handled as the eager path
handles them; and the overhead benchmark's compiled rows. Each distinct parameter list compiles once per process
(about 10-30 s), so the tests share one list of shapes."""

import math

import pytest
import torch

from gacbench.bench.overhead import run_overhead, shape_for_params
from gacbench.functional.alignment import KEEP, PROJECT, SHRINK
from gacbench.functional.gac import GACTransform

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
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)


def test_compiled_kernels_handle_overflow_and_non_finite_gradients_like_the_eager_path():
    # ||g||^2 ~ 1e44 overflows float32: the compiled sums are not finite, the eager path recomputes them exactly
    huge = _run("compiled", scale=1e20)
    assert not any(bad for _, _, bad, _ in huge)
    assert [a for a, *_ in huge] == [a for a, *_ in _run("eager", scale=1e20)]
    poisoned = _run("compiled", poison=float("nan"))
    assert poisoned[3][2] is True  # a NaN gradient is reported bad, as by the eager path
    assert torch.isnan(poisoned[3][3][0][0, 0])  # and left untouched for the caller


def test_unknown_kernels_are_refused():
    with pytest.raises(ValueError, match="kernels='fast' is not one of 'eager', 'compiled'"):
        GACTransform(kernels="fast")


def test_overhead_times_the_compiled_kernels_beside_the_eager_ones():
    record = run_overhead(params=200_000, repeats=1, kernels=("eager", "compiled"))
    for name in ("gac", "gac_keep", "gac_compiled", "gac_keep_compiled"):
        assert record[f"{name}_over_adamw"] == pytest.approx(record[f"{name}_s"] / record["adamw_step_s"])
    assert record["gac_compiled_case"] == "shrink" and record["gac_keep_compiled_case"] == "keep"
    with pytest.raises(ValueError, match="need a float32 reference buffer"):
        run_overhead(params=200_000, repeats=1, buffer_dtype="bfloat16", kernels=("compiled",))
