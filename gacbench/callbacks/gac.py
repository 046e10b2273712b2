"""Gradient Alignment Control (GAC) as a Lightning callback: a thin adapter over
:class:`gacbench.functional.gac.GACTransform` (``target="grad"``) and
:class:`gacbench.functional.step_gac.StepGAC` (``target="step"``).

At every optimizer step (after accumulation, the DDP all-reduce and AMP unscaling,
before clipping) it measures c = cos(g_t, r) against a reference direction r and
applies the rule of docs/design.md: keep (c <= c_low), shrink the aligned component
(c_low < c < c_high), or remove it / skip the step (c >= c_high). With ``target="step"`` the same rule
acts on the optimizer's step Delta_t = theta_{t+1} - theta_t, right after the optimizer has taken it,
against the previous applied step.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from typing_extensions import override

from gacbench.callbacks._common import (
    CosineTrace,
    StepGuard,
    agree,
    check_automatic_optimization,
    check_no_replicated_shards,
    check_strategy,
    is_sharded,
    load_tensor,
    local,
    log_metrics,
    optimizer_params,
    parameter_names,
    save_tensor,
)
from gacbench.functional.alignment import SKIP, sq_norm
from gacbench.functional.buffer import check_parameters
from gacbench.functional.gac import GACState, check_choice
from gacbench.functional.settings import DEFAULTS, GACSettings
from gacbench.functional.step_gac import StepGAC

TARGETS = ("grad", "step")


def run_steps(trainer: "pl.Trainer") -> float:
    """The run's optimizer steps from the Trainer's own settings, with no collective (``estimated_stepping_batches``
    can enter one under DDP at ``on_train_start``): ``max_steps``, else the epochs' batches over
    ``accumulate_grad_batches``, else inf."""
    if trainer.max_steps is not None and trainer.max_steps > 0:
        return float(trainer.max_steps)
    batches = trainer.num_training_batches
    if trainer.max_epochs is not None and trainer.max_epochs > 0 and math.isfinite(batches):
        return float(trainer.max_epochs * math.ceil(batches / trainer.accumulate_grad_batches))
    return math.inf


def clips_after_hook(trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> bool:
    """Whether the gradients may be clipped in place after ``on_before_optimizer_step``: Lightning calls the
    module's ``configure_gradient_clipping`` there on every step, which clips by ``gradient_clip_val`` unless
    the module overrides it (and then it may clip by its own rule)."""
    return bool(trainer.gradient_clip_val) or is_overridden("configure_gradient_clipping", pl_module,
                                                             pl.LightningModule)


def _never_writes_gradients(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's own step leaves ``p.grad`` as it is: torch's Adam and AdamW (not ``differentiable``),
    and SGD without Nesterov momentum (whose foreach path adds the momentum into ``p.grad`` in place)."""
    step = type(optimizer).step
    if any(g.get("differentiable", False) for g in optimizer.param_groups):
        return False
    if step in (torch.optim.Adam.step, torch.optim.AdamW.step):
        return True
    return step is torch.optim.SGD.step and not any(g.get("nesterov", False) for g in optimizer.param_groups)


def listed_after(trainer: "pl.Trainer", callback: Callback) -> list[Callback]:
    """The trainer's callbacks listed after ``callback`` (whose hooks Lightning calls after its own)."""
    cbs = trainer.callbacks
    return cbs[cbs.index(callback) + 1 :] if callback in cbs else []


def gradients_stay_put(trainer: "pl.Trainer", pl_module: "pl.LightningModule", gac: Callback) -> bool:
    """Whether nothing writes ``p.grad`` in place between GAC's ``on_before_optimizer_step`` and the next
    ``zero_grad``, so that on a kept step GAC's reference may be ``p.grad`` itself (no copy): no clipping after
    the hook (:func:`clips_after_hook`), no ``on_before_optimizer_step`` of the module (Lightning calls it after
    the callbacks'), none of a callback listed after GAC unless it declares ``keeps_gradients = True``, and an
    optimizer whose step does not write the gradient (:func:`_never_writes_gradients`)."""
    if clips_after_hook(trainer, pl_module) or is_overridden("on_before_optimizer_step", pl_module,
                                                             pl.LightningModule):
        return False
    if any(is_overridden("on_before_optimizer_step", cb, Callback) and not getattr(cb, "keeps_gradients", False)
           for cb in listed_after(trainer, gac)):
        return False
    return all(_never_writes_gradients(opt) for opt in trainer.optimizers)


