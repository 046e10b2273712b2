"""Input the user can fix, and the checks of user-given output paths.

:class:`UsageError` is raised for bad input (an option's value, a suite file, an output path, a checkpoint);
``gacbench``'s ``main`` prints it as one line, ``gacbench CMD: error: MESSAGE``, and returns 2. It lives at
the bottom of the package so that every room can raise it. :class:`Interrupted` and :func:`raise_on_signals`
turn SIGINT / SIGTERM into an exception that ``gacbench``'s commands end on with 130 / 143
(``gacbench.cli.run_interruptible``).
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path


class UsageError(ValueError):
    """Bad input that the user can fix; the message names the option or file and the fix."""


class Interrupted(BaseException):
    """Raised in the main thread by :func:`raise_on_signals`' handler: a BaseException, so that neither an
    ``except Exception`` nor Lightning's KeyboardInterrupt handling (which exits 1) takes it for something else."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _importing(frame) -> bool:
    """Whether ``frame`` runs inside an import (a module's top level, under importlib's frames)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


#: the signals waiting for the main thread's import to end (each is sent again once)
_pending: set[int] = set()


def defer_during_import(signum: int, frame) -> bool:
    """For a signal handler that raises: whether the signal came during an import (``frame``, the handler's),
    and is then sent to the main thread again once it has left every import, so that the handler runs again
    there. Raised inside an import, the exception can pass through a C++ extension's call (torch's
    ``torch.distributed`` runs Python while its C++ initialisation is on the stack), which ends the process with
    ``terminate called after throwing an instance of 'pybind11::error_already_set'`` (SIGABRT). A daemon thread
    looks at the main thread's frames every 10 ms; the same signal again meanwhile adds nothing."""
    import sys
    import threading
    import time

    if not _importing(frame):
        return False
    if signum in _pending:
        return True
    _pending.add(signum)
    main = threading.main_thread().ident

    def watch() -> None:
        while _importing(sys._current_frames().get(main)):
            time.sleep(0.01)
        _pending.discard(signum)
        signal.pthread_kill(main, signum)

    threading.Thread(target=watch, name=f"gacbench-{signal.Signals(signum).name}", daemon=True).start()
    return True


def raise_interrupted(signum, frame) -> None:
    """The handler of :func:`raise_on_signals`: raises :class:`Interrupted`, once any import under way is done
    (:func:`defer_during_import`)."""
    if defer_during_import(signum, frame):
        return
    raise Interrupted(signum)


@contextlib.contextmanager
def raise_on_signals(signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)):
    """For the ``with`` block, each of ``signals`` raises :class:`Interrupted` in the main thread
    (:func:`raise_interrupted`); the previous handlers come back after it. Outside the main thread (where Python
    cannot set handlers) nothing changes."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        signals = ()
    previous = {s: signal.signal(s, raise_interrupted) for s in signals}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


#: the signal a DDP rank received that its ranks combine at the end of a step (0 for none): SIGTERM on any rank
#: during ``gacbench grpo``'s fit, SIGINT on a rank Lightning's launcher started (:func:`started_rank`) from the
#: command's start (``gacbench.llm.cli.RunRecorder`` reads it)
FLAGGED = {"signum": 0}


def flag_signal(signum, frame) -> None:
    """A signal handler that only records the signal (:data:`FLAGGED`; SIGTERM outranks SIGINT)."""
    FLAGGED["signum"] = max(FLAGGED["signum"], signum)


def started_rank() -> bool:
    """Whether this process is a rank other than 0 of several (``LOCAL_RANK`` other than 0 and ``WORLD_SIZE`` above
    1, as Lightning's launcher and torchrun set them): such a process runs the whole command again."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        world = 1
    return os.environ.get("LOCAL_RANK", "0") != "0" and world > 1


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


def check_figure_format(option: str, path: str) -> None:
    """Refuse, before any work, a figure file whose suffix matplotlib cannot write (none at all included: it
    would add .png to the name)."""
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in formats:
        what = f"its suffix .{suffix} is not a figure format" if suffix else "it has no suffix"
        raise UsageError(f"{option} {path}: {what}; end the name in one of "
                         f"{', '.join('.' + f for f in sorted(formats))} (e.g. .png)")


def check_output_dir(option: str, path: str | os.PathLike) -> Path:
    """Create ``path`` (with its parents) if needed and check that files can be written in it; a file in
    the way, a read-only place or any other OSError becomes a UsageError naming ``option``."""
    if not str(path).strip():
        raise UsageError(f"{option} is empty; give a folder (it is created if missing)")
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
