"""Methods by name: a method is a list of callbacks plus settings, not a code path.

``gac(c_low=0.02,c_high=0.2)`` names the method ``gac`` with keyword overrides; the runner
records the spec string per cell in its canonical form (:func:`canonical_method`: the settings in the
order of the method's signature, those equal to their default dropped, so ``gac()``, ``gac( c_low=0.05 )``
and ``gac`` are one method). Every registered stabilizer is a method name too, and ``+`` joins them
(``gac+m2po``: at most one loss-side stabilizer, and no callback type twice, checked when the callbacks are
built). ``register_method`` adds a named method.

A method may need a *reference cell*: ``gac-calibrated`` takes its thresholds from the synchronous cell
of the same task and seed (:mod:`gacbench.functional.calibration`). The runner runs that cell first,
computes the calibration from its stored trace (``gacbench.bench.runner.reference_calibration``; the metric the
method names as its ``trace``: ``align/cos`` for ``gac-calibrated``, ``align/step_cos`` for
``gac-step-calibrated``), stores it in the cell's ``config.json`` under ``calibration`` and hands the cell to
:func:`method_callbacks`.
"""

from __future__ import annotations

import ast
import inspect
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from lightning.pytorch import Callback

from gacbench.callbacks import GAC
from gacbench.callbacks._common import log_metrics
from gacbench.functional.calibration import CAP, GAP, QUANTILE, calibration_record
from gacbench.stabilizers.base import loss_stabilizers
from gacbench.stabilizers.lr_scaled import StalenessLR
from gacbench.stabilizers.registry import NAME_PATTERN
from gacbench.usage import UsageError


@dataclass(frozen=True)
class Method:
    name: str
    help: str
    build: Callable[..., list[Callback]]  # keyword settings -> gradient/loss-side callbacks
    stale: bool = True  # False: the synchronous reference, always run at s = 0
    #: "sync": the method needs the synchronous cell of its task and seed, done, before it runs; its build
    #: then receives ``calibration=`` (computed from that cell by the bench runner)
    reference: str | None = None
    #: the settings the method takes, in order, with their defaults (a spec's setting equal to its default is left
    #: out of the canonical form); None: the keyword parameters of ``build``
    settings: dict[str, Any] | None = field(default=None, compare=False)
    #: with a reference: the metric of the reference cell's metrics.csv its calibration is computed from
    trace: str = "align/cos"


METHODS: dict[str, Method] = {}
REFERENCE_KINDS = ("sync",)


def register_method(name: str, help: str, build: Callable[..., list[Callback]], stale: bool = True,
                    reference: str | None = None, settings: dict[str, Any] | None = None,
                    trace: str = "align/cos") -> Method:
    if not re.fullmatch(r"[a-z0-9][a-z0-9_+-]*", name):
        raise ValueError(f"method name {name!r}: use lower-case letters, digits, '-', '_' or '+'")
    if name in METHODS:
        raise ValueError(f"method {name!r} is already registered")
    if reference is not None and reference not in REFERENCE_KINDS:
        raise ValueError(f"method {name!r}: reference={reference!r} is not one of {', '.join(REFERENCE_KINDS)}")
    METHODS[name] = Method(name, help, build, stale, reference, settings, trace)
    return METHODS[name]


def _signature_defaults(fn: Callable) -> dict[str, Any]:
    """The keyword parameters of ``fn`` that have a default, in order, with it."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name: p.default for p in inspect.signature(fn).parameters.values()
            if p.kind in kinds and p.default is not inspect.Parameter.empty}


#: GAC's settings as a method takes them: the callback's defaults, with no warm-up excluded from its summary
GAC_SETTINGS = {**_signature_defaults(GAC.__init__), "warmup": 0}


def _gac(**defaults: Any) -> Callable[..., list[Callback]]:
    def build(**kwargs: Any) -> list[Callback]:
        return [GAC(**{"warmup": 0, **defaults, **kwargs})]
    return build


def _register_gac(name: str, help: str, **defaults: Any) -> None:
    register_method(name, help, _gac(**defaults), settings={**GAC_SETTINGS, **defaults})


register_method("sync", "synchronous training (s = 0), no stabilizer", lambda: [], stale=False)
register_method("stale", "staleness s, no stabilizer", lambda: [])
_register_gac("gac", "GAC, docs/design.md's default rule: reference = previous raw gradient, full projection above "
              "c_high")
_register_gac("gac-skip", "GAC skipping steps with c_t >= c_high instead of projecting", high_mode="skip")
_register_gac("gac-cosine", "GAC shrinking so that cos(g~, r) = c_low exactly", shrink="cosine")
_register_gac("gac-applied", "GAC against the previous applied (projected) gradient", reference="applied")
_register_gac("gac-update", "GAC against the previous parameter step (includes the optimizer's preconditioning)",
              reference="update")
_register_gac("gac-ema", "GAC against an EMA (decay 0.9) of raw gradients", reference="ema")
_register_gac("gac-step", "GAC on the optimizer's step: the rule applied to theta_{t+1} - theta_t against the previous "
              "applied step, thresholds on cos of consecutive steps (align/step_cos)", target="step")

#: Settings of ``gac-calibrated`` that belong to the calibration rule, not to the GAC callback.
RULE_KEYS = ("quantile", "gap", "cap")


class CalibratedGAC(GAC):
    """GAC whose (c_low, c_high) come from a synchronous reference run (gacbench.functional.calibration).

    Args:
        calibration: a record of :func:`gacbench.functional.calibration.calibration_record` (what the bench
            runner computes from the synchronous cell of the same task and seed), or None.
        reference: instead of ``calibration``: the reference run's c_t trace, its alignment summary, its
            ``metrics.csv`` or its cell directory; ``reference_warmup`` (leading steps left out) and
            ``quantile``/``gap``/``cap`` apply to it.
        **kwargs: any other GAC setting (``high_mode``, ``reference`` is named ``gac_reference`` here, ...).

    Without either, the callback can be built (the runner checks method names this way) but refuses to
    train. At the start of fit it logs the thresholds it uses as ``gac/c_low`` and ``gac/c_high``.
    """

    def __init__(self, calibration: dict | None = None, reference=None, reference_warmup: int = 0,
                 quantile: float = QUANTILE, gap: float = GAP, cap: float = CAP, gac_reference: str = "grad",
                 **kwargs: Any) -> None:
        for key in ("c_low", "c_high"):
            if key in kwargs:
                raise ValueError(f"gac-calibrated: {key} is computed from the synchronous reference run; to set the "
                                 "thresholds by hand use gac(c_low=...,c_high=...)")
        if calibration is None and reference is not None:
            key = "align/step_cos" if kwargs.get("target") == "step" else "align/cos"
            calibration = calibration_record(_reference_trace(reference, reference_warmup, key), 0, quantile, gap,
                                             cap)
        self.calibration = calibration
        if calibration is not None:
            kwargs.update(c_low=calibration["c_low"], c_high=calibration["c_high"])
        super().__init__(reference=gac_reference, **kwargs)

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit" and self.calibration is None:
            raise ValueError("gac-calibrated has no thresholds: it takes them from the synchronous cell of the same "
                             "task and seed, which the bench runner runs first (include sync and staleness 0 in the "
                             "grid, or store that cell in --out); outside the runner pass CalibratedGAC(reference=...)")
        super().setup(trainer, pl_module, stage)

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        t = self.transform
        log_metrics(trainer, {"gac/c_low": t.c_low, "gac/c_high": t.c_high})


def _reference_trace(reference, warmup: int, key: str = "align/cos"):
    """A reference given as a trace or summary (returned as is, the trace cut by ``warmup``), a metrics.csv
    or a cell directory (its ``key`` column, cut by ``warmup``)."""
    from pathlib import Path

    if isinstance(reference, dict):
        if warmup:
            raise ValueError("gac-calibrated: an alignment summary already excludes its warm-up; leave "
                             "reference_warmup at 0")
        return reference
    if isinstance(reference, (str, Path)):
        import csv

        path = Path(reference)
        path = path / "metrics.csv" if path.is_dir() else path
        if not path.is_file():
            raise FileNotFoundError(f"gac-calibrated: no metrics.csv at {path} (give the reference run's metrics.csv "
                                    "or its cell directory)")
        with path.open() as f:  # Lightning's CSVLogger: a step column and one column per logged name
            rows = [(int(float(r["step"])), float(r[key])) for r in csv.DictReader(f)
                    if r.get(key) not in (None, "")]
        cos = [v for _, v in sorted(rows)]
        if not cos:
            raise ValueError(f"gac-calibrated: {path} has no {key} column; the reference run needs an "
                             f"AlignmentMonitor (or GAC) that logs {key}")
        return cos[warmup:]
    return list(reference)[warmup:]


def _gac_calibrated(calibration: dict | None = None, **kwargs: Any) -> list[Callback]:
    settings = {k: v for k, v in kwargs.items() if k not in RULE_KEYS}
    if "reference" in settings:
        settings["gac_reference"] = settings.pop("reference")
    return [CalibratedGAC(calibration=calibration, **{"warmup": 0, **settings})]


def _gac_step_calibrated(calibration: dict | None = None, **kwargs: Any) -> list[Callback]:
    return _gac_calibrated(calibration, **{"target": "step", **kwargs})


_CALIBRATED_SETTINGS = {"quantile": QUANTILE, "gap": GAP, "cap": CAP,
                        **{k: v for k, v in GAC_SETTINGS.items() if k not in ("c_low", "c_high")}}
register_method("gac-calibrated", "GAC with (c_low, c_high) anchored to the synchronous run of the same task and seed: "
                "c_low = q0.9(|c_t|), c_high = max(c_low + 0.25, max |c_t|) after the warm-up "
                "(gacbench/functional/calibration.py)", _gac_calibrated, reference="sync",
                settings=_CALIBRATED_SETTINGS)
register_method("gac-step-calibrated", "gac-step with (c_low, c_high) anchored to the step cosines (align/step_cos) of "
                "the synchronous run of the same task and seed, by gac-calibrated's rule", _gac_step_calibrated,
                reference="sync", settings={**_CALIBRATED_SETTINGS, "target": "step"}, trace="align/step_cos")
register_method("lr-scaled", "learning rate scaled by the staleness bound S, eta min(1, s0 / S) (s0 = 1; "
                "form='smooth': eta / (1 + S / s0)); the base method at S = 0 (arXiv 2607.01083, docs/baselines.md)",
                lambda **kw: [StalenessLR(**kw)], settings=_signature_defaults(StalenessLR.__init__))


def reference_cell(cell: dict) -> dict | None:
    """The cell ``cell``'s method needs done before it runs (the synchronous cell of its task and seed), or None."""
    method, _ = parse_method(cell["method"])
    return None if method.reference is None else sync_cell(cell)


