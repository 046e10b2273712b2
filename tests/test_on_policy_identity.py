"""Every stabilizer's ``on_policy_identity`` declaration, checked against the GRPO module's own loss code.

At s = 0 the GRPO module takes one optimizer step per batch and sets ``logp_behav = logp.detach()``, so every token
ratio is exactly 1. A stabilizer that declares ``on_policy_identity`` claims that its update then equals plain
GRPO's: the report uses sync's cells as its on-policy control. Here each declaring loss-side stabilizer's gradient,
through ``GRPOModule.policy_loss`` on a random batch built as the module builds it at s = 0 (lag 0, the engine's
log-probs differing from the trainer's as vLLM's do), must equal the module's clipped surrogate's gradient in every
aggregation and at two clip ranges; each loss-side stabilizer that does not declare it must change the update on
that batch (under the module's default token-mean aggregation: GSPO's own sequence-mean aggregation coincides with
the module's only where the module is set to seq-mean-token-mean, which is why it is not declared). The
staleness-scaled lr, the one gradient-side declaration, must leave the rate untouched at S = 0.
"""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from gacbench.llm.grpo import GRPOModule, LossConfig, RolloutConfig
from gacbench.methods import method_callbacks, on_policy_identity
from gacbench.stabilizers.base import AGG_MODES
from gacbench.stabilizers.lr_scaled import StalenessLR, staleness_lr_scale
from gacbench.stabilizers.registry import available

PROMPTS, GROUP, T, VOCAB = 4, 4, 7, 11
#: settings whose declaration differs from the class default, or that put the ratio on a boundary of a clip
#: range, beside every registered stabilizer at its defaults: (spec, declared)
VARIANTS = [
    ("m2po(variant='areal')", True), ("m2po(variant='official')", True), ("m2po-threshold", True),
    ("m2po(variant='areal',weight_cap=1.0)", True), ("m2po(variant='areal',weight_cap=0.5)", False),
    ("bapo(variant='official')", True), ("bapo(a_low=1.0,b_low=1.0,a_high=1.0,b_high=1.0)", True),
    ("cispo(lower=True)", True), ("dual-clip(clip_c=1.01)", True),
    ("tis(cap=1.0)", True), ("tis(cap=0.5)", False),
    ("decoupled-ppo(weight_cap=1.0,cap_mode='mask')", True), ("decoupled-ppo(weight_cap=0.5)", False),
    ("a3po(weight_cap=1.0,cap_mode='mask')", True), ("a3po(weight_cap=0.5,cap_mode='mask')", False),
    ("opsm(delta=1e-9)", True), ("opsm(sampling='engine')", False),
    ("geo-seq-mask(low=1.0,high=1.0)", True), ("geo-seq-mask(sampling='engine')", False),
    ("vespo(k_pos=5.0,lambda_pos=0.5,k_neg=0.5,lambda_neg=5.0)", True),
    ("vcpo(baseline=False)", True), ("vcpo(baseline=False,rho_base=2.0)", False),
    ("vcpo(baseline=False,is_cap=0.5)", False),
]
#: the gradient-side stabilizers whose declaration a test below checks
GRADIENT_SIDE_CHECKED = {"lr-scaled"}


class TokenPolicy(nn.Module):
    """A policy small enough to differentiate exactly: each completion position's logits are a learned function of
    the previous token, in float64."""

    uses_loss_stabilizer = True

    def __init__(self, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.table = nn.Parameter(torch.randn(VOCAB, VOCAB, generator=gen, dtype=torch.float64))
        self.bias = nn.Parameter(0.3 * torch.randn(T, VOCAB, generator=gen, dtype=torch.float64))

    def token_logprobs(self, packed: dict) -> torch.Tensor:
        """(B, T) log-probs of the completion tokens, 0 where masked (as GRPOModule.token_logprobs)."""
        ids, mask = packed["ids"], packed["mask"]
        logits = self.table[ids[:, :-1]] + self.bias  # (B, T, V): position k predicts token k + 1
        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        return lp * mask


def on_policy_data(seed: int) -> dict:
    """A rollout batch as GRPOModule.rollout builds it at s = 0: packed sequences of several lengths, group-normalised
    advantages (the ``grpo`` estimator) of 0/1 rewards, the engine's log-probs (the trainer's plus noise, as vLLM's
    differ), and no behaviour log-probs."""
    gen = torch.Generator().manual_seed(seed)
    B = PROMPTS * GROUP
    ids = torch.randint(0, VOCAB, (B, T + 1), generator=gen)
    lengths = torch.randint(2, T + 1, (B,), generator=gen)
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    rewards = torch.randint(0, 2, (PROMPTS, GROUP), generator=gen).double()
    rewards[0] = torch.tensor([1.0, 0.0, 0.0, 0.0])  # at least one group with a spread of rewards
    adv = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)
    with torch.no_grad():
        trainer_logp = TokenPolicy(seed).token_logprobs({"ids": ids, "mask": mask})
    engine = (trainer_logp + 0.05 * torch.randn(B, T, generator=gen, dtype=torch.float64)) * mask
    return {"packed": {"ids": ids, "mask": mask}, "logp_behav": None, "adv": adv.reshape(-1),
            "engine_logp": engine, "logp_ref": None, "rewards": rewards}


