"""Input the user can fix, and the checks of user-given output paths.

:class:`UsageError` is raised for bad input (an option's value, a suite file, an output path, a checkpoint);
``gacbench``'s ``main`` prints it as one line, ``gacbench CMD: error: MESSAGE``, and returns 2. It lives at
the bottom of the package so that every room can raise it.
"""

from __future__ import annotations

import os
from pathlib import Path


class UsageError(ValueError):
    """Bad input that the user can fix; the message names the option or file and the fix."""


def check_output_file(option: str, path: str) -> None:
    """Refuse, before any work, an output file that cannot be written: a folder, a missing or read-only parent."""
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"{option} {path} is a folder; give a file name, e.g. {target / 'result.json'}")
    parent = target.parent
    if not parent.exists():
        raise UsageError(f"{option} {path}: the folder {parent} does not exist; create it (mkdir -p {parent}) "
                         "or give another path")
    if not parent.is_dir():
        raise UsageError(f"{option} {path}: {parent} is a file, not a folder; give another path")
    if not os.access(parent, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise UsageError(f"{option} {path}: cannot write there (permission denied); give a writable path")


def check_output_dir(option: str, path: str | os.PathLike) -> Path:
    """Create ``path`` (with its parents) if needed and check that files can be written in it; a file in
    the way, a read-only place or any other OSError becomes a UsageError naming ``option``."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise UsageError(f"{option} {out} is a file, not a folder; give a folder (it is created if missing)")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".gacbench-write-test.{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise UsageError(f"{option} {out}: cannot create or write this folder ({reason}); "
                         "give a writable folder") from None
    return out