def sync_cell(cell: dict) -> dict:
    """The synchronous cell (s = 0) of ``cell``'s task, parameters and seed."""
    ref = {k: v for k, v in cell.items() if k not in ("method", "staleness", "ablation", "calibration")}
    return {**ref, "method": "sync", "staleness": 0}


def reference_trace(spec: str) -> str:
    """The metric of the reference cell's metrics.csv that the method of ``spec`` calibrates from
    (``align/cos``; ``align/step_cos`` for ``gac-step-calibrated``)."""
    method, _ = parse_method(spec)
    if method.reference is None:
        return "align/cos"
    part = next(p for p in _parts(spec) if p[0] in METHODS and METHODS[p[0]].reference)
    return METHODS[part[0]].trace


def reference_rule(spec: str) -> dict[str, Any]:
    """The calibration-rule settings (``quantile``, ``gap``, ``cap``) given to the method of ``spec`` that needs a
    reference cell (``gac-calibrated(quantile=0.95)`` -> ``{"quantile": 0.95}``); {} when it has none."""
    part = next((p for p in _parts(spec) if p[0] in METHODS and METHODS[p[0]].reference), None)
    return {} if part is None else {k: v for k, v in part[1].items() if k in RULE_KEYS}


def split_top_level(spec: str, sep: str) -> list[str]:
    """Split on ``sep`` outside parentheses: 'gac(c_low=0.02,c_high=0.2),stale' -> ['gac(...)', 'stale']."""
    parts, depth, cur = [], 0, ""
    for ch in spec:
        depth += ch == "("
        depth -= ch == ")"
        if ch == sep and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return parts + [cur]


