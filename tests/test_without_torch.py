"""The runtime needs no torch (a dev-only dependency): with torch made unimportable, the default
model converts from its GGUF, tokenizer included, and answers, and nothing on stderr says torch is
missing (transformers' advice that it is, which the engine silences)."""

import os
import subprocess
import sys
from pathlib import Path

from models.loader import cache_dir

ROOT = Path(__file__).resolve().parents[1]

# sys.modules[name] = None is how Python spells "not installed" here: `import torch` raises
# ImportError, and importlib.util.find_spec (which transformers asks) answers None.
SCRIPT = """
import sys
sys.modules["torch"] = None
from paged_jax import LLM, SamplingParams
llm = LLM("smollm2-135m", num_blocks=64)
prompt = llm.chat_prompt([{"role": "user", "content": "Explain PagedAttention in one paragraph"}])
out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
print(len(out.outputs[0].token_ids), repr(out.outputs[0].text))
"""


def test_the_default_model_answers_without_torch(tmp_path):
    # A fresh cache, so the GGUF is converted here; compiled programs from the usual place, so
    # the step is not compiled again.
    env = os.environ | {"PAGED_JAX_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT),
                        "JAX_COMPILATION_CACHE_DIR": os.environ.get("JAX_COMPILATION_CACHE_DIR", str(cache_dir() / "xla"))}
    run = subprocess.run([sys.executable, "-c", SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "PyTorch was not found" not in run.stderr, run.stderr[-3000:]
    count, text = run.stdout.split(" ", 1)
    assert count == "4" and text.strip("'\n").startswith("Paged"), run.stdout
    assert any((tmp_path / "models").iterdir()), "the conversion was not kept"
