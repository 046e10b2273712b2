"""Run by test_gac_triton.py under Triton's interpreter (TRITON_INTERPRET=1, set by the test before this process
starts, as Triton requires): GAC(kernels="triton") and the eager path on the same gradients, in each setting the
test checks. Writes every run's record to OUT_DIR/runs.pt; the test compares them.

Usage: python triton_script.py OUT_DIR [slow]   ("slow" adds a Lightning fit and the overhead benchmark)
"""

import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(__file__))

from gacbench.functional import triton_kernels  # noqa: E402
from gacbench.functional.gac import GACTransform  # noqa: E402

#: the interpreter runs each program in numpy: most runs take smaller chunks and blocks than the defaults (the same
#: kernels with other constants), and one run the defaults
CHUNK, BLOCK = 2048, 512
#: odd sizes, one tensor of exactly one chunk and one of two chunks and a tail
SHAPES = ((3,), (1,), (17, 5), (1000,), (96, 64), (CHUNK,), (2 * CHUNK + 333,))
DEFAULT_SHAPES = ((3,), (1000,), (triton_kernels.CHUNK,), (2 * triton_kernels.CHUNK + 7_233,))
#: how much of the previous gradient each step's gradient carries: keep, keep, shrink, shrink, project, keep, ...
MIXES = (0.0, 0.0, 0.005, 0.008, 0.9, 0.0, 0.5, 0.9)


def gradients(shapes=SHAPES, dtypes=None, seed=0, scale=1.0, steps=len(MIXES)) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    dtypes = dtypes or [torch.float32] * len(shapes)
    prev, out = None, []
    for mix in MIXES[:steps]:
        g = [torch.randn(s, generator=gen) for s in shapes]
        if prev is not None:
            g = [x + mix * 20.0 * p for x, p in zip(g, prev)]
        prev = [x.clone() for x in g]
        out.append([(x * scale).to(d) for x, d in zip(g, dtypes)])
    return out


def run(kernels: str, steps: list, swap: bool = True, keep_alias: bool = True, poison_at: int | None = None,
        resume_at: int | None = None, **settings) -> dict:
    """GAC over ``steps`` as the callback runs it (swap, keep_alias) or as a hook / DDP runs it (no swap); per step
    the gradient given, the action, c_t, bad, the gradient handed on, and after it the reference (flat, as
    ``state_dict`` gives it) and its cached norm.
    ``resume_at``: restore a fresh transform from ``state_dict()`` before that step."""
    params = [torch.nn.Parameter(torch.zeros(x.shape, dtype=x.dtype)) for x in steps[0]]
    gac = GACTransform(kernels=kernels, **{"c_low": 0.05, "c_high": 0.3, **settings})
    rec = {"raw": [], "actions": [], "cos": [], "bad": [], "grads": [], "refs": [], "ref_sq": []}
    for t, step in enumerate(steps):
        if t == resume_at:
            saved = gac.state_dict()
            gac = GACTransform(kernels=kernels, **{"c_low": 0.05, "c_high": 0.3, **settings})
            gac.load_state_dict(saved)
        for p, x in zip(params, step):
            p.grad = x.clone()
        if poison_at == t:
            params[-1].grad[5] = float("nan")
        rec["raw"].append([p.grad.detach().clone() for p in params])
        d = gac.step(params, swap=swap, keep_alias=keep_alias)
        rec["actions"].append(d.decision.action)
        rec["cos"].append(d.cos)
        rec["bad"].append(d.bad)
        rec["grads"].append([None if p.grad is None else p.grad.detach().clone() for p in params])
        rec["refs"].append(gac.state_dict()["ref"])
        rec["ref_sq"].append(None if gac.state.ref_sq is None else float(gac.state.ref_sq))
        gac.release(params)
        for p in params:
            p.grad = None
    return rec


def rounding_cases() -> dict:
    """float32 values at bfloat16's rounding edges, through apply's store of the raw gradient: ties to even (up
    and down), a carry out of the mantissa, the largest values (one rounds to inf), subnormals, signs."""
    bits = [0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F7FFFFF, 0x7F7FFFFF, 0x7F7F7FFF, 0x00008001, 0x00018000,
            0x80008000, 0xBF808001, 0x00000000, 0x80000000]
    x = torch.tensor([b - (1 << 32) if b >> 31 else b for b in bits], dtype=torch.int32).view(torch.float32)
    x = torch.cat([x, torch.randn(5000, generator=torch.Generator().manual_seed(4)) * 1e-3])
    ref = torch.zeros_like(x, dtype=torch.bfloat16)
    assert triton_kernels.apply([x.clone()], [ref], 0.0)
    half = torch.zeros_like(x, dtype=torch.float16)
    assert triton_kernels.apply([x.clone()], [half], 0.0)
    return {"x": x, "bf16": ref, "fp16": half}


def main(out_dir: str, slow: bool) -> None:
    assert triton_kernels.interpreted(), "TRITON_INTERPRET=1 must be set before this process starts"
    warnings.filterwarnings("error", "GAC.kernels=.triton.")  # a fall-back to the eager path would pass silently
    runs: dict = {}
    runs["default-chunk"] = {k: run(k, gradients(DEFAULT_SHAPES, steps=5)) for k in ("eager", "triton")}
    triton_kernels.CHUNK, triton_kernels.BLOCK = CHUNK, BLOCK
    steps = gradients()
    for name, kw in {"swap": {}, "no-swap": {"swap": False, "keep_alias": False},
                     "hook": {"keep_alias": False}, "skip": {"high_mode": "skip"},
                     "bf16-buffer": {"buffer_dtype": "bfloat16"}, "fp16-buffer": {"buffer_dtype": "float16"},
                     "ema": {"reference": "ema"}}.items():
        runs[name] = {k: run(k, steps, **kw) for k in ("eager", "triton")}
    runs["resumed"] = {"triton": run("triton", steps, resume_at=4), "eager": runs["swap"]["triton"]}
    huge = gradients(scale=1e20)  # ||g||^2 overflows float32: the eager path recomputes the sums
    runs["huge"] = {k: run(k, huge) for k in ("eager", "triton")}
    runs["nan"] = {k: run(k, steps, poison_at=3) for k in ("eager", "triton")}
    mixed = gradients(dtypes=[torch.float32, torch.bfloat16, torch.float32, torch.bfloat16, torch.float16,
                              torch.float32, torch.bfloat16])
    runs["mixed-dtypes"] = {k: run(k, mixed) for k in ("eager", "triton")}
    runs["rounding"] = rounding_cases()
    if slow:
        from conftest import UserRegressor, flat_params, make_trainer

        from gacbench import GAC, StalenessSimulator
        from gacbench.bench.gpu_check import check_gac_equivalence
        from gacbench.bench.overhead import run_overhead

        fits = {}
        for kernels in ("eager", "triton"):
            model = UserRegressor(optimizer="adamw", lr=0.05)
            gac = GAC(c_low=0.05, c_high=0.3, warmup=0, kernels=kernels)
            make_trainer([StalenessSimulator(4), gac], max_steps=40).fit(model)
            fits[kernels] = (flat_params(model), gac.changed, gac.kernels_used)
        runs["fit"] = fits
        runs["gpu-check row"] = check_gac_equivalence("triton", torch.device("cpu"))
        runs["overhead"] = run_overhead(params=30_000, repeats=1, kernels=("eager", "triton"))
    torch.save(runs, os.path.join(out_dir, "runs.pt"))


if __name__ == "__main__":
    main(sys.argv[1], "slow" in sys.argv[2:])