def _parse_one(spec: str) -> tuple[str, dict[str, Any]]:
    m = re.fullmatch(rf"\s*({NAME_PATTERN})\s*(?:\((.*)\))?\s*", spec)
    if not m:
        raise ValueError(f"method spec {spec!r}: expected NAME or NAME(key=value,...), joined by '+'")
    name, args = m.group(1), m.group(2)
    kwargs: dict[str, Any] = {}
    if args and args.strip():
        text = f"f({args})"
        form = (f"method spec {spec!r}: settings are key=literal pairs separated by commas, e.g. "
                "gac(c_low=0.02,c_high=0.2)")
        try:
            call = ast.parse(text, mode="eval").body
        except SyntaxError:
            raise ValueError(form) from None
        if (not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args
                or any(kw.arg is None for kw in call.keywords)):
            raise ValueError(form)
        for kw in call.keywords:
            if kw.arg in kwargs:
                raise ValueError(f"method spec {spec!r}: setting {kw.arg} is given twice; give it once")
            kwargs[kw.arg] = _setting(spec, kw.arg, ast.get_source_segment(text, kw.value) or "", kw.value)
    return name, kwargs


def _setting(spec: str, key: str, source: str, node: ast.expr) -> Any:
    """The value of setting ``key`` (a Python literal; a number must be finite)."""
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        if source.strip().lower().lstrip("+-") in ("nan", "inf", "infinity"):
            value = math.nan
        else:
            quoted = f", e.g. {key}='{source}'" if source.isidentifier() else ""
            raise ValueError(f"method spec {spec!r}: setting {key}={source} is not a literal (settings are key=literal "
                             f"pairs: a number, True, False, None or quoted text{quoted})") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"method spec {spec!r}: setting {key}={source} must be a finite number")
    return value


def stabilizers() -> dict[str, dict[str, Any]]:
    """The stabilizer registry (:func:`gacbench.stabilizers.registry.available`), refusing a plug-in that has a
    method's name: a method spec reads the methods' names first, so it would run the method (built-in GAC for
    ``gac-skip``) and table it under the plug-in's name."""
    from gacbench.stabilizers import registry

    found = registry.available()
    for name, info in found.items():
        if info["source"] != "gacbench" and name in METHODS:
            raise UsageError(f"stabilizer {name!r} of {info['package']} ({info['source']}) has the name of a gacbench "
                             f"method ({METHODS[name].help.split('. ')[0].rstrip('.')}), which a method spec would "
                             "run instead of it; rename the entry point in that package's pyproject.toml to a name "
                             "that `gacbench methods` and `gacbench stabilizers` do not list")
    return found


def method_settings(name: str) -> dict[str, Any]:
    """The settings of the method or stabilizer ``name``, in order, with their defaults ({} when unknown)."""
    if name in METHODS:
        method = METHODS[name]
        return dict(method.settings) if method.settings is not None else _signature_defaults(method.build)
    stab = stabilizers().get(name)
    return _signature_defaults(stab["cls"].__init__) if stab else {}


