"""What A-3PO saves per GRPO step at the tiny shape (the tiny model, 32 prompts x 8 completions of up to 6
tokens, HF engine): the loss step (training forward, loss, backward) of `decoupled-ppo` and of `a3po` on the
same stale batch, and of decoupled PPO with a recomputed proximal forward (AReaL's `prox_logp_method:
recompute`: one more forward pass of the batch without gradients before the loss). The methods are timed in
turn on each repeat; medians.

    python paper/llm-tiny/a3po_cost.py [--repeats 9] [--threads 1]
"""

import argparse
import os
import statistics
import time

import lightning.pytorch as pl
import torch

import gacbench.llm.grpo as grpo
from gacbench.stabilizers.a3po import A3PO
from gacbench.stabilizers.importance import DecoupledPPO


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=9, help="timed repeats per method")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    m = grpo.GRPOModule(model={"warm_steps": 400}, engine={"name": "hf"}, staleness=1, lr=1e-9, steps=2,
                        task={"name": "arithmetic", "max_ops": 2, "max_operand": 9},
                        rollout={"prompts": 32, "group": 8, "max_tokens": 6})
    pl.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
               enable_model_summary=False, enable_checkpointing=False).fit(m)
    data = m.rollout()

    def loss_step(stabilizer, recompute: bool) -> None:
        m.loss_stabilizer = stabilizer
        if recompute:
            m.frozen_logprobs(data["packed"])  # the proximal policy's log-probs, one forward without gradients
        loss, _ = m.policy_loss(data, 8)
        loss.backward()
        m.zero_grad(set_to_none=True)

    runs = {"decoupled-ppo": (DecoupledPPO(), False), "a3po": (A3PO(), False),
            "decoupled PPO + recomputed proximal forward": (DecoupledPPO(), True)}
    seconds = {k: [] for k in runs}
    for _ in range(args.repeats + 1):  # the first round warms up and is not counted
        for name, (stab, recompute) in runs.items():
            t0 = time.perf_counter()
            loss_step(stab, recompute)
            seconds[name].append(time.perf_counter() - t0)
    B, T = data["packed"]["mask"].shape
    print(f"batch {B} x {T}, {args.threads} thread(s), {args.repeats} repeats, load average {os.getloadavg()[0]:.1f}")
    for name, s in seconds.items():
        print(f"{name}: median {statistics.median(s[1:]) * 1e3:.1f} ms per loss step "
              f"(min {min(s[1:]) * 1e3:.1f}, max {max(s[1:]) * 1e3:.1f})")


if __name__ == "__main__":
    main()
