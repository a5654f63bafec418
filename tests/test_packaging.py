"""What an install holds: a built wheel carries the CPU kernel's source, and a non-editable install
runs the kernel, not the slower XLA path."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # No build isolation: no network, and the build backend is the one the dev extra installs.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", out, ROOT],
                   check=True, capture_output=True)
    return next(out.glob("paged_jax-*.whl"))


def test_wheel_carries_the_cpu_kernel_sources(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for source in ("attention.cc", "linear.cc", "common.h"):
        assert f"kernels_pallas/cpu/{source}" in names


def test_wheel_carries_the_dashboard_page(wheel):
    assert "paged_jax/serving/static/dashboard.html" in zipfile.ZipFile(wheel).namelist()


def test_non_editable_install_runs_the_cpu_kernel(wheel, tmp_path):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", site, wheel],
                   check=True, capture_output=True)
    # The engine's own choice, for a model config that needs no weights.
    code = """
import kernels_pallas
from models import ModelConfig
from paged_jax import EngineConfig
from paged_jax.core.config import default_device, resolve
config = ModelConfig(architecture="llama", vocab_size=32, hidden_size=64, intermediate_size=96, num_layers=1,
                     num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4,
                     max_position_embeddings=64)
print(kernels_pallas.__file__)
print(resolve(EngineConfig(num_blocks=8), config, default_device(), 'float32').attention)
"""
    # Run outside the repository, so that only the installed copy can be imported.
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=os.environ | {"PYTHONPATH": str(site)},
                         capture_output=True, text=True, check=True)
    location, choice = run.stdout.splitlines()
    assert Path(location).is_relative_to(site)
    assert choice == "BackendChoice(backend='cpu', reason='the C++ kernel for float32 on the CPU', fallback=False)"
