"""Off-policy sequence masking, geometric sequence masking, VESPO and A-3PO against hand computations from their
sources (docs/baselines.md), and their properties (a decision per whole response, length invariance of the
geometric mask, the length dependence of VESPO's product ratio, A-3PO's interpolation weight)."""

import math

import pytest
import torch

from gacbench.stabilizers import DecoupledPPO, PolicyBatch
from gacbench.stabilizers.a3po import A3PO, a3po_alpha, a3po_prox_logp
from gacbench.stabilizers.seqmask import OPSM, GeoSeqMask, geo_mean_ratio, opsm_keep
from gacbench.stabilizers.vespo import VESPO, vespo_phi

D = torch.float64


def t(x):
    return torch.tensor(x, dtype=D)


def batch(logp, behav, adv, mask=None, **kw):
    logp = t(logp).requires_grad_(True)
    mask = torch.ones_like(logp, dtype=torch.bool) if mask is None else torch.tensor(mask)
    return PolicyBatch(logp, t(behav), t(adv), mask, **{k: (t(v) if isinstance(v, list) else v) for k, v in kw.items()})


# -- off-policy sequence masking (DeepSeek-V3.2 Eq. 9; TRL get_off_policy_mask; slime compute_opsm_mask) ----------
def test_opsm_hand_computation():
    # three responses of two tokens, delta = 0.1, mu = pi_behav:
    #   seq 0: A = -1, log mu - log pi = [0.1, 0.2] -> KL = 0.15 > 0.1 and A < 0: dropped
    #   seq 1: A = +1, the same KL: kept (only negative responses are masked)
    #   seq 2: A = -1, log mu - log pi = [-0.05, 0.05] -> KL = 0 <= 0.1: kept
    b = batch([[-1.0, -2.0]] * 3, [[-0.9, -1.8], [-0.9, -1.8], [-1.05, -1.95]], [[-1.0] * 2, [1.0] * 2, [-1.0] * 2])
    loss, m = OPSM(delta=0.1).policy_loss(b)
    # module surrogate, clip [0.8, 1.2]: seq 1 r = e^-0.1 = 0.904837, e^-0.2 = 0.818731, A = 1 -> -0.904837, -0.818731;
    # seq 2 r = e^0.05 = 1.051271, e^-0.05 = 0.951229, A = -1 -> 1.051271, 0.951229; seq 0 counts 0; token-mean
    # over all 6 tokens (a dropped response stays in the denominator): 0.278932 / 6
    assert loss.item() == pytest.approx((-0.9048374 - 0.8187308 + 1.0512711 + 0.9512294) / 6, abs=1e-7)
    assert float(m["opsm/masked_frac"]) == pytest.approx(1 / 3)
    loss.backward()
    assert (b.logp.grad[0] == 0).all() and (b.logp.grad[1:] != 0).all()


def test_opsm_decides_per_whole_response_with_mixed_token_advantages():
    # slime pull request 1917's example: log pi = 0, log mu = 1 on 3 tokens -> KL = 1 > 0.1; token advantages
    # [-0.5, 0.25, -0.25] have mean -1/6 < 0: the whole response is dropped (a per-token decision kept token 1)
    keep = opsm_keep(t([[0.0, 0.0, 0.0]]), t([[1.0, 1.0, 1.0]]), t([[-0.5, 0.25, -0.25]]),
                     torch.ones(1, 3, dtype=torch.bool), delta=0.1)
    assert keep.tolist() == [False]
    b = batch([[0.0, 0.0, 0.0]], [[1.0, 1.0, 1.0]], [[-0.5, 0.25, -0.25]])
    loss, _ = OPSM(delta=0.1).policy_loss(b)
    loss.backward()
    assert loss.item() == 0.0 and (b.logp.grad == 0).all()


def test_opsm_thresholds_are_strict_and_padding_is_ignored():
    # KL exactly delta = 0.25 (log mu - log pi = -0.75 + 1.0) is kept; A = 0 is kept; padding (NaN) is not in the mean
    nan = float("nan")
    mask = torch.tensor([[True, True, False], [True, False, False]])
    keep = opsm_keep(t([[-1.0, -1.0, nan], [-1.0, nan, nan]]), t([[-0.75, -0.75, nan], [0.0, nan, nan]]),
                     t([[-1.0, -1.0, nan], [0.0, nan, nan]]), mask, delta=0.25)
    assert keep.tolist() == [True, True]
    keep = opsm_keep(t([[-1.0, -1.0, nan]]), t([[-0.75, -0.74, nan]]), t([[-1.0, -1.0, nan]]), mask[:1], delta=0.25)
    assert keep.tolist() == [False]


