"""Run by test_grpo_ddp.py: stale GRPO (s = 2) under Lightning DDP (2 processes, gloo, CPU), hf engine. A run of 6
steps checkpoints at step 3; a second run resumes from that checkpoint to step 6. Each rank writes both runs'
losses and final parameters to OUT_DIR/resume{r}.pt.

    python grpo_ddp_resume_script.py OUT_DIR MODEL_DIR
"""

import os
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, os.path.dirname(__file__))
from conftest import make_trainer  # noqa: E402
from grpo_ddp_script import settings  # noqa: E402

from gacbench.llm.grpo import GRPOModule  # noqa: E402

STEPS, AT = 6, 3


class Losses(pl.Callback):
    def __init__(self) -> None:
        self.values: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.values[trainer.global_step] = float(outputs["loss"])


def fit(model_dir: str, callbacks: list, ckpt_path: str | None = None) -> tuple[GRPOModule, pl.Trainer]:
    trainer = make_trainer(callbacks, max_steps=STEPS, strategy="ddp", devices=2, accelerator="cpu",
                           use_distributed_sampler=False, enable_checkpointing=ckpt_path is None)
    module = GRPOModule(**{**settings(model_dir, "token-mean"), "staleness": 2, "steps": STEPS})
    trainer.fit(module, ckpt_path=ckpt_path)
    return module, trainer


if __name__ == "__main__":
    out_dir, model_dir = sys.argv[1:3]
    full_losses, resumed_losses = Losses(), Losses()
    ckpt = ModelCheckpoint(dirpath=out_dir, every_n_train_steps=AT, save_top_k=-1)
    full, trainer = fit(model_dir, [ckpt, full_losses])
    resumed, _ = fit(model_dir, [resumed_losses], ckpt_path=os.path.join(out_dir, f"epoch=0-step={AT}.ckpt"))
    torch.save({"full": [p.detach().clone() for p in full.policy.parameters()],
                "resumed": [p.detach().clone() for p in resumed.policy.parameters()],
                "full_losses": full_losses.values, "resumed_losses": resumed_losses.values},
               os.path.join(out_dir, f"resume{trainer.global_rank}.pt"))
