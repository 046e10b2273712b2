"""Methods by name: a method is a list of callbacks plus settings, not a code path.

``gac(c_low=0.02,c_high=0.2)`` names the method ``gac`` with keyword overrides; the runner
records the full spec string per cell. Every registered stabilizer is a method name too, and
``+`` joins them (``gac+m2po``). ``register_method`` adds a named method.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import Any, Callable

from lightning.pytorch import Callback

from gacbench.callbacks import GAC


@dataclass(frozen=True)
class Method:
    name: str
    help: str
    build: Callable[..., list[Callback]]  # keyword settings -> gradient/loss-side callbacks
    stale: bool = True  # False: the synchronous reference, always run at s = 0


METHODS: dict[str, Method] = {}


def register_method(name: str, help: str, build: Callable[..., list[Callback]], stale: bool = True) -> Method:
    if not re.fullmatch(r"[a-z0-9][a-z0-9_+-]*", name):
        raise ValueError(f"method name {name!r}: use lower-case letters, digits, '-', '_' or '+'")
    if name in METHODS:
        raise ValueError(f"method {name!r} is already registered")
    METHODS[name] = Method(name, help, build, stale)
    return METHODS[name]


def _gac(**defaults: Any) -> Callable[..., list[Callback]]:
    def build(**kwargs: Any) -> list[Callback]:
        return [GAC(**{"warmup": 0, **defaults, **kwargs})]
    return build


register_method("sync", "synchronous training (s = 0), no stabilizer", lambda: [], stale=False)
register_method("stale", "staleness s, no stabilizer", lambda: [])
register_method("gac", "GAC, docs/design.md's default rule: reference = previous raw gradient, full projection above c_high", _gac())
register_method("gac-skip", "GAC skipping steps with c_t >= c_high instead of projecting", _gac(high_mode="skip"))
register_method("gac-cosine", "GAC shrinking so that cos(g~, r) = c_low exactly", _gac(shrink="cosine"))
register_method("gac-applied", "GAC against the previous applied (projected) gradient", _gac(reference="applied"))
register_method("gac-update", "GAC against the previous parameter step (includes the optimizer's preconditioning)", _gac(reference="update"))
register_method("gac-ema", "GAC against an EMA (decay 0.9) of raw gradients", _gac(reference="ema"))


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
    m = re.fullmatch(r"\s*([A-Za-z0-9_-]+)\s*(?:\((.*)\))?\s*", spec)
    if not m:
        raise ValueError(f"method spec {spec!r}: expected NAME or NAME(key=value,...), joined by '+'")
    name, args = m.group(1), m.group(2)
    kwargs: dict[str, Any] = {}
    if args and args.strip():
        try:
            call = ast.parse(f"f({args})", mode="eval").body
            assert isinstance(call, ast.Call) and not call.args
            kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
        except (SyntaxError, ValueError, AssertionError) as exc:
            raise ValueError(f"method spec {spec!r}: arguments must be key=literal pairs ({exc})") from None
    return name, kwargs


def parse_method(spec: str) -> tuple[Method, dict[str, Any]]:
    """A method spec -> (Method, kwargs). A spec is a registered method (``gac``, ``gac(c_low=0.02)``),
    a registered stabilizer (``m2po``, ``bapo(rho0=0.5)``), or several joined by ``+`` (``gac+m2po``):
    at most one loss-side stabilizer, checked when the run starts."""
    from gacbench.stabilizers import registry

    parts = [_parse_one(p) for p in split_top_level(spec, "+")]
    if len(parts) == 1 and parts[0][0] in METHODS:
        return METHODS[parts[0][0]], parts[0][1]
    stabs = registry.available()
    for name, _ in parts:
        if name not in stabs and name not in METHODS:
            raise ValueError(f"unknown method {name!r}; methods: {', '.join(sorted(METHODS))}; "
                             f"stabilizers: {', '.join(sorted(stabs))}")
        if name in METHODS and not METHODS[name].stale:
            raise ValueError(f"method {spec!r}: {name!r} is the synchronous reference and cannot be combined")

    def build() -> list[Callback]:
        out: list[Callback] = []
        for name, kwargs in parts:
            out += METHODS[name].build(**kwargs) if name in METHODS else [stabs[name]["cls"](**kwargs)]
        return out

    return Method(spec, "combination", build, stale=True), {}


def method_callbacks(spec: str) -> list[Callback]:
    method, kwargs = parse_method(spec)
    try:
        return method.build(**kwargs)
    except TypeError as exc:
        raise ValueError(f"method {spec!r}: {exc}") from None
