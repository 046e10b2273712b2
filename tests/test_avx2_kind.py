"""paper/as-avx2-kind.sh: a command it runs sees an AVX2 machine (torch's kernel capability, the CPU checks vLLM
chooses its kernels by, gacbench's recorded ``isa``), and the shim it puts on ``PYTHONPATH`` changes nothing
without the wrapper's switch."""

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from gacbench.provenance import cpu_description

REPO = Path(__file__).resolve().parents[1]
WRAPPER = REPO / "paper" / "as-avx2-kind.sh"
SWITCHES = ("GACBENCH_AVX2_KIND", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")
CHECKS = ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported", "_is_amx_tile_supported")
PROBE = ("import json, torch, torch.cpu as c\n"
         "from gacbench.provenance import cpu_description\n"
         f"print(json.dumps({{'isa': torch.backends.cpu.get_cpu_capability(), 'recorded': cpu_description()['isa'],"
         f" **{{n: getattr(c, n)() for n in {CHECKS!r} if hasattr(c, n)}}}}))")


def _cpu_flags() -> set[str]:
    """The CPU's vector extensions, as gacbench records them (empty where /proc/cpuinfo cannot be read)."""
    return set(cpu_description()["cpu_flags"] or ())


pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or "avx2" not in _cpu_flags(),
                                reason="the AVX2 kind exists only on an x86 CPU with AVX2")


def _run(cmd: list[str], extra_env: dict | None = None) -> subprocess.CompletedProcess:
    """``cmd`` with the repository on ``PYTHONPATH`` and none of the wrapper's variables inherited."""
    env = {k: v for k, v in os.environ.items() if k not in SWITCHES}
    env.update({"PYTHONPATH": str(REPO), **(extra_env or {})})
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def _probe(wrapped: bool, extra_env: dict | None = None) -> dict:
    cmd = ([str(WRAPPER)] if wrapped else []) + [sys.executable, "-c", PROBE]
    out = _run(cmd, extra_env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_wrapped_process_sees_an_avx2_machine():
    seen = _probe(wrapped=True)
    assert seen["isa"] == "AVX2" and seen["recorded"] == "AVX2"
    assert not any(seen[n] for n in CHECKS if n in seen), seen


def test_shim_on_the_path_without_the_switch_changes_nothing():
    plain = _probe(wrapped=False)
    shimmed = _probe(wrapped=False, extra_env={"PYTHONPATH": f"{REPO / 'paper' / 'avx2-kind'}:{REPO}"})
    assert shimmed == plain
    if "avx512f" in _cpu_flags():  # the wrapper then changes what the unwrapped process sees
        assert plain["_is_avx512_supported"] is True and plain["isa"] != "AVX2"


def test_vllm_loads_its_avx2_kernels_under_the_wrapper():
    pytest.importorskip("vllm")
    code = ("from vllm.platforms.cpu import CpuPlatform\n"
            "CpuPlatform.import_kernels()\n"
            "libs = {l.split('/')[-1].strip() for l in open('/proc/self/maps') if '/vllm/_C' in l}\n"
            "print(sorted(libs))")
    out = _run([str(WRAPPER), sys.executable, "-c", code])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "['_C_AVX2.abi3.so']"


def test_wrapper_without_a_command_says_how_to_use_it():
    out = _run(["bash", str(WRAPPER)])
    assert out.returncode == 2 and "usage:" in out.stderr and "COMMAND" in out.stderr
