"""Every loss-side baseline against a hand computation from its source (docs/baselines.md), the module's loss
settings reaching every stabilizer, and numerical safety (log-ratios of +-100, NaN in padding)."""

import dataclasses
import math

import pytest
import torch

from gacbench.stabilizers import (
    BAPO,
    CISPO,
    GSPO,
    M2PO,
    MIS,
    TIS,
    VCPO,
    DecoupledPPO,
    DualClipPPO,
    IcePop,
    M2POThreshold,
    PolicyBatch,
    TISEngine,
    bapo_search,
    clipped_surrogate,
    ess_lr_scale,
    ess_ratio,
    m2po_mask,
    m2po_mask_areal,
    m2po_official_bounds,
    opob_advantages,
    policy_loss,
)
from gacbench.stabilizers.registry import available
from gacbench.stabilizers.vcpo import per_sequence_grad_sq_norms, recomputed_grad_sq_norms

D = torch.float64


def t(x):
    return torch.tensor(x, dtype=D)


def pb(logp, behav, adv, mask=None, **kw):
    logp = t(logp).requires_grad_(True)
    mask = torch.ones_like(logp, dtype=torch.bool) if mask is None else torch.tensor(mask)
    kw = {k: (t(v) if isinstance(v, list) else v) for k, v in kw.items()}
    return PolicyBatch(logp, t(behav), t(adv), mask, **kw)


def ratio_batch(r, adv, mask=None, **kw):
    """A batch with pi_theta / pi_behav = r per token (logp = log r, behav = 0)."""
    logs = [[math.log(x) for x in row] for row in r]
    zeros = [[0.0] * len(row) for row in r]
    return pb(logs, zeros, adv, mask, **kw)


# -- one source of truth: clip_high = 0.28 and seq-mean-token-mean reach every stabilizer that clips --------------
R = [[1.25, 1.4, 0.7], [0.9, 1.35, 1.0]]
A = [[1.0, 1.0, -1.0], [-2.0, 2.0, 0.0]]
MASK = [[True, True, True], [True, True, False]]


def hand_surrogate(lo, hi):
    seqs = []
    for r_row, a_row, m_row in zip(R, A, MASK):
        terms = [max(-a * r, -a * min(max(r, lo), hi)) for r, a, m in zip(r_row, a_row, m_row) if m]
        seqs.append(sum(terms) / len(terms))
    return sum(seqs) / len(seqs)


def settings_batch(**kw):
    logs = [[math.log(x) for x in row] for row in R]
    zeros = [[0.0] * 3, [0.0] * 3]
    return pb(logs, zeros, A, MASK, clip_low=0.2, clip_high=0.28, agg="seq-mean-token-mean", logp_engine=zeros,
              logp_prox=zeros, **kw)


def test_the_hand_value_depends_on_the_settings():
    # by hand: seq 0 = (-1.25 - 1.28 + 0.8) / 3, seq 1 = (1.8 - 2.56) / 2
    assert hand_surrogate(0.8, 1.28) == pytest.approx(((-1.25 - 1.28 + 0.8) / 3 + (1.8 - 2.56) / 2) / 2)
    assert hand_surrogate(0.8, 1.2) != pytest.approx(hand_surrogate(0.8, 1.28))


@pytest.mark.parametrize("stab", [None, DecoupledPPO(), TIS(), DualClipPPO(), TISEngine(), MIS(), MIS(level="token"),
                                  IcePop(), M2PO(variant="areal")], ids=lambda s: type(s).__name__ if s else "default")
def test_module_clip_and_aggregation_reach_the_stabilizer(stab):
    # logp_prox = logp_behav and logp_engine = logp_behav: every weight is 1 and nothing is masked, so each of these
    # is the module's clipped surrogate with clip_high = 0.28 and per-sequence means
    loss, _ = policy_loss(stab, settings_batch())
    assert loss.item() == pytest.approx(hand_surrogate(0.8, 1.28))


def test_settings_given_to_policy_loss_replace_the_batch_ones():
    b = settings_batch()
    loss, _ = policy_loss(DecoupledPPO(), b, clip_high=0.2, agg="token-mean")
    ref = [max(-a * r, -a * min(max(r, 0.8), 1.2))
           for rr, aa, mm in zip(R, A, MASK) for r, a, m in zip(rr, aa, mm) if m]
    assert loss.item() == pytest.approx(sum(ref) / len(ref))


def test_cispo_uses_the_module_clip_high_and_aggregation():
    b = settings_batch()
    loss, m = CISPO().policy_loss(b)
    logs = [[math.log(x) for x in row] for row in R]
    seqs = []
    for r_row, a_row, l_row, m_row in zip(R, A, logs, MASK):
        terms = [-min(r, 1.28) * a * lp for r, a, lp, m in zip(r_row, a_row, l_row, m_row) if m]
        seqs.append(sum(terms) / len(terms))
    assert loss.item() == pytest.approx(sum(seqs) / 2)
    assert m["cispo/ratio_high"] == pytest.approx(1.28) and m["cispo/ratio_low"] == 0.0


def test_stabilizers_that_choose_their_bounds_ignore_the_module_clip_and_log_theirs():
    for stab, keys in [(BAPO(), ("bapo/c_low", "bapo/c_high")), (GSPO(), ("gspo/clip_low", "gspo/clip_high")),
                       (M2PO(variant="official", tau=0.01), ("m2po/ratio_low", "m2po/ratio_high"))]:
        l1, m1 = stab.policy_loss(settings_batch())
        l2, _ = policy_loss(stab, settings_batch(), clip_high=0.05, clip_low=0.05)
        assert l1.item() == pytest.approx(l2.item()) and all(k in m1 for k in keys)


# -- numerical safety -------------------------------------------------------------------------------------------
def extreme_batch(**kw):
    nan = float("nan")
    logp = t([[-0.1, -100.5, -1.0, nan], [-0.3, -0.2, nan, nan]]).requires_grad_(True)
    behav = t([[-100.1, -0.5, -1.2, nan], [-0.1, -0.4, nan, nan]])  # log-ratios +100 and -100 on valid tokens
    adv = t([[1.0, -1.0, 0.5, nan], [-1.0, 1.0, nan, nan]])
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    engine = t([[-0.2, -100.0, -1.1, nan], [-0.1, -60.0, nan, nan]])
    return PolicyBatch(logp, behav, adv, mask, logp_engine=engine, group=torch.tensor([0, 0]),
                       lag=torch.tensor([4.0, 1.0]), **kw)