def module_update(spec: str | None, seed: int = 0, clip_low: float = 0.2, clip_high: float = 0.2,
                  agg: str = "token-mean") -> torch.Tensor:
    """The flattened parameter gradient of GRPOModule.policy_loss on the batch of ``seed`` at s = 0 (lag 0) with the
    method ``spec``'s loss-side stabilizer (None: the module's clipped surrogate), times the learning-rate factor the
    stabilizer applies to the step (VCPO's ESS scale)."""
    policy = TokenPolicy(seed)
    callbacks = [] if spec is None else method_callbacks(spec)
    stab = next((cb for cb in callbacks if getattr(cb, "kind", None) == "loss"), None)
    if stab is not None:
        stab.setup(SimpleNamespace(callbacks=[stab]), policy, "fit")
    module = SimpleNamespace(token_logprobs=policy.token_logprobs, loss_stabilizer=stab,
                             loss_cfg=LossConfig(clip_low=clip_low, clip_high=clip_high, agg=agg),
                             rollout_cfg=RolloutConfig(prompts=PROMPTS, group=GROUP), _batch_lag=GRPOModule._batch_lag)
    loss, _ = GRPOModule.policy_loss(module, on_policy_data(seed), 0)
    grads = torch.autograd.grad(loss, list(policy.parameters()))
    return torch.cat([g.reshape(-1) for g in grads]) * getattr(stab, "_lr_scale", 1.0)


def loss_side_specs() -> list[tuple[str, bool]]:
    """Every registered loss-side stabilizer at its default settings, then VARIANTS."""
    names = [n for n, info in available().items() if info["kind"] == "loss"]
    return [(n, available()[n]["on_policy_identity"]) for n in names] + VARIANTS


def test_the_declarations_are_the_expected_ones():
    # the registry reports each class's declaration; an instance whose settings break it reports False
    # the built-in stabilizers' declarations (an installed plug-in adds its own, not tested here)
    declared = {n for n, info in available().items() if info["on_policy_identity"] and info["source"] == "gacbench"}
    assert declared == {"m2po", "m2po-threshold", "bapo", "tis", "decoupled-ppo", "dual-clip", "cispo", "opsm",
                        "geo-seq-mask", "vespo", "a3po", "lr-scaled"}
    for spec, expected in VARIANTS:
        assert on_policy_identity(spec) is expected, spec
    assert on_policy_identity("sync") and on_policy_identity("stale")  # no callback: the module itself
    assert on_policy_identity("m2po+lr-scaled") and not on_policy_identity("gac+m2po")
    assert not on_policy_identity("gac-calibrated") and not on_policy_identity("gspo")
    assert not on_policy_identity("no-such-method") and not on_policy_identity("gac(")


@pytest.mark.parametrize("spec, declared", loss_side_specs())
def test_a_declared_identity_gives_grpos_gradient_and_an_undeclared_one_changes_it(spec, declared):
    assert on_policy_identity(spec) is declared
    if declared:
        for agg in AGG_MODES:
            for clip_low, clip_high in ((0.2, 0.2), (0.2, 0.28)):
                for seed in (0, 1):
                    ref = module_update(None, seed, clip_low, clip_high, agg)
                    got = module_update(spec, seed, clip_low, clip_high, agg)
                    assert ref.abs().max() > 1e-3  # a batch that moves the policy
                    assert torch.allclose(got, ref, rtol=1e-9, atol=1e-12), (spec, agg, clip_low, clip_high, seed)
    elif spec in available() and available()[spec]["source"] != "gacbench":
        pytest.skip(f"{spec} is an installed plug-in that declares nothing: declaring is its package's choice")
    else:
        ref, got = module_update(None), module_update(spec)
        assert (got - ref).abs().max() > 1e-3 * ref.abs().max(), f"{spec} leaves GRPO's update: declare it"


def test_every_gradient_side_declaration_has_a_check():
    declared = {n for n, info in available().items() if info["kind"] == "gradient" and info["on_policy_identity"]}
    assert declared <= GRADIENT_SIDE_CHECKED, f"add a check of {declared - GRADIENT_SIDE_CHECKED} to this file"


@pytest.mark.parametrize("form, s0", [("min", 1.0), ("min", 4.0), ("smooth", 1.0), ("smooth", 0.3)])
def test_the_staleness_scaled_lr_is_the_base_rate_at_s_0(form, s0):
    assert staleness_lr_scale(0, s0, form) == 1.0  # exactly
    for staleness, untouched in ((0, True), (16, False)):
        module = SimpleNamespace(rollout_staleness=True, staleness=staleness)
        cb = StalenessLR(s0=s0, form=form)
        cb.setup(SimpleNamespace(callbacks=[cb]), module, "fit")
        opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.125)
        cb.on_before_optimizer_step(None, module, opt)
        assert (opt.param_groups[0]["lr"] == 0.125) is untouched
        assert (cb.scale == 1.0) is untouched
        cb._restore()
