"""A seeded workload in W1's format with chat-like lengths: many short requests, a few long ones.

    python scripts/make_workload.py --out out/longtail.json

Prompt and output lengths are log-normal, as ShareGPT's are (vLLM's serving benchmark samples that
set: a median prompt near a hundred tokens, a tail past a thousand); a share of the prompts opens with
one of a few system prompts, so prefix caching has something to find.
"""

import argparse
import json
import pathlib

import numpy as np


def make_workload(num_requests: int = 200, seed: int = 0, *, prompt_median: int = 100, output_median: int = 120,
                  sigma: float = 1.0, max_len: int = 2048, shared_fraction: float = 0.4,
                  num_system_prompts: int = 3) -> dict:
    """W1's fields: requests[i].prompt_token_ids, requests[i].max_new_tokens; token ids in [1000, 40000)."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(1000, 40000, size=int(n)).tolist() for n in rng.integers(40, 300, size=num_system_prompts)]
    # Room for the longest system prompt (300 tokens), so that no request exceeds max_len.
    prompts = np.clip(rng.lognormal(np.log(prompt_median), sigma, num_requests), 4, max_len // 2 - 300).astype(int)
    outputs = np.clip(rng.lognormal(np.log(output_median), sigma, num_requests), 4, max_len // 2).astype(int)
    requests = []
    for i, (n, m) in enumerate(zip(prompts, outputs)):
        own = rng.integers(1000, 40000, size=int(n)).tolist()
        system = systems[rng.integers(num_system_prompts)] if rng.random() < shared_fraction else []
        requests.append(dict(id=i, prompt_token_ids=system + own, max_new_tokens=int(m)))
    return dict(name=f"longtail-{num_requests}-seed{seed}", description=__doc__.splitlines()[0],
                num_requests=num_requests, total_prompt_tokens=sum(len(r["prompt_token_ids"]) for r in requests),
                total_output_tokens=sum(r["max_new_tokens"] for r in requests), requests=requests)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("out/longtail.json"))
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    workload = make_workload(args.num_requests, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(workload))
    lengths = [len(r["prompt_token_ids"]) for r in workload["requests"]]
    outputs = [r["max_new_tokens"] for r in workload["requests"]]
    print(f"wrote {args.out}: {args.num_requests} requests, prompts median {int(np.median(lengths))} "
          f"max {max(lengths)}, outputs median {int(np.median(outputs))} max {max(outputs)}")


if __name__ == "__main__":
    main()