LOSS_SIDE = sorted(n for n, i in available().items() if i["kind"] == "loss")


@pytest.mark.parametrize("name", [None] + LOSS_SIDE + ["m2po(variant='areal')", "m2po(variant='official')",
                                                       "bapo(variant='official')", "mis(level='token')"])
def test_every_loss_is_finite_at_log_ratio_100_and_nan_padding(name):
    from gacbench.methods import method_callbacks

    stab = None if name is None else method_callbacks(name)[0]
    if isinstance(stab, VCPO):
        stab.baseline = False  # the baseline's per-sequence gradients need a module (tested below)
    b = extreme_batch()
    loss, metrics = policy_loss(stab, b)
    assert torch.isfinite(loss)
    loss.backward()
    assert torch.isfinite(b.logp.grad).all()
    assert (b.logp.grad[~b.mask] == 0).all()
    for k, v in metrics.items():
        assert math.isfinite(float(v)) or k.endswith("ratio_high"), k


def test_vcpo_baseline_is_finite_with_nan_padding():
    w = torch.nn.Parameter(torch.tensor([0.3, -0.2], dtype=D))
    stab = VCPO()
    stab._params = [w]
    b = extreme_batch()
    logp = b.logp.detach().clone() + w.sum()  # depends on the parameter, NaN kept in padding
    b2 = PolicyBatch(logp, b.logp_behav, b.adv, b.mask, group=b.group)
    loss, _ = stab.policy_loss(b2)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(w.grad).all()


def test_agg_loss_drops_nan_at_masked_positions_with_where():
    x = t([[1.0, float("nan")], [float("inf"), 2.0]]).requires_grad_(True)
    mask = torch.tensor([[True, False], [False, True]])
    from gacbench.stabilizers import agg_loss

    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        x.grad = None
        out = agg_loss(x, mask, mode)
        out.backward()
        assert torch.isfinite(out) and (x.grad[~mask] == 0).all()


# -- dual-clip PPO ------------------------------------------------------------------------------------------------
def test_dual_clip_caps_negative_advantages_at_c():
    b = ratio_batch([[5.0, 2.0, 1.5]], [[-1.0, -1.0, 1.0]])
    loss, m = DualClipPPO().policy_loss(b)
    # token 0: max(5, 1.2) = 5, capped at c = 3; token 1: 2 (under the cap); token 2: min(1.5, 1.2) * 1 -> -1.2
    assert loss.item() == pytest.approx((3.0 + 2.0 - 1.2) / 3)
    loss.backward()
    # d(-A r)/dlogp = -A r, on token 1 only
    assert b.logp.grad.reshape(-1).tolist() == pytest.approx([0.0, 2.0 / 3, 0.0])
    assert float(m["pg/clipfrac_dual"]) == pytest.approx(1 / 3)
    plain, _ = clipped_surrogate(ratio_batch([[5.0, 2.0, 1.5]], [[-1.0, -1.0, 1.0]]))
    assert plain.item() == pytest.approx((5.0 + 2.0 - 1.2) / 3)


def test_dual_clip_uses_its_own_c():
    b = ratio_batch([[2.5, 1.5, 1.5]], [[-1.0, -1.0, 1.0]])
    loss, m = DualClipPPO(clip_c=2.0).policy_loss(b)
    # token 0: max(2.5, 1.2) = 2.5 capped at c = 2 (at c = 3 it would stay 2.5 with gradient 2.5 / 3); token 1: 1.5,
    # under the cap; token 2: A > 0, min(1.5, 1.2) -> -1.2
    assert loss.item() == pytest.approx((2.0 + 1.5 - 1.2) / 3)
    loss.backward()
    assert b.logp.grad.reshape(-1).tolist() == pytest.approx([0.0, 1.5 / 3, 0.0])
    assert float(m["pg/clipfrac_dual"]) == pytest.approx(1 / 3)
    at_3, _ = DualClipPPO().policy_loss(ratio_batch([[2.5, 1.5, 1.5]], [[-1.0, -1.0, 1.0]]))
    assert at_3.item() == pytest.approx((2.5 + 1.5 - 1.2) / 3)


# -- GSPO ---------------------------------------------------------------------------------------------------------
def test_gspo_sequence_ratio_and_its_tiny_clip_range():
    b = pb([[0.1, -0.1], [0.3, 0.1]], [[0.0, 0.0], [0.0, 0.0]], [[1.0, 1.0], [1.0, 1.0]])
    loss, m = GSPO().policy_loss(b)
    # s_0 = exp(0) = 1 (inside [1 - 3e-4, 1 + 4e-4]); s_1 = exp(0.2) > 1 + 4e-4, A > 0: clipped at 1.0004
    assert loss.item() == pytest.approx(-(1.0 + 1.0004) / 2)
    loss.backward()
    assert b.logp.grad.reshape(-1).tolist() == pytest.approx([-0.25, -0.25, 0.0, 0.0])
    assert m["gspo/clip_low"] == 3e-4 and m["gspo/clip_high"] == 4e-4


def test_gspo_sequence_log_ratio_is_the_token_mean_not_the_sum():
    # log r = 3e-4 on both tokens: the mean, 3e-4, gives s = e^3e-4 = 1.0003, inside [1 - 3e-4, 1 + 4e-4], so the
    # token gets the gradient; the sum, 6e-4, would give 1.0006 > 1 + 4e-4: clipped (A > 0), loss -1.0004, no gradient
    b = pb([[3e-4, 3e-4]], [[0.0, 0.0]], [[1.0, 1.0]])
    loss, m = GSPO().policy_loss(b)
    s = math.exp(3e-4)
    assert loss.item() == pytest.approx(-s, rel=1e-12)
    loss.backward()
    assert b.logp.grad.reshape(-1).tolist() == pytest.approx([-s / 2, -s / 2], rel=1e-12)  # -(1/|y|) s A per token
    assert float(m["pg/clipfrac"]) == 0.0 and float(m["gspo/seq_ratio_mean"]) == pytest.approx(s, rel=1e-12)


