"""Probe: cost of registering a host buffer with CUDA (cudaHostRegister) and DMAing straight from
it, against the one-DMA pinned copy; the data behind the prepack notes of docs/NOTES.md (CUDA).

For sizes of a SmolLM2 and a Llama-1B weight image: a page-aligned anonymous mmap (the shape of a
program's data segment; read-only mapping via mprotect for the ReadOnly flag), touched first, then
  register (flags 0, and cudaHostRegisterReadOnly where the driver takes it) -> one memcpyAsync ->
  synchronize -> unregister, each timed; GB/s over the whole sequence.
Prints one JSON object per line.
"""

from __future__ import annotations

import json
import mmap
import time

import cupy as cp
import numpy as np

RO = 0x08  # cudaHostRegisterReadOnly


def probe(nbytes: int, flags: int, reps: int = 3):
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    host = np.frombuffer(mm, np.uint8)
    host[:] = 7  # touch every page (a loaded program's bytes are resident)
    dev = cp.empty(nbytes, np.uint8)
    s = cp.cuda.Stream(non_blocking=True)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        try:
            cp.cuda.runtime.hostRegister(host.ctypes.data, nbytes, flags)
        except Exception as e:  # noqa: BLE001
            return {"bytes": nbytes, "flags": flags, "error": str(e)[:200]}
        t1 = time.perf_counter()
        cp.cuda.runtime.memcpyAsync(dev.data.ptr, host.ctypes.data, nbytes, 1, s.ptr)
        s.synchronize()
        t2 = time.perf_counter()
        cp.cuda.runtime.hostUnregister(host.ctypes.data)
        t3 = time.perf_counter()
        out.append((t1 - t0, t2 - t1, t3 - t2))
    ok = bool((dev[:: 1 << 20] == 7).all())
    best = min(out, key=sum)
    del host
    mm.close()
    return {"bytes": nbytes, "flags": flags, "register_ms": best[0] * 1e3, "dma_ms": best[1] * 1e3,
            "unregister_ms": best[2] * 1e3, "dma_GBps": nbytes / best[1] / 1e9,
            "total_GBps": nbytes / sum(best) / 1e9, "all_reps_ms": [[round(x * 1e3, 2) for x in r] for r in out],
            "bytes_ok": ok}


def main():
    for n in (269 << 20, 2470 << 20):
        for flags in (0, RO):
            print(json.dumps(probe(n, flags)), flush=True)


if __name__ == "__main__":
    main()
