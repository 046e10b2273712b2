"""GAC's two memory passes as ``torch.compile`` kernels (``GAC(kernels="compiled")``).

The eager path (:func:`~gacbench.functional.alignment.alignment_scalars`, then one ``torch.add`` per tensor)
launches one or more kernels per tensor and block. Compiled over the whole parameter list, with static shapes,
Inductor emits:

- ``scalars(g, r)``: ``[<g, r>, ||g||^2]`` in one read of g and r (both products in the same loop), each
  tensor reduced in float32 and the per-tensor sums added in float64;
- ``project(g, r, alpha)``: ``r <- g - alpha r`` in place, one read of g and r and one write of r (the
  swapping projection of :class:`~gacbench.functional.gac.GACTransform`: r's storage then becomes ``p.grad``);
- ``adamw_projected``: torch's AdamW update (decoupled weight decay, bias correction; amsgrad, maximize off)
  of p and its moments m, v with the gradient g - alpha r formed inside the loop, never written
  (``GAC(kernels="fused-adamw")``): the projection costs one more read, of r, in the optimizer's own pass;
  with a reference stored in a lower precision (``buffer_dtype="bfloat16"``) the same loop also stores g,
  rounded, as the next reference, on every step, kept ones included (then r is not read).

``alpha`` travels as a 0-d tensor, so a new coefficient does not recompile. Each distinct parameter list
(number, shapes, dtypes of tensors) compiles once, about 20-30 s on 2 CPU cores for a 46-tensor model, and
needs a C++ compiler on the CPU (Inductor's); a compile failure is reported once and the eager path is used.
Later calls with the same signature go straight to Inductor's compiled code, skipping Dynamo's guards
(see :func:`_run`).

Numerics: each tensor's sums are float32 reductions (Inductor's order, not the eager path's blocks), so
results match the eager path to float32 rounding, not bit for bit. A sum that is not finite (a float32
overflow, or a real inf/NaN in g) is recomputed by the eager path, which tells the two apart.
"""

from __future__ import annotations

import inspect
import math
import re
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

_COMPILED: dict[str, Callable] = {}
_FAILED: list[str] = []


def _scalars(gl: list[Tensor], rl: list[Tensor]) -> Tensor:
    # this form lets Inductor reduce both products of a tensor in one loop (a `sum(dtype=...)` or a stack of
    # the per-tensor sums made it ~1.6x slower on the CPU)
    dot = sum((g * r).sum().double() for g, r in zip(gl, rl))
    sq = sum((g * g).sum().double() for g in gl)
    return torch.stack([dot, sq])


def _project(gl: list[Tensor], rl: list[Tensor], alpha: Tensor) -> None:
    torch._foreach_mul_(rl, -alpha)
    torch._foreach_add_(rl, gl)


def _adamw_update(p: Tensor, gt: Tensor, m: Tensor, v: Tensor, decay: Tensor, beta1: Tensor, beta2: Tensor,
                  step_size: Tensor, bias2_sqrt: Tensor, eps: Tensor) -> None:
    # torch.optim.AdamW's single-tensor update with gradient gt: p *= 1 - lr wd; m = lerp(m, gt, 1 - b1);
    # v = b2 v + (1 - b2) gt^2; p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    p.mul_(decay)
    m.lerp_(gt, 1 - beta1)
    v.mul_(beta2).addcmul_(gt, gt, value=1 - beta2)
    p.sub_(step_size * m / (v.sqrt() / bias2_sqrt + eps))


def _adamw_projected(P: list[Tensor], G: list[Tensor], R: list[Tensor], M: list[Tensor], V: list[Tensor],
                     alpha: Tensor, *hyper: Tensor) -> None:
    # AdamW on g~ = g - alpha r, formed in the loop and never written
    for p, g, r, m, v in zip(P, G, R, M, V):
        _adamw_update(p, g - alpha * r, m, v, *hyper)


def _scalars_lowp(gl: list[Tensor], rl: list[Tensor]) -> Tensor:
    # a reference stored in a lower precision: ||r||^2 is not cached (r is g rounded), so all three products
    dot = sum((g * r.float()).sum().double() for g, r in zip(gl, rl))
    sq = sum((g * g).sum().double() for g in gl)
    rsq = sum((r.float() * r.float()).sum().double() for r in rl)
    return torch.stack([dot, sq, rsq])


def _adamw_lowp_ref(P: list[Tensor], G: list[Tensor], R: list[Tensor], M: list[Tensor], V: list[Tensor],
                    alpha: Tensor, *hyper: Tensor) -> None:
    # _adamw_projected, then r <- g rounded to r's precision, in the same loop (r is read before it is written)
    for p, g, r, m, v in zip(P, G, R, M, V):
        _adamw_update(p, g - alpha * r.float(), m, v, *hyper)
        r.copy_(g)


