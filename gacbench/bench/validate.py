"""The checks of ``gacbench bench``'s input, run before anything runs: the suite file, the command-line lists, the
method specs and the objective parameters. Bad input raises :class:`gacbench.usage.UsageError` naming the option
or file, the value and the fix.

The parameters of every task are checked by the objective's own ``check_settings`` (the check its constructor
runs, :meth:`gacbench.objectives.base.Objective.check_settings`), once per distinct (objective, parameters,
steps, staleness), so the runner refuses exactly what a cell would, without building a model or starting an
engine; then the inputs the parameters name (a task's dataset file) are read once each, by the objective's
``check_inputs``, so a malformed row stops the grid before its first cell. Method specs are read in their
canonical form (:func:`gacbench.methods.canonical_method`) and built once
(:func:`gacbench.methods.method_callbacks`), so a method spelled two ways is one method, and a combination that
cannot run is refused up front.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import yaml

import gacbench.llm  # noqa: F401  (registers the LLM objectives, e.g. grpo)
from gacbench.bench.cell import engine_key, flat_params, is_path_component
from gacbench.bench.theta0 import check_suite_theta0
from gacbench.methods import canonical_method, method_callbacks, parse_method, split_top_level
from gacbench.objectives import is_registered, objective_class, registered_objectives
from gacbench.objectives.base import SEED_MAX
from gacbench.usage import UsageError

REPO_ROOT = Path(__file__).resolve().parents[2]
#: where a wheel install keeps the task files (setup.py copies tasks/ there when it builds the wheel)
PACKAGED_TASKS = Path(__file__).resolve().parents[1] / "_tasks"


def suites_dir(repo_root: Path = REPO_ROOT, packaged: Path = PACKAGED_TASKS) -> Path:
    """The folder of the shipped suites: a checkout's ``tasks/suites`` when the package sits in one (an editable
    install, or ``PYTHONPATH``), else the copy packed into the wheel (``gacbench/_tasks/suites``)."""
    checkout = repo_root / "tasks" / "suites"
    return checkout if checkout.is_dir() or not (packaged / "suites").is_dir() else packaged / "suites"


SUITES_DIR = suites_dir()


def suite_path(name: str) -> Path:
    """A suite by name (tasks/suites/NAME.yaml) or by path."""
    p = Path(name)
    if p.suffix in (".yaml", ".yml") and p.exists():
        return p
    candidate = SUITES_DIR / f"{name}.yaml"
    if candidate.exists():
        return candidate
    known = sorted(x.stem for x in SUITES_DIR.glob("*.yaml")) if SUITES_DIR.exists() else []
    raise UsageError(f"--suite: unknown suite {name!r}; known suites: "
                     f"{', '.join(known) or f'none in {SUITES_DIR}'}, "
                     "or give the path of a suite YAML file")


def check_task_name(where: str, task: Any) -> None:
    """Refuse a task name that is not one path component: a cell's directory is ``OUT/cells/TASK/...``, so a
    ``/``, a ``..`` or an absolute path would put it outside ``--out``."""
    if not is_path_component(task):
        raise UsageError(f"{where}: the task name must be one path component (it names the folder "
                         "OUT/cells/TASK): no '/', '\\' or NUL, and not '.' or '..'; rename the task, e.g. "
                         f"{_component(task)!r}")


def _component(task: Any) -> str:
    name = "".join(ch if ch.isalnum() or ch in "-_+." else "-" for ch in str(task)).strip(".-")
    return name or "task"


EXAMPLES = {"--methods": "sync,stale,gac", "--staleness": "0,8,16", "--seeds": "0,1,2", "--tasks": "quadratic,bandit"}


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _int_list(where: str, key: str, value: Any, lo: int, hi: int | None = None) -> list[int]:
    """A suite's list of integers in [lo, hi] without repeats, else a UsageError naming the key."""
    example = "[0, 8, 16]" if key == "staleness" else "[0, 1, 2]"
    if not isinstance(value, list) or not value:
        raise UsageError(f"{where}: {key}: {value!r} must be a non-empty list, e.g. {key}: {example}")
    for x in value:
        if not _is_int(x) or x < lo or (hi is not None and x > hi):
            bound = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
            raise UsageError(f"{where}: {key}: {x!r} is not an integer {bound}")
    _no_repeats(f"{where}: {key}:", value)
    return value


