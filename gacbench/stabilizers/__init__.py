"""Stabilizers: the API (gradient side and loss side), the baselines (M2PO, BAPO, TIS, decoupled PPO)
as pure tensor functions plus thin callbacks, and the registry that finds them by name."""

from gacbench.stabilizers.bapo import BAPO, bapo_bounds
from gacbench.stabilizers.base import (
    LossStabilizer,
    PolicyBatch,
    Stabilizer,
    agg_loss,
    clipped_surrogate,
    find_loss_stabilizer,
    policy_loss,
    resolve_loss_stabilizer,
)
from gacbench.stabilizers.importance import TIS, DecoupledPPO, decoupled_ppo_loss
from gacbench.stabilizers.m2po import M2PO, m2po_mask, m2po_official_bounds

__all__ = [
    "BAPO", "M2PO", "TIS", "DecoupledPPO", "LossStabilizer", "PolicyBatch", "Stabilizer", "agg_loss",
    "bapo_bounds", "clipped_surrogate", "decoupled_ppo_loss", "find_loss_stabilizer", "m2po_mask",
    "m2po_official_bounds", "policy_loss", "resolve_loss_stabilizer",
]
