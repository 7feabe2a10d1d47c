"""Where a GGUF model's weight matrices live while it runs: copied once, at load, into one
anonymous memory region that asks the kernel for transparent huge pages (2 MiB).

Owns `placement` (the choice, from the environment), `resident_copy` (the copy, as uint8 views of that region, one per tensor) and
`huge_page_bytes` (how much of a region the kernel backs with huge pages, for reports).

Why not the file's memory map, which the decoder read before: a step reads every matrix once,
front to back, and in 4 KiB page-cache pages each page costs a TLB miss and restarts the
hardware prefetchers. Measured on a Zen 4 (2 threads, Qwen2.5-Coder-1.5B Q4_K_M, one-token
steps alternated between processes): 34.9 and 36.4 ms with the matrices in huge pages against
40.4 and 41.5 ms mapped; a 2-thread read of 900 MB in the kernels' access order ran at 31 GB/s
from huge pages against 27.5 GB/s from the file's map. llama.cpp gets the same effect by
repacking its weights into buffers of its own.

What it costs: the copied tensors are the process's own memory instead of shared page cache (so
two processes that load one file hold two copies), and loading takes longer: the 1.5B loaded in
2.5-3.6 s against 0.9-1.25 s mapped (fresh processes alternated, the file in the page cache), most
of it the first touch of the huge pages on this VM (1 GB of them: 0.9-1.4 s, of 4 KiB pages
0.4-0.5 s). The memory stays about the file's size: a tensor read only by
rows (an untied token embedding, looked up a row at a time) is not copied and stays mapped, its
pages read as they are used. The copy is read from the file, not through the map, so the mapped
pages of the copied tensors never join the process's resident set.

`VERISPEC_WEIGHTS=mapped` keeps every matrix in the file's map (no copy); where the anonymous
region cannot be had (no memory, no Linux), the map is used too. The bytes are the file's either
way, so no result changes.
"""

from __future__ import annotations

import mmap
import os
import re
from collections.abc import Iterable

import numpy as np

from ..errors import ModelLoadError

HUGE_PAGE = 2 << 20
ALIGN = 64  # each tensor starts on a cache line
READ_SLICE = 16 << 20


def placement() -> str:
    """"resident" or "mapped", from `VERISPEC_WEIGHTS` (unset or empty: "resident"); another
    value is a ModelLoadError that names the two."""
    value = os.environ.get("VERISPEC_WEIGHTS", "").strip().lower() or "resident"
    if value not in ("resident", "mapped"):
        raise ModelLoadError(f"VERISPEC_WEIGHTS={value!r}: use 'resident' (the default: the matrices in huge "
                             f"pages) or 'mapped' (kept in the file's memory map)")
    return value


def resident_copy(file, names: Iterable[str]) -> dict[str, np.ndarray]:
    """{name: the tensor's bytes as a 1-D uint8 array} for `names` of the parsed GGUF `file`,
    copied into one anonymous region in huge pages; {} where the matrices stay in the file's
    map (`VERISPEC_WEIGHTS=mapped`, or the region could not be had)."""
    names = list(dict.fromkeys(names))
    if not names or placement() == "mapped":
        return {}
    offsets, total = {}, 0
    for name in names:
        offsets[name] = total
        total += -(-file.tensors[name].nbytes // ALIGN) * ALIGN
    try:
        region = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError, AttributeError):
        return {}
    if hasattr(mmap, "MADV_HUGEPAGE"):  # before the first touch, so that the faults take 2 MiB pages
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    whole = np.frombuffer(region, dtype=np.uint8)
    start = -whole.ctypes.data % HUGE_PAGE  # the region's first 2 MiB boundary
    views = {}
    with open(file.path, "rb", buffering=0) as handle:
        for name in names:
            info = file.tensors[name]
            view = whole[start + offsets[name]:start + offsets[name] + info.nbytes]
            handle.seek(info.offset)
            target, done = memoryview(view), 0
            while done < info.nbytes:  # a read may return fewer bytes than asked
                count = handle.readinto(target[done:done + READ_SLICE])
                if not count:
                    return {}  # the file changed under us: keep the map, which reads what is there
                done += count
            view.flags.writeable = False
            views[name] = view
    return views


def huge_page_bytes(view: np.ndarray, smaps: Iterable[str] | None = None) -> int | None:
    """Bytes of the region holding `view` that the kernel backs with huge pages: its AnonHugePages
    in `smaps` (the lines of /proc/self/smaps, read when not given), or None where that cannot be
    read or no region holds it."""
    address = view.ctypes.data
    if smaps is None:
        try:
            with open("/proc/self/smaps") as file:
                return huge_page_bytes(view, file)
        except OSError:
            return None
    inside = False
    for line in smaps:
        match = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if match:
            inside = int(match.group(1), 16) <= address < int(match.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return None
