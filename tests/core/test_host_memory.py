"""Command lines restart themselves with glibc told to keep freed memory mapped (host_memory.py).

What that is worth is measured, not tested: scripts/bench_throughput.py, which restarts itself so."""

import os
import platform
import subprocess
import sys

import pytest

from paged_jax.core import host_memory

RESTARTING = """
import os
from paged_jax.core import host_memory
print(os.getpid(), os.environ.get("GLIBC_TUNABLES"), flush=True)
host_memory.restart_with_tunables()
"""


def run(code: str, tunables: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    env |= {"GLIBC_TUNABLES": tunables} if tunables is not None else {}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's")
def test_a_command_line_restarts_itself_once_with_the_settings_kept_beside_others():
    lines = run(RESTARTING, "glibc.pthread.rseq=0").splitlines()
    assert len(lines) == 2 and lines[0].split()[0] == lines[1].split()[0]  # execv: the same process, twice
    assert lines[0].split()[1] == "glibc.pthread.rseq=0"
    assert set(lines[1].split()[1].split(":")) == {"glibc.pthread.rseq=0"} | {f"{k}={v}" for k, v in host_memory.TUNABLES.items()}


def test_settings_given_by_the_user_win():
    assert "glibc.malloc.arena_max=4" in host_memory.tunables("glibc.malloc.arena_max=4").split(":")
    assert host_memory.tunables(host_memory.tunables()) == host_memory.tunables()
