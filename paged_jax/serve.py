"""`python -m paged_jax.serve`: the OpenAI-compatible server's command line (paged_jax/serving/cli.py)."""

import sys

from paged_jax.core import host_memory
from paged_jax.serving.cli import main


def run() -> None:
    """The command line's entry point (`paged-jax-serve` too)."""
    host_memory.restart_with_tunables()
    sys.exit(main())


if __name__ == "__main__":
    run()
