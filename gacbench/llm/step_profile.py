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
The phases run on the device the one trained step ran on (the GPU where there is one).

``--shape qwen3-1.7b``: a model of Qwen3-1.7B's architecture (hidden 2048, 28 layers, 151,936-token vocabulary,
1.72B parameters) built from its config with random weights (nothing is downloaded; built once and cached,
``gacbench.llm.model.cached_model_dir``), for timing at a real shape on a GPU, e.g. ``--prompts 8 --group 8
--max-tokens 512 --precision bf16-mixed --gradient-checkpointing --logit-rows 8`` (without the last two the whole
batch's logits and activations do not fit one GPU: docs/llm.md, "Memory of the training forward"); ``--shape
tiny-random`` is the built-in tiny architecture with random weights and a 4,096-token vocabulary (the same code path
at a size a CPU runs in seconds; on the CPU a shape is refused before it is built where its parameters, at 20 bytes
each, exceed the available memory). Random weights rarely emit the end-of-sequence token, so every sample runs to
``--max-tokens``. The record then also gives the training device's peak memory, the tokens per second of generation
and of the whole step, and the forward and backward against the FLOP floor (2 N and 4 N FLOPs per token of the
batch, N the parameters, at ``--peak-tflops``; the attention's own FLOPs are left out, so the floor is a lower
bound).
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

PHASES = ("weight_sync", "generate", "pack", "behaviour", "forward", "backward", "optimizer")


#: ``--shape``: Qwen3Config arguments of a model with random weights (gacbench.llm.model.tiny_config's names)
SHAPES = {
    "qwen3-1.7b": {"hidden": 2048, "layers": 28, "heads": 16, "kv_heads": 8, "intermediate": 6144, "vocab": 151936},
    "tiny-random": {"hidden": 128, "layers": 4, "heads": 4, "kv_heads": 2, "intermediate": 384, "vocab": 4096},
}


#: Bytes a float32 parameter costs a step on the CPU before any activation: the trainer's weight, its gradient,
#: AdamW's two moments and the rollout engine's own copy
CPU_BYTES_PER_PARAMETER = 20


def check_shape_fits(shape: str) -> None:
    """A usage error before anything is built when ``shape``'s parameters, at :data:`CPU_BYTES_PER_PARAMETER`
    bytes each, exceed this machine's available memory (profiled on the CPU: the GPU's memory is what a CUDA run
    reports as its peak)."""
    from gacbench.llm.model import Qwen3Shape
    from gacbench.provenance import available_memory
    from gacbench.usage import UsageError

    numel = Qwen3Shape.of_config(**SHAPES[shape]).numel()
    free, total = available_memory()
    need = CPU_BYTES_PER_PARAMETER * numel
    if free is not None and need > free:
        raise UsageError(f"--shape {shape}: {numel / 1e9:.2f}B parameters need about {need / 1e9:.0f} GB on the CPU "
                         f"(float32 weights, gradients, AdamW's moments and the engine's copy) before activations, "
                         f"and this machine has {free / 1e9:.0f} GB available of {total / 1e9:.0f} GB; profile it "
                         "on a GPU, or use --shape tiny-random")


def shape_model_dir(shape: str, max_len: int) -> str:
    """The cached checkpoint directory of a random-weight model of ``shape`` (:data:`SHAPES`) whose context
    holds ``max_len`` tokens; the tiny tokenizer (digits and operators) is saved with it."""
    from gacbench.llm.model import cached_model_dir, tiny_config

    return str(cached_model_dir(tiny_config(max_len=max_len, **SHAPES[shape])))  # head_dim = hidden / heads


def flop_floor(n_params: int, tokens: float, peak_tflops: float) -> dict:
    """Seconds the forward (2 N FLOPs per token) and the backward (4 N) cannot go below at ``peak_tflops``."""
    return {"forward_s": 2.0 * n_params * tokens / (peak_tflops * 1e12),
            "backward_s": 4.0 * n_params * tokens / (peak_tflops * 1e12)}


def build_module(args):
    """The GRPO module of the profiled shape, after one trained step (engine built, weights synced)."""
    from gacbench.llm.grpo import GRPOModule
    from gacbench.trainer import build_trainer

    settings = {"model": {"path": args.model, "gradient_checkpointing": args.gradient_checkpointing,
                          "logit_rows": args.logit_rows},
                "engine": {"name": args.engine, **({"compile": True} if args.compile else {})},
                "rollout": {"prompts": args.prompts, "group": args.group, "max_tokens": args.max_tokens,
                            **({"logprob_rows": args.logprob_rows} if args.logprob_rows is not None else {})},
                "staleness": 1, "steps": 1, "lr": args.lr, "seed": args.seed, "eval_every": 10**9}
    if args.task != "arithmetic":
        settings["task"] = {"name": args.task}
    try:
        module = GRPOModule(**settings)
    except (ValueError, FileNotFoundError) as exc:  # a setting the module refuses, a missing checkpoint
        from gacbench.usage import UsageError

        raise UsageError(str(exc)) from exc
    build_trainer(1, [], logger=False, enable_progress_bar=False).fit(module)
    return module


def time_phases(module, repeats: int, precision: str = "32") -> dict:
    """Each phase's seconds per repeat (lists), the generated tokens and the batch's tokens per repeat, on the
    device the module's parameters are on; ``precision="bf16-mixed"`` runs generation, the behaviour
    log-probs and the forward under bfloat16 autocast (Lightning's bf16-mixed: float32 weights and optimizer). An
    untimed first round comes before the ``repeats`` timed ones (it allocates AdamW's moments and fills caches)."""
    import contextlib

    import torch

    device = next(module.parameters()).device
    optimizer = module.configure_optimizers()
    seconds: dict[str, list[float]] = {k: [] for k in PHASES}
    tokens, batch_tokens = [], []
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def autocast():
        if precision == "bf16-mixed":
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def clock(key, fn, *a):
        sync()
        t0 = time.perf_counter()
        with autocast() if key in ("pack", "forward") else contextlib.nullcontext():
            out = fn(*a)
        sync()
        seconds[key].append(time.perf_counter() - t0)
        return out

    for i in range(repeats + 1):
        if i == 1:  # the first round warms up (the optimizer's moments are allocated, caches filled): not counted
            for values in (*seconds.values(), tokens, batch_tokens):
                values.clear()
        clock("weight_sync", module.sync_engine, module.global_step)
        module.start_step_counters()
        data = clock("pack", module.rollout)
        seconds["generate"].append(module._times["time/generate_s"])
        seconds["behaviour"].append(module._times["time/behav_s"])
        seconds["pack"][-1] -= seconds["generate"][-1] + seconds["behaviour"][-1]
        tokens.append(int(data["packed"]["mask"].sum()))
        batch_tokens.append(int(data["packed"]["attention"].sum()))
        loss, _ = clock("forward", module.policy_loss, data)
        clock("backward", loss.backward)
        clock("optimizer", optimizer.step)
        optimizer.zero_grad(set_to_none=True)
    return {"seconds": seconds, "tokens": tokens, "batch_tokens": batch_tokens}


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
        "gradient_checkpointing": module.model_cfg.gradient_checkpointing, "logit_rows": module.model_cfg.logit_rows,
        "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "load_avg_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def add_speeds(record: dict, timed: dict, device, peak_tflops: float) -> dict:
    """Peak memory of the training device (CUDA), tokens per second, and forward / backward against the FLOP
    floor of :func:`flop_floor` (``fwd_bwd_over_floor``: measured / floor)."""
    import torch

    med = record["phases_s"]
    batch = statistics.median(timed["batch_tokens"])
    floor = flop_floor(record["params"], batch, peak_tflops)
    record.update({
        "device": str(device), "batch_tokens_median": batch,
        "generate_tokens_per_s": record["tokens_median"] / med["generate"] if med["generate"] > 0 else None,
        "step_tokens_per_s": batch / record["stale_step_s"] if record["stale_step_s"] > 0 else None,
        "peak_tflops": peak_tflops, "flop_floor_s": floor,
        "forward_over_floor": med["forward"] / floor["forward_s"] if floor["forward_s"] > 0 else None,
        "backward_over_floor": med["backward"] / floor["backward_s"] if floor["backward_s"] > 0 else None,
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    })
    return record


def profile(args) -> dict:
    """The command's work without its output: checks ``args`` (the command's options; a :class:`UsageError`
    names a bad one), builds the module, times its phases; returns the record."""
    import torch

    from gacbench.llm.async_bench import resolve_engine_and_model
    from gacbench.usage import UsageError

    if args.repeats < 1:
        raise UsageError(f"--repeats {args.repeats} must be >= 1")
    if args.logit_rows is not None and args.logit_rows < 1:
        raise UsageError(f"--logit-rows {args.logit_rows} must be >= 1")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads {args.threads} must be >= 1")
    if not (math.isfinite(args.peak_tflops) and args.peak_tflops > 0):
        raise UsageError(f"--peak-tflops {args.peak_tflops} must be a positive number")
    if args.precision == "bf16-mixed" and not torch.cuda.is_available():
        raise UsageError("--precision bf16-mixed is for a CUDA device; on the CPU use --precision 32")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.shape is not None:
        if args.model is not None:
            raise UsageError("--shape builds its own random-weight model: give --shape or --model, not both")
        if args.task != "arithmetic":
            raise UsageError("--shape uses the tiny tokenizer (digits and operators): only --task arithmetic")
        if not torch.cuda.is_available():
            check_shape_fits(args.shape)
        args.model = shape_model_dir(args.shape, max_len=64 + args.max_tokens)
    resolve_engine_and_model(args)
    if args.compile and args.engine != "vllm":
        raise UsageError(f"--compile: engine.compile=true is for the vllm engine in float32 (this run: --engine "
                         f"{args.engine}); use --engine vllm or leave out --compile")
    module = build_module(args)
    # Lightning's fit ends with the module on the CPU: train where the run trained (the engine stays there)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    module.to(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if args.threads and torch.get_num_threads() != args.threads:  # vLLM's CPU worker replaces set_num_threads
        print(f"step-profile: asked for {args.threads} torch thread(s), running with {torch.get_num_threads()} (a "
              "vLLM engine built earlier in this process fixed the count); the record gives the count used",
              file=sys.stderr)
    timed = time_phases(module, args.repeats, args.precision)
    record = summarise(timed, module, args)
    record["shape"], record["precision"] = args.shape, args.precision
    return add_speeds(record, timed, device, args.peak_tflops)


def main(args) -> int:
    from gacbench.jsonio import write_json

    record = profile(args)
    brief = {k: v for k, v in record.items() if k != "all_s"}
    print(json.dumps(brief, indent=2))
    print("step-profile: " + ", ".join(f"{k} {v:.3f} s" for k, v in record["phases_s"].items())
          + f"; stale step {record['stale_step_s']:.2f} s, sync step {record['sync_step_s']:.2f} s; forward "
          f"{record['forward_over_floor']:.1f}x and backward {record['backward_over_floor']:.1f}x their FLOP floor "
          f"at {args.peak_tflops:g} TFLOP/s", file=sys.stderr)
    if args.json:
        from gacbench.provenance import with_provenance

        write_json(Path(args.json), with_provenance(record))
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
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="model.gradient_checkpointing: recompute each decoder layer in the backward pass (the "
                        "backward then holds one more forward)")
    p.add_argument("--logit-rows", type=int, default=None,
                   help="model.logit_rows: the output layer and log-softmax on this many sequences at a time, "
                        "recomputed in the backward pass (default: the whole batch's logits at once)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats; medians reported (default 5)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's; 1 is what each of 2 bench workers gets on 2 cores)")
    p.add_argument("--compile", action="store_true",
                   help="the vllm engine's compiled forward (engine.compile: true; CPU backend, float32)")
    p.add_argument("--lr", type=float, default=1e-9,
                   help="AdamW's learning rate (default 1e-9: the repeats stay at almost the same weights)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="a random-weight model of this architecture instead of --model/--size (nothing downloaded): "
                        "qwen3-1.7b (1.72B parameters; for a GPU), tiny-random (the same path at a CPU's size)")
    p.add_argument("--precision", choices=["32", "bf16-mixed"], default="32",
                   help="32 (default) or bf16-mixed: bfloat16 autocast around generation and the forward (CUDA)")
    p.add_argument("--peak-tflops", type=float, default=790.0,
                   help="the device's dense bf16 peak for the FLOP floor (default 790: an H200; set your GPU's)")
    p.add_argument("--json", default=None, help="also write the record (with every repeat's seconds) to this file")
