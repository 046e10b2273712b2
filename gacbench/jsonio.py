"""JSON files written atomically, and values made strict-JSON safe (NaN and infinities as null).

:func:`write_json` and :func:`write_text` write ``.NAME.PID.tmp`` beside the target and rename it over the target,
so a reader sees the old file or the new one, never a part. A write that fails (a full disk: ``ENOSPC``, a quota:
``EDQUOT``) removes its temporary file and raises the OSError with the target's path; a process killed between the
write and the rename leaves its temporary behind, and :func:`remove_stray_temporaries` removes those of processes
that are gone.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: the errors of a device or a quota with no room left
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_TEMPORARY = re.compile(r"^\..+\.(\d+)\.tmp$")


def temporary_path(path: Path) -> Path:
    """Where :func:`write_json` writes ``path``'s content before renaming it: ``.NAME.PID.tmp`` beside it."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def write_json(path: Path, obj: Any) -> None:
    """``obj`` as indented JSON in ``path``, written atomically (:func:`write_text`)."""
    write_text(path, json.dumps(obj, indent=2, default=str))


def write_text(path: Path, text: str) -> None:
    """``text`` in ``path``, atomically (:func:`replacing`)."""
    with replacing(Path(path)) as tmp:
        tmp.write_text(text)


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """Yields :func:`temporary_path` of ``path`` to be written, then renames it over ``path`` (``os.replace``), so a
    failed or stopped write leaves the old file whole. A failure removes the temporary; an OSError is raised naming
    ``path`` (a failed ``write()`` names no file)."""
    tmp = temporary_path(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.filename is None:  # name the file being written
            exc.filename = str(path)
        raise


def save_figure(fig, path: Path, **kwargs: Any) -> None:
    """``fig.savefig`` to ``path`` atomically (:func:`replacing`): a stop in the middle leaves the earlier figure
    (or none), never a cut-off image. ``kwargs`` go to ``savefig``; the format is ``path``'s suffix, or without one
    matplotlib's ``savefig.format``, its suffix added (as ``savefig`` names the file)."""
    import matplotlib

    path = Path(path)
    fmt = path.suffix.lstrip(".")
    if not fmt:
        fmt = matplotlib.rcParams["savefig.format"]
        path = path.with_name(f"{path.name}.{fmt}")
    with replacing(path) as tmp:
        fig.savefig(tmp, format=fmt, **kwargs)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def flat_params(params: dict, prefix: str = "") -> dict[str, Any]:
    """``{"engine": {"name": "hf"}}`` -> ``{"engine.name": "hf"}`` (an empty section stays a value): the dotted
    keys by which settings are named (``--param engine.name``, a run's differing settings)."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        if isinstance(value, dict) and value:
            out.update(flat_params(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def json_safe(obj: Any) -> Any:
    """``obj`` with NaN and infinities replaced by None, so that it serialises to valid JSON (no bare NaN)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def pid_alive(pid: int) -> bool:
    """Whether a process with this id runs on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


def remove_stray_temporaries(root: Path, min_age_s: float = 60.0) -> list[Path]:
    """Remove the temporary files of :func:`write_json` under ``root`` whose process is not running on this host
    and that are older than ``min_age_s`` (a write lasts milliseconds; the age keeps a live write of a process on
    another host that shares the folder safe); returns the paths removed."""
    removed = []
    now = time.time()
    for path in Path(root).rglob(".*.tmp"):
        match = _TEMPORARY.match(path.name)
        if match is None or int(match.group(1)) == os.getpid() or pid_alive(int(match.group(1))):
            continue
        try:
            if now - path.stat().st_mtime < min_age_s:
                continue
            path.unlink()
        except FileNotFoundError:
            continue
        removed.append(path)
    return removed


def disk_full(exc: BaseException) -> OSError | None:
    """The ``ENOSPC`` / ``EDQUOT`` OSError behind ``exc`` (itself, or what it wraps: a worker's error re-raised in
    the parent, a Ray task error), else None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in DISK_FULL:
            return exc
        exc = getattr(exc, "cause", None) or exc.__cause__
    return None


def disk_full_message(exc: OSError, fix: str) -> str:
    """One line: the path that could not be written, the cause, and ``fix``."""
    cause = exc.strerror or os.strerror(exc.errno)
    return f"cannot write {exc.filename or 'a file'}: {cause} ({errno.errorcode.get(exc.errno, exc.errno)}); {fix}"


#: the file a run or cell directory is claimed through (an exclusive flock, and the holder's record)
CLAIM_FILE = ".claim"


@contextlib.contextmanager
def hold(path: Path, wait: bool) -> Iterator[bool]:
    """An exclusive ``flock`` on ``path`` (created if missing) for the ``with`` block: yields True when this
    process holds it; without ``wait``, False at once when another holds it. The file stays (removing a lock
    file while another process opens it would let two processes hold it)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def claim_record() -> dict[str, Any]:
    """What a claim records of the process that holds it: its pid, host and start time."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}


@contextlib.contextmanager
def claim_dir(d: Path) -> Iterator[tuple[bool, dict]]:
    """Claim the directory ``d`` (created if missing) for the ``with`` block, without waiting: a :func:`hold` on
    ``d/.claim``. Yields ``(held, record)``. Held: ``record`` is what the file recorded before (an earlier
    holder's, or ``{}``), and this process's :func:`claim_record` is written in its place. Not held: ``record``
    is the holder's (``{}`` while it has not written it yet)."""
    d.mkdir(parents=True, exist_ok=True)
    path = d / CLAIM_FILE
    with hold(path, wait=False) as held:
        try:
            record = json.loads(path.read_text() or "{}")
        except (OSError, ValueError):
            record = {}
        record = record if isinstance(record, dict) else {}
        if held:
            path.write_text(json.dumps(claim_record()))
        yield held, record