def _adamw_lowp_ref_keep(P: list[Tensor], G: list[Tensor], R: list[Tensor], M: list[Tensor], V: list[Tensor],
                         alpha: Tensor, *hyper: Tensor) -> None:
    # a kept step (alpha = 0): AdamW on g itself, and r <- g rounded; r is not read
    for p, g, r, m, v in zip(P, G, R, M, V):
        _adamw_update(p, g, m, v, *hyper)
        r.copy_(g)


# name -> how many outputs the function's graph returns (its Python result: a tensor, or None)
_OUTPUTS = {"scalars": 1, "scalars_lowp": 1, "project": 0, "adamw": 0, "adamw_lowp": 0, "adamw_lowp_keep": 0}
_SOURCE = re.compile(r"^L\['(\w+)'\](?:\[(\d+)\])?$")
# (name, the arguments' signature) -> [(Inductor's compiled callable, each graph input as (argument, index))],
# one entry per set of shapes and strides compiled
_DIRECT: dict[tuple, list[tuple[Callable, list[tuple[int, int | None]]]]] = {}
_CAPTURED: list[tuple[str, Callable, list[tuple[int, int | None]]]] = []


def _capturing(name: str, fn: Callable) -> Callable:
    """Inductor as torch.compile's backend, keeping the compiled callable and the order of its inputs (each an
    argument of ``fn`` or an element of a list argument) for :func:`_run`'s direct calls."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    parameters = inspect.signature(fn).parameters
    params = list(parameters)
    varargs = next((i for i, v in enumerate(parameters.values()) if v.kind is inspect.Parameter.VAR_POSITIONAL), None)

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        compiled = compile_fx(gm, example_inputs)
        # the direct call relies on the compiled code checking shapes and strides (Inductor's size_asserts)
        order = _input_order(gm, params, varargs, _OUTPUTS[name]) if inductor_config.size_asserts else None
        if order is not None:
            _CAPTURED.append((name, compiled, order))
        return compiled

    return backend


def _input_order(gm: torch.fx.GraphModule, params: list[str], varargs: int | None,
                 n_outputs: int) -> list[tuple[int, int | None]] | None:
    """Each graph input of ``gm`` as (argument position, list index or None), read from the sources Dynamo
    records; None (no direct call) if an input is anything else, the graph returns another number of
    outputs, or this torch records sources differently."""
    try:
        order: list[tuple[int, int | None]] = []
        for node in gm.graph.nodes:
            if node.op == "output":
                out = node.args[0]
                if not isinstance(out, (tuple, list)) or len(out) != n_outputs:
                    return None
            if node.op != "placeholder":
                continue
            name = getattr(node.meta.get("grapharg"), "source", None)
            name = getattr(name, "name", None)
            name = name() if callable(name) else name
            match = _SOURCE.match(name) if isinstance(name, str) else None
            if match is None or match.group(1) not in params:
                return None
            arg, index = params.index(match.group(1)), match.group(2)
            if arg == varargs:  # *hyper: its elements are the trailing positional arguments
                if index is None:
                    return None
                arg, index = arg + int(index), None
            order.append((arg, None if index is None else int(index)))
        return order
    except Exception:  # noqa: BLE001  (private structures of another torch version: no direct call)
        return None


def _signature(args: tuple) -> tuple | None:
    """What the direct call's key holds: each argument's length (a list) and the dtypes and devices of its
    tensors; None when a tensor is passed twice (Dynamo compiles aliased inputs apart)."""
    sig, ids = [], set()
    for a in args:
        ts = a if isinstance(a, list) else [a]
        ids.update(id(t) for t in ts)
        sig.append((len(ts) if isinstance(a, list) else -1, frozenset((t.dtype, t.device) for t in ts)))
    return tuple(sig) if len(ids) == sum(len(a) if isinstance(a, list) else 1 for a in args) else None


def _get(name: str, fn: Callable) -> Callable | None:
    if _FAILED:
        return None
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(fn, dynamic=False, fullgraph=True, backend=_capturing(name, fn))
    return _COMPILED[name]


#: how many signatures (list lengths, dtypes, shapes) each compiled kernel may be compiled for in one process: Dynamo's
#: default of 8 recompiles, reached by a worker whose cells train models of several shapes, ends in a hard failure
#: under fullgraph=True, and every later call of the process would run the eager path
RECOMPILE_LIMIT = 256


def _recompile_limit():
    """Dynamo's recompile limit raised to :data:`RECOMPILE_LIMIT` while a kernel compiles (``recompile_limit``;
    ``cache_size_limit`` in torch versions before the rename)."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    return config.patch(**{name: max(RECOMPILE_LIMIT, getattr(config, name))})


