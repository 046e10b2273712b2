"""The vllm engine's generate call through vLLM's engine core against the same call through vLLM's front end.

``VLLMEngine.generate`` adds one request per sample to vLLM's engine core and reads the sampled tokens and
log-probs from its outputs; :func:`gacbench.rollout.engines.front_end_generate` makes the same rollouts through
``LLM.generate`` (vLLM's front end: its input handling, fan-out of n samples and output objects). Both run on one
engine of the tiny warm-started model at GRPO's shape (8 prompts x 8 samples, 6 new tokens, the arithmetic task's
training prompts, a new batch and seed each pair), in pairs whose order alternates; every pair's rollouts are
checked equal, bit for bit. The figures: each route's median call and the paired ratio (engine core over front
end), median and quartiles over the pairs. Nothing else should run on the machine meanwhile.

    python paper/vllm_generate.py --pairs 60 --threads 2 --json paper/profile/vllm-generate.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=60, help="timed pairs of calls (after 5 untimed)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=6)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", help="also write the record here")
    args = p.parse_args(argv)

    import torch

    from gacbench.llm.task import ArithmeticTask
    from gacbench.llm.warmstart import warm_started_dir
    from gacbench.rollout.engines import VLLMEngine, front_end_generate

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = warm_started_dir()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    task = ArithmeticTask(max_ops=2, max_operand=9, seed=0)
    engine = VLLMEngine(str(model_dir), seed=0)  # the context of the model, as GRPO starts it
    routes = {"engine_core": engine.generate, "front_end": lambda *a: front_end_generate(engine, *a)}
    seconds: dict[str, list[float]] = {k: [] for k in routes}
    try:
        for k in range(5 + args.pairs):
            prompts = [tok.encode(r.prompt, add_special_tokens=False)
                       for r in task.batch("train", k * args.prompts, args.prompts)]
            order = list(routes) if k % 2 == 0 else list(routes)[::-1]
            out = {}
            for name in order:
                t0 = time.perf_counter()
                out[name] = routes[name](prompts, args.group, args.max_tokens, k)
                if k >= 5:
                    seconds[name].append(time.perf_counter() - t0)
            flat = {n: [(r.completion_ids, r.logprobs) for g in o for r in g] for n, o in out.items()}
            if flat["engine_core"] != flat["front_end"]:
                raise SystemExit(f"pair {k}: the two routes' rollouts differ")
    finally:
        engine.close()
    ratios = [a / b for a, b in zip(seconds["engine_core"], seconds["front_end"])]
    q = statistics.quantiles(ratios, n=4)
    record = {"median_ms": {n: 1e3 * statistics.median(v) for n, v in seconds.items()},
              "ratio_median": statistics.median(ratios), "ratio_quartiles": [q[0], q[2]], "pairs": args.pairs,
              "prompts": args.prompts, "group": args.group, "max_tokens": args.max_tokens,
              "threads": torch.get_num_threads(), "identical_pairs": args.pairs + 5}
    print(f"engine core {record['median_ms']['engine_core']:.1f} ms, front end {record['median_ms']['front_end']:.1f} "
          f"ms a call; engine core / front end {record['ratio_median']:.3f} (quartiles {q[0]:.3f}-{q[2]:.3f}) over "
          f"{args.pairs} pairs, {torch.get_num_threads()} threads; rollouts identical in every pair")
    if args.json:
        from gacbench.jsonio import write_json
        from gacbench.provenance import provenance

        record["provenance"] = provenance()
        write_json(Path(args.json), record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