def test_opsm_and_geo_mask_read_the_engine_when_asked():
    # the behaviour log-probs equal the current ones (nothing to mask), the engine's are 0.5 higher per token
    b = batch([[-1.0, -1.0]], [[-1.0, -1.0]], [[-1.0, -1.0]], logp_engine=[[-0.5, -0.5]])
    assert OPSM(delta=0.1).policy_loss(b)[1]["opsm/masked_frac"] == 0.0
    assert float(OPSM(delta=0.1, sampling="engine").policy_loss(b)[1]["opsm/masked_frac"]) == 1.0
    assert GeoSeqMask().policy_loss(b)[1]["geo/masked_frac"] == 0.0
    assert float(GeoSeqMask(sampling="engine").policy_loss(b)[1]["geo/under_low_frac"]) == 1.0
    with pytest.raises(ValueError, match="logp_engine"):
        OPSM(sampling="engine").policy_loss(batch([[-1.0]], [[-1.0]], [[1.0]]))


# -- geometric sequence masking (SkyRL compute_sequence_mask, bounds [0.99, 1.01]) -------------------------------
def test_geo_seq_mask_hand_computation():
    # log(pi / pi_behav) per token: seq 0 [0.02, 0] -> g = e^0.01 = 1.010050 > 1.01: dropped (over);
    # seq 1 [0.005, 0.005] -> g = e^0.005 = 1.005013: kept; seq 2 [-0.03, 0] -> g = e^-0.015 = 0.985112 < 0.99:
    # dropped (under)
    b = batch([[0.02, 0.0], [0.005, 0.005], [-0.03, 0.0]], [[0.0, 0.0]] * 3, [[1.0] * 2, [-1.0] * 2, [1.0] * 2])
    loss, m = GeoSeqMask().policy_loss(b)
    # kept seq 1: A = -1, r = 1.005013 inside [0.8, 1.2] -> per-token loss 1.005013; token-mean over 6 tokens
    assert loss.item() == pytest.approx(2 * 1.0050125 / 6, abs=1e-7)
    assert float(m["geo/masked_frac"]) == pytest.approx(2 / 3)
    assert float(m["geo/over_high_frac"]) == pytest.approx(1 / 3)
    assert float(m["geo/under_low_frac"]) == pytest.approx(1 / 3)
    loss.backward()
    assert (b.logp.grad[0] == 0).all() and (b.logp.grad[2] == 0).all() and (b.logp.grad[1] != 0).all()


def test_geo_mean_ratio_is_length_invariant_and_the_product_is_not():
    gen = torch.Generator().manual_seed(3)
    log_r = 0.01 * torch.randn(6, 5, generator=gen, dtype=D)
    ones = torch.ones(6, 5, dtype=torch.bool)
    g = geo_mean_ratio(log_r, torch.zeros_like(log_r), ones)
    for k in (2, 3, 7):  # every response repeated k times: k times as long, the same per-token divergence
        longer = log_r.repeat(1, k)
        gk = geo_mean_ratio(longer, torch.zeros_like(longer), ones.repeat(1, k))
        assert torch.allclose(gk, g, rtol=0, atol=1e-12)
    # a per-token log-ratio of 0.008 is inside [0.99, 1.01] at every length; the product exp(0.008 T) leaves the
    # band from T = 2 on (e^0.016 = 1.016)
    for T in (1, 4, 50):
        b = batch([[0.008] * T], [[0.0] * T], [[1.0] * T])
        assert GeoSeqMask().policy_loss(b)[1]["geo/masked_frac"] == 0.0


def test_geo_seq_mask_refuses_a_band_without_one():
    with pytest.raises(ValueError, match="low <= 1 <= high"):
        GeoSeqMask(low=1.02, high=1.05)


# -- VESPO (FloyedShen/VESPO recipe/vespo/code/core_algos.py) ------------------------------------------------------
def test_vespo_hand_computation():
    # seq 0: A = +1, log r = [0.1, 0.2] -> log W = 0.3 (the product, not the mean), W = 1.349859,
    #        phi = exp(3 + 2 * 0.3 - 3 * 1.349859) = exp(-0.449576) = 0.637898   (k_pos = 2, lambda_pos = 3)
    # seq 1: A = -0.5, log r = [-0.2, -0.1] -> log W = -0.3, W = 0.740818,
    #        phi = exp(2 + 3 * (-0.3) - 2 * 0.740818) = exp(-0.381636) = 0.682743   (k_neg = 3, lambda_neg = 2)
    logp = [[-1.0, -2.0], [-0.5, -1.5]]
    behav = [[-1.1, -2.2], [-0.3, -1.4]]
    b = batch(logp, behav, [[1.0, 1.0], [-0.5, -0.5]])
    loss, m = VESPO().policy_loss(b)
    phi0, phi1 = 0.6378983, 0.6827432
    # loss -token-mean(phi A log pi) = -(phi0 * (-1 - 2) + phi1 * (-0.5) * (-0.5 - 1.5)) / 4
    assert loss.item() == pytest.approx(-(phi0 * -3.0 + phi1 * -0.5 * -2.0) / 4, abs=1e-6)
    loss.backward()
    # the gradient is -phi A / 4 per token: phi is a detached coefficient on grad log pi
    assert b.logp.grad.flatten().tolist() == pytest.approx([-phi0 / 4] * 2 + [phi1 * 0.5 / 4] * 2, abs=1e-7)
    assert float(m["vespo/phi_mean"]) == pytest.approx((phi0 + phi1) / 2, abs=1e-7)