# -- CISPO --------------------------------------------------------------------------------------------------------
def test_cispo_stop_gradient_clipped_weight_times_advantage_times_logp():
    logp, r = [-1.0, -2.0], [1.5, 0.5]
    behav = [lp - math.log(x) for lp, x in zip(logp, r)]
    b = pb([logp], [behav], [[1.0, -1.0]], clip_high=0.28)
    loss, _ = CISPO().policy_loss(b)
    assert loss.item() == pytest.approx(-(1.28 * 1 * -1.0 + 0.5 * -1 * -2.0) / 2)  # no lower bound: 0.5 kept
    loss.backward()
    assert b.logp.grad.reshape(-1).tolist() == pytest.approx([-1.28 / 2, 0.5 / 2])  # -sg(w) A / N
    b2 = pb([logp], [behav], [[1.0, -1.0]], clip_high=0.28)
    loss2, _ = CISPO(lower=True).policy_loss(b2)
    assert loss2.item() == pytest.approx(-(1.28 * -1.0 + 0.8 * -1 * -2.0) / 2)


# -- engine/trainer corrections: TIS on the engine, MIS, IcePop -------------------------------------------------------
def engine_batch(k, adv, mask=None):
    """logp = logp_behav (r = 1) and logp_engine = logp_behav - log k."""
    behav = [[-1.0] * len(row) for row in k]
    engine = [[-1.0 - math.log(x) for x in row] for row in k]
    return pb(behav, behav, adv, mask, logp_engine=engine)


def test_tis_engine_truncates_the_train_infer_ratio():
    b = engine_batch([[3.0, 0.5]], [[1.0, 2.0]])
    loss, m = TISEngine(cap=2.0).policy_loss(b)
    assert loss.item() == pytest.approx(-(2.0 * 1.0 + 0.5 * 2.0) / 2)
    assert float(m["is/engine_truncated_frac"]) == pytest.approx(0.5)


def test_mis_token_level_masks_weights_above_the_threshold():
    b = engine_batch([[3.0, 0.5, 1.5]], [[1.0, 1.0, 2.0]])
    loss, m = MIS(threshold=2.0, level="token").policy_loss(b)
    assert loss.item() == pytest.approx(-(0.5 * 1.0 + 1.5 * 2.0) / 2)  # rejected token leaves the denominator
    assert float(m["mis/masked_frac"]) == pytest.approx(1 / 3)
    loss.backward()
    assert b.logp.grad[0, 0].item() == 0.0


def test_mis_sequence_level_uses_the_product_of_token_ratios():
    b = engine_batch([[1.5, 1.2], [1.5, 1.5]], [[1.0, 1.0], [1.0, 1.0]])
    loss, _ = MIS(threshold=2.0).policy_loss(b)
    # seq 0: rho = 1.8 <= 2, kept with weight 1.8 on both tokens; seq 1: rho = 2.25 > 2, rejected
    assert loss.item() == pytest.approx(-1.8)
    b2 = engine_batch([[1.5, 1.2], [1.5, 1.5]], [[1.0, 1.0], [1.0, 1.0]])
    assert MIS(threshold=2.5).policy_loss(b2)[0].item() == pytest.approx(-(1.8 * 2 + 2.25 * 2) / 4)


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_mis_rejects_whole_sequences_outside_its_band_under_the_sequence_mean_modes(agg):
    """Seq-MIS with verl's band [0.5, 2] (``lower=0.5``) under the seq-mean modes: a sequence with rho above 2 or
    below 0.5 leaves the sequence count and carries no gradient; the kept ones are weighted by rho. Sequences:
    rho = 1.5 * 1.2 = 1.8 (kept), 2.25 (above), 0.5 * 0.8 = 0.4 (below: kept without ``lower``), 1 (kept)."""
    k = [[1.5, 1.2], [1.5, 1.5], [0.5, 0.8], [1.0, 1.0]]
    adv = [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [2.0, 2.0]]

    def per_seq(weight, a, tokens):  # a kept sequence's -loss: rho * A per token, its mean or its sum
        return weight * a * (tokens if agg == "seq-mean-token-sum" else 1)

    b = dataclasses.replace(engine_batch(k, adv), agg=agg)
    loss, m = MIS(threshold=2.0, lower=0.5).policy_loss(b)
    assert loss.item() == pytest.approx(-(per_seq(1.8, 1.0, 2) + per_seq(1.0, 2.0, 2)) / 2)
    assert float(m["mis/masked_frac"]) == pytest.approx(0.5)
    loss.backward()
    assert b.logp.grad[1].abs().sum().item() == 0.0 and b.logp.grad[2].abs().sum().item() == 0.0
    assert b.logp.grad[0].abs().sum().item() > 0.0 and b.logp.grad[3].abs().sum().item() > 0.0
    b2 = dataclasses.replace(engine_batch(k, adv), agg=agg)
    loss2, _ = MIS(threshold=2.0).policy_loss(b2)  # no lower bound: the rho = 0.4 sequence joins the mean
    assert loss2.item() == pytest.approx(-(per_seq(1.8, 1.0, 2) + per_seq(0.4, 1.0, 2) + per_seq(1.0, 2.0, 2)) / 3)


def test_icepop_drops_tokens_outside_the_band_and_weights_the_rest_by_k():
    b = engine_batch([[0.4, 1.0, 4.0, 6.0]], [[1.0, 1.0, 1.0, 1.0]])
    loss, m = IcePop().policy_loss(b)
    assert loss.item() == pytest.approx(-(0 + 1.0 + 4.0 + 0) / 4)  # dropped tokens stay in the denominator
    loss.backward()
    assert b.logp.grad.reshape(-1).tolist() == pytest.approx([0.0, -0.25, -1.0, 0.0])
    assert float(m["icepop/masked_frac"]) == pytest.approx(0.5)
    b2 = engine_batch([[0.51, 4.9]], [[1.0, 1.0]])  # just inside the band: kept and weighted
    assert IcePop().policy_loss(b2)[0].item() == pytest.approx(-(0.51 + 4.9) / 2)