def _no_repeats(where: str, values: list) -> None:
    seen: set = set()
    for x in values:
        if x in seen:
            note = " (a repeated seed would count the same run twice)" if "seeds" in where else ""
            raise UsageError(f"{where} lists {x} twice; give each value once{note}")
        seen.add(x)


ABLATION = "ablation"  # the --methods keyword that selects a suite's threshold-ablation cells


def _check_methods(where: str, methods: Any) -> list[str]:
    """``methods`` in canonical form (:func:`gacbench.methods.canonical_method`), each built once: an unknown name
    or setting, a setting given twice or not finite, or a combination that cannot run (``gac+gac``, ``m2po+bapo``)
    fails here, not in every cell; two spellings of one method are refused as a repeat, naming both."""
    if not isinstance(methods, list) or not methods or not all(isinstance(m, str) and m.strip() for m in methods):
        raise UsageError(f"{where}: {methods!r} must be a non-empty list of method names, e.g. [sync, stale, gac]")
    _no_repeats(where, [m.strip() for m in methods])
    canonical: dict[str, str] = {}
    for m in methods:
        try:
            method_callbacks(m)
            c = canonical_method(m)
        except ValueError as exc:
            raise UsageError(f"{where} {exc}") from None
        if c in canonical:
            raise UsageError(f"{where} lists {canonical[c].strip()!r} and {m.strip()!r}, which are one method, {c} "
                             "(settings in the method's order, those at their default left out); give each method once")
        canonical[c] = m
    return list(canonical)


def has_loss_on(objective: str) -> bool:
    """Whether the objective defines its own side-effect-free ``loss_on`` (what AssumptionMonitor needs)."""
    from gacbench.objectives.base import Objective

    return getattr(objective_class(objective), "loss_on", Objective.loss_on) is not Objective.loss_on


def check_families(where: str, families: Any) -> dict[str, dict]:
    """A suite's ``families``: a mapping of family names to ``{test: TEST, per: [KEY, ...]}``, TEST one of
    :data:`~gacbench.bench.stats.FAMILY_TESTS` (each test in at most one family, so that every comparison gets one
    adjusted p) and ``per`` a list of :data:`~gacbench.bench.stats.FAMILY_DIMS` (default: none, one family over
    every task, measure and s). Raises a UsageError naming the family and the fix."""
    from gacbench.bench.stats import FAMILY_DIMS, FAMILY_TESTS

    example = "families: {recovers the gap at s: {test: vs_stale, per: [task, measure, staleness]}}"
    if not isinstance(families, dict) or not families:
        raise UsageError(f"{where}: families: must map family names to {{test: ..., per: [...]}}, e.g. {example}")
    out, seen = {}, {}
    for name, spec in families.items():
        at = f"{where}: families: {name!r}"
        if not isinstance(name, str) or not name.strip():
            raise UsageError(f"{where}: families: a family name must be a non-empty string, not {name!r}")
        if not isinstance(spec, dict) or "test" not in spec:
            raise UsageError(f"{at} must be a mapping with test (one of {', '.join(FAMILY_TESTS)}) and optionally "
                             f"per, e.g. {example}")
        unknown = sorted(set(spec) - {"test", "per"})
        if unknown:
            raise UsageError(f"{at}: unknown key {unknown[0]!r}; a family sets test and per")
        if spec["test"] not in FAMILY_TESTS:
            raise UsageError(f"{at}: test {spec['test']!r} is not one of {', '.join(FAMILY_TESTS)}")
        if spec["test"] in seen:
            raise UsageError(f"{at}: test {spec['test']!r} is already in family {seen[spec['test']]!r}; each test "
                             "belongs to one family (split it with per: instead)")
        per = spec.get("per", [])
        if not isinstance(per, list) or any(k not in FAMILY_DIMS for k in per) or len(set(per)) != len(per):
            raise UsageError(f"{at}: per: {per!r} must be a list of distinct keys among {', '.join(FAMILY_DIMS)}")
        seen[spec["test"]] = name
        out[name] = {"test": spec["test"], "per": list(per)}
    return out


