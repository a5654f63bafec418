"""Compiled programs are kept on disk for the next run: set once, when the engine is imported, unless
the user chose a cache of their own; building an engine changes no JAX setting."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from models.tiny import TINY_LLAMA, random_model
from paged_jax import EngineConfig, LLMEngine

ROOT = Path(__file__).resolve().parents[2]
CODE = "import jax, paged_jax.core.engine; print(jax.config.jax_compilation_cache_dir)"


@pytest.mark.parametrize("users", [False, True], ids=["default", "users_own"])
def test_importing_the_engine_keeps_compiled_programs_in_the_cache_folder(tmp_path, users):
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env |= {"PAGED_JAX_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    if users:
        env["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path / "mine")
    run = subprocess.run([sys.executable, "-c", CODE], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(tmp_path / ("mine" if users else "cache/xla"))


def test_building_an_engine_changes_no_jax_setting():
    chosen = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)  # as if no cache were set: the engine must not set one
    try:
        before = dict(jax.config.values)
        LLMEngine(random_model(TINY_LLAMA), TINY_LLAMA, None, EngineConfig(num_blocks=8, block_size=16))
        assert dict(jax.config.values) == before
    finally:
        jax.config.update("jax_compilation_cache_dir", chosen)
