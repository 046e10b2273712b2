"""One GRPO step of gacbench against Hugging Face TRL's ``GRPOTrainer`` at the tiny shape, run in turn.

Both sides: the tiny warm-started Qwen3 (gacbench's pinned start point), 8 prompts x 8 samples, 6 new tokens,
temperature 1, lr 3e-4, AdamW, no KL, fp32 on the CPU, the machine's threads, 30 steps, the median step over steps
5-30. TRL runs the peer script (``--peer``: a script that takes OUT_DIR MODEL_DIR PROMPTS_JSONL and writes
OUT_DIR/times.json with ``median_step_s_5_30``; TRL is not a dependency of gacbench, so it runs in its own
environment, ``--trl-python``). gacbench runs :class:`~gacbench.llm.grpo.GRPOModule` synchronously with each engine
variant (``hf``, ``vllm``, ``vllm-compile``: ``engine.compile: true``; ``vllm-front-end``, not run by default: the
eager vllm engine through ``LLM.generate`` instead of vLLM's engine core, :func:`register_front_end_engine`). Each
round runs every side once, one after the other, so that a round sees one state of a shared machine; the ratios are
paired by round, and the table gives their medians over rounds with the range. Nothing else should run on the
machine meanwhile.

    python paper/trl_compare.py --peer PEER.py --trl-python .trlenv/bin/python --rounds 8 \\
        --out /tmp/trl-compare --json paper/profile/trl-compare.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = {"hf": {"name": "hf"}, "vllm": {"name": "vllm"}, "vllm-compile": {"name": "vllm", "compile": True},
            "vllm-front-end": {"name": "vllm-front-end"}}


def register_front_end_engine() -> None:
    """The engine ``vllm-front-end``: the eager vllm engine with its calls through vLLM's front end
    (``VLLMEngine.route = "front_end"``, ``LLM.generate``), registered as any outside engine is, so that a series
    pairs the engine-core route with the front end's round by round."""
    from gacbench.rollout.engines import ENGINES, register_engine

    def build(spec, **inputs):
        engine = ENGINES["vllm"](spec, **inputs)  # the vllm engine as the registry builds it
        engine.route = "front_end"
        return engine

    if "vllm-front-end" not in ENGINES:
        register_engine("vllm-front-end", build)


def gacbench_side(out: str, variant: str) -> None:
    """30 synchronous GRPO steps at the peer's shape; writes the median step (steps 5-30) and generation to out."""
    from gacbench.llm.grpo import GRPOModule
    from gacbench.trainer import build_trainer

    register_front_end_engine()
    module = GRPOModule(engine=VARIANTS[variant], rollout={"prompts": 8, "group": 8, "max_tokens": 6}, staleness=0,
                        steps=30, lr=3e-4, seed=0, eval_every=10**9)
    t0 = time.perf_counter()
    build_trainer(30, [], logger=False, enable_progress_bar=False).fit(module)
    step = [h[0] for h in module._history]
    gen = [h[1] for h in module._history]
    Path(out).write_text(json.dumps({"median_step_s_5_30": statistics.median(step[4:]),
                                     "median_generate_s_5_30": statistics.median(gen[4:]),
                                     "wall_s": time.perf_counter() - t0, "step_s": step, "generate_s": gen,
                                     "route": getattr(module.engine, "route", None)}))  # the vllm engines


def inputs(where: Path) -> tuple[str, str]:
    """The tiny warm-started model's directory and the training prompts in gacbench's order, as JSONL."""
    from gacbench.llm.task import ArithmeticTask
    from gacbench.llm.warmstart import warm_started_dir

    prompts = where / "prompts.jsonl"
    rows = ArithmeticTask(max_ops=2, max_operand=9, seed=0).batch("train", 0, 320)
    prompts.write_text("".join(json.dumps({"prompt": r.prompt, "answer": r.answer}) + "\n" for r in rows))
    return str(warm_started_dir()), str(prompts)