#: The keys a suite file and each of its tasks may set (docs/bench.md); any other is a typo that would be ignored
SUITE_KEYS = ("name", "tasks", "methods", "staleness", "seeds", "steps", "warmup", "assumptions", "families",
              "ablation")
TASK_KEYS = ("objective", "params", "steps", "staleness", "methods", "extra_methods", "extra_staleness", "on_policy",
             "theta0")


def _known_keys(where: str, mapping: dict, known: tuple[str, ...]) -> None:
    """Refuse a key outside ``known`` (a misspelt ``warmpu:`` would otherwise leave the default in place
    silently), naming the closest known key."""
    import difflib

    for key in mapping:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise UsageError(f"{where}: unknown key {key!r}; {hint}the keys are {', '.join(known)}")


class UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a mapping that holds a key twice (the safe loader keeps the last silently: a
    task block copied without renaming it replaced the first). Checked on the parsed nodes, as written: a merge
    key (``<<: *anchor``) and the keys it brings, which the mapping's own may override, are not repeats."""

    def compose_mapping_node(self, anchor):
        node = super().compose_mapping_node(anchor)
        seen = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = (key_node.tag, key_node.value)
            if key in seen:
                raise yaml.composer.ComposerError(None, None, f"the key {key_node.value!r} appears twice in one "
                                                  "mapping", key_node.start_mark)
            seen.add(key)
        return node


