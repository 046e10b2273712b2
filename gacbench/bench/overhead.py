"""``gacbench overhead``: GAC's per-step cost against the optimizer step it sits beside.

A benchmark, not a test: it builds a Qwen3-shaped list of parameters of about N elements on
the current device, gives them gradients, and times side by side, in one process,
(a) one AdamW step (fused where the device supports it, else foreach) and (b) one GAC pass
(the three alignment scalars, the projection, the reference update), through the same
:class:`GACTransform` the callback runs. Each figure is the median of ``repeats`` timed
runs after a warm-up. The projection is forced on every timed pass (c_low = 0, so every
step with positive alignment is shrunk), which is GAC's worst case. Beside them it times the two
memory passes each branch needs, made of torch's eager kernels (one read of g and r, as a dot product per
tensor; one ``g - alpha r`` pass), so that each branch's floor with those kernels on the machine at hand is
printed with it (a kernel that streams memory faster than torch's dot product, such as the Triton path's, can
go below it). Threads: torch's default (set ``OMP_NUM_THREADS`` to pin them; on a shared machine one thread
gives the steadiest figures).

Memory: at most :data:`GRADIENT_COPIES` float32 copies of the parameter list at once (55 GB at the Qwen3-1.7B
shape; checked against a GPU's free memory before anything is built).

The kernel paths are timed one after the other, each in its own interleaved rounds (the first: AdamW, the
path's two branches and the floors; each later one: its two branches), so that a path's figures are printed as
soon as they are measured and a slow compile holds back only its own path. Each ratio is to the AdamW step of
the first rounds. On the command line a line is printed at least every ``QUIET_S`` seconds (what is running,
for how long), and a compile's start and duration are printed. On a GPU the last lines are each path's row for
``gacbench.functional.kernels.MEASURED``, the table ``kernels="auto"`` chooses from there.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Callable, TextIO

import torch

from gacbench.functional import triton_kernels
from gacbench.functional.alignment import ACTION_NAMES
from gacbench.functional.gac import GACState, GACTransform
from gacbench.functional.kernels import measurement_row
from gacbench.llm.model import Qwen3Shape
from gacbench.llm.step_profile import SHAPES
from gacbench.provenance import available_memory
from gacbench.usage import UsageError

#: GAC's kernel paths (``GAC(kernels=...)``) and the suffix of their keys in the record
KERNEL_SUFFIX = {"eager": "", "compiled": "_compiled", "fused-adamw": "_fused", "triton": "_triton"}
#: the kernel paths whose first call compiles (torch.compile; Triton's JIT)
COMPILING = ("compiled", "fused-adamw", "triton")
#: the longest the command line stays silent: a progress line after this many seconds without output
QUIET_S = 10.0


class Progress:
    """Lines for a person watching: :meth:`say` prints one at once (flushed); while :meth:`doing` names an
    activity, a background thread prints ``... still <activity> (N s)`` whenever ``quiet_s`` seconds pass
    without a line. Use as a context manager (the thread runs inside it)."""

    def __init__(self, stream: TextIO | None = None, quiet_s: float = QUIET_S, prefix: str = "overhead") -> None:
        self.stream, self.quiet_s, self.prefix = stream, quiet_s, prefix
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._what: str | None = None
        self._since = self._last
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def say(self, line: str) -> None:
        with self._lock:
            print(line, file=self.stream or sys.stdout, flush=True)
            self._last = time.monotonic()

    def doing(self, what: str | None) -> None:
        with self._lock:
            self._what, self._since = what, time.monotonic()

    def _beat(self) -> None:
        while not self._stop.wait(min(1.0, self.quiet_s / 4)):
            now = time.monotonic()
            if self._what is not None and now - self._last >= self.quiet_s:
                self.say(f"  {self.prefix}: still {self._what} ({now - self._since:.0f} s)")

    def __enter__(self) -> "Progress":
        self._thread = threading.Thread(target=self._beat, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


class _Silent:
    def say(self, line: str) -> None:
        pass

    def doing(self, what: str | None) -> None:
        pass


QWEN3_1_7B = Qwen3Shape.of_config(**SHAPES["qwen3-1.7b"])


def shape_for_params(n: int) -> Qwen3Shape:
    """A small Qwen3 shape (head_dim 32, 2 to 48 layers, a 512- to 8192-token vocabulary) whose size is closest
    to ``n``."""
    if n < 1:
        raise UsageError(f"--params {n} must be positive")
    best = None
    for vocab in (8192, 2048, 512):
        for layers in range(2, 49):
            for hidden in range(64, 16384 + 1, 64):
                s = Qwen3Shape(hidden, layers, 3 * hidden, hidden // 32, max(1, hidden // 64), 32, vocab)
                if best is None or abs(s.numel() - n) < abs(best.numel() - n):
                    best = s
                if s.numel() > n:
                    break
    assert best is not None
    return best


def _interleaved(cases: dict[str, tuple[Callable[[], object], Callable[[], None]]], repeats: int,
                 sync: Callable[[], None], progress=None,
                 compiling: frozenset = frozenset()) -> tuple[dict[str, float], dict[str, float]]:
    """Median wall time of each case's ``fn``, the cases run in turn within every repeat (so that
    drifts in machine load hit them alike); each ``setup`` runs untimed before its ``fn``. Also returns
    each case's time in the first round, a warm-up left out of the medians (it includes any compile).
    ``progress`` (:class:`Progress`) is told what runs; the first call of a case in ``compiling`` is announced
    as a compile, with its duration."""
    progress = progress or _Silent()
    times: dict[str, list[float]] = {name: [] for name in cases}
    first: dict[str, float] = {}
    for i in range(repeats + 1):  # the first round is a warm-up
        progress.doing(f"timing round {i} of {repeats} ({', '.join(cases)})" if i else
                       f"the warm-up round ({', '.join(cases)})")
        for name, (fn, setup) in cases.items():
            setup()
            sync()
            if not i and name in compiling:
                progress.say(f"  {name}: first call, compiling (torch.compile: minutes for a large model; "
                             "Triton: seconds) ...")
                progress.doing(f"compiling {name}")
            t0 = time.perf_counter()
            fn()
            sync()
            elapsed = time.perf_counter() - t0
            if i:
                times[name].append(elapsed)
            else:
                first[name] = elapsed
                if name in compiling:
                    progress.say(f"  {name}: first call took {elapsed:.1f} s (its compile included, unless an "
                                 "earlier call compiled the same shapes)")
                    progress.doing(f"the warm-up round ({', '.join(cases)})")
    progress.doing(None)
    return {name: statistics.median(ts) for name, ts in times.items()}, first


def _device(device: str | None) -> torch.device:
    """The device to time on; a usage error for a name torch does not know or a CUDA device this machine lacks."""
    try:
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        raise UsageError(f"--device {device!r} is not a torch device; give cpu or cuda") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {device} asks for CUDA, but this torch ({torch.__version__}) sees no "
                         "CUDA device; run on a GPU machine or give --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UsageError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA "
                         "device(s); give cuda or cuda:0")
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {device}: only cpu and cuda are supported")
    return dev


#: the most gradient-sized float32 copies :func:`run_overhead` holds at once (the parameters, their gradients,
#: AdamW's two moments, GAC's reference for each of the two timed branches, the gradient being stepped, and the
#: floors' scratch buffer in the first rounds); tests/test_cli.py counts them
GRADIENT_COPIES = 8


def check_memory(dev: torch.device, numel: int) -> None:
    """A usage error before anything is built when the device's free memory (a GPU's, or the machine's available
    memory on the CPU: /proc/meminfo's MemAvailable, where Linux gives it) cannot hold :data:`GRADIENT_COPIES`
    float32 copies of ``numel`` elements and one more for a path's temporaries."""
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # memory this process's allocator caches but no tensor holds counts as free
        free, total = torch.cuda.mem_get_info(dev)
        what = "GPU memory"
        fix = "free the GPU"
    else:
        free, total = available_memory()
        if free is None:
            return
        what = "memory"
        fix = "free memory"
    need = (GRADIENT_COPIES + 1) * 4 * numel
    if need > free:
        raise UsageError(f"overhead: {numel:,} parameters need about {need / 1e9:.0f} GB of {what} "
                         f"({GRADIENT_COPIES + 1} float32 copies), and {dev} has {free / 1e9:.0f} GB free of "
                         f"{total / 1e9:.0f} GB; {fix}, or time a smaller list: --params "
                         f"{int(free / need * numel * 0.9):,} without --shape")