def test_vespo_kernel_is_one_on_policy_and_vanishes_far_from_it():
    adv = t([1.0, -1.0, 1.0, -1.0, 1.0])
    phi = vespo_phi(t([0.0, 0.0, 5.0, 5.0, -30.0]), adv)
    assert phi[:2].tolist() == pytest.approx([1.0, 1.0])  # phi(1) = 1 for both signs
    # W = e^5: exp(lambda + 5 k - lambda e^5) < 1e-120; W = e^-30: exp(3 - 2 * 30 - 3 W) = e^-57 = 1.8e-25
    assert (phi[2:] < 1e-24).all()


def test_vespo_weight_depends_on_length_through_the_product():
    # the same per-token log-ratio 0.1 on 1 and on 4 tokens: log W = 0.1 and 0.4, different weights
    short = VESPO().policy_loss(batch([[0.1]], [[0.0]], [[1.0]]))[1]["vespo/phi_mean"]
    long = VESPO().policy_loss(batch([[0.1] * 4], [[0.0] * 4], [[1.0] * 4]))[1]["vespo/phi_mean"]
    assert float(short) == pytest.approx(math.exp(3 + 2 * 0.1 - 3 * math.exp(0.1)))
    assert float(long) == pytest.approx(math.exp(3 + 2 * 0.4 - 3 * math.exp(0.4)))


# -- A-3PO (AReaL compute_prox_logp_approximations, loglinear) -----------------------------------------------------
def test_a3po_interpolation_weight_from_versions():
    # AReaL: v_theta = 10, v_prox = 9; v_behav = 6 -> alpha = (9 - 6) / (10 - 6) = 3/4; v_behav = 9 -> 0;
    # v_behav = 10 (lag 0) -> 0; in lags s = v_theta - v_behav: (s - 1) / s
    assert a3po_alpha(t([4.0, 1.0, 0.0, 2.0])).tolist() == pytest.approx([0.75, 0.0, 0.0, 0.5])
    prox = a3po_prox_logp(t([[-1.0, -3.0]]), t([[-2.0, -1.0]]), t([4.0]), torch.ones(1, 2, dtype=torch.bool))
    assert prox[0].tolist() == pytest.approx([-2.0 + 0.75 * 1.0, -1.0 + 0.75 * -2.0])


def test_a3po_hand_computation_and_difference_from_decoupled_ppo():
    # seq 0 at lag 4 (alpha = 3/4), log pi_behav = 0: token 0 ratio pi/pi_behav = 3, A = +1:
    #   w = 3^0.75 = 2.279507, r = pi / pi_prox = 3^0.25 = 1.316074 > 1.2 -> loss -w * 1.2 = -2.735408 (no gradient)
    #   token 1 ratio 0.5, A = -1: w = 0.5^0.75, r = 0.5^0.25 = 0.840896 inside the clip -> w * r = 0.5
    # seq 1 at lag 1 (alpha = 0, pi_prox = pi_behav): ratio 1.5 and 1.0 (second token), A = +1:
    #   -min(1.5, 1.2) = -1.2 and -1.0
    logp = [[math.log(3.0), math.log(0.5)], [math.log(1.5), 0.0]]
    b = batch(logp, [[0.0, 0.0]] * 2, [[1.0, -1.0], [1.0, 1.0]], lag=[4.0, 1.0])
    loss, m = A3PO().policy_loss(b)
    assert loss.item() == pytest.approx((-2.7354085 + 0.5 - 1.2 - 1.0) / 4, abs=1e-6)
    assert float(m["a3po/alpha_mean"]) == pytest.approx(0.375)
    loss.backward()
    assert b.logp.grad[0, 0].item() == 0.0 and b.logp.grad[1, 0].item() == 0.0  # clipped tokens
    assert b.logp.grad[0, 1].item() == pytest.approx(0.5 / 4)  # w r A' with d r / d log pi = r: 0.5 / 4
    # decoupled PPO (pi_prox = pi_theta): r = 1, weight = the whole ratio: (-3 + 0.5 - 1.5 - 1) / 4
    dec, _ = DecoupledPPO().policy_loss(batch(logp, [[0.0, 0.0]] * 2, [[1.0, -1.0], [1.0, 1.0]]))
    assert dec.item() == pytest.approx((-3.0 + 0.5 - 1.5 - 1.0) / 4) and dec.item() != pytest.approx(loss.item())


def test_a3po_needs_the_lag():
    with pytest.raises(ValueError, match="lag"):
        A3PO().policy_loss(batch([[0.0]], [[0.0]], [[1.0]]))
    with pytest.raises(ValueError, match="lag must have shape"):
        batch([[0.0]], [[0.0]], [[1.0]], lag=[1.0, 2.0])


@pytest.mark.parametrize("cls,kwargs,match", [(OPSM, {"delta": 0}, "delta"), (OPSM, {"sampling": "x"}, "sampling"),
                                              (GeoSeqMask, {"low": -1.0}, "low"), (VESPO, {"k_pos": 0}, "k_pos"),
                                              (A3PO, {"cap_mode": "x"}, "cap_mode")])
def test_bad_arguments_are_named(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)