def canonical_method(spec: str) -> str:
    """The canonical form of a method spec: per part (joined by ``+`` in the order given), the name, then the
    settings in the order of the method's signature (:func:`method_settings`; unknown ones after, by name), each
    written as ``key=repr(value)``, a setting equal to its default left out (an integer given for a number setting
    counts as that number), and no parentheses without settings. ``gac()``, ``gac ( c_low=0.05 )`` and ``gac`` are
    all ``gac``; ``m2po(variant="areal")`` is ``m2po(variant='areal')``; ``gac(c_high=0.2,c_low=0.02)`` is
    ``gac(c_low=0.02,c_high=0.2)``. Raises ValueError for a spec that does not parse."""
    out = []
    for name, kwargs in _parts(spec):
        defaults = method_settings(name)
        order = {key: i for i, key in enumerate(defaults)}
        items = []
        for key in sorted(kwargs, key=lambda k: (order.get(k, len(order)), k)):
            value = kwargs[key]
            if key in defaults:
                default = defaults[key]
                if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
                    value = float(value)
                if type(value) is type(default) and value == default:
                    continue
            items.append(f"{key}={value!r}")
        out.append(f"{name}({','.join(items)})" if items else name)
    return "+".join(out)


def _parts(spec: str) -> list[tuple[str, dict[str, Any]]]:
    return [_parse_one(p) for p in split_top_level(spec, "+")]


def parse_method(spec: str) -> tuple[Method, dict[str, Any]]:
    """A method spec -> (Method, kwargs). A spec is a registered method (``gac``, ``gac(c_low=0.02)``),
    a registered stabilizer (``m2po``, ``bapo(rho0=0.5)``), or several joined by ``+`` (``gac+m2po``):
    at most one loss-side stabilizer and one callback of each type, checked when the callbacks are built
    (:func:`method_callbacks`, which the bench runner calls for every method before anything runs)."""
    stabs = stabilizers()
    parts = _parts(spec)
    if len(parts) == 1 and parts[0][0] in METHODS:
        return METHODS[parts[0][0]], parts[0][1]
    for name, _ in parts:
        if name not in stabs and name not in METHODS:
            raise ValueError(f"unknown method {name!r}; methods: {', '.join(sorted(METHODS))}; "
                             f"stabilizers: {', '.join(sorted(stabs))}")
        if name in METHODS and not METHODS[name].stale:
            raise ValueError(f"method {spec!r}: {name!r} is the synchronous reference and cannot be combined")

    refs = {METHODS[name].reference for name, _ in parts if name in METHODS and METHODS[name].reference}
    if len(refs) > 1 or sum(1 for name, _ in parts if name in METHODS and METHODS[name].reference) > 1:
        raise ValueError(f"method {spec!r}: at most one method that needs a reference cell per combination")

    def build(calibration: dict | None = None) -> list[Callback]:
        out: list[Callback] = []
        for name, kwargs in parts:
            try:
                if name in METHODS:
                    extra = {"calibration": calibration} if METHODS[name].reference else {}
                    out += METHODS[name].build(**kwargs, **extra)
                else:
                    out += [stabs[name]["cls"](**kwargs)]
            except TypeError:
                _check_setting_names(spec, name, kwargs)
                raise
        _check_combination(spec, out)
        return out

    return Method(spec, "combination", build, stale=True, reference=next(iter(refs), None)), {}


def plugin_provenance(spec: str) -> dict[str, dict[str, Any]]:
    """The stabilizer plug-ins (installed packages' entry points, not gacbench's own) that method ``spec`` uses,
    by name, with what a stored run records of each (:func:`gacbench.stabilizers.registry.plugin_record`);
    empty for a method of built-ins only."""
    from gacbench.stabilizers.registry import plugin_record

    stabs = stabilizers()
    found = {name: stabs[name] for name, _ in _parts(spec)
             if name not in METHODS and name in stabs and stabs[name]["source"] != "gacbench"}
    return {name: plugin_record(info) for name, info in sorted(found.items())}