def stale_engine_batch(r, k, adv):
    """r = pi_theta / pi_behav (the staleness) and k = pi_behav / pi_engine per token."""
    behav = [[-1.0] * len(row) for row in r]
    logp = [[-1.0 + math.log(x) for x in row] for row in r]
    engine = [[-1.0 - math.log(x) for x in row] for row in k]
    return pb(logp, behav, adv, logp_engine=engine)


@pytest.mark.parametrize("cls", [TISEngine, MIS, IcePop])
def test_engine_corrections_apply_no_dual_clip_unless_asked(cls):
    # r = 4 on an A < 0 token (stale by more than verl's c = 3), r = 2 on another, k = 1: every weight is 1
    r, k, adv = [[4.0, 2.0]], [[1.0, 1.0]], [[-1.0, -1.0]]
    b = stale_engine_batch(r, k, adv)
    loss, m = cls().policy_loss(b)  # default: no cap, the r = 4 token keeps its gradient -A r
    assert loss.item() == pytest.approx((4.0 + 2.0) / 2) and "pg/clipfrac_dual" not in m
    loss.backward()
    assert b.logp.grad.reshape(-1).tolist() == pytest.approx([4.0 / 2, 2.0 / 2])
    b = stale_engine_batch(r, k, adv)
    loss, m = cls(dual_clip=3.0).policy_loss(b)  # verl's cap: -c A = 3, no gradient past r = 3
    assert loss.item() == pytest.approx((3.0 + 2.0) / 2) and float(m["pg/clipfrac_dual"]) == pytest.approx(0.5)
    loss.backward()
    assert b.logp.grad.reshape(-1).tolist() == pytest.approx([0.0, 2.0 / 2])
    with pytest.raises(ValueError, match="dual_clip=1.0 must be > 1"):
        cls(dual_clip=1.0)


