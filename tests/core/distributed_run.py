"""One process of a group for test_distributed.py: joins the group at 127.0.0.1:PORT, builds
tensor_parallel_run's engines split over every process's devices, and as the leader runs the workload
through each and prints the results as one JSON line; as a follower, follows.

    python tests/distributed_run.py PORT NUM_PROCESSES PROCESS_ID TIMEOUT HEARTBEAT_TIMEOUT MODE RUN...

MODE "once": each run's workload once. MODE "endless": the leader prints "stepping" after its first
steps and then runs the workload again and again, until a process of the group dies. MODE "idle": the
leader prints "idle" and waits, as a server without requests does.
"""

import json
import sys
import time

import jax

import tensor_parallel_run as tp
from paged_jax.core import distributed


def endless(engine) -> None:
    steps = 0
    while True:
        if not engine.has_unfinished_requests():
            for prompt in tp.PROMPTS:
                engine.add_request(prompt, tp.PARAMS)
        engine.step()
        steps += 1
        if steps == 3:
            print("stepping", flush=True)


def main(argv: list[str]) -> None:
    port, num_processes, process_id, timeout, heartbeat_timeout, mode, *names = argv
    distributed.initialize(distributed.DistributedConfig(f"127.0.0.1:{port}", int(num_processes), int(process_id),
                                                         int(timeout), int(heartbeat_timeout)))
    results = {}
    for name in names:
        engine = tp.make_engine(name, tensor_parallel_size=jax.device_count())
        if not distributed.is_leader():
            distributed.follow(engine.runner)
        elif mode == "endless":
            endless(engine)
        elif mode == "idle":
            print("idle", flush=True)
            time.sleep(600)
        else:
            results[name] = tp.drive(engine) | dict(devices=jax.device_count(), processes=jax.process_count())
            distributed.stop_followers()
    if distributed.is_leader():
        print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
