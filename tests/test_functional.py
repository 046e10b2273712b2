"""Property and exactness tests of the pure functions (no Lightning)."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gacbench.functional import (
    alignment_scalars,
    alignment_summary,
    cosine,
    dot,
    gac_decision,
    gac_project,
    sq_norm,
    validate_thresholds,
)
from gacbench.functional.alignment import _CPU_BLOCK_PER_THREAD, KEEP, PROJECT, SHRINK, SKIP
from gacbench.functional.gac import REFERENCES, GACTransform

SHAPES = [(3, 4), (5,), (2, 2, 2)]


def split(v: torch.Tensor) -> list[torch.Tensor]:
    out, i = [], 0
    for s in SHAPES:
        n = math.prod(s)
        out.append(v[i : i + n].reshape(s).clone())
        i += n
    return out


def flat(xs) -> torch.Tensor:
    return torch.cat([x.reshape(-1) for x in xs])


N = sum(math.prod(s) for s in SHAPES)
vectors = st.lists(st.floats(-10, 10, allow_nan=False, width=32), min_size=N, max_size=N).map(
    lambda xs: torch.tensor(xs, dtype=torch.float64)
)


def aligned_pair(c: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """g and r with cos(g, r) = c exactly (float64)."""
    gen = torch.Generator().manual_seed(seed)
    r = torch.randn(N, generator=gen, dtype=torch.float64)
    w = torch.randn(N, generator=gen, dtype=torch.float64)
    u = r / r.norm()
    w = w - (w @ u) * u
    w = w / w.norm()
    g = (c * u + math.sqrt(1 - c * c) * w) * 3.7
    return g, r


def test_dot_and_norm_match_flat_vectors():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(N, generator=gen), torch.randn(N, generator=gen)
    a64, b64 = a.double(), b.double()
    assert float(dot(split(a), split(b))) == pytest.approx(float(a64 @ b64), rel=1e-6)
    assert float(sq_norm(split(a))) == pytest.approx(float(a64 @ a64), rel=1e-6)
    assert cosine(split(a), split(b)) == pytest.approx(float(a @ b / (a.norm() * b.norm())), rel=1e-5)


def test_alignment_scalars_of_tensors_larger_than_a_block():
    """Tensors longer than the CPU block are reduced block by block; the scalars equal a float64
    computation, whatever the dtype of the reference, and ||r||^2 taken as the third scalar is bit for bit
    ||r||^2 taken as the second (GAC caches one and recomputes the other on resume)."""
    gen = torch.Generator().manual_seed(5)
    n = 2 * _CPU_BLOCK_PER_THREAD * torch.get_num_threads() + 50000  # two whole blocks and a part
    g = [torch.randn(n, generator=gen), torch.randn(7, generator=gen)]
    r = [torch.randn(n, generator=gen) + 0.3 * g[0], torch.randn(7, generator=gen)]
    for ref in (r, [t.bfloat16() for t in r]):
        g64, r64 = flat(g).double(), flat(ref).double()
        s = alignment_scalars(g, ref)
        assert s.tolist() == pytest.approx([float(g64 @ r64), float(g64 @ g64), float(r64 @ r64)], rel=1e-5)
    s = alignment_scalars(g, r)
    assert float(alignment_scalars(r, g)[1]) == float(s[2])
    assert float(alignment_scalars(g, r, ref_sq=s[2])[2]) == float(s[2])


def test_dot_upcasts_low_precision():
    a = torch.randn(1000, dtype=torch.bfloat16)
    assert dot([a], [a]).dtype == torch.float64


def test_cosine_of_zero_vector_is_zero_not_nan():
    assert cosine([torch.zeros(3)], [torch.ones(3)]) == 0.0


@pytest.mark.parametrize("bad", [(-0.1, 0.3), (0.3, 0.3), (0.4, 0.3), (0.05, 1.5), (float("nan"), 0.3), ("0.1", 0.3)])
def test_threshold_validation_names_the_values(bad):
    with pytest.raises(ValueError, match="c_low|c_high"):
        validate_thresholds(*bad)


@settings(max_examples=200, deadline=None)
@given(g=vectors, r=vectors)
def test_below_c_low_the_gradient_is_untouched_bit_for_bit(g, r):
    gl, rl = split(g), split(r)
    c = cosine(gl, rl)
    out, d = gac_project(gl, rl, c_low=0.05, c_high=0.3)
    if c <= 0.05:
        assert d.action == KEEP
        assert all(o is x for o, x in zip(out, gl))  # the very same tensors


@settings(max_examples=100, deadline=None)
@given(c=st.floats(0.051, 0.299), seed=st.integers(0, 1000), shrink=st.sampled_from(["component", "cosine"]))
def test_mid_regime_brings_alignment_to_c_low(c, seed, shrink):
    g, r = aligned_pair(c, seed)
    out, d = gac_project(split(g), split(r), c_low=0.05, c_high=0.3, shrink=shrink)
    assert d.action == SHRINK
    gt = flat(out)
    u = r / r.norm()
    if shrink == "component":  # docs/design.md's formula: the aligned component is c_low * ||g||
        assert float(gt @ u) == pytest.approx(0.05 * float(g.norm()), rel=1e-5)
    else:  # the cosine itself is c_low
        assert float(gt @ u / gt.norm()) == pytest.approx(0.05, rel=1e-5)
    # the orthogonal part is untouched
    assert torch.allclose(gt - (gt @ u) * u, g - (g @ u) * u, atol=1e-6)


@settings(max_examples=100, deadline=None)
@given(c=st.floats(-0.99, 0.99), seed=st.integers(0, 1000), high_mode=st.sampled_from(["project", "skip"]))
def test_descent_guarantees(c, seed, high_mode):
    """<g~, g> >= (1 - c_high^2) ||g||^2 whenever c < c_high; in full projection g~ is orthogonal to r
    and <g~, g> = (1 - c^2) ||g||^2; ||g~|| <= ||g|| always."""
    c_low, c_high = 0.05, 0.3
    g, r = aligned_pair(c, seed)
    out, d = gac_project(split(g), split(r), c_low, c_high, high_mode=high_mode)
    gg = float(g @ g)
    assert d.cos == pytest.approx(c, abs=1e-6)
    c = d.cos  # the regime follows the computed cosine (float32 accumulation)
    if d.action == SKIP:
        assert out is None and c >= c_high and high_mode == "skip"
        return
    gt = flat(out)
    assert float(gt.norm()) <= float(g.norm()) * (1 + 1e-7)
    if c < c_high:
        assert float(gt @ g) >= (1 - c_high**2) * gg * (1 - 1e-6)
    else:
        assert d.action == PROJECT
        assert abs(float(gt @ r)) <= 1e-6 * float(g.norm() * r.norm())
        assert float(gt @ g) == pytest.approx((1 - c * c) * gg, rel=1e-5)


@settings(max_examples=50, deadline=None)
@given(c=st.floats(0.31, 0.99), seed=st.integers(0, 1000))
def test_projecting_twice_changes_nothing(c, seed):
    g, r = aligned_pair(c, seed)
    once, _ = gac_project(split(g), split(r), 0.05, 0.3)
    twice, d = gac_project(once, split(r), 0.05, 0.3)
    assert d.action == KEEP  # g~ is orthogonal to r: the on-policy regime
    assert torch.allclose(flat(twice), flat(once))


def test_a_zero_reference_gives_no_cosine_and_keeps_the_gradient():
    """A zero reference has no direction: c is NaN (as GAC's callback and step report it), the gradient is kept
    as it is, and a zero gradient against a non-zero reference is orthogonal to it (c = 0)."""
    g, r = split(torch.arange(1.0, N + 1.0)), split(torch.zeros(N))
    out, d = gac_project(g, r, 0.05, 0.3)
    assert d.action == KEEP and math.isnan(d.cos)
    assert all(o is x for o, x in zip(out, g))
    out, d = gac_project(split(torch.zeros(N)), split(torch.ones(N)), 0.05, 0.3)
    assert d.action == KEEP and d.cos == 0.0


def test_decision_regimes_and_coefficients():
    assert gac_decision(0.05).action == KEEP
    assert gac_decision(-0.9).action == KEEP
    assert gac_decision(float("nan")).action == KEEP
    d = gac_decision(0.1)
    assert d.action == SHRINK and d.coef == pytest.approx(0.5)
    assert gac_decision(0.3).action == PROJECT and gac_decision(0.3).coef == 1.0
    assert gac_decision(0.3, high_mode="skip").action == SKIP


def test_alignment_summary_matches_numpy():
    rng = np.random.default_rng(0)
    cos = list(rng.uniform(-0.2, 0.2, size=200))
    s = alignment_summary(cos, warmup=50, tol=0.05)
    a = np.abs(np.asarray(cos[50:]))
    assert s["n"] == 150
    assert s["q90_abs"] == pytest.approx(np.quantile(a, 0.9))
    assert s["max_abs"] == pytest.approx(a.max())
    assert s["frac_le_tol"] == pytest.approx(np.mean(a <= 0.05))
    assert math.isnan(alignment_summary([0.1], warmup=5)["q90_abs"])
    assert alignment_summary([0.05, -0.05, 0.2], tol=0.05)["frac_le_tol"] == pytest.approx(2 / 3)  # |c| = tol counts


def test_a_skipped_step_leaves_the_applied_reference_as_it_was():
    """reference="applied", high_mode="skip": step 2 (c = 0.995 against (1, 0)) is skipped, so nothing is applied
    and the reference stays (1, 0); step 3's (0, 1) is then orthogonal to it (c = 0, kept), where against the
    skipped raw gradient (1, 0.1) it would read 0.0995 and be shrunk."""
    gac = GACTransform(c_low=0.05, c_high=0.3, reference="applied", high_mode="skip")
    p = torch.nn.Parameter(torch.zeros(2))
    actions, cos = [], []
    for g in ([1.0, 0.0], [1.0, 0.1], [0.0, 1.0]):
        p.grad = torch.tensor(g)
        d = gac.step([p]).decision
        actions.append(d.action)
        cos.append(d.cos)
        if len(actions) == 2:
            assert gac.state.ref[0].tolist() == [1.0, 0.0]
    assert actions[1:] == [SKIP, KEEP]
    assert cos[1] == pytest.approx(1 / math.sqrt(1.01)) and cos[2] == 0.0


def _run_transform(gac: GACTransform, params: list[torch.nn.Parameter], grads: list[torch.Tensor]) -> list:
    """Steps ``gac`` on each gradient (a flat vector), then moves the parameters by -0.1 * applied gradient."""
    out = []
    for g in grads:
        for p, gi in zip(params, split(g)):
            p.grad = gi.clone()
        step = gac.step(params)
        applied = [p.grad.clone() if p.grad is not None else None for p in params]
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.sub_(0.1 * p.grad)
        out.append((step.decision, applied))
    return out


@pytest.mark.parametrize("reference", REFERENCES)
def test_transform_state_round_trip_continues_bit_for_bit(reference):
    """state_dict -> load_state_dict, into a fresh transform (before it has seen the parameters) and
    into one that already has a reference, continues exactly as the uninterrupted transform."""
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(N, generator=gen, dtype=torch.float64)
    grads = [base + 0.7 * torch.randn(N, generator=gen, dtype=torch.float64) for _ in range(6)]  # aligned: GAC acts
    start = [torch.nn.Parameter(t) for t in split(torch.randn(N, generator=gen, dtype=torch.float64))]

    full, params = GACTransform(reference=reference), [torch.nn.Parameter(p.detach().clone()) for p in start]
    head = _run_transform(full, params, grads[:3])
    saved = full.state_dict()
    theta = [p.detach().clone() for p in params]  # the parameters at the cut
    assert saved["has_ref"] and saved["ref"].shape == (N,)
    tail = _run_transform(full, params, grads[3:])
    assert any(d.changed for d, _ in head + tail)

    early, late = GACTransform(reference=reference), GACTransform(reference=reference)
    early.load_state_dict(saved)
    assert early.state.ref is None and early.state.saved is not None  # waits for the parameters
    _run_transform(late, [torch.nn.Parameter(t.clone()) for t in theta], grads[5:])  # holds another reference
    late.load_state_dict(saved)
    for resumed in (early, late):
        got = _run_transform(resumed, [torch.nn.Parameter(t.clone()) for t in theta], grads[3:])
        assert [d for d, _ in got] == [d for d, _ in tail]
        for (_, a), (_, b) in zip(got, tail):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
        assert torch.equal(resumed.state_dict()["ref"], full.state_dict()["ref"])


def test_transform_state_refuses_a_foreign_checkpoint():
    gac = GACTransform()
    params = [torch.nn.Parameter(torch.zeros(3))]
    params[0].grad = torch.ones(3)
    gac.step(params)
    with pytest.raises(ValueError, match="5 elements but the model has 3"):
        gac.load_state_dict({"has_ref": True, "ref": torch.zeros(5)})
    with pytest.raises(ValueError, match="keys 'has_ref' and 'ref' \\(and 'ref_sq', 'held'\\)"):
        gac.load_state_dict({"ref": torch.zeros(3)})


def _sgd_run(gac: GACTransform, grads: list[list[float]], lr: float = 0.5):
    """Steps ``gac`` on each 4-element gradient, then moves theta by -lr * (applied gradient); theta_0 = 0.
    Returns the decisions and the applied gradients (None for a skipped step)."""
    p = torch.nn.Parameter(torch.zeros(4))
    decisions, applied = [], []
    for g in grads:
        p.grad = torch.tensor(g, dtype=torch.float32)
        decisions.append(gac.step([p]).decision)
        applied.append(None if p.grad is None else p.grad.tolist())
        if p.grad is not None:
            with torch.no_grad():
                p.sub_(lr * p.grad)
    return decisions, applied


# The three references on hand-worked examples, exact in binary floating point. c_low = 0.25 and c_high = 0.75:
# against r = (4, 0, 0, 0), g = (1, 1, 1, 1) has c = 4 / (2 * 4) = 1/2, so the shrink removes the fraction
# 1 - c_low/c = 1/2 of g_par = (1, 0, 0, 0): g~ = (0.5, 1, 1, 1). A g written r + w with w orthogonal to r has
# c >= c_high in each example below and is projected to exactly w.


def test_ema_reference_by_hand():
    """r_t = 0.75 r_{t-1} + 0.25 g_t (raw gradients). Step 2: r = 0.75 (4,0,0,0) + 0.25 (1,1,1,1) =
    (3.25, 0.25, 0.25, 0.25). Step 3: g = r + (0, 1, -1, 0), c = sqrt(10.75 / 12.75) = 0.918, projected to
    (0, 1, -1, 0); then r = 0.75 r + 0.25 g = (3.25, 0.5, 0, 0.25)."""
    gac = GACTransform(c_low=0.25, c_high=0.75, reference="ema", ema_decay=0.75)
    decisions, applied = _sgd_run(gac, [[4, 0, 0, 0], [1, 1, 1, 1], [3.25, 1.25, -0.75, 0.25]])
    assert [d.action for d in decisions] == [KEEP, SHRINK, PROJECT]
    assert applied == [[4, 0, 0, 0], [0.5, 1, 1, 1], [0, 1, -1, 0]]
    assert decisions[1].cos == 0.5 and decisions[2].cos == pytest.approx(math.sqrt(10.75 / 12.75), rel=1e-7)
    assert gac.state.ref[0].tolist() == [3.25, 0.5, 0, 0.25]


def test_applied_reference_by_hand():
    """r_t = g~_t. Step 2 applies (0.5, 1, 1, 1), which becomes r (||r||^2 = 3.25). Step 3: g = r + (0.5, 0, 0,
    -0.25), c = sqrt(3.25 / 3.5625) = 0.955, projected to (0.5, 0, 0, -0.25). Step 4: g = (1, 0, 0, 2) is
    orthogonal to that applied gradient, so c = 0 (against step 3's raw gradient it would be 0.59)."""
    gac = GACTransform(c_low=0.25, c_high=0.75, reference="applied")
    decisions, applied = _sgd_run(gac, [[4, 0, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0.75], [1, 0, 0, 2]])
    assert [d.action for d in decisions] == [KEEP, SHRINK, PROJECT, KEEP]
    assert applied[1:3] == [[0.5, 1, 1, 1], [0.5, 0, 0, -0.25]]
    assert decisions[2].cos == pytest.approx(math.sqrt(3.25 / 3.5625), rel=1e-7)
    assert decisions[3].cos == 0.0  # <(1, 0, 0, 2), (0.5, 0, 0, -0.25)> = 0
    assert gac.state.ref[0].tolist() == [1, 0, 0, 2]


@pytest.mark.parametrize("reference", ["grad", "applied"])
def test_the_cached_reference_norm_is_the_references_norm_after_every_step(reference):
    """The reference "grad" holds the raw gradient after a kept, shrunk or projected step, so its norm is cached
    as ||g||^2 (the next step reads r once less); "applied" caches it only where r is the gradient as it was
    (a kept step). Wherever a norm is cached it is the reference's own."""
    gac = GACTransform(c_low=0.25, c_high=0.75, reference=reference)
    p = torch.nn.Parameter(torch.zeros(4))
    cached = []
    for g in [[4, 0, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0.75], [1, 0, 0, 2]]:
        p.grad = torch.tensor(g, dtype=torch.float32)
        action = gac.step([p]).decision.action
        if gac.state.ref_sq is not None:
            assert float(gac.state.ref_sq) == pytest.approx(float(gac.state.ref[0] @ gac.state.ref[0]), rel=1e-6)
        cached.append((action, gac.state.ref_sq is not None))
    # against the raw (1, 1, 1, 0.75) the last gradient has c = 0.59, against the applied (0.5, 0, 0, -0.25) c = 0
    expected = [(KEEP, True), (SHRINK, True), (PROJECT, True), (SHRINK, True)] if reference == "grad" else \
        [(KEEP, True), (SHRINK, False), (PROJECT, False), (KEEP, True)]
    assert cached == expected


def test_update_reference_by_hand():
    """r_t = theta_{t-1} - theta_t with theta moved by -0.5 g~. Step 1: theta = (-2, 0, 0, 0). Step 2:
    r = (2, 0, 0, 0) points along the previous gradient, c = 1/2, g~ = (0.5, 1, 1, 1) and theta = (-2.25, -0.5,
    -0.5, -0.5). Step 3: r = (0.25, 0.5, 0.5, 0.5); g = 4 r + (0, 1, -1, 0), c = 3.25 / sqrt(15 * 0.8125) = 0.931,
    projected to (0, 1, -1, 0). With the sign of r flipped, step 2 would see c = -1/2 and keep (1, 1, 1, 1)."""
    gac = GACTransform(c_low=0.25, c_high=0.75, reference="update")
    decisions, applied = _sgd_run(gac, [[4, 0, 0, 0], [1, 1, 1, 1], [1, 3, 1, 2]])
    assert [d.action for d in decisions] == [KEEP, SHRINK, PROJECT]
    assert applied == [[4, 0, 0, 0], [0.5, 1, 1, 1], [0, 1, -1, 0]]
    assert decisions[1].cos == 0.5
    assert decisions[2].cos == pytest.approx(3.25 / math.sqrt(15 * 0.8125), rel=1e-7)


@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_ema_reference_of_a_tensor_larger_than_a_block_is_rounded_once(threads):
    """r <- 0.9 r + 0.1 g with r in bfloat16: every element, the last partial block included, is the exact
    combination rounded once to bfloat16 (within half a bfloat16 ulp; rounding twice would err by up to one).

    Holds for any thread count and torch version: the combination widens r to float32 before any arithmetic
    (gac._combine_rounding_once), so no bfloat16 operation, whose evaluation differs between torch versions, is
    involved, and each element's float32 arithmetic is the same whatever the block (thread count) it lies in."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_bf16_ema_rounded_once()
    finally:
        torch.set_num_threads(previous)


def _check_bf16_ema_rounded_once() -> None:
    gen = torch.Generator().manual_seed(6)
    n = 2 * _CPU_BLOCK_PER_THREAD * torch.get_num_threads() + 50000
    gac = GACTransform(c_low=0.98, c_high=0.99, reference="ema", ema_decay=0.9, buffer_dtype="bfloat16")
    p = torch.nn.Parameter(torch.zeros(n))
    grads = [torch.randn(n, generator=gen) for _ in range(2)]
    for g in grads:
        p.grad = g.clone()
        assert gac.step([p]).decision.action == KEEP  # independent gradients: c ~ 0
    a_r, b_g = 0.9 * grads[0].bfloat16().double(), 0.1 * grads[1].double()
    exact = a_r + b_g
    # the float32 combination's own error (five float32 roundings at most, of 2^-24 each: the coefficients 0.9
    # and 0.1, a r, b g, their sum), which decides the rounding only where a r and b g nearly cancel or the float32
    # result lies on a bfloat16 tie; elsewhere it is ~2^-15 of a bfloat16 ulp
    f32 = 2.0 ** -22 * (a_r.abs() + b_g.abs())
    ulp = torch.exp2(torch.floor(torch.log2(exact.abs() + f32)) - 7)  # bfloat16 keeps 8 significant bits
    excess = (gac.state.ref[0].double() - exact).abs() - 0.5 * ulp - f32
    assert float(excess.max()) <= 0.0
    assert float(((gac.state.ref[0].double() - exact).abs() / ulp).median()) < 0.3  # not the zero vector
