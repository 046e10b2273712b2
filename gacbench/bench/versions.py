"""The code versions a benchmark directory's cells ran in, from the ``provenance`` each cell's config.json records
(:mod:`gacbench.provenance`): one entry per distinct environment key, and the groups whose seeds mix keys."""

from __future__ import annotations

from collections import defaultdict

from gacbench.provenance import code_label, environment_key


def code_versions(records: list[dict], provenances: list[dict | None]) -> list[dict]:
    """One entry per distinct environment key of ``records`` (``provenances[i]`` is ``records[i]``'s), most cells
    first: ``key``, ``description`` (the commits or versions with that key, each with its dirty mark) and
    ``cells`` (every stored cell with that key, done or not)."""
    by_key: dict[str, list[dict | None]] = defaultdict(list)
    for prov in provenances:
        by_key[environment_key(prov)].append(prov)
    out = [{"key": key, "description": ", ".join(dict.fromkeys(code_label(p) for p in provs)), "cells": len(provs)}
           for key, provs in by_key.items()]
    return sorted(out, key=lambda v: (-v["cells"], v["key"]))


def mixed_version_groups(cells: list[dict]) -> list[dict]:
    """The groups (task as grouped, method, staleness) whose done cells ran in more than one environment:
    ``task``, ``method``, ``staleness`` and their environment keys, sorted (each cell carries ``environment``)."""
    keys: dict[tuple, set] = defaultdict(set)
    for c in cells:
        if c["status"] == "done":
            keys[(c["task"], c["method"], c["staleness"])].add(c["environment"])
    return [{"task": t, "method": m, "staleness": s, "versions": sorted(v)}
            for (t, m, s), v in sorted(keys.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1])) if len(v) > 1]