@pytest.mark.parametrize("name", ["tis-engine", "mis", "mis(level='token')", "icepop"])
def test_engine_corrections_are_the_default_surrogate_when_behaviour_is_the_engine(name):
    """rollout.mode async / uniform: the behaviour log-probs are the engine's (logp_behav = logp_engine), so k = 1 on
    every token and each correction gives the default surrogate's loss and gradient."""
    from gacbench.methods import method_callbacks

    gen = torch.Generator().manual_seed(0)
    engine = -torch.rand(3, 4, generator=gen, dtype=D) * 2
    logp = engine + torch.randn(3, 4, generator=gen, dtype=D) * 0.5  # staleness: r far from 1 on some tokens
    adv = torch.randn(3, 1, generator=gen, dtype=D).expand(3, 4)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    grads = []
    for stab in (method_callbacks(name)[0], None):
        x = logp.clone().requires_grad_(True)
        loss, _ = policy_loss(stab, PolicyBatch(x, engine, adv, mask, logp_engine=engine))
        loss.backward()
        grads.append((loss.detach(), x.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_engine_corrections_refuse_a_batch_without_engine_log_probs():
    b = pb([[-1.0]], [[-1.0]], [[1.0]])
    for stab in (TISEngine(), MIS(), IcePop()):
        with pytest.raises(ValueError, match="logp_engine"):
            stab.policy_loss(b)


# -- M2PO ---------------------------------------------------------------------------------------------------------
def test_m2po_paper_masks_only_trust_region_tokens():
    lr = t([[0.5, 0.5, -0.3, 0.3, 0.05]])
    adv = t([[1.0, -1.0, -1.0, -1.0, 1.0]])  # trust region: tokens 0 (A>0, r>1), 2 (A<0, r<1), 4 (A>0, r>1)
    mask = torch.ones_like(lr, dtype=torch.bool)
    # trust-region (log r)^2 = .25 .09 .0025, mean .114 > .04: drop .25 -> .04625 > .04, drop .09 -> .0025
    assert m2po_mask(lr, adv, mask, 0.04).tolist() == [[False, True, False, True, True]]
    # the all-token reading: .25 .25 .09 .09 .0025, mean .1365; dropping one at a time the mean falls to .108, .0608,
    # .04625 and .0025: four go
    assert m2po_mask(lr, adv, mask, 0.04, tokens="all").tolist() == [[False, False, False, False, True]]


def test_m2po_paper_loss_is_minus_r_a_over_kept_tokens_with_the_full_denominator():
    lr = [0.5, 0.5, -0.3, 0.3, 0.05]
    b = pb([lr], [[0.0] * 5], [[1.0, -1.0, -1.0, -1.0, 1.0]])
    loss, m = M2PO().policy_loss(b)
    r = [math.exp(x) for x in lr]
    assert loss.item() == pytest.approx(-(r[1] * -1 + r[3] * -1 + r[4] * 1) / 5)
    assert float(m["m2po/masked_frac"]) == pytest.approx(2 / 5)


def test_m2po_algorithm_1_drops_one_argmax_at_a_time_and_m2po_threshold_drops_the_ties_together():
    # Algorithm 1 (the authors' repository, docs/static/m2po-images/alg.jpg): T = trust-region tokens; while
    # mean_T M2 > tau: j = argmax_T M2, M_j = False, T = T minus j. Tokens, row-major: log r .1 .3 .1 / .3 .1 -.3, all
    # A = +1, so the trust region is every r > 1 token: the first five (the last, r < 1 with A > 0, is outside).
    lr = [[0.1, 0.3, 0.1], [0.3, 0.1, -0.3]]
    b = pb(lr, [[0.0] * 3] * 2, [[1.0] * 3] * 2)
    # trust-region (log r)^2: .01 .09 .01 .09 .01, mean .0424 > .04; drop one .09 (the first in batch order,
    # row 0): (.09 + .03) / 4 = .03 <= .04, stop. The other .09 stays.
    keep = m2po_mask(b.logp.detach(), b.adv, b.mask, 0.04)
    assert keep.tolist() == [[True, False, True], [True, True, True]]
    loss, m = M2PO().policy_loss(b)
    r = [[math.exp(x) for x in row] for row in lr]
    assert loss.item() == pytest.approx(-(r[0][0] + r[0][2] + r[1][0] + r[1][1] + r[1][2]) / 6)  # denominator 6
    assert float(m["m2po/masked_frac"]) == pytest.approx(1 / 6)
    assert float(m["m2po/m2_kept"]) == pytest.approx(0.03)
    # m2po-threshold: every trust-region token at or above the cut value goes, both .09s
    assert m2po_mask(b.logp.detach(), b.adv, b.mask, 0.04, ties="together").tolist() == [[True, False, True],
                                                                                          [False, True, True]]
    loss_t, m_t = M2POThreshold().policy_loss(b)
    assert loss_t.item() == pytest.approx(-(r[0][0] + r[0][2] + r[1][1] + r[1][2]) / 6)
    assert float(m_t["m2po/masked_frac"]) == pytest.approx(2 / 6)
    with pytest.raises(ValueError, match="ties"):
        m2po_mask(b.logp.detach(), b.adv, b.mask, 0.04, ties="random")


def test_m2po_statistic_covers_the_whole_batch_not_each_sequence():
    # one sequence alone is within budget (.0025 each), the other is not: the batch mean decides, and only the
    # largest values go wherever they sit
    lr = [[0.05, 0.05], [0.5, 0.05]]
    b = pb(lr, [[0.0] * 2] * 2, [[1.0] * 2] * 2)
    # (.0025 + .0025 + .25 + .0025) / 4 = .064375 > .04; drop .25: .0025 <= .04
    assert m2po_mask(b.logp.detach(), b.adv, b.mask, 0.04).tolist() == [[True, True], [False, True]]


def test_m2po_tie_at_tau_is_within_budget():
    lr, adv, mask = t([[0.5, -0.5]]), t([[1.0, -1.0]]), torch.ones(1, 2, dtype=torch.bool)
    assert m2po_mask(lr, adv, mask, 0.25).all()  # M2 = 0.25 exactly: not masked
    assert m2po_mask(t([[0.5, -0.51]]), adv, mask, 0.25).tolist() == [[True, False]]
    # AReaL's reading needs a mean strictly below tau: it masks the first of two tied tokens
    assert m2po_mask_areal(lr**2, mask, 0.25).tolist() == [[False, True]]


def test_m2po_areal_splits_ties_in_sort_order_and_uses_the_kept_denominator():
    lr = [0.3, 0.3, 0.3, 0.05, 0.05]
    mask = torch.ones(1, 5, dtype=torch.bool)
    # .09 .09 .09 .0025 .0025: suffix means .055, .04625, .0317 < .04 -> drop the first two .09 only
    assert m2po_mask_areal(t([lr]) ** 2, mask, 0.04).tolist() == [[False, False, True, True, True]]
    b = pb([lr], [[0.0] * 5], [[1.0, 1.0, 2.0, 1.0, -1.0]])
    loss, _ = M2PO(variant="areal").policy_loss(b)
    w = [math.exp(x) for x in lr]  # pi_prox / pi_behav; r = pi / pi_prox = 1
    assert loss.item() == pytest.approx(-(w[2] * 2 + w[3] * 1 + w[4] * -1) / 3)


def test_m2po_official_bounds_hand_example():
    lr = t([[0.4, 0.1, -0.3, 0.2]])
    adv = t([[1.0, 1.0, -1.0, -1.0]])  # trust region: tokens 0, 1, 2 (v = .16 .01 .09, mean .0867)
    lo, hi, m2 = m2po_official_bounds(lr, adv, torch.ones_like(adv, dtype=torch.bool), 0.04)
    assert m2 == pytest.approx((0.16 + 0.01 + 0.09) / 3)
    # capped means at the breakpoints .01 -> .01, .09 -> .0633 >= .04: step back to t^2 = .01
    assert (lo, hi) == pytest.approx((math.exp(-0.1), math.exp(0.1)))
    assert m2po_official_bounds(lr, adv, torch.ones_like(adv, dtype=torch.bool), 1.0)[:2] == (0.0, math.inf)
    lo, hi, _ = m2po_official_bounds(lr, adv, torch.ones_like(adv, dtype=torch.bool), 0.04, 0.3, 0.5)
    assert (lo, hi) == pytest.approx((0.7, 1.5))  # the code's miniclip floors


# -- BAPO ---------------------------------------------------------------------------------------------------------
def bapo(ratio, adv, **kw):
    r, a = t([ratio]), t([adv])
    return bapo_search(r, a, torch.ones_like(a, dtype=torch.bool), **kw)


def test_bapo_paper_accounting_keeps_the_start_bounds_when_the_share_is_met():
    # Eq. 8 at (0.6, 1.2): pos = min(1.52, 1.2) + min(2.5, 1.2) = 2.4; neg = max(.7, .6) + max(1, .6) = 1.7
    c_low, c_high, share = bapo([1.52, 2.5, 0.7, 1.0], [1.0, 1.0, -1.0, -1.0])
    assert (c_low, c_high) == pytest.approx((0.6, 1.2)) and share == pytest.approx(2.4 / 4.1)


def test_bapo_raises_c_high_by_delta1_until_the_share_is_met():
    # pos = min(2, c_high), neg = 2: share >= .4 needs pos >= 4/3: 1.30 gives .394, 1.35 gives .403
    c_low, c_high, share = bapo([2.0, 1.0, 1.0], [1.0, -1.0, -1.0])
    assert (c_low, c_high) == pytest.approx((0.6, 1.35)) and share == pytest.approx(1.35 / 3.35)


def test_bapo_c_low_phase_runs_with_delta2_to_b_low():
    # share 1/3 at every candidate (raising c_high admits nothing, raising c_low adds to the negative side)
    assert bapo([0.5, 1.0], [1.0, -1.0])[:2] == pytest.approx((0.9, 3.0))  # 0.88 + 0.02 reaches 0.9 (tolerance)
    assert bapo([0.5, 1.0], [1.0, -1.0], b_low=0.65)[:2] == pytest.approx((0.64, 3.0))  # steps of 0.02
    assert bapo([0.5, 1.0], [1.0, -1.0], b_high=1.31)[:2] == pytest.approx((0.9, 1.30))
    # Algorithm 1's loop needs c_low + delta2 <= b_low: with a_low = b_low it never runs
    assert bapo([0.5, 1.0], [1.0, -1.0], a_low=0.6, b_low=0.6)[:2] == pytest.approx((0.6, 1.2))


def test_bapo_tie_at_rho0_stops_and_zero_advantages_keep_the_start():
    assert bapo([1.0, 1.0], [2.0, -3.0])[:2] == pytest.approx((0.6, 1.2))  # share 2/5 = rho0 exactly
    assert bapo([1.0, 1.0], [2.0, -3.0001])[:2] == pytest.approx((0.9, 3.0))
    c_low, c_high, share = bapo([1.7, 0.3], [0.0, 0.0])
    assert (c_low, c_high, share) == pytest.approx((0.6, 1.2, 1.0))


def test_bapo_official_raises_c_low_first_and_compares_pos_over_neg():
    c_low, c_high, _ = bapo([2.0, 1.0, 1.0], [1.0, -1.0, -1.0], variant="official")
    assert (c_low, c_high) == pytest.approx((0.9, 1.35))  # pos/neg = 1.35/2 >= 0.4/0.6


def test_bapo_loss_uses_the_chosen_bounds_and_official_adds_the_dual_clip():
    b = ratio_batch([[2.0, 1.0, 1.0]], [[1.0, -1.0, -1.0]])
    loss, m = BAPO().policy_loss(b)
    ref, _ = clipped_surrogate(ratio_batch([[2.0, 1.0, 1.0]], [[1.0, -1.0, -1.0]]), ratio_low=0.6, ratio_high=1.35)
    assert loss.item() == pytest.approx(ref.item()) and m["bapo/c_high"] == pytest.approx(1.35)
    b = ratio_batch([[5.0, 1.0]], [[-1.0, 1.0]])
    paper, _ = BAPO().policy_loss(b)
    official, _ = BAPO(variant="official").policy_loss(ratio_batch([[5.0, 1.0]], [[-1.0, 1.0]]))
    assert paper.item() == pytest.approx((5.0 - 1.0) / 2) and official.item() == pytest.approx((3.0 - 1.0) / 2)


# -- decoupled PPO and TIS on the staleness gap ---------------------------------------------------------------------
def test_decoupled_ppo_and_tis_hand_computation():
    lp, lb, adv = [-1.0, -2.0, -0.5], [-1.5, -1.0, -0.5], [1.0, -1.0, 2.0]
    w = [math.exp(a - b) for a, b in zip(lp, lb)]  # pi_prox / pi_behav (prox = current)
    b = pb([lp], [lb], [adv])
    loss, _ = DecoupledPPO().policy_loss(b)
    assert loss.item() == pytest.approx(-sum(x * a for x, a in zip(w, adv)) / 3)
    loss.backward()
    assert b.logp.grad.reshape(-1).tolist() == pytest.approx([-x * a / 3 for x, a in zip(w, adv)])  # r = 1 in value
    loss, m = TIS(cap=1.2).policy_loss(pb([lp], [lb], [adv]))
    assert loss.item() == pytest.approx(-sum(min(x, 1.2) * a for x, a in zip(w, adv)) / 3)
    assert float(m["is/truncated_frac"]) == pytest.approx(1 / 3)
    loss, m = DecoupledPPO(weight_cap=1.2, cap_mode="mask").policy_loss(pb([lp], [lb], [adv]))
    assert loss.item() == pytest.approx(-(w[1] * adv[1] + w[2] * adv[2]) / 3)


# -- VCPO ---------------------------------------------------------------------------------------------------------
def test_vcpo_ess_ratio_and_learning_rate_scale():
    assert ess_ratio(t([1.0, 3.0])) == pytest.approx(16 / (2 * 10))
    assert ess_lr_scale(0.8) == pytest.approx(math.sqrt(0.8)) and ess_lr_scale(0.8, rho_base=0.5) == 1.0
    # sequence weights from the log-probs: w = exp(sum_t log(pi_prox / pi_behav)) = [1, 3]
    b = pb([[0.0, 0.0], [math.log(3.0), 0.0]], [[0.0, 0.0], [0.0, 0.0]], [[1.0, 1.0], [-1.0, -1.0]])
    stab = VCPO(baseline=False)
    loss, m = stab.policy_loss(b)
    assert m["vcpo/lr_scale"] == pytest.approx(math.sqrt(0.8))
    assert loss.item() == pytest.approx(-(1 * 1 + 3 * -1) / 2)  # -agg(min(w, 8) r A), r = 1


def test_vcpo_scales_the_learning_rate_for_one_step_only():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1)
    stab = VCPO(baseline=False)
    stab._lr_scale = 0.5
    p.grad = torch.ones(1)
    stab.on_before_optimizer_step(None, None, opt)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    opt.step()
    assert p.item() == pytest.approx(-0.05) and opt.param_groups[0]["lr"] == pytest.approx(0.1)


def test_vcpo_advantages_use_the_module_estimator_with_the_unbiased_group_std():
    """GRPO's default estimator divides by the unbiased group std, and VCPO takes the module's advantages as they
    are: at G = 8 its advantages are sqrt(7/8) = 0.935 times the authors' (population std), unless the run sets
    rollout.advantage: grpo-population."""
    from gacbench.llm.grpo import RolloutConfig
    from gacbench.rollout.advantages import advantage_fn

    rewards = torch.tensor([[1.0] + [0.0] * 7], dtype=D)  # mean 1/8; sum of squared deviations 7/8
    unbiased, population = math.sqrt(7 / 8 / 7), math.sqrt(7 / 8 / 8)

    def vcpo_grad(estimator: str) -> list[float]:
        adv = advantage_fn(estimator)(rewards).reshape(8, 1)
        b = pb([[-1.0]] * 8, [[-1.0]] * 8, adv.tolist())  # w = r = 1: the loss is -mean_i A_i
        VCPO(baseline=False).policy_loss(b)[0].backward()
        return b.logp.grad.reshape(-1).tolist()

    grad = vcpo_grad(RolloutConfig().advantage)
    assert grad[0] == pytest.approx(-(7 / 8) / (unbiased + 1e-6) / 8, rel=1e-12)
    assert grad[1] == pytest.approx((1 / 8) / (unbiased + 1e-6) / 8, rel=1e-12)
    authors = vcpo_grad("grpo-population")
    assert authors[0] == pytest.approx(-(7 / 8) / (population + 1e-6) / 8, rel=1e-12)
    assert grad[0] / authors[0] == pytest.approx(math.sqrt(7 / 8), rel=1e-5)  # 0.935


def test_opob_advantages_hand_example():
    # group 0: lambda = [.75, .25], baseline .75 * 1 + .25 * -1 = .5; group 1: zero weights, the equal-weight
    # baseline, its mean 0: the advantages stay
    out = opob_advantages(t([1.0, -1.0, 0.5, -0.5]), torch.tensor([0, 0, 1, 1]), t([3.0, 1.0, 0.0, 0.0]))
    assert out.tolist() == pytest.approx([0.5, -1.5, 0.5, -0.5])
    # a group of zero weights whose advantages do not average 0: their mean, 0.5, is subtracted
    out = opob_advantages(t([1.0, 0.0]), torch.tensor([0, 0]), t([0.0, 0.0]))
    assert out.tolist() == pytest.approx([0.5, -0.5])


def test_per_sequence_gradient_norms_match_the_softmax_score_function():
    gen = torch.Generator().manual_seed(0)
    W = torch.nn.Parameter(torch.randn(3, 4, generator=gen, dtype=D))
    x = torch.randn(5, 3, generator=gen, dtype=D)
    a = torch.tensor([0, 1, 3, 2, 1])
    logp = torch.log_softmax(x @ W, -1).gather(-1, a.view(-1, 1)).squeeze(-1)
    got = per_sequence_grad_sq_norms(logp, [W])
    p = torch.softmax(x @ W, -1).detach()
    expected = (x**2).sum(-1) * ((torch.nn.functional.one_hot(a, 4) - p) ** 2).sum(-1)  # ||x||^2 ||e_a - p||^2
    assert got.tolist() == pytest.approx(expected.tolist())


def _token_policy(seed=0, B=6, T=3):
    """A softmax policy over 4 tokens with logits x @ W per token: (W, row_logp, mask)."""
    gen = torch.Generator().manual_seed(seed)
    W = torch.nn.Parameter(torch.randn(3, 4, generator=gen, dtype=D))
    x = torch.randn(B, T, 3, generator=gen, dtype=D)
    a = torch.randint(0, 4, (B, T), generator=gen)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 2] = mask[3, 1:] = False

    def row_logp(rows):
        return torch.log_softmax(x[rows] @ W, -1).gather(-1, a[rows].unsqueeze(-1)).squeeze(-1) * mask[rows]

    return W, row_logp, mask


