"""Many hosts: processes joined by `jax.distributed`, one leader that schedules, followers that run its steps.

The mesh spans every process's devices (tensor_parallel_size = jax.device_count()), so each process
holds its shards of the weights and of the KV cache. Process 0 leads: it alone has requests, the
scheduler, the block pool and the page tables, and (serving) the HTTP front end. The ModelRunner's
methods that touch the device are `replicated`: on the leader, a call first goes to the followers as
a message (the method's name and its host arrays: the step's flat batch, page tables and sampling
tensors with its block copies, or the blocks a swap reads or writes), and each follower (`follow`)
makes the same call on its own shards. So every process runs the same jitted programs in the same
order, and their collectives meet; the sampled tokens come out of the sharded step replicated, and the
leader reads its own copy.

A message crosses with JAX's own collective (multihost_utils.broadcast_one_to_all) in two parts: a
fixed-size header, its length, then the pickled message padded to a power of two, so the followers
learn every shape from the leader and a run compiles one broadcast per size bucket. (Pickle trusts
the leader, as the group trusts its members.)

Nothing hangs for ever; each of these ends the process with a message on stderr and exit status
EXIT_GROUP_FAILED:
- joining: the coordinator (process 0) cannot be reached, or not every process joins, within `timeout`;
- an operation of the group fails, or takes longer than `timeout` (a process that is alive but stuck).
  A process that dies makes the others' next collective fail at once (its connections close); a group
  cannot recover from a failed operation (its processes may no longer agree), so it ends;
- a process that falls silent (its host gone): JAX's coordination service misses its heartbeats for
  `heartbeat_timeout` seconds (by default `timeout`) and ends every process itself.
"""

import argparse
import atexit
import contextlib
import dataclasses
import functools
import itertools
import os
import pickle
import sys
import threading
import zlib

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from models.sharding import make_mesh
from paged_jax.core.buckets import bucket

EXIT_GROUP_FAILED = 3
DEFAULT_TIMEOUT = 300  # seconds: JAX's own initialization timeout
_MIN_MESSAGE_BYTES = 4096


@dataclasses.dataclass(frozen=True, slots=True)
class DistributedConfig:
    """How this process joins its group. Values left None come from the environment, as
    jax.distributed.initialize finds them (JAX_COORDINATOR_ADDRESS, Slurm, Open MPI, ...)."""

    coordinator_address: str | None = None  # host:port of process 0, reachable from every process
    num_processes: int | None = None
    process_id: int | None = None
    # Seconds to join, for one operation of the group, and of silence before a process counts as dead.
    timeout: int = DEFAULT_TIMEOUT
    # Seconds of silence alone, where they should differ: a dead host found sooner than a slow start or a
    # first step's compile may take. None: `timeout`.
    heartbeat_timeout: int | None = None

    def __post_init__(self):
        if self.timeout < 1 or (self.heartbeat_timeout is not None and self.heartbeat_timeout < 1):
            raise ValueError(f"timeouts must be >= 1 s, got {self.timeout} and {self.heartbeat_timeout}")
        if self.num_processes is not None and self.num_processes < 1:
            raise ValueError(f"num_processes must be >= 1, got {self.num_processes}")
        if self.process_id is not None and not 0 <= self.process_id < (self.num_processes or self.process_id + 1):
            raise ValueError(f"process_id must be in [0, num_processes), got {self.process_id}")


_config = DistributedConfig()  # this process's, once initialize has run
_name = "a process of the group"  # how messages name this process
_followers_waiting = False  # whether the followers are in `follow` and must be told to stop


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("many hosts (jax.distributed: process 0 leads, the others follow)")
    group.add_argument("--coordinator-address", help="host:port of process 0, reachable from every process")
    group.add_argument("--num-processes", type=int, help="processes in the group")
    group.add_argument("--process-id", type=int, help="this process's rank, 0 to num-processes - 1")
    group.add_argument("--distributed", action="store_true",
                       help="join a group whose unset values come from the environment (JAX_COORDINATOR_ADDRESS, "
                            "Slurm, Open MPI)")
    group.add_argument("--distributed-timeout", type=int, default=DEFAULT_TIMEOUT,
                       help="seconds to join, for one step of the group, and of silence before a process counts "
                            "as dead (default: %(default)s)")
    group.add_argument("--distributed-heartbeat-timeout", type=int, default=None,
                       help="seconds of silence before a process counts as dead, where it should differ from "
                            "--distributed-timeout")


