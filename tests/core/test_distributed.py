"""Many hosts, on one machine: two processes joined by jax.distributed on localhost (gloo collectives),
each with 2 forced host devices, the model split over all 4 (distributed_run.py is one process).

The leader's greedy tokens equal one process's on one device, with chunked prefill, prefix caching
and both preemption modes in play; a group whose follower is killed, or that cannot form, ends with
a clear error within a bounded time instead of hanging.
"""

import contextlib
import json
import os
import select
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import tensor_parallel_run as tp  # noqa: E402
from paged_jax.core.distributed import EXIT_GROUP_FAILED  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
# The group's: to join, for one operation, of silence. It also bounds how long one process waits for the
# other to build its engine, which on a busy 2-core machine took over 30 s.
TIMEOUT = 120
RUNS = {"kv2-tp4": "kv2-tp1", "kv2-tp4-swap": "kv2-tp1-swap"}  # run of the group -> its one-process twin


def environment(devices: int) -> dict:
    flags = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
    return os.environ | {"XLA_FLAGS": flags, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests" / "core")])}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def group(mode: str, names: list[str], ranks=(0, 1), num_processes: int = 2, timeout: int = TIMEOUT,
          heartbeat_timeout: int | None = None):
    """The processes of `ranks` (of a group of num_processes) running distributed_run.py; killed on the way out."""
    port = free_port()
    processes = [subprocess.Popen([sys.executable, str(REPO / "tests" / "core" / "distributed_run.py"), str(port),
                                   str(num_processes), str(rank), str(timeout), str(heartbeat_timeout or timeout),
                                   mode, *names],
                                  cwd=REPO, env=environment(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)
                 for rank in ranks]
    try:
        yield processes
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.communicate()


def wait_for_line(process: subprocess.Popen, line: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([process.stdout], [], [], deadline - time.monotonic())
        if ready and (got := process.stdout.readline()):
            if got.strip() == line:
                return
        elif process.poll() is not None:
            break
    pytest.fail(f"no {line!r} from the leader within {timeout} s; its stderr: {process.stderr.read()[-3000:]}")


@pytest.fixture(scope="module")
def one_process() -> dict:
    runs = list(RUNS.values())
    code = ("import json, tensor_parallel_run as tp; "
            f"print(json.dumps({{n: tp.drive(tp.make_engine(n)) for n in {runs}}}))")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=environment(1), capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def two_processes() -> dict:
    with group("once", list(RUNS)) as (leader, follower):
        out, err = leader.communicate(timeout=300)
        assert leader.returncode == 0, err[-3000:]
        follower.wait(timeout=60)
        assert follower.returncode == 0, "the follower stops when the leader's runs are over"
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(RUNS))
def test_greedy_tokens_match_one_process(one_process, two_processes, name):
    got, want = two_processes[name], one_process[RUNS[name]]
    assert got["processes"] == 2 and got["devices"] == 4
    tp.assert_same_tokens(got, want, swap=name.endswith("swap"))


def test_leader_ends_with_a_clear_error_when_a_follower_dies():
    with group("endless", ["kv2-tp4"]) as (leader, follower):
        wait_for_line(leader, "stepping", timeout=240)
        follower.kill()
        killed = time.monotonic()
        _, err = leader.communicate(timeout=TIMEOUT + 30)
        ended = time.monotonic() - killed
    # Its next collective fails at once.
    assert leader.returncode == EXIT_GROUP_FAILED, err[-3000:]
    assert "paged_jax.core.distributed, process 0 of 2:" in err and "failed" in err, err[-3000:]
    assert ended < TIMEOUT, f"the leader took {ended:.0f} s to end"


def test_idle_leader_ends_when_a_follower_dies():
    # No collective runs: JAX's coordination service misses the follower's heartbeats for `heartbeat`
    # seconds and ends the leader itself. Joining and building the engines (each step of the warm-up is
    # an operation of the group) keep the group's TIMEOUT, which a busy machine's start needs.
    heartbeat = 10
    with group("idle", ["kv2-tp4"], heartbeat_timeout=heartbeat) as (leader, follower):
        wait_for_line(leader, "idle", timeout=240)
        follower.kill()
        killed = time.monotonic()
        _, err = leader.communicate(timeout=heartbeat + 30)
        ended = time.monotonic() - killed
    assert leader.returncode != 0
    assert "heartbeat" in err, err[-3000:]
    assert ended < heartbeat + 15, f"the leader took {ended:.0f} s to end"


def test_a_process_that_cannot_reach_the_coordinator_ends_with_a_clear_error():
    # It gives up after its own 5 s; waiting on JAX's default (300 s) would run past communicate's
    # bound, which leaves a slow or busy machine minutes for the process's start.
    with group("once", ["kv2-tp4"], ranks=[1], timeout=5) as (follower,):
        _, err = follower.communicate(timeout=120)
    assert follower.returncode == EXIT_GROUP_FAILED, err[-3000:]
    assert "could not join the group within 5 s: the coordinator (process 0, at 127.0.0.1:" in err, err[-3000:]
