"""Run by test_grpo_ddp.py: two optimizer steps of GRPO under Lightning DDP (2 processes, gloo, CPU), hf engine,
GAC attached. Each rank writes to OUT_DIR/rank{r}.pt what it generated (its rollouts and rewards), the loss its
training_step returned, the step's logged scalars, the gradients after DDP's all-reduce (before GAC), GAC's c_t and
the final parameters.

    python grpo_ddp_script.py OUT_DIR MODEL_DIR AGG [METHOD]

METHOD ``mis``: the loss is MIS's (sequence level, threshold 2), and rank 0 lowers the engine log-prob of the
first completion token of every other rollout by 1 (rho = e^1 > 2): those sequences are rejected on rank 0
only, so the ranks keep different numbers of tokens and sequences. ``gspo``: GSPO's loss, which aggregates
seq-mean-token-mean whatever the module's aggregation.
"""

import os
import sys

import lightning.pytorch as pl
import torch

sys.path.insert(0, os.path.dirname(__file__))
from conftest import TINY_TASK, make_trainer  # noqa: E402

from gacbench import GAC  # noqa: E402
from gacbench.llm.grpo import GRPOModule  # noqa: E402
from gacbench.stabilizers import GSPO, MIS  # noqa: E402

STEPS = 2


def settings(model_dir: str, agg: str) -> dict:
    return {"model": {"path": model_dir}, "engine": {"name": "hf"}, "task": dict(TINY_TASK),
            "rollout": {"prompts": 8, "group": 4, "max_tokens": 4}, "loss": {"agg": agg}, "lr": 3e-3,
            "steps": STEPS, "seed": 1, "eval_every": 10**6}


class Record(pl.Callback):
    """Listed before GAC: sees the all-reduced gradients as GAC receives them."""

    def __init__(self, reject: bool = False) -> None:
        self.rollouts, self.rewards, self.grads, self.losses, self.logged = [], [], [], [], []
        self.reject = reject

    def on_train_start(self, trainer, pl_module) -> None:
        pack, rollout = pl_module._pack, pl_module.rollout

        def spy_pack(rollouts):
            if self.reject and trainer.global_rank == 0:
                for r in rollouts[::2]:  # in place: the module reads the engine log-probs from these lists
                    r.logprobs[0] -= 1.0
            self.rollouts.append([(r.prompt_ids, r.completion_ids, r.logprobs) for r in rollouts])
            return pack(rollouts)

        def spy_rollout():
            data = rollout()
            self.rewards.append(data["rewards"].clone())
            return data

        pl_module._pack, pl_module.rollout = spy_pack, spy_rollout

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.grads.append([p.grad.detach().clone() for p in pl_module.policy.parameters()])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))
        self.logged.append({k: float(v) for k, v in trainer.callback_metrics.items()})


if __name__ == "__main__":
    out_dir, model_dir, agg = sys.argv[1:4]
    method = sys.argv[4] if len(sys.argv) > 4 else "none"
    rec, gac = Record(reject=method == "mis"), GAC(c_low=0.05, c_high=0.3, warmup=0)
    callbacks = [rec, gac] + {"mis": [MIS()], "gspo": [GSPO()]}.get(method, [])
    trainer = make_trainer(callbacks, max_steps=STEPS, strategy="ddp", devices=2, accelerator="cpu",
                           use_distributed_sampler=False)
    module = GRPOModule(**settings(model_dir, agg))
    trainer.fit(module)
    torch.save({"world": trainer.world_size, "rollouts": rec.rollouts, "rewards": rec.rewards, "grads": rec.grads,
                "losses": rec.losses, "logged": rec.logged, "cos": list(gac.trace.values),
                "params": [p.detach().clone() for p in module.policy.parameters()]},
               os.path.join(out_dir, f"rank{trainer.global_rank}.pt"))