def test_recomputed_gradient_norms_equal_the_norms_through_the_batch_graph():
    W, row_logp, mask = _token_policy()
    every = torch.arange(mask.shape[0])
    through_batch = per_sequence_grad_sq_norms(row_logp(every).sum(-1), [W])
    assert (through_batch > 0).all()
    assert recomputed_grad_sq_norms(row_logp, mask, [W], every).tolist() == pytest.approx(through_batch.tolist())
    # only the rows asked for are computed
    assert recomputed_grad_sq_norms(row_logp, mask, [W], torch.tensor([1, 4])).tolist() == pytest.approx(
        [0.0, through_batch[1].item(), 0.0, 0.0, through_batch[4].item(), 0.0])


def test_vcpo_baseline_skips_norms_that_cannot_change_an_advantage():
    W, row_logp, mask = _token_policy()
    every = torch.arange(mask.shape[0])
    # group 0 (rows 0-2) has advantages, group 1 (rows 3-5) is all ties; the behaviour log-probs give unequal
    # sequence weights w_i = exp(sum_t log(pi_prox / pi_behav))
    adv = t([1.0, -0.5, 2.0, 0.0, 0.0, 0.0]).view(-1, 1).expand(-1, 3)
    behav = t([[0.3, 0.0, 0.0], [-0.2, 0.1, 0.0], [0.0, 0.5, -0.1], [0.2, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0, 0]])
    asked = []

    def counting(rows):
        asked.extend(rows.tolist())
        return row_logp(rows)

    def run(recompute):
        W.grad = None
        logp = row_logp(every)
        b = PolicyBatch(logp, logp.detach() - behav, adv, mask, group=torch.tensor([0, 0, 0, 1, 1, 1]),
                        row_logp=counting if recompute else None)
        stab = VCPO()
        stab._params = [W]
        loss, m = stab.policy_loss(b)
        loss.backward()
        return loss.item(), W.grad.clone(), m

    loss_r, grad_r, m = run(True)
    assert sorted(asked) == [0, 1, 2] and m["vcpo/grad_rows_frac"] == pytest.approx(3 / 6)
    loss_b, grad_b, _ = run(False)
    assert loss_r == pytest.approx(loss_b) and torch.allclose(grad_r, grad_b)
    # every norm taken: the same advantages, since the skipped rows' group has only zero advantages
    logp = row_logp(every)
    w = torch.exp((logp.detach() - (logp.detach() - behav)).masked_fill(~mask, 0).sum(-1).clamp(-20, 20))
    gsq = per_sequence_grad_sq_norms(logp.sum(-1), [W])
    full = opob_advantages(adv[:, 0], torch.tensor([0, 0, 0, 1, 1, 1]), w**2 * gsq)
    assert full[3:].tolist() == [0.0, 0.0, 0.0]
    expected = -(w.clamp(max=8).unsqueeze(-1) * full.unsqueeze(-1)).expand(-1, 3)[mask].mean()
    assert loss_r == pytest.approx(expected.item())


