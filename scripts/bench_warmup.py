"""A cold warm-up, timed: every program an engine's steps can run made before traffic (warmup.py),
with the persistent compilation cache empty, its programs compiled side by side (parallel_compile.py)
or one at a time (--serial), each in a fresh process.

    python scripts/bench_warmup.py                     # SmolLM2, side by side, then one at a time
    python scripts/bench_warmup.py --modes serial --model path/to/model --dtype bfloat16

Prints, per mode, the warm-up's seconds and programs (the same programs either way). On a 2-core Xeon
(family 6 model 207, quiet) both modes took about 63 s for SmolLM2's 68 programs: on two cores side by
side gains nothing. It is meant for a GPU host's many cores, where one model-call program took about
20 s to compile (an H100, docs/gpu.md): not measured there yet.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parent.parent

CHILD = """
import json, sys, jax
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
from paged_jax.core import parallel_compile, warmup
from paged_jax import LLM
if sys.argv[2] == "serial":
    parallel_compile.workers = lambda: 1
llm = LLM(sys.argv[3], **json.loads(sys.argv[4]))
done = warmup.warm_up(llm.engine)
print(json.dumps(dict(mode=sys.argv[2], seconds=round(done.seconds, 1), programs=done.num_programs,
                      workers=parallel_compile.workers(), device=jax.devices()[0].device_kind)))
"""


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default=None)
    p.add_argument("--modes", default="parallel,serial", help="parallel, serial, or both, in this order")
    args = p.parse_args(argv)
    options = {"dtype": args.dtype} if args.dtype else {}
    rows = []
    for mode in args.modes.split(","):
        # This checkout's code, whatever the environment has installed.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        with tempfile.TemporaryDirectory() as cache:
            out = subprocess.run([sys.executable, "-c", CHILD, cache, mode, args.model, json.dumps(options)],
                                 capture_output=True, text=True, check=True, env=env).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    return rows


if __name__ == "__main__":
    main()
