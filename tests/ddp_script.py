"""Run by test_distributed.py: a 2-process DDP (gloo, CPU) fit with AssumptionMonitor, StalenessSimulator and GAC.
Each rank writes what it saw and decided to OUT_DIR/rank{r}.json."""

import json
import os
import sys

import lightning.pytorch as pl

sys.path.insert(0, os.path.dirname(__file__))
from conftest import UserRegressor, flat_params, make_trainer  # noqa: E402

from gacbench import GAC, AssumptionMonitor, StalenessSimulator  # noqa: E402


class Record(pl.Callback):
    def __init__(self, gac, sim):
        self.gac, self.sim, self.rows = gac, sim, []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        metrics = trainer.callback_metrics  # every rank holds the agreed values, not only rank 0
        self.rows.append({"lag": self.sim.lag, "changed": self.gac.changed, "skipped": self.gac.skipped,
                          "cos": self.gac.trace.values[-1] if self.gac.trace.values else None,
                          "metric_cos": float(metrics["align/cos"]) if "align/cos" in metrics else None,
                          "metric_lag": float(metrics["stale/lag"]),
                          "assume": {k: float(v) for k, v in metrics.items() if k.startswith("assume/")}})


if __name__ == "__main__":
    out_dir = sys.argv[1]
    sim = StalenessSimulator(3, schedule="uniform", seed=11)
    gac = GAC(c_low=0.05, c_high=0.3, high_mode="skip", warmup=0)
    rec = Record(gac, sim)
    monitor = AssumptionMonitor(every=2, loss_fn=lambda module, batch: module.loss_fn(batch))
    trainer = make_trainer([monitor, sim, gac, rec], max_steps=12, strategy="ddp", devices=2, accelerator="cpu")
    model = UserRegressor(n=128, optimizer="adamw")
    trainer.fit(model)
    with open(os.path.join(out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump({"rows": rec.rows, "params": flat_params(model).tolist(), "world": trainer.world_size}, f)
