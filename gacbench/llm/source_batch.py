"""The batch of a rollout source (``rollout.mode`` async or uniform): the module's batch dict built from groups of
rollouts stamped with the versions that generated them, and the engine-vs-trainer log-prob gaps of such a batch.

Both sources (:mod:`gacbench.llm.async_source`, :mod:`gacbench.llm.lag_schedule`) build their batches here, so
neither imports the other for it.
"""

from __future__ import annotations

from typing import Any

import torch

from gacbench.rollout.engines import Rollout


@torch.no_grad()
def assemble(module, step: int, problems: list, groups: list[list[Rollout]], versions: list[int]
             ) -> tuple[dict[str, Any], torch.Tensor]:
    """The module's batch dict from the groups of rollouts of ``problems`` (one group per problem, ``versions`` the
    version of each group): the keys of the synchronous ``rollout()`` (``packed``, ``logp_behav`` = the engine's
    log-probs, ``engine_logp``, ``logp_ref``, ``adv``, ``rewards``) plus ``versions`` and ``sample_lag`` per
    sequence. Also returns the lags (step - version) per sequence, and counts the tokens and the reference pass
    in the module's step timings."""
    m = module
    flat: list[Rollout] = [x for g in groups for x in g]
    stamped = torch.tensor([v for g, v in zip(groups, versions) for _ in g])
    if any(x.version != v for x, v in zip(flat, stamped.tolist())):
        raise RuntimeError(f"GRPO: a sample of step {step} is stamped with another version than its job's; the engine "
                           "loaded weights in the middle of a generation")
    data = m.batch_from_groups(problems, groups)
    m.rollouts_made = step + 1
    lag = step - stamped
    data.update({"logp_behav": data["engine_logp"], "versions": stamped.to(m.device), "sample_lag": lag.to(m.device)})
    return data, lag


def logprob_gaps(logp: torch.Tensor, data: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The engine-vs-trainer log-prob gaps of an async batch: ``is/behav_current_kl`` = E[log p_engine - log
    p_theta] over every sampled token (staleness and engine mismatch together), and ``is/engine_mismatch_kl``,
    the same over the tokens of lag-0 samples (engine mismatch alone), when the batch has any."""
    mask = data["packed"]["mask"]
    gap = (data["engine_logp"] - logp) * mask
    out = {"is/behav_current_kl": gap.sum() / mask.sum().clamp_min(1)}
    fresh = (data["sample_lag"] == 0).unsqueeze(-1) & mask
    if bool(fresh.any()):
        out["is/engine_mismatch_kl"] = (gap * fresh).sum() / fresh.sum()
    return out