def summarise(runs: dict[str, list[dict]]) -> tuple[dict, dict]:
    """The table of a series from each side's per-round records (``runs["trl"]`` and one list per variant, in round
    order): per side the median step and generation, the step's ratio to TRL's paired by round (median and range),
    the per-round figures and the route; and, where ``vllm`` and ``vllm-front-end`` both ran, their step and
    generation ratios paired by round (else an empty dict)."""
    trl = [x["median_step_s_5_30"] for x in runs["trl"]]
    table = {}
    for k, xs in runs.items():
        step = [x["median_step_s_5_30"] for x in xs]
        ratio = [a / b for a, b in zip(step, trl)]
        table[k] = {"median_step_ms": 1e3 * statistics.median(step),
                    "median_generate_ms": 1e3 * statistics.median(x["median_generate_s_5_30"] for x in xs),
                    "ratio_to_trl_median": statistics.median(ratio), "ratio_min": min(ratio), "ratio_max": max(ratio),
                    "run_wall_s_median": statistics.median(x["wall_s"] for x in xs), "rounds": len(xs),
                    "route": xs[0].get("route"), "step_ms_by_round": [1e3 * v for v in step],
                    "generate_ms_by_round": [1e3 * x["median_generate_s_5_30"] for x in xs]}
    routes = {}
    if "vllm" in table and "vllm-front-end" in table:  # the two routes of the eager engine, paired by round
        for key in ("step_ms_by_round", "generate_ms_by_round"):
            r = [a / b for a, b in zip(table["vllm"][key], table["vllm-front-end"][key])]
            routes[key.split("_")[0]] = {"median": statistics.median(r), "min": min(r), "max": max(r)}
    return table, routes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peer", help="TRL's side: a script taking OUT_DIR MODEL_DIR PROMPTS_JSONL")
    p.add_argument("--trl-python", default="python3", help="the Python of an environment with TRL")
    p.add_argument("--variants", default="hf,vllm,vllm-compile", help="gacbench engine variants, comma-separated")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default="/tmp/trl-compare", help="a scratch directory for each run's record and log")
    p.add_argument("--json", help="also write the table's record here")
    p.add_argument("--gacbench-run", nargs=2, metavar=("OUT", "VARIANT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.gacbench_run:
        gacbench_side(*args.gacbench_run)
        return 0
    if not args.peer or not Path(args.peer).is_file():
        p.error(f"--peer {args.peer!r}: give TRL's step script (e.g. /work/shared/peer/trl_grpo_step.py)")
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: {', '.join(unknown)} not among {', '.join(VARIANTS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, prompts = inputs(out)
    runs: dict[str, list[dict]] = {"trl": [], **{v: [] for v in variants}}
    for r in range(args.rounds):
        side = out / f"trl-r{r}"
        with open(out / f"trl-r{r}.log", "w") as log:
            subprocess.run([args.trl_python, args.peer, str(side), model, prompts], stdout=log, stderr=log, check=True)
        runs["trl"].append(json.loads((side / "times.json").read_text()))
        for v in variants:
            rec = out / f"{v}-r{r}.json"
            with open(out / f"{v}-r{r}.log", "w") as log:
                subprocess.run([sys.executable, __file__, "--gacbench-run", str(rec), v], stdout=log, stderr=log,
                               check=True)
            runs[v].append(json.loads(rec.read_text()))
        done = ", ".join(f"{k} {x[-1]['median_step_s_5_30'] * 1e3:.1f} ms" for k, x in runs.items())
        print(f"round {r + 1}: {done}", flush=True)
    table, routes = summarise(runs)
    print("| side | step (median over rounds) | generation | ratio to TRL, paired by round: median (range) |")
    print("|---|---|---|---|")
    for k, t in table.items():
        print(f"| {k} | {t['median_step_ms']:.1f} ms | {t['median_generate_ms']:.1f} ms | "
              f"{t['ratio_to_trl_median']:.3f} ({t['ratio_min']:.3f}-{t['ratio_max']:.3f}) |")
    if routes:
        print("vllm / vllm-front-end, paired by round: " + ", ".join(
            f"{k} {v['median']:.3f} ({v['min']:.3f}-{v['max']:.3f})" for k, v in routes.items()))
    if args.json:
        import platform

        import torch

        from gacbench.provenance import provenance

        record = {"table": table, "vllm_over_vllm_front_end": routes or None, "rounds": args.rounds,
                  "threads": torch.get_num_threads(),
                  "machine": platform.processor() or platform.machine(), "provenance": provenance()}
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