def test_vcpo_baseline_needs_groups():
    stab = VCPO()
    stab._params = [torch.nn.Parameter(torch.zeros(1))]
    with pytest.raises(ValueError, match="group"):
        stab.policy_loss(pb([[0.0]], [[0.0]], [[1.0]]))


def test_a_fully_rejected_batch_gives_a_zero_loss_and_finite_metrics():
    b = engine_batch([[3.0, 3.0]], [[1.0, -1.0]])
    loss, m = MIS(threshold=2.0, level="token").policy_loss(b)
    loss.backward()
    assert loss.item() == 0.0 and (b.logp.grad == 0).all()
    assert all(math.isfinite(float(v)) for v in m.values()) and float(m["mis/masked_frac"]) == 1.0


@pytest.mark.parametrize("ties", ["split", "together"])
def test_m2po_keeps_every_token_when_its_two_means_round_to_either_side_of_tau(ties):
    # float32 mean (log r)^2 = 0.0400000028 > tau, while the suffix mean the cut is taken from rounds to
    # 0.0399999991 <= tau (the exact mean, 0.03999999936, is below tau): nothing is dropped
    lr = torch.tensor([[0.18094496428966522, 0.2425098419189453, 0.16866503655910492]])
    adv, mask = torch.ones_like(lr), torch.ones_like(lr, dtype=torch.bool)
    assert float((lr**2).mean()) > 0.04 >= float(lr.double().pow(2).mean())
    assert m2po_mask(lr, adv, mask, 0.04, ties=ties).all()


