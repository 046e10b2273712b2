"""Peak memory of the trainer's log-prob pass at Qwen3-1.7B's width, with and without ``model.logit_rows`` and
``model.gradient_checkpointing`` (docs/llm.md, "Memory of the training forward").

Each setting runs in a process of its own: a Qwen3 of Qwen3-1.7B's width (hidden 2048, 16 heads of 128, 8 KV
heads, intermediate 6144, a 151,936-token vocabulary) with a few of its 28 layers and random weights; a batch of
rows of 10 prompt and 512 completion tokens; one forward of ``GRPOModule.token_logprobs`` under bfloat16 autocast
and one backward. The figure is the peak resident memory (``ru_maxrss``) beyond what the process held with the
weights and zeroed gradients. CPU only; about 5 minutes on 2 cores for the default settings, 24 GiB of memory.

    python paper/logit_memory.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

#: (rows, layers, logit_rows or 0 for the whole batch, gradient checkpointing)
SETTINGS = [(4, 2, 0, False), (4, 2, 1, True), (4, 4, 0, False), (4, 4, 1, True), (8, 2, 0, False), (8, 2, 1, True)]
PROMPT, COMPLETION = 10, 512


def child(rows: int, layers: int, logit_rows: int, checkpointing: bool) -> dict:
    import resource
    import time
    from types import SimpleNamespace

    import torch
    from transformers import Qwen3ForCausalLM

    from gacbench.llm.grpo import GRPOModule, ModelConfig
    from gacbench.llm.model import tiny_config

    torch.manual_seed(0)
    config = tiny_config(hidden=2048, layers=layers, heads=16, kv_heads=8, intermediate=6144, vocab=151936,
                         max_len=PROMPT + COMPLETION + 8)
    model = Qwen3ForCausalLM(config).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(3, config.vocab_size, (rows, PROMPT + COMPLETION))
    packed = {"ids": ids, "attention": torch.ones_like(ids), "mask": torch.ones(rows, COMPLETION, dtype=torch.bool),
              "prompt_len": torch.full((rows,), PROMPT)}
    # token_logprobs reads only model_cfg and policy from its module
    module = SimpleNamespace(model_cfg=ModelConfig(path="unused", gradient_checkpointing=checkpointing,
                                                   logit_rows=logit_rows or None), policy=model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # the gradients' memory is in the baseline
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp = GRPOModule.token_logprobs(module, packed)
    logp.sum().backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {"rows": rows, "layers": layers, "logit_rows": logit_rows or None, "gradient_checkpointing": checkpointing,
            "base_gib": round(base, 2), "added_gib": round(peak - base, 2),
            "seconds": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None, help="also write the rows to this file")
    p.add_argument("--child", nargs=4, type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        rows, layers, logit_rows, checkpointing = args.child
        print(json.dumps(child(rows, layers, logit_rows, bool(checkpointing))))
        return 0
    import torch

    results = []
    print("rows  layers  logit_rows  checkpointing  added GiB  seconds")
    for rows, layers, logit_rows, checkpointing in SETTINGS:
        proc = subprocess.run([sys.executable, __file__, "--child", str(rows), str(layers), str(logit_rows),
                               str(int(checkpointing))], capture_output=True, text=True, check=True)
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        results.append(r)
        print(f"{rows:4d}  {layers:6d}  {str(r['logit_rows'] or 'batch'):>10s}  {str(checkpointing):>13s}  "
              f"{r['added_gib']:9.2f}  {r['seconds']:7.1f}", flush=True)
    if args.json:
        from gacbench.jsonio import write_json
        from gacbench.provenance import provenance

        write_json(Path(args.json), {"rows": results, "prompt_tokens": PROMPT, "completion_tokens": COMPLETION,
                               "torch": torch.__version__, "provenance": provenance()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