def _run(name: str, fn: Callable, *args) -> tuple[bool, object]:
    """(True, the compiled ``fn(*args)``), or (False, None) after a compile failure (warned once; the caller
    goes eager).

    A signature seen before is called directly in Inductor's compiled code, without torch.compile's guards
    (0.7-1 ms per call over 92-238 tensors at 20M parameters on 2 CPU cores): the key checks every tensor's
    dtype and device and each list's length, and the compiled code's own asserts check every shape and
    stride before any kernel runs; shapes no entry was compiled for go through torch.compile, which compiles
    them."""
    compiled = _get(name, fn)
    if compiled is None:
        return False, None
    key = (name, _signature(args))
    entries = _DIRECT.get(key, []) if key[1] is not None else []
    for n, (call, order) in enumerate(entries):  # the most recently used first
        try:
            out = call(*[args[a] if i is None else args[a][i] for a, i in order])
        except AssertionError:  # shapes or strides this entry was not compiled for
            continue
        entries.insert(0, entries.pop(n))
        return True, (out[0] if _OUTPUTS[name] else None)
    _CAPTURED.clear()
    try:
        with _recompile_limit():
            result = compiled(*args)
    except Exception as exc:  # noqa: BLE001  (Inductor raises many kinds; any of them means: go eager)
        _FAILED.append(f"{type(exc).__name__}: {exc}")
        warnings.warn(f"GAC(kernels='compiled'): torch.compile failed ({_FAILED[0][:300]}); using the eager "
                      "kernels for the rest of this process", RuntimeWarning, stacklevel=3)
        return False, None
    if key[1] is not None and len(_CAPTURED) == 1 and _CAPTURED[0][0] == name:
        _DIRECT.setdefault(key, []).insert(0, _CAPTURED[0][1:])
    _CAPTURED.clear()
    return True, result


def compiled_scalars(g: list[Tensor], r: list[Tensor]) -> Tensor | None:
    """``tensor([<g, r>, ||g||^2])`` (float64, shape (2,)) in one compiled pass, or None (use eager)."""
    return _run("scalars", _scalars, list(g), list(r))[1]


def compiled_project(g: list[Tensor], r: list[Tensor], alpha: float) -> bool:
    """``r <- g - alpha r`` for every pair, in one compiled pass; False if the compiled path is unavailable."""
    a = torch.tensor(alpha, dtype=r[0].dtype, device=r[0].device)
    return _run("project", _project, list(g), list(r), a)[0]


def _step_counts(states: list[dict]) -> list[float]:
    """The ``state["step"]`` of each parameter, read to the host at once: a fused or capturable AdamW keeps them as
    tensors on the parameters' device, where reading each alone would synchronise once per parameter."""
    steps = [st["step"] for st in states]
    tensors = [s for s in steps if isinstance(s, Tensor)]
    if not tensors:
        return [float(s) for s in steps]
    if len({t.device for t in tensors}) == 1:
        values = torch.stack([t.reshape(()).float() for t in tensors]).tolist()  # one read (counts are exact)
    else:
        values = [float(t) for t in tensors]
    read = iter(values)
    return [next(read) if isinstance(s, Tensor) else float(s) for s in steps]


def _advance_steps(states: list[dict], by: int) -> None:
    """``state["step"] += by`` for every state, the tensor counts in one multi-tensor operation."""
    tensors = [st["step"] for st in states if isinstance(st["step"], Tensor)]
    if tensors:
        torch._foreach_add_(tensors, by)
    for st in states:
        if not isinstance(st["step"], Tensor):
            st["step"] += by


def adamw_group_fusable(optimizer: torch.optim.Optimizer, params: list[Tensor]) -> bool:
    """Whether :func:`compiled_adamw_projected` can take ``optimizer``'s step for ``params``: a plain
    ``torch.optim.AdamW`` (amsgrad, maximize, capturable, differentiable off) over exactly these parameters,
    float32, each with its moments already created (the optimizer creates them at its first step)."""
    if type(optimizer) is not torch.optim.AdamW:
        return False
    owned = [p for group in optimizer.param_groups for p in group["params"]]
    if len(owned) != len(params) or any(a is not b for a, b in zip(owned, params)):
        return False
    for group in optimizer.param_groups:
        if any(group.get(k) for k in ("amsgrad", "maximize", "capturable", "differentiable")):
            return False
        states = []
        for p in group["params"]:
            st = optimizer.state.get(p)
            if p.dtype != torch.float32 or not st or "exp_avg" not in st or "exp_avg_sq" not in st:
                return False
            states.append(st)
        if len(set(_step_counts(states))) > 1:  # one bias correction per group: every parameter took as many steps
            return False
    return True