# -- edges of the hand computations: bounds, defaults and metrics no other test pins ----------------------------------
def exact_engine_batch(k, adv):
    """A batch with r = 1 and pi_behav / pi_engine = k per token (log-probs 0 and -log k): exactly k for 0.5, 2 and
    4 in float64, within an ulp for others (8: 7.999999999999998)."""
    zeros = [[0.0] * len(row) for row in k]
    return pb(zeros, zeros, adv, logp_engine=[[-math.log(x) for x in row] for row in k])


def test_cispo_clipfrac_counts_the_tokens_whose_weight_is_capped():
    """r = (1.5, 0.5, 1.0) at clip_high 0.28: only the first token's weight is capped (CISPO has no lower bound)."""
    logp, r = [-1.0, -2.0, -1.0], [1.5, 0.5, 1.0]
    b = pb([logp], [[lp - math.log(x) for lp, x in zip(logp, r)]], [[1.0, -1.0, 1.0]], clip_high=0.28)
    assert float(CISPO().policy_loss(b)[1]["pg/clipfrac"]) == pytest.approx(1 / 3)


def test_dual_clip_caps_a_negative_advantage_at_three_by_default():
    """verl's clip_ratio_c = 3: r = 2.5 is under the cap, so the loss is -A r = 2.5 (at c = 2 it would be 2)."""
    from gacbench.stabilizers import dual_clip_loss

    assert dual_clip_loss(pb([[math.log(2.5)]], [[0.0]], [[-1.0]]))[0].item() == pytest.approx(2.5)
    assert dual_clip_loss(pb([[math.log(3.5)]], [[0.0]], [[-1.0]]))[0].item() == pytest.approx(3.0)


def test_the_engine_corrections_keep_a_weight_on_their_bounds():
    """TIS truncates k > C (k = C is not counted), MIS keeps rho = C and rho = lower, IcePop keeps k = alpha and
    k = beta (beta = 4 here: exp(log 5) is not 5 in float64)."""
    m = TISEngine(cap=2.0).policy_loss(exact_engine_batch([[2.0, 4.0]], [[1.0, 1.0]]))[1]
    assert float(m["is/engine_truncated_frac"]) == 0.5
    loss, m = MIS(threshold=2.0, level="token").policy_loss(exact_engine_batch([[2.0, 1.0]], [[1.0, 1.0]]))
    assert loss.item() == pytest.approx(-1.5) and float(m["mis/masked_frac"]) == 0.0
    loss, m = MIS(threshold=2.0, level="token", lower=0.5).policy_loss(exact_engine_batch([[0.5, 1.0]], [[1.0, 1.0]]))
    assert loss.item() == pytest.approx(-0.75) and float(m["mis/masked_frac"]) == 0.0
    loss, m = IcePop(alpha=0.5, beta=4.0).policy_loss(exact_engine_batch([[0.5, 4.0]], [[1.0, 1.0]]))
    assert loss.item() == pytest.approx(-2.25) and float(m["icepop/masked_frac"]) == 0.0


def test_icepop_logs_the_mean_engine_weight_before_its_band():
    m = IcePop().policy_loss(exact_engine_batch([[0.5, 1.0, 4.0, 8.0]], [[1.0] * 4]))[1]
    assert float(m["is/engine_weight_mean"]) == pytest.approx(13.5 / 4)  # 8 is outside [0.5, 5], still counted


def test_the_bands_edges_are_accepted_or_refused_as_documented():
    from gacbench.stabilizers.lr_scaled import staleness_lr_scale

    IcePop(alpha=1.0)  # alpha may reach 1
    with pytest.raises(ValueError, match="below threshold"):
        MIS(threshold=2.0, lower=2.0)
    with pytest.raises(ValueError, match="must be >= 0"):
        staleness_lr_scale(-1)


def test_a_sequence_weight_is_clamped_in_log_space():
    """Seq-MIS: sum log k = -30 is clamped to -20 (verl's bound) before exp."""
    from gacbench.stabilizers.rollout_correction import mis_weights

    w, _ = mis_weights(t([[-15.0, -15.0]]), torch.ones(1, 2, dtype=torch.bool))
    assert float(w[0, 0]) == pytest.approx(math.exp(-20.0))


def test_opsm_defaults_to_slimes_delta():
    from gacbench.stabilizers.seqmask import OPSM

    assert OPSM().delta == 1e-4


def test_vcpo_truncates_only_weights_above_its_cap():
    m = VCPO(baseline=False, is_cap=2.0).policy_loss(pb([[0.0]], [[-math.log(2.0)]], [[1.0]], logp_prox=[[0.0]]))[1]
    assert float(m["is/truncated_frac"]) == 0.0  # w = 2 = the cap


def test_vespo_floors_the_sequence_weight_and_reads_a_zero_advantage_as_positive():
    """W = prod r floored at 1e-8 (sum log r = -30); A = 0 takes the A >= 0 pair (k, lambda) = (2, 3): phi(2) =
    2^2 e^(3 (1 - 2)) = 4 e^-3."""
    from gacbench.stabilizers.vespo import VESPO

    m = VESPO().policy_loss(pb([[-15.0, -15.0]], [[0.0, 0.0]], [[1.0, 1.0]]))[1]
    assert float(m["vespo/w_seq_mean"]) == pytest.approx(1e-8)
    m = VESPO().policy_loss(pb([[math.log(2.0)]], [[0.0]], [[0.0]]))[1]
    assert float(m["vespo/phi_mean"]) == pytest.approx(4 * math.exp(-3))
