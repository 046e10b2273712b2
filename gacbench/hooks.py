"""GAC and the alignment monitor on any ``torch.optim.Optimizer``, without Lightning.

:func:`attach_gac` and :func:`attach_alignment_monitor` register a step pre-hook
(``Optimizer.register_step_pre_hook``) that runs, inside every ``optimizer.step()``, the code the
Lightning callbacks run in ``on_before_optimizer_step``: the same :class:`GACTransform` with the same
settings, on all the optimizer's parameters (in param-group order), with the same metric names. A hook runs
once per optimizer step, so under gradient accumulation it sees the accumulated gradient; it runs after
whatever the training loop did before ``step()`` (``clip_grad_norm_``, ``GradScaler.unscale_``), and not at
all on a step a ``GradScaler`` skips for an overflow.

Clipping comes before the hook, GAC(clip(g)), where the Lightning callback acts before Lightning's clipping,
clip(GAC(g)). Without clipping the two give the same parameters bit for bit. Clipping by the global norm
rescales the gradient, so with the references "grad" and "applied" c_t and the decision are the same either
way (under "ema" and "update" the reference differs); the step's length differs on the steps the clipping
acts on, and ``grad/norm`` is the clipped norm here, the unclipped one in the callback (docs/integrations.md).

``optimizer.step(closure)`` is refused: step pre-hooks run before the closure computes the gradients,
so a hook would read the previous step's. Lightning always steps with a closure: use the callbacks
:class:`gacbench.GAC` and :class:`gacbench.AlignmentMonitor` there.
"""

from __future__ import annotations

import inspect
import math
import warnings
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gacbench.functional.alignment import (
    ACTION_NAMES,
    KEEP,
    SKIP,
    full_vector_scalars,
    plain_number,
    reference_cosine,
)
from gacbench.functional.buffer import (
    LazyFlatBuffer,
    check_dense_gradients,
    check_parameters,
    keep_reference,
    listed_entries,
)
from gacbench.functional.collective import agree_scalars, release_process_group_at_exit
from gacbench.functional.gac import local, parse_dtype
from gacbench.functional.settings import GACSettings, summary_settings
from gacbench.functional.stats import alignment_summary
from gacbench.usage import UsageError

# optimizer -> a weak reference to its GAC hook while attached: nothing here keeps either alive
_GAC_ATTACHED: "weakref.WeakKeyDictionary[torch.optim.Optimizer, weakref.ref]" = weakref.WeakKeyDictionary()


def _attached(optimizer: torch.optim.Optimizer) -> "GACHook | None":
    ref = _GAC_ATTACHED.get(optimizer)
    return None if ref is None else ref()


def attached_gac(optimizer: torch.optim.Optimizer) -> str | None:
    """Who attached the GAC hook this optimizer has (``attach_gac(...)``, ``GACCallback(...)``), or None."""
    hook = _attached(optimizer)
    return None if hook is None else hook.origin


