"""Property and exactness tests of the pure functions (no Lightning)."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gacbench.functional import alignment_summary, cosine, dot, gac_decision, gac_project, sq_norm, validate_thresholds
from gacbench.functional.alignment import KEEP, PROJECT, SHRINK, SKIP
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
    assert torch.allclose(dot(split(a), split(b)), a @ b, rtol=1e-5)
    assert torch.allclose(sq_norm(split(a)), a @ a, rtol=1e-5)
    assert cosine(split(a), split(b)) == pytest.approx(float(a @ b / (a.norm() * b.norm())), rel=1e-5)


def test_dot_upcasts_low_precision():
    a = torch.randn(1000, dtype=torch.bfloat16)
    assert dot([a], [a]).dtype == torch.float32


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
    with pytest.raises(ValueError, match="keys 'has_ref' and 'ref'"):
        gac.load_state_dict({"ref": torch.zeros(3)})