def load_suite(name: str) -> dict[str, Any]:
    """A suite YAML file, checked: a malformed or empty file, a missing key, or a value of the wrong kind
    raises a UsageError that names the file and the key."""
    path = suite_path(name)
    where = f"suite {path}"
    try:
        suite = yaml.load(path.read_text(), Loader=UniqueKeyLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or type(exc).__name__
        line = f" (line {mark.line + 1})" if mark else ""
        raise UsageError(f"{where} is not valid YAML{line}: {problem}; fix the file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{where} cannot be read ({exc})") from None
    if suite is None:
        raise UsageError(f"{where} is empty; a suite sets tasks, methods, staleness, seeds and steps "
                         f"(see {SUITES_DIR / 'synthetic-smoke.yaml'})")
    if not isinstance(suite, dict):
        raise UsageError(f"{where} must be a mapping with the keys tasks, methods, staleness, seeds and steps; "
                         f"it holds a {type(suite).__name__}")
    for key in ("tasks", "methods", "staleness", "seeds", "steps"):
        if key not in suite:
            raise UsageError(f"{where} has no {key!r}; a suite sets tasks, methods, staleness, seeds and steps")
    _known_keys(where, suite, SUITE_KEYS)
    if not _is_int(suite["steps"]) or suite["steps"] < 1:
        raise UsageError(f"{where}: steps: {suite['steps']!r} is not a positive integer (e.g. steps: 300)")
    if not _is_int(suite.get("warmup", 0)) or suite.get("warmup", 0) < 0:
        raise UsageError(f"{where}: warmup: {suite['warmup']!r} is not a non-negative integer")
    if "assumptions" in suite and (not _is_int(suite["assumptions"]) or suite["assumptions"] < 2):
        raise UsageError(f"{where}: assumptions: {suite['assumptions']!r} is not an integer >= 2 (AssumptionMonitor's "
                         "every: estimate L and eta_max(s) every this many steps)")
    _int_list(where, "staleness", suite["staleness"], 0)
    _int_list(where, "seeds", suite["seeds"], 0, SEED_MAX)
    suite["methods"] = _check_methods(f"{where}: methods:", suite["methods"])
    if not isinstance(suite["tasks"], dict) or not suite["tasks"]:
        raise UsageError(f"{where}: tasks: must map task names to {{objective: NAME, params: {{...}}}}")
    for task, spec in suite["tasks"].items():
        at = f"{where}, task {task!r}"
        check_task_name(at, task)
        if not isinstance(spec, dict):
            raise UsageError(f"{at}: must be a mapping such as {{objective: quadratic, params: {{lr: 0.1}}}}")
        _known_keys(at, spec, TASK_KEYS)
        if not is_registered(spec.get("objective")):
            raise UsageError(f"{at}: objective {spec.get('objective')!r} is not one of "
                             f"{', '.join(registered_objectives())}")
        if spec.get("params") is None:
            spec["params"] = {}
        if not isinstance(spec["params"], dict):
            raise UsageError(f"{at}: params: {spec['params']!r} must be a mapping of parameter names to values")
        if "steps" in spec and (not _is_int(spec["steps"]) or spec["steps"] < 1):
            raise UsageError(f"{at}: steps: {spec['steps']!r} is not a positive integer")
        steps = spec.get("steps", suite["steps"])
        if suite.get("warmup", 0) >= steps:
            raise UsageError(f"{at}: warmup: {suite['warmup']} leaves none of its {steps} steps for the c_t "
                             "statistics; lower warmup or raise steps")
        if suite.get("assumptions") and not has_loss_on(spec["objective"]):
            raise UsageError(f"{at}: assumptions: objective {spec['objective']!r} has no side-effect-free loss_on, "
                             "which AssumptionMonitor needs; drop assumptions: from the suite, or use an objective "
                             "that defines loss_on (quadratic, logistic, mlp, grpo)")
        if "extra_methods" in spec:
            spec["extra_methods"] = _check_methods(f"{at}: extra_methods:", spec["extra_methods"])
        if "methods" in spec:
            spec["methods"] = _check_methods(f"{at}: methods:", spec["methods"])
        for key in ("staleness", "extra_staleness"):
            if key in spec:
                _int_list(at, key, spec[key], 0)
                outside = [x for x in spec[key] if x not in (suite["staleness"] if key == "staleness"
                                                            else spec.get("staleness", suite["staleness"]))]
                if outside:
                    within = "the suite's staleness" if key == "staleness" else "the task's staleness"
                    raise UsageError(f"{at}: {key}: {outside} not in {within}; a task's {key} narrows the grid, "
                                     f"so list values of {within} only")
        if "on_policy" in spec:
            spec["on_policy"] = _check_methods(f"{at}: on_policy:", spec["on_policy"])
            sync_like = [m for m in spec["on_policy"] if not parse_method(m)[0].stale]
            if sync_like:
                raise UsageError(f"{at}: on_policy: {sync_like[0]!r} runs at s = 0 already; on_policy lists stale "
                                 "methods to run at s = 0 as well (e.g. on_policy: [gac-step])")
            if 0 not in spec.get("staleness", suite["staleness"]):
                raise UsageError(f"{at}: on_policy: runs its methods at s = 0, and the task's staleness has no 0; "
                                 "add 0 to the staleness or drop on_policy:")
        check_suite_theta0(where, task, spec)
        if "extra_staleness" in spec and "extra_methods" not in spec:
            raise UsageError(f"{at}: extra_staleness: is the staleness of the task's extra_methods, and the task has "
                             "none; add extra_methods: or drop extra_staleness:")
    if "families" in suite:
        suite["families"] = check_families(where, suite["families"])
    ablation = suite.get("ablation")
    if ablation is not None:
        if not isinstance(ablation, dict) or not all(k in ablation for k in ("staleness", "c_low", "c_high")):
            raise UsageError(f"{where}: ablation: must be a mapping with staleness, c_low and c_high "
                             "(and optionally method)")
        _known_keys(f"{where}: ablation:", ablation, ("staleness", "c_low", "c_high", "method"))
        if not _is_int(ablation["staleness"]) or ablation["staleness"] < 1:
            raise UsageError(f"{where}: ablation: staleness: {ablation['staleness']!r} is not a positive integer")
        for key in ("c_low", "c_high"):
            values = ablation[key]
            numbers = isinstance(values, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                       and math.isfinite(x) for x in values)
            if not values or not numbers:
                raise UsageError(f"{where}: ablation: {key}: {values!r} must be a non-empty list of finite numbers")
            outside = [x for x in values if not 0.0 <= x <= 1.0]
            if outside:
                raise UsageError(f"{where}: ablation: {key}: {outside} outside [0, 1]; GAC's thresholds are cosines "
                                 "with 0 <= c_low < c_high <= 1")
        if not any(lo < hi for lo in ablation["c_low"] for hi in ablation["c_high"]):
            raise UsageError(f"{where}: ablation: no pair of c_low {ablation['c_low']} and c_high {ablation['c_high']} "
                             "has c_low < c_high, so the ablation has no point; GAC needs c_low < c_high")
        _check_methods(f"{where}: ablation: method:", [ablation.get("method", "gac")])
    return suite


def parse_methods(text: str | None, suite: dict, suite_name: str = "") -> list[str] | None:
    """``--methods``: :func:`parse_list` split outside parentheses, each method checked and in canonical form
    (:func:`_check_methods`); the keyword ``ablation`` selects the suite's threshold-ablation cells, refused for a
    suite without them. None (the suite's methods) when the option is not given."""
    methods = parse_list("--methods", text, lambda t: split_top_level(t, ","))
    if methods is None:
        return None
    if ABLATION in methods and not suite.get("ablation"):
        raise UsageError(f"--methods: {ABLATION!r} selects the suite's threshold-ablation cells, and suite "
                         f"{suite.get('name', suite_name)!r} has no ablation: section")
    named = [m for m in methods if m != ABLATION]
    canonical = iter(_check_methods(f"--methods {text!r}:", named) if named else [])
    return [m if m == ABLATION else next(canonical) for m in methods]


def parse_list(option: str, text: str | None, split=None) -> list[str] | None:
    """A comma-separated option value as a list; None (the suite's default) when the option is not given.
    An empty value, an empty item (``0,``) or a repeated item is refused, naming the option."""
    if text is None:
        return None
    example = f"e.g. {option} {EXAMPLES.get(option, 'a,b')}"
    if not text.strip():
        raise UsageError(f"{option} is empty; give comma-separated values ({example}), or leave {option} out for "
                         "the suite's own")
    items = [x.strip() for x in (split(text) if split else text.split(","))]
    if "" in items:
        raise UsageError(f"{option} {text!r} has an empty item (a stray comma?); {example}")
    _no_repeats(f"{option} {text!r}", items)
    return items


def parse_int_list(option: str, text: str | None, lo: int, hi: int | None = None) -> list[int] | None:
    """:func:`parse_list` of integers in [lo, hi]: ``2.5``, ``x`` or ``-1`` is refused, naming the option."""
    items = parse_list(option, text)
    if items is None:
        return None
    values = []
    for x in items:
        try:
            v = int(x)
        except ValueError:
            raise UsageError(f"{option} {text!r}: {x!r} is not an integer; e.g. {option} {EXAMPLES[option]}") from None
        if v < lo or (hi is not None and v > hi):
            bound = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
            raise UsageError(f"{option} {text!r}: {v} is not {bound}")
        values.append(v)
    _no_repeats(f"{option} {text!r}", values)
    return values


def parse_params(items: list[str]) -> dict[str, Any]:
    """``["engine.name=hf", "lr=1e-3"]`` -> ``{"engine": {"name": "hf"}, "lr": 0.001}``: values read as YAML
    scalars; a dotted key sets a field of a parameter that is a section (a dict)."""
    import yaml

    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        path = key.split(".")
        if not sep or not key or not all(path):
            raise UsageError(f"--param {item!r}: expected KEY=VALUE or SECTION.KEY=VALUE, e.g. --param lr=3e-4 "
                             "or --param engine.name=hf")
        if path[0] in RESERVED_PARAMS:
            raise UsageError(f"--param {key}: set by the grid itself; use --seeds / --staleness, "
                             "or the suite's 'steps'")
        try:
            parsed = yaml.safe_load(value) if value.strip() else value
        except yaml.YAMLError:
            parsed = value
        if isinstance(parsed, (dict, list)):  # e.g. a template "{problem}": keep the text
            parsed = value
        parsed = float(parsed) if isinstance(parsed, str) and _is_number(parsed) else parsed
        out = merge_params(out, _nest(path, parsed))
    return out


def _nest(path: list[str], value: Any) -> dict[str, Any]:
    for key in reversed(path):
        value = {key: value}
    return value


def merge_params(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` applied: a dict merges into a dict key by key, anything else replaces."""
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_params(out[key], value)
        else:
            out[key] = value
    return out


RESERVED_PARAMS = ("seed", "steps", "staleness")


def _hints(target: Any) -> dict[str, Any]:
    import typing

    try:
        return typing.get_type_hints(target)
    except Exception:  # unresolvable annotations: no type check
        return {}


def _section_type(cls: type, name: str) -> type | None:
    """The dataclass of parameter ``name`` of ``cls.__init__`` when its type is one (a section), else None."""
    import dataclasses
    import typing

    hint = _hints(cls.__init__).get(name)
    for arg in typing.get_args(hint) or (hint,):
        if isinstance(arg, type) and dataclasses.is_dataclass(arg):
            return arg
    return None


def _section_fields(cls: type, name: str) -> set[str] | None:
    """The fields of parameter ``name`` of ``cls.__init__`` when its type is a dataclass (a section), else None."""
    import dataclasses

    section = _section_type(cls, name)
    return None if section is None else {f.name for f in dataclasses.fields(section)}


def type_ok(value: Any, hint: Any) -> bool | None:
    """Whether ``value`` (read from YAML) fits the annotation ``hint``: True, False, or None when the
    annotation is not one this check knows (then the objective itself decides)."""
    import dataclasses
    import types
    import typing

    if hint is None or hint is typing.Any:
        return None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        results = [type_ok(value, arm) for arm in typing.get_args(hint)]
        return True if True in results else (None if None in results else False)
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return _is_int(value)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if hint in (list, tuple) or origin in (list, tuple):
        return isinstance(value, (list, tuple))
    if hint is dict or origin is dict or (isinstance(hint, type) and dataclasses.is_dataclass(hint)):
        return isinstance(value, dict)
    return None


def describe_type(hint: Any) -> str:
    """``float | None`` -> ``a number or null``."""
    import dataclasses
    import types
    import typing

    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(dict.fromkeys(describe_type(a) for a in typing.get_args(hint)))
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    names = {bool: "true or false", int: "an integer", float: "a number", str: "text", type(None): "null",
             dict: "a section", list: "a list", tuple: "a list"}
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return "a section"
    return names.get(origin or hint, getattr(hint, "__name__", str(hint)))


def _describe_value(value: Any) -> str:
    if isinstance(value, str):
        note = " (YAML reads 1e-3 as text: write 1.0e-3)" if _is_number(value) and math.isfinite(float(value)) else ""
        return f"the text {value!r}{note}"
    return f"{json.dumps(value, default=str)} ({'true or false' if isinstance(value, bool) else type(value).__name__})"


def check_params(cells: list[dict], overrides: dict[str, Any] | None = None) -> None:
    """Every cell's params must be arguments of its objective, of the annotated type, and a section's keys
    fields of that section, of their types: a typo or a wrong type fails here, not in every cell. Then the
    objective's ``check_settings`` (:func:`check_settings`) refuses what its constructor would. A bad value
    that came from ``overrides`` (``--param``) is named as ``--param KEY``."""
    import inspect

    from_cli = set(flat_params(overrides or {}))
    checked: set[tuple[str, str]] = set()
    for c in cells:
        key = engine_key(c)
        if key in checked:
            continue
        checked.add(key)
        cls = objective_class(c["objective"])
        where = f"task {c['task']!r} ({c['objective']})"
        accepted = inspect.signature(cls.__init__).parameters
        any_name = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
        unknown = [] if any_name else sorted(set(c["params"]) - set(accepted))
        if unknown:
            raise UsageError(f"{where}: unknown parameter(s) {', '.join(unknown)}; "
                             f"accepted: {', '.join(k for k in accepted if k != 'self')}")
        hints = _hints(cls.__init__)

        def refuse(name: str, value: Any, hint: Any) -> None:
            origin = f"--param {name}" if name in from_cli else f"{where}: parameter {name} (suite)"
            raise UsageError(f"{origin}: {name} takes {describe_type(hint)}, got {_describe_value(value)}")

        for name, value in c["params"].items():
            section = _section_type(cls, name)
            if section is None:
                if type_ok(value, hints.get(name)) is False:
                    refuse(name, value, hints[name])
                continue
            if value is None:
                continue
            fields = _section_fields(cls, name)
            if not isinstance(value, dict):
                raise UsageError(f"{where}: parameter {name!r} is a section with the "
                                 f"fields {', '.join(sorted(fields))}; set a field: --param {name}.FIELD=VALUE")
            bad = sorted(set(value) - fields)
            if bad:
                raise UsageError(f"{where}: unknown {name} setting(s) "
                                 f"{', '.join(f'{name}.{k}' for k in bad)}; the {name} section takes "
                                 f"{', '.join(sorted(fields))}")
            field_hints = _hints(section)
            for field, v in value.items():
                if type_ok(v, field_hints.get(field)) is False:
                    refuse(f"{name}.{field}", v, field_hints[field])
    check_settings(cells, overrides)


def objective_args(cell: dict, stale: bool = True) -> dict[str, Any]:
    """The constructor arguments of ``cell``'s objective that its cell passes (:func:`gacbench.bench.cell.run_cell`):
    its params, steps and seed, and for an objective that makes its own stale rollouts the staleness (0 when the
    cell's method is not ``stale``: the synchronous reference)."""
    args = {**cell.get("params", {}), **{k: cell[k] for k in ("steps", "seed") if k in cell}}
    if objective_class(cell["objective"]).rollout_staleness and "staleness" in cell:
        args["staleness"] = int(cell["staleness"]) if stale else 0
    return args


def check_settings(cells: list[dict], overrides: dict[str, Any] | None = None) -> None:
    """Each cell's objective arguments (:func:`objective_args`) checked by the objective's own ``check_settings``,
    the check its constructor runs, once per distinct (objective, arguments other than the seed), then its
    ``check_inputs`` (the files they name read) once per distinct (objective, parameters); and each method
    against its objective: a loss-side stabilizer needs an objective that builds its loss through one
    (``uses_loss_stabilizer``). A refusal becomes a UsageError naming ``--param KEY`` for a value from ``overrides``,
    else the task's parameter in the suite."""
    from_cli = set(flat_params(overrides or {}))
    stale = {m: parse_method(m)[0].stale for m in {c["method"] for c in cells if "method" in c}}
    seen: set[tuple[str, str]] = set()
    read: set[tuple[str, str]] = set()
    pairs: set[tuple[str, str]] = set()
    for c in cells:
        cls = objective_class(c["objective"])
        args = objective_args(c, stale.get(c.get("method"), True))
        key = (c["objective"], json.dumps({k: v for k, v in args.items() if k != "seed"}, sort_keys=True, default=str))
        if key not in seen:
            seen.add(key)
            try:
                cls.check_settings(args)
            except (ValueError, TypeError) as exc:  # TypeError: a section of the wrong kind
                raise UsageError(_blame(exc, c, from_cli)) from None
        inputs = (c["objective"], json.dumps(c.get("params", {}), sort_keys=True, default=str))
        if inputs not in read:  # the inputs a task's params name, read once however many cells share them
            read.add(inputs)
            try:
                cls.check_inputs(args)
            except ValueError as exc:
                raise UsageError(_blame(exc, c, from_cli)) from None
        if "method" in c and (c["objective"], c["method"]) not in pairs:
            pairs.add((c["objective"], c["method"]))
            callbacks = method_callbacks(c["method"])
            loss_side = [type(cb).__name__ for cb in callbacks if getattr(cb, "kind", None) == "loss"]
            if loss_side and not getattr(cls, "uses_loss_stabilizer", False):
                raise UsageError(f"method {c['method']!r} on task {c['task']!r}: {loss_side[0]} is a loss-side "
                                 f"stabilizer, and objective {c['objective']!r} computes its own loss; list it under "
                                 "the extra_methods of a task whose objective takes one (bandit, sequence, grpo), or "
                                 "use a gradient-side stabilizer (gac) here")


def _blame(exc: Exception, cell: dict, from_cli: set[str]) -> str:
    """Where the value ``exc`` refuses came from, then ``exc``: ``--param KEY``, the grid's staleness, or the task's
    parameter in the suite."""
    task = f"task {cell['task']!r}, objective {cell['objective']}"
    key = getattr(exc, "key", None)
    if key is None:  # a check of several keys: the first --param it names
        key = next((k for k in sorted(from_cli) if f"{k}=" in str(exc)), None)
    if key in from_cli:
        return f"--param {key}: {exc} ({task})"
    if key == "staleness":
        return f"staleness {cell.get('staleness')} of {task}: {exc}"
    if key is not None:
        return f"{task}: {'steps' if key == 'steps' else f'parameter {key}'} (suite): {exc}"
    return f"{task}: {exc}"


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