def config_from_args(args: argparse.Namespace) -> DistributedConfig | None:
    """The config `add_arguments`' flags ask for, or None when they ask for no group."""
    if not (args.distributed or args.coordinator_address or args.num_processes or args.process_id is not None):
        return None
    return DistributedConfig(args.coordinator_address, args.num_processes, args.process_id, args.distributed_timeout,
                             args.distributed_heartbeat_timeout)


def initialize_from_args(args: argparse.Namespace) -> None:
    """Join the group `add_arguments`' flags ask for, if they ask for one."""
    config = config_from_args(args)
    if config is not None:
        initialize(config)


def initialize(config: DistributedConfig) -> None:
    """Join the group, before anything else touches JAX. On the CPU the processes' collectives go over gloo."""
    global _config, _name
    _name = f"process {config.process_id}" if config.process_id is not None else _name
    with contextlib.suppress(AttributeError):  # the option JAX 0.10 has (gloo its default); a later JAX may not
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    where = config.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS") or "the environment's address"
    # JAX aborts with a bare DEADLINE_EXCEEDED when it gives up: give up a little before it, and say why.
    with _deadline(config.timeout, f"could not join the group within {config.timeout} s: the coordinator "
                                   f"(process 0, at {where}) cannot be reached, or not every process started"):
        jax.distributed.initialize(config.coordinator_address, config.num_processes, config.process_id,
                                   initialization_timeout=config.timeout + 10,
                                   heartbeat_timeout_seconds=config.heartbeat_timeout or config.timeout,
                                   shutdown_timeout_seconds=config.timeout)
    _config = config
    _name = f"process {jax.process_index()} of {jax.process_count()}"
    # Before JAX's own exit handler (they run last registered first), whose shutdown waits for every process.
    atexit.register(stop_followers)


def is_leader() -> bool:
    return jax.process_index() == 0


def is_follower() -> bool:
    """Whether this process follows a leader: then it runs `follow`, not a front end of its own."""
    return jax.process_count() > 1 and not is_leader()


def engine_mesh(size: int) -> Mesh | None:
    """The mesh an engine of tensor_parallel_size `size` splits its model over, or None on one device.
    In a group it must span every process's devices: each process then holds a share."""
    if jax.process_count() > 1 and size != jax.device_count():
        raise ValueError(f"in a group of {jax.process_count()} processes the model is split over all their "
                         f"{jax.device_count()} devices: tensor_parallel_size must be {jax.device_count()}, not {size}")
    return make_mesh(size) if size > 1 else None


def agree(num_blocks: int, described: object) -> int:
    """The KV blocks every process of a group runs with: the fewest any has room for. Fails when the
    processes describe their engine (options and model) differently; alone, `num_blocks`."""
    global _followers_waiting
    if jax.process_count() == 1:
        return num_blocks
    # This is the group's first collective, and gloo gives processes 30 s to meet at one; hosts build
    # their engines at their own pace (a slower disk, a busy machine), so they meet at a barrier first.
    _guarded("waiting for every process to build its engine", _barrier, "engine built")
    mine = np.array([num_blocks, zlib.crc32(repr(described).encode()) & 0x7FFFFFFF], np.int32)
    rows = _guarded("agreeing on the engine", multihost_utils.process_allgather, mine)
    if len(set(rows[:, 1].tolist())) > 1:
        raise ValueError(f"the processes of the group were given different engine options or models: {described}")
    # From here on the followers build their runner and follow it, until the leader says stop.
    _followers_waiting = is_leader()
    return int(rows[:, 0].min())