def _params(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The optimizer's parameters across its param groups, in order, deduplicated."""
    seen: set[int] = set()
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def _check_optimizer(optimizer: Any, who: str) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UsageError(f"{who}: expected a torch.optim.Optimizer, got {type(optimizer).__name__}; pass the "
                         "optimizer whose step() applies the gradients (for a Lightning module use the callbacks)")


def _check_no_closure(who: str, callback: str, args: tuple, kwargs: dict) -> None:
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # args[0] is the optimizer
    if closure is not None:
        raise UsageError(
            f"{who}: optimizer.step(closure) is not supported: the step pre-hook runs before the closure computes "
            f"the gradients, so it would act on the previous step's. Call loss.backward() and then "
            f"optimizer.step() without a closure; under Lightning (which always steps with a closure) use the "
            f"callback gacbench.{callback} instead."
        )


class _Reducer:
    """The gradient scalars made identical on every rank with one collective, as the callbacks do:
    sharded gradients (DTensor, FSDP2) are summed over the ranks; replicated ones (DDP) are broadcast
    from rank 0 so that decisions cannot differ by a rounding error."""

    def __init__(self, distributed: bool | None, sharded: bool) -> None:
        initialized = _initialized()
        self.active = initialized and dist.get_world_size() > 1 and distributed is not False
        self.sharded = sharded
        if self.active:
            release_process_group_at_exit()

    def __call__(self, scalars: Tensor) -> Tensor:
        return agree_scalars(scalars, self.sharded) if self.active else scalars


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _is_sharded(grads: list[Tensor | None]) -> bool:
    return any(g is not None and hasattr(g, "to_local") for g in grads)


class _StepHook:
    """Registration, removal and the c_t trace shared by the two hooks."""

    who = ""
    callback = ""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup: int, tol: float, distributed: bool | None) -> None:
        _check_optimizer(optimizer, self.who)
        try:
            warmup, tol = summary_settings(self.who, warmup, tol)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        if distributed not in (None, True, False):
            raise UsageError(f"{self.who}: distributed={distributed!r} must be None (automatic), True or False")
        if distributed and not _initialized():
            raise UsageError(f"{self.who}: distributed=True but torch.distributed is not initialized; call "
                             "torch.distributed.init_process_group before attaching, or pass distributed=None")
        self.optimizer = optimizer
        self.params = _params(optimizer)
        check_parameters(self.params, self.who)
        self._n_listed = listed_entries(optimizer)
        self.warmup, self.tol, self.distributed = warmup, float(tol), distributed
        self.values: list[float] = []  # the c_t trace
        self.metrics: dict[str, float] = {}
        self._reducer: _Reducer | None = None
        self._handle = optimizer.register_step_pre_hook(self._pre_step)

    def _pre_step(self, optimizer, args: tuple, kwargs: dict) -> None:
        _check_no_closure(self.who, self.callback, args, kwargs)
        if listed_entries(optimizer) != self._n_listed:
            raise UsageError(f"{self.who}: the optimizer's parameters changed after the hook was attached "
                             "(add_param_group); attach the hook after the last add_param_group")
        found_inf = getattr(optimizer, "found_inf", None)  # set by a GradScaler around a fused optimizer's step
        if found_inf is not None and float(found_inf) > 0:
            self.metrics = {}
            return  # an fp16 overflow: the fused step skips itself, and the scaler lowers its scale
        if getattr(optimizer, "grad_scale", None) is not None:
            raise UsageError(f"{self.who}: this fused optimizer receives scaled gradients from the GradScaler; call "
                             "scaler.unscale_(optimizer) before scaler.step(optimizer)")
        self._step()

    def _reduce(self, grads: list[Tensor | None]) -> _Reducer:
        """Fixed at the first step with a gradient (whether the gradients are DTensor shards)."""
        if self._reducer is None and any(g is not None for g in grads):
            self._reducer = _Reducer(self.distributed, _is_sharded(grads))
        return self._reducer or _Reducer(self.distributed, False)

    def _step(self) -> None:
        raise NotImplementedError

    def summary(self) -> dict[str, float]:
        """The on-policy statistics of paper Table 3 over the c_t trace after ``warmup`` steps:
        ``q90_abs``, ``max_abs``, ``frac_le_tol``, ``median``, ``n``, and ``skipped``: the steps without a c_t (a
        zero or non-finite gradient, logged as NaN and never a reference)."""
        return alignment_summary(self.values, self.warmup, self.tol)

    def remove(self) -> None:
        """Unregister the hook; the optimizer steps as if it had never been attached."""
        self._handle.remove()
        if _attached(self.optimizer) is self:
            del _GAC_ATTACHED[self.optimizer]


