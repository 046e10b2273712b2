"""Run a process on an x86 machine with AVX-512 as the AVX2 machine kind computes: loaded at interpreter start
(``sitecustomize``) when this directory is on ``PYTHONPATH`` and ``GACBENCH_AVX2_KIND=1``, as
``paper/as-avx2-kind.sh`` sets both.

torch's own kernels are capped by environment variables that the wrapper sets before torch loads
(``ATEN_CPU_CAPABILITY=avx2``, ``MKL_ENABLE_INSTRUCTIONS=AVX2``, ``ONEDNN_MAX_CPU_ISA=AVX2``). vLLM's CPU
platform does not read them: it chooses its kernel library (``vllm._C``, ``_C_AVX512`` or ``_C_AVX2``) and its
attention kernels from ``torch.cpu._is_avx512_supported()`` and its siblings, which read the CPU itself. This
module makes those report no AVX-512 and no AMX, so that vLLM loads ``_C_AVX2`` and samples with the same
arithmetic as on a machine without AVX-512. It changes nothing without ``GACBENCH_AVX2_KIND=1``.
"""

import os

if os.environ.get("GACBENCH_AVX2_KIND") == "1":
    import torch.cpu as _cpu

    def _absent() -> bool:
        return False

    for _name in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported",
                  "_is_avx512_fp16_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        if hasattr(_cpu, _name):
            setattr(_cpu, _name, _absent)
