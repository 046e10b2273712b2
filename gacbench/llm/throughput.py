"""``gacbench rollout-bench``: rollout throughput of the registered engines (``vllm`` and ``hf`` by default)
side by side, their weight-sync time, and the share of GRPO step time spent generating.

Every engine gets the same model (the tiny warm-started one, or ``--model PATH``), the same prompts and
the same sampling settings; the timed calls are interleaved (hf, vllm, hf, vllm, ...) after one untimed
warm-up call each, so that machine noise hits all alike, and medians are reported. Each repeat also
times one weight sync per engine (``load_weights`` of the policy's state dict). Then a short synchronous
GRPO run per engine (``--grpo-steps``) gives the median step time and the share of step time spent in
generation (``GRPOModule.run_stats``); it runs on the engine already built here (the per-process engine
cache), so no engine starts twice.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path


def _time_generate(engine, prompts: list[list[int]], n: int, max_tokens: int, seed: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    groups = engine.generate(prompts, n=n, max_tokens=max_tokens, seed=seed)
    seconds = time.perf_counter() - t0
    return seconds, sum(len(r.completion_ids) for g in groups for r in g)


def _time_sync(engine, state_dict: dict) -> float:
    import torch

    cuda = any(v.is_cuda for v in state_dict.values())
    t0 = time.perf_counter()
    engine.load_weights(state_dict, version=0)
    if cuda:  # the copies are asynchronous on a GPU: they finish inside the clock
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _grpo_stats(model_path: str, engine: str, steps: int, prompts: int, group: int, max_tokens: int) -> dict:
    import lightning.pytorch as pl

    from gacbench.llm.grpo import GRPOModule

    module = GRPOModule(model={"path": model_path}, engine={"name": engine},
                        rollout={"prompts": prompts, "group": group, "max_tokens": max_tokens}, lr=3e-4, steps=steps,
                        eval_every=10**9)
    trainer = pl.Trainer(max_steps=steps, accelerator="auto", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module)
    return module.run_stats


def main(args) -> int:
    import torch

    from gacbench.llm.model import check_checkpoint_option, load
    from gacbench.llm.task import ArithmeticTask
    from gacbench.rollout.engines import EngineSpec, acquire_engine, engine_names, release_engines
    from gacbench.usage import UsageError

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [e for e in engines if e not in engine_names()]
    if bad or not engines:
        raise UsageError(f"--engines {args.engines!r}: each must be a registered engine ({', '.join(engine_names())})")
    if args.grpo_steps < 0:
        raise UsageError(f"--grpo-steps {args.grpo_steps} must be >= 0 (0 skips the GRPO runs)")
    if args.model is None:
        from gacbench.llm.warmstart import warm_started_dir

        model_path = str(warm_started_dir())
    else:
        check_checkpoint_option("--model", args.model)
        model_path = args.model
    model, tok = load(model_path)
    if torch.cuda.is_available():  # the HF engine generates where training would run
        model.to("cuda")
    context = int(getattr(model.config, "max_position_embeddings", 0) or 0) or None
    prompts = [tok.encode(p.prompt, add_special_tokens=False) for p in ArithmeticTask().batch("train", 0, args.prompts)]
    state = model.state_dict()
    built = {}
    for name in engines:
        built[name] = acquire_engine(EngineSpec(name), model_path=model_path, policy=model,
                                     eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                     max_model_len=context, seed=0)
        _time_sync(built[name], state)
        _time_generate(built[name], prompts, args.group, args.max_tokens, seed=10**6)  # warm-up, untimed
    runs: dict[str, list[tuple[float, int]]] = {name: [] for name in engines}
    syncs: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(args.repeats):
        for name in engines:
            runs[name].append(_time_generate(built[name], prompts, args.group, args.max_tokens, seed=r))
            syncs[name].append(_time_sync(built[name], state))
    record: dict = {"model_path": model_path, "params": sum(p.numel() for p in model.parameters()),
                    "prompts": args.prompts, "group": args.group, "max_tokens": args.max_tokens,
                    "repeats": args.repeats, "threads": torch.get_num_threads(),
                    "machine": platform.processor() or platform.machine(), "engines": {}}
    for name, xs in runs.items():
        tps = [tok_count / sec for sec, tok_count in xs]
        record["engines"][name] = {"tokens_per_s_median": statistics.median(tps), "tokens_per_s_all": tps,
                                   "seconds_median": statistics.median(sec for sec, _ in xs),
                                   "tokens_median": statistics.median(t for _, t in xs),
                                   "weight_sync_s_median": statistics.median(syncs[name]),
                                   "weight_sync": getattr(built[name], "sync_method", None)}
    if "hf" in runs and "vllm" in runs:
        tps = {name: record["engines"][name]["tokens_per_s_median"] for name in ("vllm", "hf")}
        record["vllm_over_hf"] = tps["vllm"] / tps["hf"]
    del built
    if args.grpo_steps > 0:
        for name in engines:
            record["engines"][name]["grpo"] = _grpo_stats(model_path, name, args.grpo_steps, args.grpo_prompts,
                                                          args.group, args.max_tokens)
    release_engines()
    print(json.dumps(record, indent=2))
    if args.json:
        from gacbench.jsonio import write_json
        from gacbench.provenance import with_provenance

        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        write_json(Path(args.json), with_provenance(record))
    return 0
