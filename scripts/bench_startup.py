"""Start-up as a person meets it: process wall time from launching scripts/generate.py to its first
answer byte, cold (an empty cache directory: the model is converted, the kernel built, the step
compiled) and warm (the same directory again).

    python scripts/bench_startup.py --warm-runs 5 --json out/startup.json

Each figure is a whole process, imports included, so the runs alternate nothing: run it on a quiet
machine. The process's CPU time (user + system, read from /proc at the first byte) is printed beside
the wall time; on a busy machine it is the steadier of the two.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from paged_jax.research import machine

REPO = Path(__file__).resolve().parent.parent
PROMPT = "Explain PagedAttention in one paragraph"


def first_token(cache_dir: str, model: str, max_tokens: int) -> dict:
    """One run of generate.py: seconds to the first byte it prints (wall, and the process's CPU)."""
    cmd = [sys.executable, str(REPO / "scripts" / "generate.py"), PROMPT, "--model", model,
           "--max-tokens", str(max_tokens)]
    # This checkout's code, whatever the environment has installed.
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PAGED_JAX_CACHE_DIR=cache_dir, PYTHONPATH=path)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first = proc.stdout.read(1)
    wall = time.perf_counter() - start
    with open(f"/proc/{proc.pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    rest, err = proc.communicate()
    total = time.perf_counter() - start
    if proc.returncode != 0 or not first:
        raise SystemExit(f"generate.py failed ({proc.returncode}): {err.decode()[-2000:]}")
    return {"first_token_s": round(wall, 2), "cpu_s": round(cpu, 2), "exit_s": round(total, 2),
            "text": (first + rest).decode(errors="replace").strip()}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--warm-runs", type=int, default=3)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="paged_jax_startup_") as cache_dir:
        cold = first_token(cache_dir, args.model, args.max_tokens)
        warm = [first_token(cache_dir, args.model, args.max_tokens) for _ in range(args.warm_runs)]
    if any(run["text"] != cold["text"] for run in warm):
        raise SystemExit("a warm run answered differently from the cold one")
    figures = {
        "machine": machine.describe(),
        "cold_first_token_s": cold["first_token_s"],
        "cold_cpu_s": cold["cpu_s"],
        "warm_first_token_s": [run["first_token_s"] for run in warm],
        "warm_cpu_s": [run["cpu_s"] for run in warm],
        "warm_first_token_median_s": statistics.median(run["first_token_s"] for run in warm),
        "warm_cpu_median_s": statistics.median(run["cpu_s"] for run in warm),
        "load_average_1min": os.getloadavg()[0],
        "answer": cold["text"],
    }
    print(machine.one_line(figures["machine"]))
    for name, value in figures.items():
        if name != "machine":
            print(f"{name:>26}: {value}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return figures


if __name__ == "__main__":
    main()