class GACHook(_StepHook):
    """GAC on an optimizer; returned by :func:`attach_gac`.

    ``metrics``: the last step's values under the callback's names (``align/cos`` or ``align/ref_cos``,
    ``grad/norm``, ``align/proj_frac``, ``align/skip``, ``gac/coef``; ``gac/zero_grad``, ``gac/bad_grad`` on
    those steps); empty after a step that had no gradient. ``action``: ``"keep"``, ``"shrink"``, ``"project"``
    or ``"skip"`` at the last step. ``transform``: the :class:`GACTransform` that does the work.
    """

    who = "attach_gac"
    callback = "GAC"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        c_low: float = GACSettings.c_low,
        c_high: float = GACSettings.c_high,
        high_mode: str = GACSettings.high_mode,
        reference: str = GACSettings.reference,
        ema_decay: float = GACSettings.ema_decay,
        shrink: str = GACSettings.shrink,
        buffer_dtype: str | torch.dtype | None = GACSettings.buffer_dtype,
        on_bad_grad: str = GACSettings.on_bad_grad,
        on_zero_grad: str = GACSettings.on_zero_grad,
        warmup: int = GACSettings.warmup,
        tol: float = GACSettings.tol,
        kernels: str = GACSettings.kernels,
        distributed: bool | None = None,
        steps: int | None = None,
    ) -> None:
        try:
            self.config = GACSettings(c_low, c_high, high_mode, reference, ema_decay, shrink, buffer_dtype,
                                      on_bad_grad, on_zero_grad, warmup, tol, kernels)  # checked as the callback's
        except ValueError as e:
            raise UsageError(str(e)) from None
        run_steps = plain_number(steps) if steps is not None else None
        if steps is not None and not ((isinstance(run_steps, int) and run_steps > 0) or run_steps == math.inf):
            raise UsageError(f"attach_gac: steps={steps!r} must be None (unknown), a positive integer (the run's "
                             "optimizer steps, which kernels='auto' chooses from) or math.inf")
        self.transform = self.config.transform()
        _check_optimizer(optimizer, self.who)
        first = attached_gac(optimizer)
        if first is not None:
            raise UsageError(f"attach_gac: this optimizer already has GAC, attached by {first}; a second one would "
                             "apply GAC twice per step. Attach it once, or call .remove() on the first hook")
        given = {k: v for k, v in self.config.as_dict().items() if v != getattr(GACSettings, k)}
        #: who attached this hook (named when a second attach is refused); GACCallback writes its own name here
        self.origin = "attach_gac(" + ", ".join(f"{k}={v!r}" for k, v in given.items()) + ")"
        self.on_bad_grad, self.on_zero_grad = on_bad_grad, on_zero_grad
        self.run_steps, self._kernels_chosen = run_steps, False
        self.steps = self.changed = self.skipped = self.bad = self.zero = 0
        self.action = ""
        super().__init__(optimizer, self.config.warmup, self.config.tol, distributed)
        _GAC_ATTACHED[optimizer] = weakref.ref(self)

    @property
    def cos_key(self) -> str:
        return "align/cos" if self.transform.reference == "grad" else "align/ref_cos"

    def _step(self) -> None:
        params = self.params
        if not self._kernels_chosen and params:  # kernels="auto": the path from the parameters and the run's steps
            self._kernels_chosen = True
            self.transform.choose_kernels_for(sum(p.numel() for p in params), self.run_steps or math.inf,
                                              params[0].device)
        reduce = self._reduce([p.grad for p in params])
        # swap exchanges p.grad with the reference's storage (plain gradient tensors only); keep_alias stays off:
        # the hook never sees zero_grad, so p.grad must not be the reference itself
        out = self.transform.step(params, reduce, swap=not reduce.sharded, keep_alias=False,
                                  zero_passes=self.on_zero_grad == "pass")
        self.metrics, self.action = {}, ""
        if out is None:
            return
        self.steps += 1
        if out.bad:  # a zero or non-finite gradient has no c_t (NaN, counted as skipped in the summary)
            self.values.append(float("nan"))
            self.metrics = {self.cos_key: float("nan")}
        if out.zero:
            self.zero += 1
            self.metrics["gac/zero_grad"] = float(self.zero)
            if self.on_zero_grad == "pass":
                self.action = ACTION_NAMES[KEEP]
                return
        if out.bad:
            self._bad_gradient(out.grad_sq, self.on_zero_grad if out.zero else self.on_bad_grad)
            return
        d = out.decision
        self.changed += d.changed
        self.skipped += d.action == SKIP
        self.action = ACTION_NAMES[d.action]
        if out.measured:
            self.values.append(d.cos)
        self.metrics = {
            "grad/norm": math.sqrt(out.grad_sq),
            "align/proj_frac": self.changed / self.steps,
            "align/skip": float(d.action == SKIP),
            "gac/coef": d.coef,
        }
        if out.measured:
            self.metrics[self.cos_key] = d.cos

    def _bad_gradient(self, g_sq: float, action: str) -> None:
        kind = "zero" if g_sq == 0.0 else f"non-finite (||g||^2 = {g_sq})"
        if action == "raise":
            option = "on_zero_grad='pass'" if g_sq == 0.0 else "on_bad_grad='skip'"
            raise FloatingPointError(
                f"attach_gac: the gradient at step {self.steps} is {kind}. Look for NaN/inf in the loss "
                f"(learning rate too high, log of zero, fp16 overflow), or pass {option} to go on."
            )
        self.bad += 1
        self.skipped += 1
        if self.bad == 1:
            warnings.warn(f"attach_gac: skipping step {self.steps}: its gradient is {kind}. "
                          "Later skips are counted in gac/bad_grad.", stacklevel=4)
        self.transform.skip(self.params)
        self.action = ACTION_NAMES[SKIP]
        self.metrics.update({"align/skip": 1.0, "gac/bad_grad": float(self.bad)})

    def state_dict(self) -> dict[str, Any]:
        """Counters, the c_t trace and the transform's state (its reference, copied)."""
        return {"steps": self.steps, "changed": self.changed, "skipped": self.skipped, "bad": self.bad,
                "zero": self.zero, "values": list(self.values), "transform": self.transform.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        keys = {"steps", "changed", "skipped", "bad", "zero", "values", "transform"}
        if not isinstance(state, dict) or set(state) != keys:
            found = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise UsageError("attach_gac: load_state_dict expects the dict the hook's state_dict() returns, with keys "
                             f"{sorted(keys)}; got {found}")
        self.steps, self.changed, self.skipped = state["steps"], state["changed"], state["skipped"]
        self.bad, self.zero = state["bad"], state["zero"]
        self.values = [float(v) for v in state["values"]]
        self.transform.load_state_dict(state["transform"])


class AlignmentMonitorHook(_StepHook):
    """c_t = cos(g_t, g_{t-1}) at every optimizer step; returned by :func:`attach_alignment_monitor`.

    ``metrics``: the last step's ``grad/norm`` and (from the second step on) ``align/cos``;
    ``summary()``: the Table 3 statistics.
    """

    who = "attach_alignment_monitor"
    callback = "AlignmentMonitor"

    def __init__(self, optimizer: torch.optim.Optimizer, warmup: int = 50, tol: float = 0.05,
                 buffer_dtype: str | torch.dtype | None = None, distributed: bool | None = None) -> None:
        try:
            dtype = parse_dtype(self.who, buffer_dtype)
        except ValueError as e:
            raise UsageError(str(e)) from None
        self.has_prev = False
        self._prev = LazyFlatBuffer(dtype)
        super().__init__(optimizer, warmup, tol, distributed)

    def _step(self) -> None:
        params = self.params
        check_dense_gradients(params, self.who)
        grads = [local(p.grad) if p.grad is not None else None for p in params]
        self.metrics = {}
        if all(g is None for g in grads):
            return
        reduce = self._reduce([p.grad for p in params])
        prev = self._prev.get([local(p.detach()) for p in params])
        scalars = reduce(full_vector_scalars(grads, prev.views))  # a missing gradient is zero
        g_r, g_sq, r_sq = (float(v) for v in scalars.tolist())  # one read to the host
        self.metrics["grad/norm"] = math.sqrt(g_sq) if g_sq >= 0 else float("nan")
        if not (math.isfinite(g_sq) and g_sq > 0.0):  # a zero or non-finite gradient: no c_t, never a reference
            self.metrics["align/cos"] = float("nan")
            self.values.append(float("nan"))
            return
        if self.has_prev:
            c = reference_cosine(g_r, g_sq, r_sq)  # NaN against a zero reference: no c_t, counted as skipped
            self.metrics["align/cos"] = c
            self.values.append(c)
        self.has_prev = keep_reference(prev, grads, self.who)

    def state_dict(self) -> dict[str, Any]:
        """Whether a previous gradient is held, the c_t trace and that gradient (a flat copy, or None)."""
        return {"has_prev": self.has_prev, "values": list(self.values), "prev": self._prev.state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        keys = {"has_prev", "values", "prev"}
        if not isinstance(state, dict) or set(state) != keys:
            raise UsageError("attach_alignment_monitor: load_state_dict expects the dict the hook's state_dict() "
                             f"returns, with keys {sorted(keys)}")
        self.has_prev = bool(state["has_prev"])
        self.values = [float(v) for v in state["values"]]
        self._prev.load(state["prev"])


_GAC_SETTINGS = frozenset(inspect.signature(GACHook.__init__).parameters) - {"self", "optimizer"}


def _check_known(settings: dict[str, Any]) -> None:
    unknown = sorted(set(settings) - _GAC_SETTINGS)
    if unknown:
        raise UsageError(f"attach_gac: unknown setting(s) {', '.join(unknown)}; the settings are "
                         f"{', '.join(sorted(_GAC_SETTINGS))}")


def check_gac_settings(settings: dict[str, Any]) -> None:
    """Raise a UsageError naming the first bad or unknown setting of :func:`attach_gac`, without an optimizer."""
    _check_known(settings)
    probe = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    GACHook(probe, **settings).remove()


def attach_gac(optimizer: torch.optim.Optimizer, **settings: Any) -> GACHook:
    """Run Gradient Alignment Control inside every ``optimizer.step()`` (a step pre-hook).

    ``settings`` are those of :class:`gacbench.GAC` (``c_low``, ``c_high``, ``high_mode``, ``reference``,
    ``ema_decay``, ``shrink``, ``buffer_dtype``, ``on_bad_grad``, ``on_zero_grad``, ``warmup``, ``tol``,
    ``kernels``), plus ``distributed``: None agrees the scalars across ranks whenever torch.distributed is
    initialized with more than one rank, False never. A skipped step sets every ``p.grad`` to None, so the
    optimizer leaves parameters and state (momentum, step count) untouched, as the callback does.
    ``kernels="fused-adamw"`` runs as ``"compiled"`` here: the hook does not take the optimizer's step itself;
    ``kernels="auto"`` (the default, as in the callback) chooses from the parameter count and ``steps``, the
    run's optimizer steps (the callback reads them from the trainer; without them "auto" runs eager).
    Returns the :class:`GACHook` (``.metrics``, ``.action``, ``.summary()``, ``state_dict()``,
    ``load_state_dict()``, ``remove()``).
    """
    _check_known(settings)
    return GACHook(optimizer, **settings)


def attach_alignment_monitor(optimizer: torch.optim.Optimizer, warmup: int = 50, tol: float = 0.05,
                             buffer_dtype: str | torch.dtype | None = None,
                             distributed: bool | None = None) -> AlignmentMonitorHook:
    """Log c_t = cos(g_t, g_{t-1}) and ``grad/norm`` at every ``optimizer.step()`` (a step pre-hook), as
    :class:`gacbench.AlignmentMonitor` does. Attach it before :func:`attach_gac` to see raw gradients (hooks
    run in the order they were attached). Returns the :class:`AlignmentMonitorHook` (``.metrics``,
    ``.summary()`` with the Table 3 statistics, ``state_dict()``, ``load_state_dict()``, ``remove()``)."""
    return AlignmentMonitorHook(optimizer, warmup, tol, buffer_dtype, distributed)
