"""JSON files written atomically, and values made strict-JSON safe (NaN and infinities as null)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any


def write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def json_safe(obj: Any) -> Any:
    """``obj`` with NaN and infinities replaced by None, so that it serialises to valid JSON (no bare NaN)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj
