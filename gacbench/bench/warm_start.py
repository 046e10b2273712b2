"""``gacbench warm-start``: rebuild the start points of a suite's GRPO tasks (or of one model and task) from scratch,
in a fresh directory, and print each one's weights hash, and the hash of its configuration, vocabulary and end
tokens, beside their pins (:mod:`gacbench.llm.pinned`)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from gacbench.bench.validate import load_suite
from gacbench.llm import pinned
from gacbench.llm.warmstart import build_warm_start, start_point
from gacbench.provenance import cpu_description, weights_sha256
from gacbench.usage import UsageError, check_output_dir


def main(args) -> int:
    """``gacbench warm-start``: build the start points of a suite's GRPO tasks (or of one model and task) from
    scratch, in a fresh directory, and print each one's weights hash beside its pin."""
    if args.suite:
        suite = load_suite(args.suite)
        points = {}
        for name, spec in suite["tasks"].items():
            if spec["objective"] == "grpo" and (sp := start_point(spec.get("params", {}))) is not None:
                points.setdefault(sp[0], (sp, []))[1].append(name)
        if not points:
            raise UsageError(f"--suite {args.suite}: no GRPO task of this suite starts from a built-in model (its "
                             "tasks are synthetic, or give their own model.path); name a GRPO suite, e.g. llm-smoke")
    else:
        try:
            sp = start_point({"model": {"size": args.size, "warm_steps": args.warm_steps},
                              "task": {"name": args.task, "max_ops": args.max_ops, "max_operand": args.max_operand}})
        except ValueError as exc:  # an unknown size or task
            raise UsageError(f"--size {args.size} --task {args.task}: {exc}") from None
        points = {sp[0]: (sp, [args.task])}
    isa = cpu_description().get("isa")
    out_root = check_output_dir("--out", args.out) if args.out else Path(tempfile.mkdtemp(prefix="gacbench-warm-"))
    differ = 0
    for name, ((_, config, task, steps), tasks) in points.items():
        path = out_root / name
        if path.exists():
            shutil.rmtree(path)
        print(f"{name} ({', '.join(tasks)}): building {steps} supervised steps in {path} ...", flush=True)
        build_warm_start(path, config, task, steps, cache_dir=out_root)
        digest, pin = weights_sha256(path), pinned.pin_of(name)
        verdict = "no pin" if pin is None else ("= the pin" if digest == pin else f"!= the pin {pin}")
        spec, spec_pin = pinned.spec_sha256(path), pinned.PINNED_SPEC.get(name)
        spec_verdict = "no pin" if spec_pin is None else ("= the pin" if spec == spec_pin else f"!= the pin {spec_pin}")
        differ += (pin is not None and digest != pin) or (spec_pin is not None and spec != spec_pin)
        print(f"  weights SHA-256 {digest} {verdict} (isa {isa})", flush=True)
        print(f"  configuration, vocabulary and end tokens SHA-256 {spec} {spec_verdict}", flush=True)
    if differ:
        print(f"{differ} start point(s) built here differ from the pinned θ₀: runs here use the shipped "
              f"checkpoints ({pinned.models_root()}); a machine without them is refused", flush=True)
    return 1 if differ else 0
