"""``gacbench demo``: the embedded default job.

Three runs of the same noisy quadratic (SGD, seeded): synchronous (s = 0), stale (delayed
gradients, s = --staleness) and stale + GAC, each with the alignment monitor. Prints the
final optimality gap and the c_t statistics of paper Table 3 side by side.
"""

from __future__ import annotations

import json
import math
import time

import lightning.pytorch as pl
from rich.console import Console
from rich.table import Table

from gacbench.callbacks import GAC, AlignmentMonitor, StalenessSimulator
from gacbench.loggers import MemoryLogger
from gacbench.objectives import NoisyQuadratic


def run_method(method: str, staleness: int, steps: int, seed: int) -> dict:
    pl.seed_everything(seed, verbose=False)
    model = NoisyQuadratic(dim=100, L=1.0, kappa=10.0, sigma2=10.0, steps=steps, lr=0.1, seed=seed)
    callbacks: list[pl.Callback] = []
    if method != "sync":
        callbacks.append(StalenessSimulator(staleness))
    callbacks.append(AlignmentMonitor(warmup=min(50, steps // 5)))
    if method == "gac":
        callbacks.append(GAC(warmup=min(50, steps // 5)))
    start_gap = float(model.gap().detach())
    logger = MemoryLogger()
    trainer = pl.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, logger=logger, callbacks=callbacks, log_every_n_steps=1,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )
    t0 = time.perf_counter()
    trainer.fit(model)
    source = next(cb for cb in callbacks if isinstance(cb, (GAC, AlignmentMonitor)) and getattr(cb, "summary", None))
    gap = float(model.gap().detach())
    return {
        "method": method,
        "staleness": 0 if method == "sync" else staleness,
        "start_gap": start_gap,
        "final_gap": gap,
        "diverged": not math.isfinite(gap) or gap > 1e6,
        "cos": source.summary,
        "proj_frac": logger.last("align/proj_frac", 0.0),
        "seconds": time.perf_counter() - t0,
    }


def main(args) -> int:
    import logging
    import warnings

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # keep the table readable
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")  # a Lightning deprecation, not ours
    from gacbench.objectives.base import SEED_MAX
    from gacbench.usage import UsageError, check_output_file

    if args.staleness < 1:
        raise UsageError(f"--staleness {args.staleness} must be >= 1 (the stale runs need a delay)")
    if args.staleness >= args.steps:
        raise UsageError(f"--staleness {args.staleness} is not below --steps {args.steps}: the lag at step t is at "
                         f"most t, so it would never reach {args.staleness}; use a smaller --staleness or more --steps")
    if not 0 <= args.seed <= SEED_MAX:
        raise UsageError(f"--seed {args.seed} must be in 0..{SEED_MAX}")
    if args.json:
        check_output_file("--json", args.json)  # before the runs, so that they are not lost
    results = [run_method(m, args.staleness, args.steps, args.seed) for m in ("sync", "stale", "gac")]
    table = Table(title=f"Noisy quadratic (d=100, kappa=10, sigma^2=10, SGD lr=0.1), {args.steps} steps, "
                        f"seed {args.seed}; f(theta_0)-f* = {results[0]['start_gap']:.3g}")

    for col in ("method", "s", "f(theta)-f*", "median c_t", "q0.9|c_t|", "Pr(|c_t|<=0.05)", "GAC changed", "time"):
        table.add_column(col, justify="right")
    for r in results:
        c = r["cos"]
        table.add_row(r["method"], str(r["staleness"]), f"{r['final_gap']:.3g}", f"{c['median']:.3f}",
                      f"{c['q90_abs']:.3f}", f"{c['frac_le_tol']:.2f}",
                      f"{r['proj_frac']:.2f}" if r["method"] == "gac" else "-", f"{r['seconds']:.1f}s")
    Console(width=120).print(table)
    if args.json:
        from gacbench.jsonio import json_safe

        with open(args.json, "w") as f:
            json.dump(json_safe(results), f, indent=2, allow_nan=False)  # a diverged run's gap is null, not NaN
        print(f"wrote {args.json}")
    return 0
