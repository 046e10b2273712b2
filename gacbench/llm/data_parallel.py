"""GRPO across processes (Lightning DDP): each rank generates its share of the step's prompts with its own engine,
and the loss is scaled so that one optimizer step equals the single-process step on the same global batch.

- **Prompts**: step t's P prompts are split in W (world size) contiguous shares; rank r generates prompts
  [r P/W, (r + 1) P/W) with n samples each. P must be a multiple of W. A prompt's group lives on one rank, so the
  group-normalised advantages are those of the single-process run.
- **Engines**: one per rank, in the rank's process (``acquire_engine`` in ``on_train_start``), on the rank's device
  (the hf engine copies the rank's policy; a vLLM engine sees the devices the rank's process sees). Each rank's
  sampling seed is offset by its rank, so that ranks draw independent samples; weight syncs happen on every rank
  after the (identical) optimizer step.
- **Loss**: DDP averages gradients over ranks, and the ranks hold different numbers of response tokens (and,
  where sequences without a token are possible, of sequences): each rank's loss is multiplied by W c_r / C,
  c_r the count its aggregation divides by (tokens for ``token-mean``, sequences holding a token for the
  seq-mean modes: ``gacbench.stabilizers.base.agg_count``) and C that count over all ranks (one all-reduce of
  a scalar per step, as verl normalises by the global token count), so that the average of the ranks'
  gradients is the gradient of the global aggregate. A loss that aggregates over fewer tokens than the
  batch's mask (MIS's and M2PO's AReaL-variant rejection: ``over_kept_tokens``) or in another mode than the
  module's (GSPO's seq-mean-token-mean) corrects this to its own count (``across_ranks``).
- Loss-side stabilizers whose loss uses batch-level statistics (M2PO's masks and bounds, BAPO's bound search,
  VCPO's ESS) compute those statistics over all ranks' tokens (one all-gather or all-reduce), as one process
  holding the whole batch would.
- **Logged scalars**: each rank computes a step's scalars (``reward/mean``, ``pg/clipfrac``, ``is/*``, ...) on its
  own share; one all-gather per step makes them one value per step, the same on every rank
  (:func:`metrics_over_ranks`): a ``*_max`` key the largest of the ranks' values, a ``*_min`` key the smallest, any
  other key their mean. The ranks hold equal numbers of sequences, so a mean over sequences (``reward/mean``,
  ``response/tokens_mean``) is the global batch's exactly; a mean over tokens (``is/ratio_mean``, ``pg/clipfrac``)
  is the mean of the ranks' token means, and ``is/ess_frac`` and ``is/chi2`` the mean of the ranks' values, which
  differ from one process's figures on the whole batch when the ranks' token counts or weights differ.
"""

from __future__ import annotations

import math

import torch

from gacbench.stabilizers.base import agg_count

RANK_SEED_STRIDE = 1_000_000_007  # seed offset between ranks' generation streams


def world(module) -> tuple[int, int]:
    """(rank, world size) of the module's trainer; (0, 1) outside a fit."""
    trainer = getattr(module, "_trainer", None)
    if trainer is None:
        return 0, 1
    return int(trainer.global_rank), int(trainer.world_size)


def share_problem(prompts: int, size: int) -> str | None:
    """Why ``prompts`` per step cannot be shared out among ``size`` processes, or None."""
    if size > 1 and prompts % size:
        return (f"rollout.prompts {prompts} is not a multiple of the {size} processes (data parallel: "
                "--trainer.devices x --trainer.num_nodes): every rank generates prompts / processes prompts. Make "
                "it a multiple of the number of processes.")
    return None


def rank_share(module, problems: list) -> tuple[list, int]:
    """This rank's contiguous share of a step's problems and the rank's seed offset (0 on one process)."""
    rank, size = world(module)
    if size == 1:
        return problems, 0
    problem = share_problem(len(problems), size)
    if problem is not None:
        raise ValueError(f"GRPO: {problem}")
    share = len(problems) // size
    return problems[rank * share : (rank + 1) * share], rank * RANK_SEED_STRIDE


def metrics_over_ranks(module, metrics: dict) -> dict:
    """A step's scalars as one value for the whole batch under DDP, the same on every rank (see the module
    docstring: ``*_max`` the maximum, ``*_min`` the minimum, else the mean over the ranks that report the key);
    ``metrics`` unchanged on one process. Every rank must call it at every step (one all-gather)."""
    _, size = world(module)
    if size == 1:
        return metrics
    local = {k: float(v) for k, v in metrics.items()}
    ranks: list = [None] * size
    torch.distributed.all_gather_object(ranks, local)
    out = {}
    for key in [*local, *sorted(set().union(*ranks) - local.keys())]:
        values = [r[key] for r in ranks if key in r]
        if any(math.isnan(v) for v in values):  # undefined on a rank: undefined for the batch
            out[key] = math.nan
        else:
            out[key] = (max(values) if key.endswith("_max") else min(values) if key.endswith("_min")
                        else sum(values) / len(values))
    return out


def data_parallel_loss(module, loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``loss`` scaled by W c_r / C under DDP (see the module docstring); as it is on one process."""
    _, size = world(module)
    if size == 1:
        return loss
    local = agg_count(mask, module.loss_cfg.agg).to(torch.float64)
    total = module.trainer.strategy.reduce(local.clone(), reduce_op="sum")
    return loss * (local * size / total.clamp_min(1.0)).to(loss.dtype)
