"""``gacbench rollout-bench``: rollout throughput of the ``vllm`` and ``hf`` engines side by side, and
the share of GRPO step time spent generating.

Both engines get the same model (the tiny warm-started one, or ``--model PATH``), the same prompts and
the same sampling settings; the timed calls are interleaved (hf, vllm, hf, vllm, ...) after one
untimed warm-up call each, so that machine noise hits both alike, and medians are reported. Then a
short GRPO run per engine (``--grpo-steps``, synchronous) gives the median step time and the share of
step time spent in generation (``GRPOModule.run_stats``).
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


def _grpo_stats(model_path: str, engine: str, steps: int, prompts: int, group: int, max_tokens: int) -> dict:
    import lightning.pytorch as pl

    from gacbench.llm.grpo import GRPOModule

    module = GRPOModule(model_path, engine=engine, prompts=prompts, group=group, max_tokens=max_tokens, steps=steps,
                        eval_every=10**9)
    trainer = pl.Trainer(max_steps=steps, accelerator="auto", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module)
    stats = module.run_stats
    del module.engine
    return stats


def main(args) -> int:
    import torch

    from gacbench.llm.engines import HFEngine, VLLMEngine
    from gacbench.llm.model import load
    from gacbench.llm.task import ArithmeticTask

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [e for e in engines if e not in ("hf", "vllm")]
    if bad or not engines:
        raise SystemExit(f"--engines {args.engines!r}: each must be 'hf' or 'vllm'")
    if args.model is None:
        from gacbench.llm.warmstart import warm_started_dir

        model_path = str(warm_started_dir())
    else:
        model_path = args.model
    model, tok = load(model_path)
    if torch.cuda.is_available():  # the HF engine generates where training would run
        model.to("cuda")
    context = int(getattr(model.config, "max_position_embeddings", 0) or 0) or None
    prompts = [tok.encode(p.prompt, add_special_tokens=False) for p in ArithmeticTask().batch("train", 0, args.prompts)]
    built = {}
    for name in engines:
        built[name] = (HFEngine(model, tok.eos_token_id, tok.pad_token_id) if name == "hf"
                       else VLLMEngine(model_path, max_model_len=context))
        _time_generate(built[name], prompts, args.group, args.max_tokens, seed=10**6)  # warm-up, untimed
    runs: dict[str, list[tuple[float, int]]] = {name: [] for name in engines}
    for r in range(args.repeats):
        for name in engines:
            runs[name].append(_time_generate(built[name], prompts, args.group, args.max_tokens, seed=r))
    record: dict = {"model_path": model_path, "params": sum(p.numel() for p in model.parameters()),
                    "prompts": args.prompts, "group": args.group, "max_tokens": args.max_tokens, "repeats": args.repeats,
                    "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(), "engines": {}}
    for name, xs in runs.items():
        tps = [tok_count / sec for sec, tok_count in xs]
        record["engines"][name] = {"tokens_per_s_median": statistics.median(tps), "tokens_per_s_all": tps,
                                   "seconds_median": statistics.median(sec for sec, _ in xs),
                                   "tokens_median": statistics.median(t for _, t in xs)}
    if "hf" in runs and "vllm" in runs:
        record["vllm_over_hf"] = record["engines"]["vllm"]["tokens_per_s_median"] / record["engines"]["hf"]["tokens_per_s_median"]
    del built
    if args.grpo_steps > 0:
        for name in engines:
            record["engines"][name]["grpo"] = _grpo_stats(model_path, name, args.grpo_steps, args.grpo_prompts, args.group,
                                                          args.max_tokens)
    print(json.dumps(record, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=2))
    return 0
