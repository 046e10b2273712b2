"""The code versions a benchmark directory's cells ran in, from the ``provenance`` each cell's config.json records
(:mod:`gacbench.provenance`): one entry per distinct environment key (the library's; the stabilizer plug-ins'
code apart, listed on its own), the groups whose seeds mix keys (plug-in code included), and the
machine blocks of a grid computed on several CPU kinds (one kind per seed, the seeds' paired comparisons within
one kind)."""

from __future__ import annotations

import json
from collections import defaultdict

from gacbench.provenance import code_label, environment_key, machine_kind


def start_points_differ(records: list[dict], provenances: list[dict | None]) -> set:
    """The tasks of ``records`` whose cells recorded more than one initial-weights hash."""
    seen: dict = defaultdict(set)
    for c, p in zip(records, provenances):
        if isinstance(p, dict) and p.get("initial_weights"):
            seen[c.get("task")].add(p["initial_weights"])
    return {task for task, weights in seen.items() if len(weights) > 1}


def version_key(record: dict, prov: dict | None, mixed_tasks: set, machine: bool = True, plugins: bool = True) -> str:
    """A cell's code version: its environment key without the start point, which tasks of one grid may have
    apart (llm-size's model sizes start from different checkpoints), except for a task whose cells started from
    more than one (``mixed_tasks``): there the weights tell its versions apart. ``plugins``: with the code hashes
    of the plug-ins its method used (the key of a cell, which a group's seeds must share), else the library's
    environment alone (which the cells of every method share)."""
    return environment_key(prov, weights=record.get("task") in mixed_tasks, machine=machine, plugins=plugins)


def code_versions(records: list[dict], provenances: list[dict | None], mixed_tasks: set | None = None) -> list[dict]:
    """One entry per distinct code version of ``records`` (``provenances[i]`` is ``records[i]``'s;
    :func:`version_key`), most cells first: ``key``, ``description`` (the commits or versions with that key, each
    with its dirty mark) and ``cells`` (every stored cell with that key, done or not). ``mixed_tasks``:
    :func:`start_points_differ` of ``records``, where the caller has it already."""
    mixed = start_points_differ(records, provenances) if mixed_tasks is None else mixed_tasks
    by_key: dict[str, list[dict | None]] = defaultdict(list)
    for record, prov in zip(records, provenances):
        by_key[version_key(record, prov, mixed, plugins=False)].append(prov)
    out = [{"key": key, "description": ", ".join(dict.fromkeys(code_label(p) for p in provs)), "cells": len(provs)}
           for key, provs in by_key.items()]
    return sorted(out, key=lambda v: (-v["cells"], v["key"]))


def start_points(records: list[dict], provenances: list[dict | None]) -> list[dict]:
    """The initial weights (θ₀) the cells of each task started from, as their provenance records them
    (``initial_weights``, the SHA-256 of the start point's weight files): ``task``, ``initial_weights`` and
    ``cells``, by task and then most cells first; cells that recorded none are left out."""
    seen: dict[tuple, int] = defaultdict(int)
    for record, prov in zip(records, provenances):
        if isinstance(prov, dict) and prov.get("initial_weights"):
            seen[(record.get("task"), prov["initial_weights"])] += 1
    return [{"task": t, "initial_weights": w, "cells": n}
            for (t, w), n in sorted(seen.items(), key=lambda kv: (str(kv[0][0]), -kv[1], kv[0][1]))]


def plugin_versions(provenances: list[dict | None]) -> list[dict]:
    """One entry per distinct plug-in code among the cells (their provenance's ``plugins``): ``name``,
    ``distribution``, ``version``, ``sha256`` and ``cells``, by name and then most cells first."""
    seen: dict[tuple, dict] = {}
    for prov in provenances:
        for name, rec in sorted(((prov or {}).get("plugins") or {}).items()):
            rec = rec if isinstance(rec, dict) else {}
            key = (name, rec.get("distribution"), rec.get("version"), rec.get("sha256"))
            entry = seen.setdefault(key, {"name": name, "distribution": key[1], "version": key[2],
                                          "sha256": key[3], "cells": 0})
            entry["cells"] += 1
    return sorted(seen.values(), key=lambda v: (v["name"], -v["cells"], str(v["sha256"])))


def mixed_version_groups(cells: list[dict]) -> list[dict]:
    """The groups (task as grouped, method, staleness) whose done cells ran in more than one environment:
    ``task``, ``method``, ``staleness`` and their environment keys, sorted (each cell carries ``environment``)."""
    keys: dict[tuple, set] = defaultdict(set)
    for c in cells:
        if c["status"] == "done":
            keys[(c["task"], c["method"], c["staleness"])].add(c["environment"])
    return [{"task": t, "method": m, "staleness": s, "versions": sorted(v)}
            for (t, m, s), v in sorted(keys.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1])) if len(v) > 1]


def machine_blocks(cells: list[dict], provenances: list[dict | None]) -> dict | None:
    """Where the done ``cells`` (``provenances[i]`` is ``cells[i]``'s) ran on more than one CPU kind
    (:func:`~gacbench.provenance.machine_kind`), the seeds of each kind; ``None`` on one kind. A grid whose cells
    are one code version apart from the machine (``code_versions``: their :func:`version_key` without the CPU kind)
    and whose every seed of a task ran on one kind (``mixed_seeds`` empty) is a blocked design: every paired
    comparison of the report (methods within a seed) is made on one machine, and the spread over seeds holds the
    machine's effect as it holds the seed's; a grid whose seeds of one group ran different plug-in code is not
    one. ``blocked`` says whether the grid is one. Returns ``kinds`` (kind:
    the seeds of each task on it, as ``task: [seeds]``, and the done cells), ``mixed_seeds`` (task, seed and the
    kinds of a seed that ran on more than one), ``code_versions`` and ``blocked``."""
    done = [(c, p, machine_kind(p) or "unrecorded") for c, p in zip(cells, provenances) if c.get("status") == "done"]
    kinds = {kind for _, _, kind in done}
    if len(kinds) < 2:
        return None
    per_seed: dict[tuple, set] = defaultdict(set)
    by_kind: dict[str, dict] = {k: {"seeds": defaultdict(set), "cells": 0} for k in kinds}
    for c, _, kind in done:
        per_seed[(c["task"], c["seed"])].add(kind)
        by_kind[kind]["seeds"][c["task"]].add(c["seed"])
        by_kind[kind]["cells"] += 1
    mixed = [{"task": t, "seed": s, "kinds": sorted(k)} for (t, s), k in sorted(per_seed.items()) if len(k) > 1]
    mixed_tasks = start_points_differ([c for c, _, _ in done], [p for _, p, _ in done])
    code = sorted({version_key(c, p, mixed_tasks, machine=False, plugins=False) for c, p, _ in done})
    plugin_code: dict[tuple, set] = defaultdict(set)  # a group's plug-in code, which its seeds must share too
    for c, p, _ in done:
        plugin_code[(c["task"], c["method"], c["staleness"])].add(
            json.dumps(p.get("plugins") if isinstance(p, dict) else None, sort_keys=True))
    plugins_mixed = any(len(v) > 1 for v in plugin_code.values())
    return {"kinds": {k: {"seeds": {t: sorted(s) for t, s in sorted(v["seeds"].items())}, "cells": v["cells"]}
                      for k, v in sorted(by_kind.items())},
            "mixed_seeds": mixed, "code_versions": code,
            "blocked": not mixed and len(code) == 1 and not plugins_mixed and "unrecorded" not in kinds}