def compiled_scalars_lowp(g: list[Tensor], r: list[Tensor]) -> Tensor | None:
    """``tensor([<g, r>, ||g||^2, ||r||^2])`` (float64) for a reference ``r`` of lower precision than ``g``, in one
    compiled pass (r upcast in registers), or None (use eager)."""
    return _run("scalars_lowp", _scalars_lowp, list(g), list(r))[1]


def compiled_adamw_projected(optimizer: torch.optim.Optimizer, grads: list[Tensor], refs: list[Tensor],
                             alpha: float, write_ref: bool = False) -> bool:
    """The optimizer's AdamW step with g - alpha r as the gradient, one compiled pass per parameter group
    (``grads`` and ``refs`` in the optimizer's parameter order); ``state["step"]`` advances as the optimizer's
    own step would. ``write_ref``: also store g, rounded, into ``refs`` (a lower-precision reference) in the same
    pass. False (nothing changed) if the compiled path is unavailable. The caller checked
    :func:`adamw_group_fusable`."""
    if _FAILED:
        return False
    name, fn = "adamw", _adamw_projected
    if write_ref:
        name, fn = ("adamw_lowp", _adamw_lowp_ref) if alpha else ("adamw_lowp_keep", _adamw_lowp_ref_keep)
    i = 0
    for group in optimizer.param_groups:
        ps = group["params"]
        n = len(ps)
        states = [optimizer.state[p] for p in ps]
        _advance_steps(states, 1)
        t = float(states[0]["step"])
        lr, wd, (b1, b2), eps = group["lr"], group["weight_decay"], group["betas"], group["eps"]
        dev = ps[0].device

        def f(x: float) -> Tensor:
            return torch.tensor(x, dtype=torch.float32, device=dev)

        ok, _ = _run(name, fn, [p.detach() for p in ps], list(grads[i:i + n]), list(refs[i:i + n]),
                     [st["exp_avg"] for st in states], [st["exp_avg_sq"] for st in states], f(alpha),
                     f(1 - lr * wd), f(b1), f(b2), f(lr / (1 - b1 ** t)), f((1 - b2 ** t) ** 0.5), f(eps))
        if not ok:
            if i:  # a failure after a group was updated cannot be undone: the caller must not step again
                raise RuntimeError("GAC(kernels='fused-adamw'): torch.compile failed part-way through the "
                                   f"optimizer's parameter groups ({_FAILED[0][:300]})")
            _advance_steps(states, -1)
            return False
        i += n
    return True


def compiled_available() -> bool:
    """False once a compile has failed in this process."""
    return not _FAILED


# kernels="auto": measured with `gacbench overhead --kernels eager,fused-adamw` (docs/callbacks.md, "Choosing the
# kernels"). The compile of the fused path costs a fixed time per process (59-334 s cold on the shared 2-core test
# machine); at 20M parameters the kept step, the branch it speeds up least, saved 3.3-31 ms per step, which puts
# the crossover at 1.3e11 to 3.6e11 parameters x steps (three runs). At 5M and 10M the compiled kept step was
# slower than the eager one in three runs of four, so the rule asks for the smallest size measured faster: the
# benchmark's 20M shape (19.99M parameters), rounded down.
AUTO_COMPILE_PARAM_STEPS = 4.0e11
AUTO_MIN_PARAMS = 19_000_000


@dataclass(frozen=True)
class Measurement:
    """One kernel path's figures from ``gacbench overhead`` on one machine, as recorded in docs/gpu.md.

    ``device``: the torch device type; ``gpu``: its name as ``torch.cuda.get_device_name`` gives it; ``torch``: the
    version it ran; ``shape``, ``params``: the parameter list timed; ``adamw_ms``: the fused AdamW step beside it;
    ``keep``, ``shrink``: GAC's two branches as ratios to that step (the record's ``gac_keep*_over_adamw`` and
    ``gac*_over_adamw``); ``first_call_s``: the first round's time beyond a timed one (the compile; 0 for eager)."""

    device: str
    gpu: str
    torch: str
    shape: str
    params: int
    kernels: str
    adamw_ms: float
    keep: float
    shrink: float
    first_call_s: float


