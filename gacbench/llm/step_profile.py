"""``gacbench step-profile``: where the time of one GRPO step goes, phase by phase, at one model and task shape.

A GRPO module of the given shape (the built-in model of ``--size`` warm-started on ``--task``, or ``--model``)
trains one step, which builds its engine; then the phases of a stale step (s > 0) are timed ``--repeats`` times,
in the order the trainer runs them, on the batch each repeat generates:

- ``weight_sync``: the policy's weights into the rollout engine (``GRPOModule.sync_engine``);
- ``generate``: one rollout batch of ``--prompts`` x ``--group`` samples (``engine.generate``);
- ``pack``: the rest of ``GRPOModule.rollout``: decoding, rewards, packing, advantages;
- ``behaviour``: the trainer's log-probs of the batch at generation time, without gradients, ``rollout.logprob_rows``
  sequences per pass (only stale steps need it: a synchronous step's behaviour log-probs are its forward's);
- ``forward``: the loss at the current parameters (``GRPOModule.policy_loss``: the training forward over the
  whole batch, the loss and its diagnostics);
- ``backward``: ``loss.backward()``;
- ``optimizer``: the module's own optimizer step (``configure_optimizers``: fused AdamW).

``stale_step_s`` is their sum, ``sync_step_s`` the same without ``behaviour``; each phase's ``share`` is of the
stale step. Medians over the repeats; the evaluations and Lightning's own loop are not timed (``gacbench bench
--verbose`` splits a whole cell's wall time). Run it with nothing else on the machine: the figures are seconds.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

PHASES = ("weight_sync", "generate", "pack", "behaviour", "forward", "backward", "optimizer")


def build_module(args):
    """The GRPO module of the profiled shape, after one trained step (engine built, weights synced)."""
    from gacbench.llm.grpo import GRPOModule
    from gacbench.trainer import build_trainer

    settings = {"model": {"path": args.model}, "engine": {"name": args.engine},
                "rollout": {"prompts": args.prompts, "group": args.group, "max_tokens": args.max_tokens,
                            **({"logprob_rows": args.logprob_rows} if args.logprob_rows else {})},
                "staleness": 1, "steps": 1, "lr": args.lr, "seed": args.seed, "eval_every": 10**9}
    if args.task != "arithmetic":
        settings["task"] = {"name": args.task}
    module = GRPOModule(**settings)
    build_trainer(1, [], logger=False, enable_progress_bar=False).fit(module)
    return module


def time_phases(module, repeats: int) -> dict:
    """Each phase's seconds per repeat (lists) and the generated tokens per repeat."""
    optimizer = module.configure_optimizers()
    seconds: dict[str, list[float]] = {k: [] for k in PHASES}
    tokens = []

    def clock(key, fn, *a):
        t0 = time.perf_counter()
        out = fn(*a)
        seconds[key].append(time.perf_counter() - t0)
        return out

    for _ in range(repeats):
        clock("weight_sync", module.sync_engine, module.global_step)
        module.start_step_counters()
        data = clock("pack", module.rollout)
        seconds["generate"].append(module._times["time/generate_s"])
        seconds["behaviour"].append(module._times["time/behav_s"])
        seconds["pack"][-1] -= seconds["generate"][-1] + seconds["behaviour"][-1]
        tokens.append(int(data["packed"]["mask"].sum()))
        loss, _ = clock("forward", module.policy_loss, data)
        clock("backward", loss.backward)
        clock("optimizer", optimizer.step)
        optimizer.zero_grad(set_to_none=True)
    return {"seconds": seconds, "tokens": tokens}


def summarise(timed: dict, module, args) -> dict:
    """The record: medians per phase, the two step totals and the shares."""
    import torch

    med = {k: statistics.median(v) for k, v in timed["seconds"].items()}
    stale = sum(med.values())
    return {
        "phases_s": med, "share": {k: v / stale for k, v in med.items()},
        "stale_step_s": stale, "sync_step_s": stale - med["behaviour"],
        "all_s": timed["seconds"],
        "tokens_median": statistics.median(timed["tokens"]),
        "tokens_per_response": statistics.median(timed["tokens"]) / (args.prompts * args.group),
        "params": module.n_params, "model_path": args.model, "engine": args.engine, "task": args.task,
        "prompts": args.prompts, "group": args.group, "max_tokens": args.max_tokens, "repeats": args.repeats,
        "logprob_rows": module.rollout_cfg.logprob_rows,
        "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "load_avg_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def main(args) -> int:
    import torch

    from gacbench.llm.async_bench import resolve_engine_and_model
    from gacbench.usage import UsageError

    if args.repeats < 1:
        raise UsageError(f"--repeats {args.repeats} must be >= 1")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads {args.threads} must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    resolve_engine_and_model(args)
    module = build_module(args)
    if args.threads and torch.get_num_threads() != args.threads:  # vLLM's CPU worker replaces set_num_threads
        print(f"step-profile: asked for {args.threads} torch thread(s), running with {torch.get_num_threads()} (a "
              "vLLM engine built earlier in this process fixed the count); the record gives the count used",
              file=sys.stderr)
    record = summarise(time_phases(module, args.repeats), module, args)
    from gacbench.jsonio import write_json

    brief = {k: v for k, v in record.items() if k != "all_s"}
    print(json.dumps(brief, indent=2))
    print("step-profile: " + ", ".join(f"{k} {v:.3f} s" for k, v in record["phases_s"].items())
          + f"; stale step {record['stale_step_s']:.2f} s, sync step {record['sync_step_s']:.2f} s", file=sys.stderr)
    if args.json:
        write_json(Path(args.json), record)
    return 0


def add_arguments(p) -> None:
    """The ``step-profile`` options (gacbench.cli builds the subparser)."""
    from gacbench.llm.async_bench import add_model_arguments

    add_model_arguments(p)
    p.add_argument("--prompts", type=int, default=32, help="prompts per step (default 32, as the LLM suites)")
    p.add_argument("--group", type=int, default=8, help="samples per prompt (default 8)")
    p.add_argument("--max-tokens", type=int, default=6,
                   help="new tokens per sample (default 6; 48 for --task scratchpad)")
    p.add_argument("--logprob-rows", type=int, default=None,
                   help="rollout.logprob_rows: sequences per pass of the behaviour log-probs (default: GRPO's, 64)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats; medians reported (default 5)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's; 1 is what each of 2 bench workers gets on 2 cores)")
    p.add_argument("--lr", type=float, default=1e-9,
                   help="AdamW's learning rate (default 1e-9: the repeats stay at almost the same weights)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the record (with every repeat's seconds) to this file")
