"""Nominal hardware facts: what the op families assume about the GPU before any GPU is touched.

Search spaces, default candidates and render contexts are built in the parent process from the spec
alone, before any GPU is touched, and a spec does not name the GPU (the cache key's environment
does). So the rules that depend on the hardware (which points are worth timing, how large a tile may
be) read these nominal values; code that runs on the device reads the real ones (the persistent
launchers call torch.cuda.get_device_properties at run time). One table, so that the op families
cannot drift apart.

Bottom layer: the standard library only (imported by kernels/*.py and forge/opkit.py).
"""

from __future__ import annotations

# Streaming multiprocessors.
# GPU_SMS: 132, the H100/H200 SXM count (forge is tuned on an H200). It bounds which points are worth
#          timing: the elementwise persistent grids (opkit.elementwise_space), matmul's split-K and sdpa's
#          split-KV (each rule says why where it is written).
GPU_SMS = 132
# CPU_SMS: 4, what the Triton interpreter pretends to have. The elementwise persistent rule uses it for
#          a "cpu" spec, and the persistent launchers size their grid with it there (rendered into the
#          interpreter's sources as CPU_SMS), so that interpreted persistent programs loop over blocks.
CPU_SMS = 4

# Shared memory one program may use for its tiles (matmul's pipelined A/B tiles, sdpa's q tile and
# K/V buffers). Hopper allows 227 KB per block; the budget stays below it for what Triton needs of
# its own (barriers, the epilogue's layout conversion, the compiler's scratch).
SMEM_PER_PROGRAM = 200 * 1024