#: What ``kernels="auto"`` chooses from off the CPU: one row per kernel path and machine, from docs/gpu.md.
#: ``gacbench gpu-check`` and ``gacbench overhead`` print each measured path's row in this form; a path's row counts
#: once the eager row of the same GPU and shape is here (see :func:`choose_measured`).
MEASURED: tuple[Measurement, ...] = (
    # docs/gpu.md, "The last GPU run": 16.5 ms kept, 21.7 ms shrunk, beside a 16.3 ms AdamW step
    Measurement("cuda", "NVIDIA H200", "2.11", "qwen3-1.7b", 1_720_574_976, "eager", 16.3, 1.01, 1.33, 0.0),
    # the Triton path's row goes here, as the GPU run prints it (docs/gpu.md, "The Triton path"); not measured yet
)


def choose_measured(n_params: int, steps: float, device_type: str, device_name: str | None,
                    table: tuple[Measurement, ...] = MEASURED) -> str:
    """The path ``kernels="auto"`` runs on a device other than the CPU, from measured rows only: a path other than
    eager counts where ``table`` holds its row and the eager row of the same device, GPU and shape, the GPU is this
    one (``device_name``), the model is at least the measured size (``params <= n_params``: nothing is assumed
    about smaller models), and both of its branches cost less than eager's (ratios to AdamW). Its saving per step
    is the smaller of the two branches' (a run that keeps every step must also repay the compile), in seconds at
    the measured AdamW step; it must repay ``first_call_s`` within ``steps``. Of the paths that count, the one
    that saves most; else ``"eager"``."""
    best, best_saving = "eager", 0.0
    if not (0 < steps < math.inf):
        return best
    for row in table:
        if row.kernels == "eager" or row.device != device_type or row.gpu != device_name or row.params > n_params:
            continue
        base = next((e for e in table if e.kernels == "eager" and (e.device, e.gpu, e.shape) ==
                     (row.device, row.gpu, row.shape)), None)
        if base is None:
            continue
        saving_s = min(base.keep - row.keep, base.shrink - row.shrink) * row.adamw_ms / 1e3
        if saving_s > 0 and saving_s * steps >= row.first_call_s and saving_s > best_saving:
            best, best_saving = row.kernels, saving_s
    return best


def measurement_row(record: dict, kernels: str, suffix: str) -> str | None:
    """``kernels``' :class:`Measurement` from a ``gacbench overhead`` record, as the line to add to
    :data:`MEASURED`; None for a record not taken on a GPU."""
    if not record.get("gpu"):
        return None
    shape = record.get("shape_name") or f"{record['params'] / 1e6:.0f}M"
    # the AdamW step timed in this path's own rounds (records before per-path timing hold one for all paths)
    adamw_s = record.get(f"adamw_step{suffix or '_eager'}_s", record["adamw_step_s"])
    return (f'Measurement("cuda", {record["gpu"]!r}, {record["torch"].split("+")[0]!r}, {shape!r}, '
            f'{record["params"]:_}, {kernels!r}, {adamw_s * 1e3:.1f}, '
            f'{record["gac_keep" + suffix + "_over_adamw"]:.2f}, {record["gac" + suffix + "_over_adamw"]:.2f}, '
            f'{record["first_round_extra" + (suffix or "_eager") + "_s"]:.1f}),')


def choose_kernels(n_params: int, steps: float, device_type: str = "cpu", device_name: str | None = None,
                   table: tuple[Measurement, ...] = MEASURED) -> str:
    """What ``GAC(kernels="auto")`` runs: on the CPU ``"fused-adamw"`` where its compile pays back within the run,
    else ``"eager"``; on other devices what the measured rows of ``table`` choose (:func:`choose_measured`).

    ``n_params``: the elements GAC reads (the optimizer's parameters); ``steps``: the run's optimizer steps,
    known when fit starts (the Trainer's ``max_steps``, or its epochs' batches; inf for a run without an end);
    ``device_name``: the GPU's name (``torch.cuda.get_device_name``). On the CPU the compile costs a fixed time per
    process and saves a time per step that grows with the model: it pays back when ``n_params >= AUTO_MIN_PARAMS``
    and ``n_params * steps >= AUTO_COMPILE_PARAM_STEPS``. Eager where the steps are unknown (inf or not positive).
    On CUDA :data:`MEASURED` holds only the eager path's H200 figures, so every CUDA run is eager until a measured
    row of another path is added (docs/gpu.md)."""
    if device_type != "cpu":
        return choose_measured(n_params, steps, device_type, device_name, table)
    if not (0 < steps < math.inf) or n_params < AUTO_MIN_PARAMS:
        return "eager"
    return "fused-adamw" if n_params * steps >= AUTO_COMPILE_PARAM_STEPS else "eager"
