"""Keeping freed host memory mapped, so that an engine step on the CPU does not fault its buffers in again.

XLA's CPU runtime allocates a program's scratch and outputs with the C allocator each time it runs the
program, and frees them after. glibc serves allocations over 32 MB (and, until its adaptive threshold
has risen, anything over 128 kB) with a fresh mmap and unmaps them on free, its threads' arenas give
their free memory back as well, and so each step meets memory the OS has not mapped: every 4 kB page
of it faults in again. On the 2-core VMs this project is measured on a fault costs about 5 us, and a W1
run with every program compiled and every KV block already written still faulted 400,000 times, about
2 s of its 24 (the sampler of 64 rows alone: 9,000 faults a call, its 38 MB of scratch).

`TUNABLES` have glibc serve every thread from one heap, never by mmap, and keep up to 1 GiB free at its
top, so the next call finds its pages mapped. What that costs: memory a step frees stays with the
process, up to that bound, for the next step to use, as a serving process would hold it at its next
peak anyway. glibc reads them when a process starts (set later through mallopt they miss the threads
that already have an arena), so the command lines restart themselves with them
(`restart_with_tunables`); a program of one's own that runs the engine on the CPU can be started with
`GLIBC_TUNABLES` set to `tunables()`. vLLM's CPU backend asks for tcmalloc preloaded for the same reason.
"""

import os
import platform
import sys

TUNABLES = {"glibc.malloc.arena_max": "1", "glibc.malloc.mmap_max": "0", "glibc.malloc.trim_threshold": str(1 << 30)}


def tunables(current: str = "") -> str:
    """GLIBC_TUNABLES with TUNABLES added to `current` (a value already set wins)."""
    settings = dict(item.split("=", 1) for item in current.split(":") if "=" in item)
    return ":".join(f"{name}={value}" for name, value in (TUNABLES | settings).items())


def restart_with_tunables() -> None:
    """Run this process again (os.execv: the same pid and command line) with TUNABLES set, unless they are
    or the C library is not glibc. A command line's first statement: anything before it runs twice."""
    current = os.environ.get("GLIBC_TUNABLES", "")
    if platform.libc_ver()[0] != "glibc" or tunables(current) == current:
        return
    os.environ["GLIBC_TUNABLES"] = tunables(current)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, sys.orig_argv)