def _check_setting_names(spec: str, name: str, kwargs: dict[str, Any]) -> None:
    """After its builder refused ``kwargs`` with a TypeError: name the setting the method or stabilizer ``name``
    does not take, the closest one it does, and its settings (nothing when its settings are not known by name)."""
    known = method_settings(name)
    unknown = [k for k in kwargs if k != "calibration" and known and k not in known]
    if unknown:
        import difflib

        close = difflib.get_close_matches(unknown[0], list(known), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"method {spec!r}: {name} has no setting {unknown[0]!r}; {hint}its settings are "
                         f"{', '.join(known)}")


def _check_combination(spec: str, callbacks: list[Callback]) -> None:
    """Refuse callbacks that cannot run together: two of one type (``gac+gac``, ``gac+gac-skip``: one GAC per run)
    or two loss-side stabilizers (``m2po+bapo``)."""
    seen: dict[type, int] = {}
    for cb in callbacks:
        seen[type(cb)] = seen.get(type(cb), 0) + 1
    twice = [t.__name__ for t, n in seen.items() if n > 1]
    if twice:
        raise ValueError(f"method {spec!r}: {', '.join(twice)} twice; a run takes one callback of each type (join "
                         "different stabilizers, e.g. 'gac+m2po')")
    try:
        loss_stabilizers(callbacks)
    except ValueError as exc:
        raise ValueError(f"method {spec!r}: {exc}") from None


def on_policy_identity(spec: str) -> bool:
    """Whether the method of ``spec`` leaves a synchronous run unchanged, so that its on-policy control (the method
    at s = 0) is sync itself: every callback it builds (with the spec's settings) declares ``on_policy_identity``
    True (:class:`gacbench.stabilizers.base.Stabilizer`; a callback that declares nothing counts as False). The
    synchronous reference and ``stale``, which build no callback, are True. False for a spec that does not parse or
    names a stabilizer that is not installed."""
    try:
        method, kwargs = parse_method(spec)
        if method.reference is not None:
            kwargs = {**kwargs, "calibration": None}  # built without thresholds: enough to read the declarations
        callbacks = method.build(**kwargs)
    except (ValueError, TypeError, KeyError):
        return False
    return all(getattr(cb, "on_policy_identity", False) is True for cb in callbacks)


#: The method families of the report's figures, in their order: what a method's callbacks act on
FAMILIES = ("GAC readings", "loss-side corrections", "combinations", "other methods")


def method_family(spec: str) -> str:
    """The family of the method of ``spec`` (one of :data:`FAMILIES`), from the callbacks it builds (as
    :func:`on_policy_identity` builds them), each of one kind: GAC, a loss-side stabilizer, or another callback.
    ``GAC readings`` where every callback is GAC, ``loss-side corrections`` where every one is a loss-side stabilizer,
    ``combinations`` where they are of two kinds or more (``gac+m2po``), else ``other methods`` (``lr-scaled``; also
    sync and stale, which build nothing, and a spec that does not parse or names a stabilizer that is not
    installed)."""
    try:
        method, kwargs = parse_method(spec)
        if method.reference is not None:
            kwargs = {**kwargs, "calibration": None}
        callbacks = method.build(**kwargs)
    except (ValueError, TypeError, KeyError):
        return FAMILIES[-1]
    kinds = {"gac" if isinstance(cb, GAC) else "loss" if loss_stabilizers([cb]) else "other" for cb in callbacks}
    if len(kinds) > 1:
        return FAMILIES[2]
    return {frozenset({"gac"}): FAMILIES[0], frozenset({"loss"}): FAMILIES[1]}.get(frozenset(kinds), FAMILIES[-1])


def method_callbacks(spec: str, cell: dict | None = None) -> list[Callback]:
    """The callbacks of a method spec. A method with a reference (``gac-calibrated``) takes its calibration
    from ``cell["calibration"]`` (written by the bench runner); without it, the callbacks refuse to train."""
    method, kwargs = parse_method(spec)
    if method.reference is not None:
        kwargs = {**kwargs, "calibration": (cell or {}).get("calibration")}
    try:
        return method.build(**kwargs)
    except TypeError as exc:
        _check_setting_names(spec, method.name, kwargs)
        raise ValueError(f"method {spec!r}: {exc}") from None
