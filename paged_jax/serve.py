"""`python -m paged_jax.serve`: the OpenAI-compatible server's command line (paged_jax/serving/cli.py)."""

import sys

from paged_jax.serving.cli import main

if __name__ == "__main__":
    sys.exit(main())
