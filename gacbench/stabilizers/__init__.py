"""Stabilizers: the API (gradient side and loss side), the loss-side baselines (M2PO, BAPO, TIS, decoupled PPO,
dual-clip PPO, GSPO, CISPO, TIS on the engine, MIS, IcePop, VCPO) as pure tensor functions plus thin callbacks,
the staleness-scaled learning rate, and the registry that finds them by name."""

from gacbench.stabilizers.bapo import BAPO, bapo_bounds, bapo_search
from gacbench.stabilizers.base import (
    AGG_MODES,
    LossStabilizer,
    PolicyBatch,
    Stabilizer,
    across_ranks,
    agg_count,
    agg_loss,
    clipped_surrogate,
    find_loss_stabilizer,
    over_kept_tokens,
    policy_loss,
    resolve_loss_stabilizer,
)
from gacbench.stabilizers.importance import TIS, DecoupledPPO, decoupled_ppo_loss
from gacbench.stabilizers.lr_scaled import StalenessLR, staleness_lr_scale
from gacbench.stabilizers.m2po import M2PO, M2POThreshold, m2po_mask, m2po_mask_areal, m2po_official_bounds
from gacbench.stabilizers.ppo import CISPO, GSPO, DualClipPPO, cispo_loss, dual_clip_loss, gspo_loss
from gacbench.stabilizers.rollout_correction import MIS, IcePop, TISEngine, icepop_loss, mis_loss, tis_engine_loss
from gacbench.stabilizers.vcpo import VCPO, ess_lr_scale, ess_ratio, opob_advantages

__all__ = [
    "AGG_MODES", "BAPO", "CISPO", "DecoupledPPO", "DualClipPPO", "GSPO", "IcePop", "LossStabilizer", "M2PO",
    "M2POThreshold", "MIS", "PolicyBatch", "Stabilizer", "StalenessLR", "TIS", "TISEngine", "VCPO", "across_ranks",
    "agg_count", "agg_loss", "bapo_bounds", "bapo_search", "cispo_loss", "clipped_surrogate", "decoupled_ppo_loss",
    "dual_clip_loss", "ess_lr_scale", "ess_ratio", "find_loss_stabilizer", "gspo_loss", "icepop_loss", "m2po_mask",
    "m2po_mask_areal", "m2po_official_bounds", "mis_loss", "opob_advantages", "over_kept_tokens", "policy_loss",
    "resolve_loss_stabilizer", "staleness_lr_scale", "tis_engine_loss",
]