class GAC(Callback):
    """Gradient Alignment Control.

    Args:
        c_low: below this cosine the gradient is untouched (the on-policy range; paper: 0.05).
        c_high: at or above it the aligned component is removed, or the step skipped (paper: 0.3).
        high_mode: ``"project"`` removes g_par entirely when c >= c_high; ``"skip"`` skips the step.
        reference: the direction r the alignment is measured against: ``"grad"`` the previous
            raw gradient g_{t-1} (then ``align/cos`` is c_t of docs/design.md); ``"applied"`` the
            previous gradient after GAC; ``"update"`` the previous parameter step
            -(theta_t - theta_{t-1}), which includes the optimizer's preconditioning (it reads theta_t,
            so it must be listed after any callback declaring ``swaps_parameters``, such as
            StalenessSimulator; the wrong order is refused at fit);
            ``"ema"`` an exponential moving average of raw gradients.
        ema_decay: the decay of the ``"ema"`` reference, in [0, 1).
        shrink: ``"component"`` (docs/design.md) or ``"cosine"``; see :func:`gacbench.functional.gac_decision`.
        buffer_dtype: dtype of the stored reference (``"bfloat16"`` halves its memory); default
            each parameter's own dtype. Not allowed below a parameter's precision for ``"update"``.
        on_bad_grad: a non-finite gradient is skipped with a warning (``"skip"``) or
            stops the run (``"raise"``). Under an fp16 GradScaler non-finite gradients are left
            to the scaler, which skips the step and lowers its scale.
        on_zero_grad: an all-zero gradient (in RL: every group with equal rewards) has nothing to
            project: ``"pass"`` (default) hands it to the optimizer untouched, as a run without GAC
            would, so that GAC-vs-stale comparisons are not confounded by skipped optimizer steps
            (AdamW still moves on momentum); ``"skip"`` skips the step with a warning; ``"raise"``
            stops the run. The reference is kept either way, and the step has no c_t: it logs NaN and counts as
            ``skipped`` in the summary (as a non-finite gradient does).
        warmup, tol: steps excluded from, and the tolerance of, the end-of-fit alignment summary.
        kernels: ``"auto"`` (default): on the CPU ``"fused-adamw"`` where its compile pays back within the run
            (from the number of parameters and the run's optimizer steps, read when fit starts), on a GPU what its
            measured rows choose (none but eager's yet); else ``"eager"`` (see
            :func:`gacbench.functional.kernels.choose_kernels`); ``kernels_used`` tells which.
            ``"triton"``: the scalars in one Triton launch over the whole parameter list, the projection (or, where
            storage cannot be swapped, the projection and the reference's update) in one more
            (gacbench.functional.triton_kernels); on CUDA, and on the CPU only under ``TRITON_INTERPRET=1``
            (Triton's interpreter, for checking); anywhere else the eager path, with one warning per reason (and,
            without a warning, on a step where a parameter has no gradient).
            ``"eager"``, ``"compiled"``: the alignment scalars and the projection as two
            ``torch.compile`` kernels over the whole parameter list (gacbench.functional.kernels), or
            ``"fused-adamw"``: the compiled scalars, and, when the optimizer is a plain ``torch.optim.AdamW``
            and no gradient clipping or GradScaler acts after this hook, a shrunk or projected step taken
            by GAC as that AdamW's update with g - alpha r formed in its own pass (the optimizer's step then
            finds no gradient and does nothing). Used where the reference is the raw gradient and the
            gradients are plain float32 tensors, else the eager path runs. The first step compiles
            (20-30 s on 2 CPU cores); a compile failure falls back to eager with one warning.
        target: what the rule acts on. ``"grad"`` (default): the gradient, as above. ``"step"``: the optimizer's
            step Delta_t = theta_{t+1} - theta_t, read in a post-step hook of the optimizer, against the previous
            applied step (:class:`gacbench.functional.step_gac.StepGAC`): c = cos(Delta_t, Delta~_{t-1}) is
            logged as ``align/step_cos``, a shrunk or projected step is written as theta_{t+1} = theta_t +
            Delta~_t, and ``high_mode="skip"`` restores theta_t exactly; the optimizer's moments keep this
            step's gradient. ``reference``, ``ema_decay``, ``buffer_dtype``, ``on_zero_grad`` and ``kernels``
            belong to the gradient target and must stay at their defaults; ``on_bad_grad`` applies to a
            non-finite gradient (checked before the step, so that AdamW's moments never take it in) and to a
            non-finite step (``"skip"`` restores theta_t).

    Logs ``align/cos`` (``align/ref_cos`` for references other than ``"grad"``; ``align/step_cos`` for
    ``target="step"``, which leaves ``align/cos`` and ``grad/norm`` to the AlignmentMonitor), ``grad/norm``,
    ``align/proj_frac`` (share of steps changed so far), ``align/skip`` and ``gac/coef``, into
    ``trainer.callback_metrics`` every step and to the loggers every ``log_every_n_steps``.
    """

    kind = "gradient"  # the stabilizer API: GAC acts on gradients, composes with one loss-side stabilizer
    on_policy_identity = False  # it acts on synchronous steps too, wherever c_t > c_low

    def __init__(
        self,
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
        target: str = "grad",
    ) -> None:
        self.config = GACSettings(c_low, c_high, high_mode, reference, ema_decay, shrink, buffer_dtype, on_bad_grad,
                                  on_zero_grad, warmup, tol, kernels)  # checked there, as attach_gac's and TRL's
        self.transform = self.config.transform()
        check_choice("GAC", "target", target, TARGETS)
        self.target = target
        self.step_transform: StepGAC | None = None
        if target == "step":
            given = {k: (getattr(self.config, k), getattr(DEFAULTS, k))
                     for k in ("reference", "ema_decay", "buffer_dtype", "on_zero_grad", "kernels")}
            odd = [f"{k}={v!r}" for k, (v, default) in given.items() if v != default]
            if odd:
                raise ValueError(f"GAC(target='step'): {', '.join(odd)} belong to the gradient target; the step "
                                 "target measures against the previous applied step. Drop them, or use target='grad'.")
            self.step_transform = StepGAC(c_low, c_high, high_mode, shrink)
        self.on_bad_grad, self.on_zero_grad = on_bad_grad, on_zero_grad
        self._reset()

    def _reset(self) -> None:
        """No reference, trace or counts: each fit starts fresh (a resume loads its state after ``setup``)."""
        self.transform.state = GACState()  # the same transform (its settings and kernels), without a reference
        if self.step_transform is not None:
            t = self.transform
            self.step_transform = StepGAC(t.c_low, t.c_high, t.high_mode, t.shrink)
        self.trace = CosineTrace(self.config.warmup, self.config.tol, "GAC")
        self._guard = StepGuard("GAC")
        self.steps = self.changed = self.skipped = self.bad = self.zero = 0
        self.summary: dict[str, float] = {}

    @property
    def reference(self) -> str:
        return self.transform.reference

    @property
    def kernels_used(self) -> str:
        """The kernel path the steps run: ``kernels`` as given, or what ``"auto"`` chose when fit started."""
        return self.transform.kernels

    @property
    @override
    def state_key(self) -> str:
        t = self.transform
        extra = {"target": "step"} if self.target == "step" else {}
        return self._generate_state_key(c_low=t.c_low, c_high=t.c_high, high_mode=t.high_mode, reference=t.reference,
                                        shrink=t.shrink, ema_decay=t.ema_decay, **extra)

    @property
    def logs_raw_alignment(self) -> bool:
        """The capability AlignmentMonitor looks for: with the previous raw gradient as reference, GAC
        computes c_t itself and logs ``align/cos``, ``grad/norm`` and the end-of-fit summary."""
        return self.target == "grad" and self.reference == "grad"

    @property
    def logs_step_alignment(self) -> bool:
        """The capability AlignmentMonitor looks for before logging ``align/step_cos``: with ``target="step"`` GAC
        logs the cosine of consecutive (applied) optimizer steps itself."""
        return self.target == "step"

    @property
    def cos_key(self) -> str:
        """The metric name of the cosine this instance thresholds."""
        if self.target == "step":
            return "align/step_cos"
        return "align/cos" if self.reference == "grad" else "align/ref_cos"

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit":
            self._reset()  # an instance passed to a second fit carries nothing of the first into it
            check_automatic_optimization(pl_module, "GAC")
            check_strategy(trainer, "GAC", allow_sharded=True)
            if self.reference == "update":
                self._check_order(trainer)

    def _check_order(self, trainer: "pl.Trainer") -> None:
        """``reference="update"`` reads theta_t in ``on_before_optimizer_step``: a callback listed after GAC
        that declares ``swaps_parameters`` has not yet put theta_t back at that point, so GAC would read its
        stale iterate and build its reference from the wrong parameters."""
        for cb in listed_after(trainer, self):
            if getattr(cb, "swaps_parameters", False):
                name = type(cb).__name__
                raise ValueError(
                    f"GAC(reference='update') must be listed after {name}: GAC reads the parameters theta_t in "
                    f"on_before_optimizer_step, and {name} (which declares swaps_parameters) puts theta_t back "
                    f"in that same hook, so listed after GAC it has not done so yet and GAC would build its "
                    f"reference from a stale iterate. Move GAC after {name} in callbacks=[...]."
                )

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._params = optimizer_params(trainer, "GAC")  # fixed for the fit: not re-collected every step
        self._guard.start(trainer)
        check_no_replicated_shards(self._params, "GAC")
        # fixed for the fit as well: whether the reference may alias p.grad on kept steps, and whether the
        # fused-adamw path may take the optimizer's step inside this hook: not when a callback listed after GAC
        # has an on_before_optimizer_step, which would run after that step (a simulator putting theta_t back
        # over the step taken from its stale iterate, a learning-rate scale the step did not use, a monitor
        # finding p.grad None)
        self._alias = gradients_stay_put(trainer, pl_module, self)
        self._may_fuse = not any(is_overridden("on_before_optimizer_step", cb, Callback)
                                 for cb in listed_after(trainer, self))
        self.transform.names = parameter_names(pl_module, self._params)
        check_parameters(self._params, "GAC", self.transform.names)
        if self.step_transform is not None:
            self.step_transform.start(self._params)
            self._hook = trainer.optimizers[0].register_step_post_hook(partial(self._after_step, trainer))
            return
        if self.transform.requested_kernels == "auto":
            # the run's total steps, not those left: a resumed run makes the same choice as the uninterrupted one
            n_params = sum(p.numel() for p in self._params)  # the global count (a DTensor counts every shard)
            self.transform.choose_kernels_for(n_params, run_steps(trainer),
                                              self._params[0].device if self._params else "cpu")

    def _check_gradient(self, trainer: "pl.Trainer") -> None:
        """``target="step"``: a non-finite gradient would reach AdamW's moments and make every later step
        non-finite, so it is handled before the step as the gradient target handles it (``on_bad_grad``); one
        read of the gradient. Under a GradScaler the scaler skips such a step itself."""
        if getattr(trainer.precision_plugin, "scaler", None) is not None:
            return
        grads = [local(p.grad) for p in self._params if p.grad is not None]
        if not grads:
            return
        g_sq = float(agree(trainer, torch.stack([sq_norm(grads)]), is_sharded(trainer))[0])
        if not math.isfinite(g_sq):
            self.steps += 1
            self._bad_gradient(trainer, self._params, g_sq, self.on_bad_grad)

    def _after_step(self, trainer: "pl.Trainer", optimizer, args, kwargs) -> None:
        """``target="step"``: the optimizer's post-step hook (the step has moved the parameters)."""
        out = self.step_transform.step(self._params, partial(agree, trainer, sharded=is_sharded(trainer)))
        if out is None:  # the step moved nothing
            return
        self.steps += 1
        if out.bad:
            self.bad += 1
            self.skipped += 1
            if self.on_bad_grad == "raise":
                raise FloatingPointError(
                    f"GAC: the optimizer's step at step {trainer.global_step} is non-finite (||step||^2 = "
                    f"{out.step_sq}); the parameters were restored. Look for NaN/inf in the loss (learning rate too "
                    "high, log of zero), or pass GAC(on_bad_grad='skip') to go on.")
            if self.bad == 1:
                rank_zero_warn(f"GAC: skipping step {trainer.global_step}: the optimizer's step is non-finite. "
                               "Later skips are counted in gac/bad_grad.")
            log_metrics(trainer, {"align/skip": 1.0, "gac/bad_grad": float(self.bad)})
            return
        d = out.decision
        self.changed += d.changed
        self.skipped += d.action == SKIP
        metrics = {"align/proj_frac": self.changed / self.steps, "align/skip": float(d.action == SKIP),
                   "gac/coef": d.coef}
        if out.measured:
            self.trace.append(d.cos)
            metrics["align/step_cos"] = d.cos
        log_metrics(trainer, metrics)

    @override
    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer) -> None:
        self._guard.check(trainer, optimizer)
        if self.step_transform is not None:  # target="step" acts after the optimizer's step (_after_step)
            self._check_gradient(trainer)
            return
        params = self._params
        sharded = is_sharded(trainer)
        reduce = partial(agree, trainer, sharded=sharded)
        # kernels="fused-adamw" takes a shrunk or projected AdamW step itself; not under a GradScaler, which may
        # still decide to skip the step after this hook
        fuse = (self.transform.kernels == "fused-adamw" and self._may_fuse
                and getattr(trainer.precision_plugin, "scaler", None) is None)
        out = self.transform.step(params, reduce, swap=not sharded, keep_alias=self._alias,
                                  optimizer=optimizer if fuse else None, zero_passes=self.on_zero_grad == "pass")
        if out is None:  # no gradient at all (training_step returned None)
            return
        self.steps += 1
        if out.bad:  # a zero or non-finite gradient has no c_t (NaN, counted as skipped in the summary)
            self.trace.append(float("nan"))
            log_metrics(trainer, {self.cos_key: float("nan")})
        if out.zero:
            self.zero += 1
            log_metrics(trainer, {"gac/zero_grad": float(self.zero)})
            if self.on_zero_grad == "pass":
                return
        if out.bad:
            self._bad_gradient(trainer, params, out.grad_sq, self.on_zero_grad if out.zero else self.on_bad_grad)
            return
        d = out.decision
        self.changed += d.changed
        self.skipped += d.action == SKIP
        if out.measured:
            self.trace.append(d.cos)
        metrics = {
            "grad/norm": math.sqrt(out.grad_sq),
            "align/proj_frac": self.changed / self.steps,
            "align/skip": float(d.action == SKIP),
            "gac/coef": d.coef,
        }
        if out.measured:  # the first step has no reference yet
            metrics[self.cos_key] = d.cos
        log_metrics(trainer, metrics)

    @override
    def on_before_zero_grad(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer) -> None:
        if self.step_transform is None:
            self.transform.release(self._params)

    def _bad_gradient(self, trainer, params, g_sq: float, action: str) -> None:
        if getattr(trainer.precision_plugin, "scaler", None) is not None and not math.isfinite(g_sq):
            return  # an fp16 overflow: the GradScaler skips this step itself
        kind = "zero" if g_sq == 0.0 else f"non-finite (||g||^2 = {g_sq})"
        if action == "raise":
            option = "on_zero_grad='pass'" if g_sq == 0.0 else "on_bad_grad='skip'"
            raise FloatingPointError(
                f"GAC: the gradient at step {trainer.global_step} is {kind}. Look for NaN/inf in the loss "
                f"(learning rate too high, log of zero, fp16 overflow), or pass GAC({option}) to go on."
            )
        self.bad += 1
        self.skipped += 1
        if self.bad == 1:
            rank_zero_warn(f"GAC: skipping step {trainer.global_step}: its gradient is {kind}. "
                           "Later skips are counted in gac/bad_grad.")
        self.transform.skip(params)
        log_metrics(trainer, {"align/skip": 1.0, "gac/bad_grad": float(self.bad)})

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.step_transform is not None:
            self._remove_hook()
            self.summary = self.trace.summary()  # of the step cosines; the align/ summary metrics are c_t's
        elif self.reference == "grad":
            self.summary = self.trace.log_summary(trainer)

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._remove_hook()  # also after a failed fit

    def _remove_hook(self) -> None:
        hook = getattr(self, "_hook", None)
        if hook is not None:
            hook.remove()
            self._hook = None

    # Counters and the c_t trace travel through state_dict(); the transform's state (its reference
    # tensors and whether it is set) travels as one unit in the checkpoint's tensor section.
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "changed": self.changed, "skipped": self.skipped, "bad": self.bad,
                "zero": self.zero, "trace": self.trace.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.steps, self.changed, self.skipped = state_dict["steps"], state_dict["changed"], state_dict["skipped"]
        self.bad, self.zero = state_dict["bad"], state_dict["zero"]
        self.trace.load_state_dict(state_dict["trace"])

    @override
    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        state = self.step_transform if self.step_transform is not None else self.transform
        save_tensor(checkpoint, self.state_key, state.state_dict())

    @override
    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        saved = load_tensor(checkpoint, self.state_key, trainer, "GAC")
        if saved is not None:
            (self.step_transform if self.step_transform is not None else self.transform).load_state_dict(saved)
