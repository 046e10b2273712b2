"""GAC's Triton kernels (kernels="triton"), checked on the CPU under Triton's interpreter (TRITON_INTERPRET=1, set
in a child process before Triton defines the kernels: tests/triton_script.py): every step's decision and c_t equal
to the eager path's to float32 rounding; every changed gradient within rounding of g - alpha r computed in float64
from the same inputs; the reference exactly the raw gradient, rounded once to its buffer's dtype; non-finite sums,
checkpoints, lower-precision buffers and mixed dtypes as the eager path handles them. Then, without the interpreter,
the fall-back to the eager path, and the GPU run's target check on synthetic records."""

import math
import os
import subprocess
import sys
import warnings

import pytest
import torch

from gacbench.functional.alignment import KEEP, PROJECT, SHRINK, SKIP, gac_decision

HERE = os.path.dirname(__file__)
#: unit roundoff of each dtype: |x - round(x)| <= U * |x|
U = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def _interpreted(tmp_path, *args) -> dict:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, os.path.join(HERE, "triton_script.py"), str(tmp_path), *args],
                          capture_output=True, text=True, timeout=900, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(tmp_path / "runs.pt", weights_only=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _interpreted(tmp_path_factory.mktemp("triton"))


def _flat(tensors, dtype=torch.float64) -> torch.Tensor:
    return torch.cat([t.reshape(-1).to(dtype) for t in tensors])


def _check_against_float64(rec: dict, settings: dict) -> None:
    """Each step of a Triton run against the rule computed in float64 from the same gradient and the reference the
    run held before it: the same action, c_t within 1e-6, a changed gradient within rounding of g - alpha r (one
    rounding to its dtype, and the float32 sums behind alpha), a kept one untouched."""
    c_low, c_high = settings.get("c_low", 0.05), settings.get("c_high", 0.3)
    has_ref = False
    for t, (raw, action, cos, bad, out) in enumerate(zip(rec["raw"], rec["actions"], rec["cos"], rec["bad"],
                                                         rec["grads"])):
        g = _flat(raw)
        if bad:
            assert not torch.isfinite(g).all()
            continue
        r = rec["refs"][t - 1].to(torch.float64) if t else torch.zeros_like(g)
        dot, gg, rr = float(g @ r), float(g @ g), float(r @ r)
        c = dot / math.sqrt(gg * rr) if has_ref else float("nan")
        want = gac_decision(c, c_low, c_high, settings.get("high_mode", "project"))
        assert action == want.action, (t, action, want)
        assert (math.isnan(c) and math.isnan(cos)) or abs(cos - c) <= 1e-6, (t, cos, c)
        if action == SKIP:
            assert all(x is None for x in out)
        elif action == KEEP:
            assert all(torch.equal(x, y) for x, y in zip(out, raw)), t
        else:
            alpha = want.coef * dot / rr
            exact = g - alpha * r
            got = _flat(out)
            units = torch.cat([torch.full((x.numel(),), U[x.dtype], dtype=torch.float64) for x in raw])
            tol = units * exact.abs() + 2e-6 * (g.abs() + abs(alpha) * r.abs())
            assert bool(((got - exact).abs() <= tol).all()), (t, float(((got - exact).abs() / tol).max()))
        has_ref = True


def _check_reference_is_the_raw_gradient(rec: dict, buffer_dtype=None) -> None:
    """With the reference "grad": after each step the reference is that step's raw gradient rounded once to the
    buffer's dtype, bit for bit (unchanged after a step with a non-finite gradient), and a cached ||r||^2 is its
    norm."""
    for t, (raw, bad, ref, ref_sq) in enumerate(zip(rec["raw"], rec["bad"], rec["refs"], rec["ref_sq"])):
        if bad:
            assert torch.equal(ref, rec["refs"][t - 1])
            continue
        want = torch.cat([x.reshape(-1).to(buffer_dtype or x.dtype).to(ref.dtype) for x in raw])
        assert torch.equal(ref, want), t
        if ref_sq is not None:
            assert ref_sq == pytest.approx(float(ref.double() @ ref.double()), rel=1e-6)


def _same_decisions_as_eager(pair: dict, cos_tol: float = 1e-6) -> None:
    eager, fast = pair["eager"], pair["triton"]
    assert fast["actions"] == eager["actions"] and fast["bad"] == eager["bad"]
    for a, b in zip(eager["cos"], fast["cos"]):
        assert (math.isnan(a) and math.isnan(b)) or abs(a - b) <= cos_tol


@pytest.mark.parametrize("name,settings,buffer_dtype", [
    ("default-chunk", {}, None),  # the kernels' own chunk and block sizes
    ("swap", {}, None),  # as the callback runs it: the projection swaps storage, a kept step writes nothing
    ("hook", {}, None),  # swap without keep_alias (attach_gac): a kept step copies g into the reference
    ("no-swap", {}, None),  # gradients that cannot be swapped (DDP bucket views): one pass writes g~ and r
    ("skip", {"high_mode": "skip"}, None),
    ("bf16-buffer", {}, torch.bfloat16),
    ("fp16-buffer", {}, torch.float16),
    ("mixed-dtypes", {}, None),  # float32, bfloat16 and float16 parameters: one launch per dtype pair
])
def test_triton_path_takes_the_eager_decisions_and_the_exact_update(runs, name, settings, buffer_dtype):
    pair = runs[name]
    assert {SHRINK, PROJECT} <= set(pair["eager"]["actions"]) or SKIP in pair["eager"]["actions"]
    _same_decisions_as_eager(pair)
    _check_against_float64(pair["triton"], settings)
    _check_reference_is_the_raw_gradient(pair["triton"], buffer_dtype)


def test_other_references_take_the_triton_scalars_and_the_eager_update(runs):
    pair = runs["ema"]
    _same_decisions_as_eager(pair)
    _check_against_float64(pair["triton"], {})
    for a, b in zip(pair["eager"]["refs"], pair["triton"]["refs"]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6 * float(a.abs().max()))


def test_a_float32_overflow_goes_to_the_eager_sums_and_a_nan_gradient_is_left_alone(runs):
    huge = runs["huge"]  # ||g||^2 ~ 1e45: the float32 partials overflow, the eager path recomputes in float64
    _same_decisions_as_eager(huge)
    assert not any(huge["triton"]["bad"]) and SHRINK in huge["triton"]["actions"]
    _check_against_float64(huge["triton"], {})
    nan = runs["nan"]
    _same_decisions_as_eager(nan)
    assert nan["triton"]["bad"][3] is True
    assert torch.isnan(nan["triton"]["grads"][3][-1][5])  # handed back untouched, for the caller to handle
    _check_reference_is_the_raw_gradient(nan["triton"])


def test_a_run_resumed_from_its_state_dict_continues_bit_for_bit(runs):
    resumed, straight = runs["resumed"]["triton"], runs["resumed"]["eager"]  # "eager": the uninterrupted Triton run
    assert resumed["actions"] == straight["actions"] and resumed["cos"][1:] == straight["cos"][1:]
    for a, b in zip(resumed["grads"], straight["grads"]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(torch.equal(x, y) for x, y in zip(resumed["refs"], straight["refs"]))


def test_stores_round_to_nearest_even_as_torch_does(runs):
    """The kernels round float32 to bfloat16 by integer arithmetic (the interpreter would truncate): ties to even,
    a carry into the exponent, overflow to inf, subnormals and signs as torch rounds them; float16 by a cast."""
    cases = runs["rounding"]
    assert torch.equal(cases["bf16"], cases["x"].bfloat16())
    assert torch.equal(cases["fp16"], cases["x"].half())
    assert torch.isinf(cases["bf16"][4])  # float32's largest value is past bfloat16's


@pytest.mark.slow
def test_triton_path_in_a_trainer_in_gpu_check_and_in_overhead(tmp_path):
    runs = _interpreted(tmp_path, "slow")
    (eager, changed_e, used_e), (fast, changed_t, used_t) = runs["fit"]["eager"], runs["fit"]["triton"]
    assert (used_e, used_t) == ("eager", "triton") and changed_e == changed_t > 0
    torch.testing.assert_close(fast, eager, rtol=1e-4, atol=1e-5)
    row = runs["gpu-check row"]
    assert row["ok"] and row["actions"] == ["keep", "keep", "shrink", "project"] and row["cos_err"] > 0
    record = runs["overhead"]
    assert record["kernels"] == ["eager", "triton"]
    assert record["gac_triton_case"] == "shrink" and record["gac_keep_triton_case"] == "keep"
    assert record["gac_triton_over_adamw"] == pytest.approx(record["gac_triton_s"] / record["adamw_step_triton_s"])


@pytest.mark.slow
def test_the_kernels_compile_for_an_h100_and_vectorise_aligned_loads():
    """Triton's CUDA compiler needs no GPU to emit PTX: the aligned variant's loads are 16-byte vectors (the hint
    on the addresses reaches the compiler), the unaligned one's are not."""
    triton = pytest.importorskip("triton")
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this Triton has no CUDA backend")
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from gacbench.functional import _triton_jit, triton_kernels

    sig = {"owner": "*i32", "starts": "*i64", "ends": "*i64", "g_addr": "*i64", "r_addr": "*i64",
           "partials": "*fp32", "G": "constexpr", "R": "constexpr", "REF_SQ": "constexpr", "ALIGNED": "constexpr",
           "BLOCK": "constexpr"}
    loads = {}
    for aligned in (True, False):
        src = ASTSource(fn=_triton_jit.scalars_kernel, signature=sig,
                        constexprs={"G": tl.float32, "R": tl.bfloat16, "REF_SQ": True, "ALIGNED": aligned,
                                    "BLOCK": triton_kernels.BLOCK})
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": True})
        loads[aligned] = kernel.asm["ptx"].count("ld.global.v4")
    assert loads[True] >= 2 and loads[False] == 0


def test_without_a_gpu_or_the_interpreter_triton_warns_once_and_runs_eager(monkeypatch):
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter is on in this process")
    from gacbench.functional import triton_kernels
    from gacbench.functional.gac import GACTransform

    monkeypatch.setattr(triton_kernels, "_WARNED", set())
    gen = torch.Generator().manual_seed(0)
    g0 = [torch.randn(s, generator=gen) for s in ((7, 3), (5,))]
    outs = {}
    for kernels in ("eager", "triton"):
        params = [torch.nn.Parameter(torch.zeros_like(x)) for x in g0]
        gac = GACTransform(c_low=0.05, c_high=0.3, kernels=kernels)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for g in (g0, [2.0 * x + 0.1 for x in g0], g0):
                for p, x in zip(params, g):
                    p.grad = x.clone()
                d = gac.step(params, swap=True, keep_alias=True)
                gac.release(params)
        outs[kernels] = (d.decision.action, d.cos, [p.grad for p in params])
        ours = [w for w in caught if "kernels='triton'" in str(w.message)]
        assert len(ours) == (1 if kernels == "triton" else 0)
    assert "interpreter" in str(ours[0].message) or "cannot be imported" in str(ours[0].message)
    assert outs["eager"][:2] == (PROJECT, outs["triton"][1]) and outs["triton"][0] == PROJECT
    assert all(torch.equal(p, q) for p, q in zip(outs["eager"][2], outs["triton"][2]))  # the eager kernels ran


def test_triton_takes_only_lists_it_can_read():
    from gacbench.functional.triton_kernels import unusable

    g = [torch.randn(4, 3)]
    assert "float64" in unusable([g[0].double()], [g[0].double()])
    assert "contiguous" in unusable([g[0].t()], [torch.zeros(3, 4).t().contiguous()])
    assert "lengths" in unusable(g, [])
    assert unusable(g, [torch.zeros(4, 3)]) is not None  # CPU tensors without the interpreter, or no Triton


# -- the GPU run: its targets and its rows for MEASURED, on synthetic records ------------------------------------

from test_gac_kernels import _record  # noqa: E402  (the same synthetic overhead record as the auto-table tests)


@pytest.mark.parametrize("keep,shrink,ok", [(0.31, 0.74, True), (0.46, 0.74, False), (0.31, 0.91, False)])
def test_gpu_check_fails_the_triton_row_that_misses_its_target(monkeypatch, keep, shrink, ok):
    from gacbench.bench import gpu_check, overhead

    monkeypatch.setattr(overhead, "run_overhead", lambda **kw: _record(keep, shrink))
    rows = gpu_check.check_overhead(("eager", "triton"), torch.device("cuda"), 1, None)
    eager, fast = rows
    assert eager["ok"] and "target" not in eager["detail"]  # the eager path has no target
    assert fast["ok"] is ok and ("target keep <= 0.45x, shrink <= 0.90x: " + ("met" if ok else "MISSED")) in \
        fast["detail"]
    assert fast["measured"].startswith('Measurement("cuda", \'NVIDIA H200\'')


def test_without_a_gpu_the_triton_rows_are_skipped_and_overhead_refuses_it(capsys):
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter is on in this process")
    from gacbench.bench.gpu_check import run_gpu_check
    from gacbench.cli import main

    result = run_gpu_check(device="cpu", kernels=("triton",), grpo_steps=0, skip_tests=True, stream=sys.stderr)
    assert result["ok"] and [(r["check"], r["ok"]) for r in result["rows"]] == [("gac triton", None),
                                                                                ("tests", None)]
    assert main(["overhead", "--params", "100000", "--kernels", "triton"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--kernels triton on cpu" in err and "leave triton out" in err