def replicated(method):
    """A ModelRunner method that every process of a group runs, with the same host arguments: on the
    leader, the call goes to the followers first. Alone, a plain call."""

    @functools.wraps(method)
    def call(runner, *args):
        if jax.process_count() == 1:
            return method(runner, *args)
        _guarded(f"sending {method.__name__} to the followers", _broadcast, (method.__name__, args))
        return _guarded(method.__name__, method, runner, *args)

    call.replicated = True
    return call


def follow(runner) -> None:
    """A follower's life once its engine is built: make each `replicated` call the leader's runner
    makes, on this process's shards, until the leader stops (its engine is done, or it exits)."""
    while True:
        # Not guarded: an idle leader (a server without requests) sends nothing for as long as it likes.
        try:
            message = _broadcast(None)
        except Exception as error:
            _fail(f"lost the leader (process 0): {error}")
        if message is None:
            return
        name, args = message
        method = getattr(type(runner), name, None)
        if not getattr(method, "replicated", False):
            _fail(f"the leader sent {name!r}, which is no replicated method of {type(runner).__name__}")
        _guarded(name, method.__wrapped__, runner, *args)


def stop_followers() -> None:
    """On the leader: let the followers' `follow` return (also done at exit)."""
    global _followers_waiting
    if _followers_waiting and jax.process_count() > 1:
        _followers_waiting = False
        _guarded("stopping the followers", _broadcast, None)


def to_host(tree):
    """numpy copies of a pytree of arrays, whole, on every process. An array split over processes is
    gathered, a collective: every process must call this for it."""
    if jax.process_count() == 1:
        return jax.device_get(tree)

    def whole(x: jax.Array) -> np.ndarray:
        if x.is_fully_addressable:
            return np.asarray(x)
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        return multihost_utils.process_allgather(x, tiled=True)

    return jax.tree.map(whole, tree)


def _broadcast(message: object) -> object:
    """The leader's `message` on every process (the followers pass None): its length, then its bytes."""
    leader = is_leader()
    data = np.frombuffer(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL), np.uint8) if leader else None
    size = int(multihost_utils.broadcast_one_to_all(np.array([data.size if leader else 0], np.int32))[0])
    buffer = np.zeros(bucket(size, _MIN_MESSAGE_BYTES), np.uint8)
    if leader:
        buffer[:size] = data
    buffer = multihost_utils.broadcast_one_to_all(buffer)
    return message if leader else pickle.loads(buffer[:size].tobytes())


_barriers = itertools.count()  # barrier names are used once: each is numbered, in the order every process meets them


def _barrier(name: str) -> None:
    """Wait until every process of the group has come here, for up to the group's timeout (and a little
    more: _guarded's watchdog, which says what was waited for, ends it first)."""
    from jax._src import distributed as jax_distributed  # the coordination service's client has no public door

    jax_distributed.global_state.client.wait_at_barrier(f"paged_jax: {name} {next(_barriers)}",
                                                        (_config.timeout + 10) * 1000)


def _guarded(what: str, fn, *args):
    """fn(*args), ending the process if it fails or outlasts the group's timeout."""
    with _deadline(_config.timeout, f"{what} did not finish within {_config.timeout} s: a process of the group "
                                    f"is stuck or unreachable"):
        try:
            return fn(*args)
        except Exception as error:
            _fail(f"{what} failed: {type(error).__name__}: {error}\nA process that died shows as a failed "
                  f"collective. The group cannot go on after a failed operation, so this process ends.")


@contextlib.contextmanager
def _deadline(seconds: float, message: str):
    timer = threading.Timer(seconds, _fail, (message,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _fail(message: str) -> None:
    """End this process now, from any thread, without JAX's exit handlers (whose shutdown barrier
    would wait for the processes that are gone)."""
    sys.stderr.write(f"paged_jax.core.distributed, {_name}: {message}\n")
    sys.stderr.flush()
    os._exit(EXIT_GROUP_FAILED)
