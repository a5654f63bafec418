"""The step-cost model that compare_policies.py replays on (seconds = a + b * tokens computed +
c * context tokens attended), fitted to real SmolLM2 steps on this machine; step_cost.json beside
this script keeps the fit with the command, machine and date that produced it."""

import datetime
import pathlib
import sys
import time

import numpy as np

from make_workload import make_workload
from paged_jax.research import machine


def fit_step_cost(args) -> dict:
    """Time real engine steps on SmolLM2 (the second of two passes, so nothing compiles) and fit
    seconds = a + b * tokens + c * context by least squares."""
    from paged_jax import LLM, LLMEngine, SamplingParams

    # No prefix caching: the timed pass must meet exactly the shapes the first pass compiled.
    engine = LLMEngine.from_pretrained(args.model, max_num_batched_tokens=512, block_size=args.block_size,
                                       enable_prefix_caching=False)
    samples = []
    schedule = engine.scheduler.schedule

    def recording():
        out = schedule()
        samples.append((out.num_tokens, sum(s.seq.num_computed_tokens + s.num_new_tokens for s in out.scheduled)))
        return out

    engine.scheduler.schedule = recording  # measurement only: the decision itself is untouched
    workload = make_workload(args.fit_requests, seed=args.seed + 1)
    prompts = [r["prompt_token_ids"] for r in workload["requests"]]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=min(48, r["max_new_tokens"]))
              for r in workload["requests"]]
    llm = LLM.from_engine(engine)
    llm.generate(prompts, params, use_tqdm=False)
    rows = []
    for prompt, param in zip(prompts, params):
        engine.add_request(prompt, param)
    while engine.has_unfinished_requests():
        start, compiles = time.perf_counter(), engine.runner.num_compiles
        samples.clear()
        engine.step()
        if samples and samples[0][0] and engine.runner.num_compiles == compiles:
            rows.append((*samples[0], time.perf_counter() - start))
    data = np.array(rows)
    design = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
    # Least squares with every coefficient >= 0: a term that comes out negative is dropped and the
    # rest fitted again (a cost never shrinks with more work).
    keep = np.ones(3, bool)
    while True:
        coef = np.zeros(3)
        coef[keep] = np.linalg.lstsq(design[:, keep], data[:, 2], rcond=None)[0]
        if (coef >= 0).all():
            break
        keep &= coef > 0
    predicted = design @ coef
    r2 = 1 - np.sum((data[:, 2] - predicted) ** 2) / np.sum((data[:, 2] - data[:, 2].mean()) ** 2)
    return dict(a=float(coef[0]), b=float(coef[1]), c=float(coef[2]), r2=float(r2), num_steps=len(data),
                command="python scripts/" + " ".join([pathlib.Path(sys.argv[0]).name, *sys.argv[1:]]),
                model=args.model, block_size=args.block_size, machine=machine.one_line(machine.describe()),
                date=datetime.date.today().isoformat(),
                median_step_s=float(np.median(data[:, 2])), max_tokens_in_a_step=int(data[:, 0].max()))
