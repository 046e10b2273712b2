"""Advantage estimators for group-sampled rollouts, found by name.

Every estimator maps rewards of shape (P, G) (P prompts, G samples per prompt) to advantages of the
same shape, computed within each group. Adding one is a function plus ``@register_advantage("name")``;
a rollout objective takes the name as a setting (GRPO: ``rollout.advantage``).

- ``grpo``: (r - mean) / (std + eps), the std unbiased (Shao et al. 2024, DeepSeekMath, GRPO with outcome
  supervision; verl's ``compute_grpo_outcome_advantage`` has the same form).
- ``grpo-population``: the same with the population std (divided by G, not G - 1), as the VCPO authors' code
  normalises its baseline-corrected advantages: sqrt(G / (G - 1)) times ``grpo``'s (1.069 at G = 8) up to
  the eps.
- ``dr-grpo``: r - mean, no std division (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical
  Perspective", the Dr. GRPO objective).
- ``rloo``: r_i minus the mean of the other G - 1 rewards of its group, = G/(G-1) (r_i - mean)
  (Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human
  Feedback in LLMs").
"""

from __future__ import annotations

from typing import Callable

import torch

AdvantageFn = Callable[[torch.Tensor], torch.Tensor]
ADVANTAGES: dict[str, AdvantageFn] = {}


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    def deco(fn: AdvantageFn) -> AdvantageFn:
        if name in ADVANTAGES:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADVANTAGES[name] = fn
        return fn

    return deco


def advantage_fn(name: str) -> AdvantageFn:
    try:
        return ADVANTAGES[name]
    except KeyError:
        raise ValueError(f"unknown advantage estimator {name!r}; known: {', '.join(sorted(ADVANTAGES))} "
                         "(add one with gacbench.rollout.advantages.register_advantage)") from None


def _check(rewards: torch.Tensor) -> None:
    if rewards.dim() != 2 or rewards.shape[-1] < 2:
        raise ValueError("advantages need rewards of shape (prompts, group) with group >= 2, "
                         f"got {tuple(rewards.shape)}")


def _zero_where_tied(rewards: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """``adv`` with exactly 0 in every group whose rewards are all equal: there the float mean of a value such as
    0.7 can differ from it in the last bit, which a division by the group's std (also a rounding residue) would
    turn into an advantage of the same sign for every sample."""
    tied = (rewards == rewards[..., :1]).all(-1, keepdim=True)
    return torch.where(tied, torch.zeros_like(adv), adv)


def _centred(rewards: torch.Tensor) -> torch.Tensor:
    """r - mean within each group, exactly 0 in a tied group (:func:`_zero_where_tied`)."""
    return _zero_where_tied(rewards, rewards - rewards.mean(-1, keepdim=True))


@register_advantage("grpo")
def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: rewards (P, G) normalised within each group, (r - mean) / (std + eps), std unbiased. (P, G)."""
    _check(rewards)
    return _centred(rewards) / (rewards.std(-1, keepdim=True) + eps)


@register_advantage("grpo-population")
def group_advantages_population(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO with the population std: (r - mean) / (std + eps), std over G (not G - 1). (P, G)."""
    _check(rewards)
    return _centred(rewards) / (rewards.std(-1, correction=0, keepdim=True) + eps)


@register_advantage("dr-grpo")
def dr_grpo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO: rewards (P, G) centred within each group, not divided by the std. (P, G)."""
    _check(rewards)
    return _centred(rewards)


@register_advantage("rloo")
def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """RLOO: each reward minus the mean of the other G - 1 rewards of its group. (P, G)."""
    _check(rewards)
    G = rewards.shape[-1]
    return _zero_where_tied(rewards, rewards - (rewards.sum(-1, keepdim=True) - rewards) / (G - 1))
