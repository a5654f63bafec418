"""What an install holds: a built wheel carries the CPU kernel's source, and a non-editable install
runs the kernel, not the slower XLA path; the project's own `models` and `kernels_pallas` are imported
whatever folders or files of those names lie where the user works, from a wheel and from the editable
install that `make setup` makes."""

import os
import shlex
import subprocess
import sys
import sysconfig
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


def test_wheel_carries_every_package_of_the_checkout(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    packages = [init.parent.relative_to(ROOT).as_posix() for top in ("paged_jax", "kernels_pallas", "models")
                for init in (ROOT / top).rglob("__init__.py")]
    assert packages and [p for p in packages if f"{p}/__init__.py" not in names] == []


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
from paged_jax.core.resolve import default_device, resolve
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


def _setup_install_args() -> list[str]:
    """The arguments `make setup` gives `pip install` for the project itself (the line with -e)."""
    recipe = ROOT.joinpath("Makefile").read_text().split("\nsetup:\n", 1)[1].split("\n\n", 1)[0]
    line = next(line for line in recipe.splitlines() if "pip install" in line and " -e " in line)
    return [str(ROOT) if arg == "." else arg for arg in shlex.split(line.split("pip install", 1)[1])]


@pytest.fixture(scope="module")
def editable_venv(tmp_path_factory) -> Path:
    """A fresh virtualenv holding the project installed as `make setup` installs it; its other
    dependencies come from this interpreter's site-packages (a path entry: that folder's own .pth
    files, this environment's editable install among them, are not read)."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # No build isolation and no dependencies: nothing is downloaded.
    subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-build-isolation",
                    *_setup_install_args()], check=True, capture_output=True)
    return python


# What a user's working folder may hold: folders of weights, or modules of their own.
SHADOWS = {
    "folders": {"models/weights.safetensors": "", "kernels_pallas/notes.txt": ""},
    "modules": {"models.py": "MINE = True\n", "kernels_pallas.py": "MINE = True\n"},
}
IMPORT = """
import paged_jax, models, kernels_pallas
assert models.load_model and kernels_pallas.paged_attention
print(models.__file__)
print(kernels_pallas.__file__)
"""


def _user_folder(tmp_path: Path, shadows: str) -> Path:
    folder = tmp_path / "work"
    for name, text in SHADOWS[shadows].items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


def _imported_from(run: subprocess.CompletedProcess, where: Path) -> None:
    assert run.returncode == 0, run.stderr
    for file in run.stdout.splitlines():
        assert Path(file).resolve().is_relative_to(where.resolve()), file


@pytest.mark.parametrize("shadows", sorted(SHADOWS))
def test_editable_install_imports_its_own_packages_beside_a_users_shadows(editable_venv, tmp_path, shadows):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([editable_venv, "-c", IMPORT], cwd=_user_folder(tmp_path, shadows), env=env,
                         capture_output=True, text=True)
    _imported_from(run, ROOT)


@pytest.mark.parametrize("shadows", sorted(SHADOWS))
def test_wheel_imports_its_own_packages_beside_a_users_shadows(wheel, tmp_path, shadows):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", site, wheel],
                   check=True, capture_output=True)
    run = subprocess.run([sys.executable, "-c", IMPORT], cwd=_user_folder(tmp_path, shadows),
                         env=os.environ | {"PYTHONPATH": str(site)}, capture_output=True, text=True)
    _imported_from(run, site)


def test_a_users_module_imported_first_under_a_project_name_is_a_clear_error(tmp_path):
    run = subprocess.run([sys.executable, "-c", "import models, paged_jax"], cwd=_user_folder(tmp_path, "modules"),
                         env=os.environ | {"PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    assert run.returncode != 0
    assert f"a module named 'models' is already imported from {tmp_path / 'work' / 'models.py'}" in run.stderr