def default_kernels(device: str | None) -> tuple[str, ...]:
    """The paths ``gacbench overhead`` times when ``--kernels`` is not given: every path that runs natively on the
    device (the Triton path on CUDA, not under the CPU's interpreter)."""
    dev = _device(device)
    return tuple(k for k in KERNEL_SUFFIX if k != "triton" or (dev.type == "cuda" and
                                                                triton_kernels.device_problem("cuda") is None))


def run_overhead(
    params: int = 20_000_000,
    device: str | None = None,
    repeats: int = 7,
    buffer_dtype: str | None = None,
    shape: str = "auto",
    seed: int = 0,
    kernels: tuple[str, ...] = ("eager",),
    progress: Progress | None = None,
) -> dict:
    """Time AdamW and a GAC pass on the same parameters; returns the JSON record. ``kernels``: GAC's kernel
    paths to time (:data:`KERNEL_SUFFIX`; ``compiled`` needs a float32 reference buffer; ``triton`` a CUDA device,
    or Triton's interpreter on the CPU, which times the interpreter: a check that it runs). A step GAC takes itself
    (``fused-adamw``: a shrunk one, or every one with a bfloat16 buffer) includes the AdamW update, so its
    ``_over_adamw`` is (time - AdamW) / AdamW. ``progress``: where each figure's line goes as soon as it is
    measured (and the progress lines); None prints nothing. Bad arguments raise :class:`UsageError`."""
    out = progress or _Silent()
    kernels = tuple(kernels)
    if not kernels or set(kernels) - set(KERNEL_SUFFIX) or len(set(kernels)) != len(kernels):
        raise UsageError(f"kernels={kernels!r} must be a non-empty subset of {tuple(KERNEL_SUFFIX)}, "
                         "each once")
    if "compiled" in kernels and buffer_dtype not in (None, "float32"):
        raise UsageError(f"the compiled kernels need a float32 reference buffer, not {buffer_dtype}; "
                         "time them without --buffer-dtype, or use --kernels eager,fused-adamw")
    if shape not in ("auto", "qwen3-1.7b"):
        raise UsageError(f"shape={shape!r} is not one of 'auto', 'qwen3-1.7b'")
    if repeats < 1:
        raise UsageError(f"--repeats {repeats} must be >= 1")
    dev = _device(device)
    if "triton" in kernels and triton_kernels.device_problem(dev.type) is not None:
        raise UsageError(f"--kernels triton on {dev.type}: {triton_kernels.device_problem(dev.type)}; leave triton "
                         "out of --kernels here")
    qshape = QWEN3_1_7B if shape == "qwen3-1.7b" else shape_for_params(params)
    check_memory(dev, qshape.numel())
    out.doing(f"building {qshape.numel():,} parameters and their gradients on {dev}")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dev) * 0.02) for s in qshape.shapes()]
    base_grads = [torch.randn(s, generator=gen).to(dev) for s in qshape.shapes()]
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    fused = dev.type in ("cuda", "cpu")
    try:
        opt = torch.optim.AdamW(ps, lr=1e-6, weight_decay=0.01, fused=fused)
    except (RuntimeError, TypeError):
        fused = False
        opt = torch.optim.AdamW(ps, lr=1e-6, weight_decay=0.01, foreach=True)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def set_grads() -> None:
        for p, g in zip(ps, base_grads):
            p.grad = g

    # GAC, as the callback runs it, in its steady state (a stored reference and its cached
    # norm), restored untimed before each run so that every run takes the same branch:
    # "project": the reference is a perturbed copy of g (c ~ 0.9) and c_low=0, c_high=1, so the
    # aligned component is shrunk (the costly branch); "keep": an independent reference (c ~ 0).
    Case = tuple[Callable[[], object], Callable[[], None], GACTransform]

    set_grads()
    opt.step()  # AdamW's moments exist, as after any first step (what kernels="fused-adamw" steps with)

    # Each case's reference is drawn anew on the device whenever its steady state is restored, and nothing of it
    # is kept between runs but GAC's own state: at the 1.72B shape a gradient-sized copy is 6.9 GB, and the
    # command holds GRADIENT_COPIES of them at most (parameters, gradients, AdamW's two moments, the two
    # branches' references, the gradient being stepped, and the floors' scratch buffer in the first rounds),
    # which fits an 80 GB GPU.
    def reference(aligned: bool) -> list[torch.Tensor]:
        """'project': a perturbed copy of g (c ~ 0.9); 'keep': an independent direction (c ~ 0)."""
        draw = torch.Generator(device=dev).manual_seed(seed + 1 + aligned)
        return [(g + 0.5 * torch.randn(g.shape, generator=draw, device=dev)) if aligned else
                torch.randn(g.shape, generator=draw, device=dev) for g in base_grads]

    def gac_case(aligned: bool, c_low: float, kernel: str) -> Case:
        gac = GACTransform(c_low=c_low, c_high=1.0, buffer_dtype=buffer_dtype, kernels=kernel)

        def setup() -> None:  # GAC's steady state: the first step stores the reference, as in a run
            for p in ps:
                p.grad = None
            gac.state = GACState()
            for p, r in zip(ps, reference(aligned)):
                p.grad = r
            gac.step(ps, swap=True, keep_alias=True)
            for p, g in zip(ps, base_grads):
                p.grad = g.clone()

        fused = opt if kernel == "fused-adamw" else None
        return (lambda: gac.step(ps, swap=True, keep_alias=True, optimizer=fused)), setup, gac

    # The floor of each branch on this machine, timed beside them: the kernels GAC's traffic cannot go below.
    # "read": one pass reading g and r (a dot product per tensor): all the keep branch needs with a fused
    # two-product kernel. "write": one g - alpha r pass into r's storage, the projection's read-modify-write.
    floors = buffer_dtype in (None, str(ps[0].dtype).replace("torch.", ""))  # the floor passes are of that dtype
    flat_g = [g.reshape(-1) for g in base_grads]
    scratch = [torch.randn(g.numel(), generator=gen).to(dev) for g in base_grads] if floors else []

    def read_pass() -> None:
        for g, r in zip(flat_g, scratch):
            torch.dot(g, r)

    def write_pass() -> None:
        for g, r in zip(flat_g, scratch):
            torch.add(g, r, alpha=-1e-3, out=r)

    record = {
        "params": sum(p.numel() for p in ps),
        "device": str(dev) + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else ""),
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        "shape": qshape.__dict__,
        "shape_name": "qwen3-1.7b" if qshape == QWEN3_1_7B else None,
        "tensors": len(ps),
        "adamw": "fused" if fused else "foreach",
        "buffer_dtype": buffer_dtype or str(ps[0].dtype).replace("torch.", ""),
        "repeats": repeats,
        "kernels": list(kernels),
    }
    out.say(f"params={record['params']:,} on {record['device']} ({record['tensors']} tensors, AdamW "
            f"{record['adamw']}, buffer {record['buffer_dtype']}); each figure: the median of {repeats}")
    adamw_s = None
    for kernel in kernels:  # one path at a time, its figures printed as soon as they are measured
        suffix = KERNEL_SUFFIX[kernel]
        out.doing(f"setting up the {kernel} path")
        branches = {"gac" + suffix: gac_case(True, 0.0, kernel)[:2],
                    "gac_keep" + suffix: gac_case(False, 0.5, kernel)[:2]}
        # AdamW is timed in every path's rounds, interleaved with that path's branches, and each path's ratios
        # divide by its own rounds' AdamW: a change of the machine's load between paths moves both sides
        cases = {"adamw": (opt.step, set_grads), **branches}
        if adamw_s is None and floors:
            cases.update({"read": (read_pass, lambda: None), "write": (write_pass, lambda: None)})
        medians, first = _interleaved(cases, repeats, sync, out,
                                      frozenset(branches) if kernel in COMPILING else frozenset())
        path_adamw_s = record[f"adamw_step{suffix or '_eager'}_s"] = medians["adamw"]
        out.say(f"  AdamW step           {path_adamw_s * 1e3:9.2f} ms (in the {kernel} path's rounds)")
        if adamw_s is None:
            flat_g = scratch = None  # the floors are timed in the first rounds only
            adamw_s = record["adamw_step_s"] = medians["adamw"]
            record.update({
                "read_pass_s": medians["read"] if floors else None,
                "write_pass_s": medians["write"] if floors else None,
                "floor_keep_over_adamw": medians["read"] / adamw_s if floors else None,
                "floor_project_over_adamw": (medians["read"] + medians["write"]) / adamw_s if floors else None,
            })
            if floors:
                out.say(f"  floor (eager kernels): one read of g and r {medians['read'] * 1e3:.2f} ms, one "
                        f"g - alpha r pass {medians['write'] * 1e3:.2f} ms: keep >= "
                        f"{record['floor_keep_over_adamw']:.3f}, shrink >= {record['floor_project_over_adamw']:.3f} "
                        "of AdamW")
        for (name, (fn, setup)), what in zip(branches.items(), ("the costly branch", "the on-policy branch")):
            setup()
            result = fn()
            record[f"{name}_s"] = medians[name]
            # a step GAC took itself (fused-adamw) includes the AdamW update: its cost is what it adds to one
            record[f"{name}_over_adamw"] = (medians[name] - path_adamw_s * result.stepped) / path_adamw_s
            record[f"{name}_case"] = ACTION_NAMES[result.decision.action]
            record[f"{name}_took_the_step"] = result.stepped
            took = " incl. the AdamW update; minus AdamW:" if result.stepped else ""
            out.say(f"  GAC pass, {kernel:11s} {medians[name] * 1e3:9.2f} ms  ({record[name + '_case']}: "
                    f"{what}{took})  {name}_over_adamw = {record[name + '_over_adamw']:.3f}")
        # what the first round cost beyond a timed one: the compile, for the compiled paths
        extra = sum(first[n] - medians[n] for n in branches)
        record[f"first_round_extra{suffix or '_eager'}_s"] = extra
        out.say(f"  {kernel}: first round beyond a timed one (the compile, for compiled paths) {extra:.1f} s")
        # this path's references and their copies are freed before the next path's are made
        branches = cases = fn = setup = None
    record.update({"threads": torch.get_num_threads(), "torch": torch.__version__,
                   "peak_memory_gib": torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None})
    for kernel in kernels:  # on a GPU: each path's line for the table kernels="auto" chooses from
        row = measurement_row(record, kernel, KERNEL_SUFFIX[kernel])
        if row is not None:
            out.say(f"  row for gacbench.functional.kernels.MEASURED: {row}")
    return record


def main(args) -> int:
    kernels = (tuple(k.strip() for k in args.kernels.split(",") if k.strip()) if args.kernels
               else default_kernels(args.device))
    if args.params is not None and args.params <= 0:
        raise UsageError(f"--params {args.params} must be positive")
    with Progress() as progress:
        record = run_overhead(args.params, args.device, args.repeats, args.buffer_dtype, args.shape,
                              kernels=kernels, progress=progress)
    if args.json:
        from gacbench.jsonio import write_json
        from gacbench.provenance import with_provenance

        record["load_avg_1min"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        write_json(Path(args.json), with_provenance(record))
        print(f"wrote {args.json}", flush=True)
    return 0
