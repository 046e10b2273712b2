"""What VCPO's off-policy optimal baseline costs per GRPO step on the headline shape (the small model, 32
prompts x 8 completions of up to 6 tokens, HF engine): the per-sequence gradient norm taken alone from a
forward and backward pass of one sequence (PolicyBatch.row_logp) against the same norm taken by a backward
pass through the whole batch's graph, timed side by side on the same rows (median of 3), and the one backward
pass of the batch that every method pays.

    python paper/llm-headline/vcpo_norms.py [--rows 16] [--threads 1]
"""

import argparse
import statistics
import time

import lightning.pytorch as pl
import torch

import gacbench.llm.grpo as grpo
from gacbench.stabilizers.vcpo import per_sequence_grad_sq_norms, recomputed_grad_sq_norms, rows_needing_norms


def median_time(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16, help="sequences timed per method (scaled to the batch)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    m = grpo.GRPOModule(model={"size": "small", "warm_steps": 400}, engine={"name": "hf"}, staleness=1, lr=1e-3,
                        steps=2, task={"name": "arithmetic", "max_ops": 2, "max_operand": 9},
                        rollout={"prompts": 32, "group": 8, "max_tokens": 6})
    pl.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
               enable_model_summary=False, enable_checkpointing=False).fit(m)
    data = m.rollout()
    seen = []
    grpo.policy_loss = lambda stab, pb: (seen.append(pb), (pb.logp.sum(), {}))[1]  # capture the PolicyBatch
    m.policy_loss(data)
    pb = seen[0]
    params = [p for p in m.parameters() if p.requires_grad]
    B = pb.logp.shape[0]
    live = rows_needing_norms(pb.adv[:, 0].detach(), pb.group)
    rows = torch.linspace(0, B - 1, args.rows).long()
    batch = median_time(lambda: torch.autograd.grad(pb.logp.sum(), params, retain_graph=True))
    through = median_time(lambda: per_sequence_grad_sq_norms(pb.logp.sum(-1), params, rows)) / rows.numel()
    alone = median_time(lambda: recomputed_grad_sq_norms(pb.row_logp, pb.mask, params, rows)) / rows.numel()
    print(f"batch: {B} sequences; {live.numel()} in groups with a non-zero advantage (their norms are taken)")
    print(f"one backward pass of the batch: {batch * 1e3:.0f} ms")
    print(f"one sequence's gradient norm: {alone * 1e3:.1f} ms alone (row_logp), {through * 1e3:.0f} ms through the "
          f"batch graph: {through / alone:.1f}x")
    print(f"the baseline's norms per step: {alone * live.numel():.1f} s alone, {through * live.numel():.0f} s through "
          f"the batch graph")


if __name__ == "__main__":
    main()
