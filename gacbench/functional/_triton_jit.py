"""The Triton kernels of ``GAC(kernels="triton")``; imported on first use by
:mod:`gacbench.functional.triton_kernels`, which documents them (Triton reads ``TRITON_INTERPRET`` when a kernel
is defined, so this module is imported only when a kernel is first needed).

Every kernel runs one program per chunk of one tensor of a list: ``owner[pid]`` is the tensor's index, and its
address is read from ``g_addr[owner]`` / ``r_addr[owner]`` (int64, ``Tensor.data_ptr()``), so one launch covers
the whole list whatever the tensors' sizes and addresses. The program walks ``[start, end)`` of that tensor in
unmasked blocks of ``BLOCK`` elements and one masked tail. ``ALIGNED``: every address is a multiple of 16 bytes
and every ``start`` a multiple of ``BLOCK``, told to the compiler so that the unmasked loads are vectorised.
"""

import triton
import triton.language as tl


@triton.jit
def _chunk(owner, starts, ends, g_addr, r_addr, G: tl.constexpr, R: tl.constexpr, ALIGNED: tl.constexpr,
           BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(owner + pid)
    start = tl.load(starts + pid)
    end = tl.load(ends + pid)
    ga = tl.load(g_addr + t)
    ra = tl.load(r_addr + t)
    gp = ga.to(tl.pointer_type(G))
    rp = ra.to(tl.pointer_type(R))
    if ALIGNED:  # the hint must sit on the pointer: on the integer it does not pass through the cast
        gp = tl.multiple_of(gp, 16)
        rp = tl.multiple_of(rp, 16)
        start = tl.multiple_of(start, BLOCK)
    full = start + (end - start) // BLOCK * BLOCK  # [start, full): unmasked blocks; [full, end): the tail
    return pid, gp, rp, start, full, end


@triton.jit
def _round(x, DT: tl.constexpr):
    """float32 ``x`` rounded to ``DT``, to nearest even. To bfloat16 by integer arithmetic on the bits (a carry out of
    the mantissa raises the exponent; a value past bfloat16's largest rounds to inf), the same on every device: Triton's
    interpreter truncates a float32 to bfloat16 where the GPU rounds it. ``x`` is finite (GAC updates only finite
    gradients)."""
    if DT == tl.bfloat16:
        u = x.to(tl.uint32, bitcast=True)
        u = u + 0x7FFF + ((u >> 16) & 1)
        return (u >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DT)


@triton.jit
def scalars_kernel(owner, starts, ends, g_addr, r_addr, partials, G: tl.constexpr, R: tl.constexpr,
                   REF_SQ: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """partials[pid] <- (<g, r>, ||g||^2, ||r||^2 if REF_SQ else 0) over the program's chunk, float32."""
    pid, gp, rp, start, full, end = _chunk(owner, starts, ends, g_addr, r_addr, G, R, ALIGNED, BLOCK)
    gr = tl.zeros([BLOCK], dtype=tl.float32)
    gg = tl.zeros([BLOCK], dtype=tl.float32)
    rr = tl.zeros([BLOCK], dtype=tl.float32)
    for base in range(start, full, BLOCK):
        offs = base + tl.arange(0, BLOCK)
        g = tl.load(gp + offs).to(tl.float32)
        r = tl.load(rp + offs).to(tl.float32)
        gr += g * r
        gg += g * g
        if REF_SQ:
            rr += r * r
    offs = full + tl.arange(0, BLOCK)
    mask = offs < end
    g = tl.load(gp + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(rp + offs, mask=mask, other=0.0).to(tl.float32)
    gr += g * r
    gg += g * g
    if REF_SQ:
        rr += r * r
    tl.store(partials + 3 * pid, tl.sum(gr, axis=0))
    tl.store(partials + 3 * pid + 1, tl.sum(gg, axis=0))
    tl.store(partials + 3 * pid + 2, tl.sum(rr, axis=0))


@triton.jit
def project_kernel(owner, starts, ends, g_addr, r_addr, alpha, G: tl.constexpr, R: tl.constexpr,
                   ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """r <- g - alpha r over the program's chunk, in float32, rounded once to r's dtype."""
    pid, gp, rp, start, full, end = _chunk(owner, starts, ends, g_addr, r_addr, G, R, ALIGNED, BLOCK)
    for base in range(start, full, BLOCK):
        offs = base + tl.arange(0, BLOCK)
        g = tl.load(gp + offs).to(tl.float32)
        r = tl.load(rp + offs).to(tl.float32)
        tl.store(rp + offs, _round(g - alpha * r, R))
    offs = full + tl.arange(0, BLOCK)
    mask = offs < end
    g = tl.load(gp + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(rp + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(rp + offs, _round(g - alpha * r, R), mask=mask)


@triton.jit
def apply_kernel(owner, starts, ends, g_addr, r_addr, alpha, G: tl.constexpr, R: tl.constexpr,
                 PROJECT: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """g <- g - alpha r (if PROJECT) and r <- the raw g rounded once to r's dtype, over the program's chunk."""
    pid, gp, rp, start, full, end = _chunk(owner, starts, ends, g_addr, r_addr, G, R, ALIGNED, BLOCK)
    for base in range(start, full, BLOCK):
        offs = base + tl.arange(0, BLOCK)
        g = tl.load(gp + offs).to(tl.float32)
        if PROJECT:
            r = tl.load(rp + offs).to(tl.float32)
            tl.store(gp + offs, _round(g - alpha * r, G))
        tl.store(rp + offs, _round(g, R))
    offs = full + tl.arange(0, BLOCK)
    mask = offs < end
    g = tl.load(gp + offs, mask=mask, other=0.0).to(tl.float32)
    if PROJECT:
        r = tl.load(rp + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(gp + offs, _round(g - alpha * r, G), mask=mask)
    tl.store(rp + offs, _round(g, R), mask=mask)
