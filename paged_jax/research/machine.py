"""The machine a figure was taken on: CPU model, vector extensions, usable cores.

Every benchmark prints `one_line(describe())` and stores `describe()` in its JSON, so a figure always
says where it was taken: machines of one kind have landed on different CPUs (an Intel Xeon, an AMD
EPYC Zen 5), and the kernels' speed, and their ratio to a peer's, differ between them.

The model name is lscpu's "Model name" where lscpu runs, else /proc/cpuinfo's "model name", else
`platform.processor()`. Vendors reuse a name across generations ("AMD EPYC"), so the CPU family and
model numbers come with it where the system gives them. Where JAX sees an accelerator (a GPU), the
line names it too: there the figure is the GPU's, and the CPU only feeds it.
"""

import collections
import os
import platform
import shutil
import subprocess

# The flags that matter to the kernels (SIMD width, dot-product and 16-bit float instructions, AMX
# tiles), in the order they are printed. x86 names as Linux spells them; ARM's from "Features".
VECTOR_EXTENSIONS = (
    "sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni",
    "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
    "amx_tile", "amx_bf16", "amx_int8",
    "asimd", "asimddp", "bf16", "i8mm", "sve", "sve2", "sme",
)


def _fields(text: str | None, separator: str) -> dict[str, str]:
    """The first value of each `key<separator> value` line (cpuinfo repeats its keys once per core)."""
    out: dict[str, str] = {}
    for line in (text or "").splitlines():
        key, sep, value = line.partition(separator)
        if sep:
            out.setdefault(key.strip().lower(), value.strip())
    return out


def parse(lscpu: str | None, cpuinfo: str | None, cores: int, accelerators: tuple[str, ...] = ()) -> dict:
    """describe()'s answer from lscpu's output and /proc/cpuinfo's text (either may be None), and the
    device kinds of JAX's accelerators, one entry per device."""
    ls, info = _fields(lscpu, ":"), _fields(cpuinfo, ":")
    model = ls.get("model name") or info.get("model name") or platform.processor()
    flags = set((ls.get("flags") or info.get("flags") or info.get("features") or "").split())
    family = ls.get("cpu family") or info.get("cpu family")
    number = ls.get("model") or info.get("model")
    return {
        "cpu_model": model or "unknown",
        "vendor": ls.get("vendor id") or info.get("vendor_id") or info.get("cpu implementer") or "",
        "cpu_family": family or "",
        "cpu_model_number": number if number and number.isdigit() else "",
        "cores": cores,
        "vector_extensions": [name for name in VECTOR_EXTENSIONS if name in flags],
        "accelerators": [f"{count} x {kind}" for kind, count in collections.Counter(accelerators).items()],
    }


def _usable_cores() -> int:
    """The cores this process may run on (a container or taskset may hold fewer than the host has)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _lscpu() -> str | None:
    if shutil.which("lscpu") is None:
        return None
    try:
        run = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10,
                             env=dict(os.environ, LC_ALL="C"))  # English field names
    except (OSError, subprocess.SubprocessError):
        return None
    return run.stdout if run.returncode == 0 else None


def _accelerators() -> tuple[str, ...]:
    """The device kind of each device of JAX's default backend, unless that backend is the CPU."""
    import jax  # here, not at the top: parse() and one_line() serve scripts that never start JAX

    return tuple(d.device_kind for d in jax.devices() if d.platform != "cpu")


def describe() -> dict:
    """{"cpu_model", "vendor", "cpu_family", "cpu_model_number", "cores", "vector_extensions",
    "accelerators"} of this machine."""
    return parse(_lscpu(), _read("/proc/cpuinfo"), _usable_cores(), _accelerators())


def one_line(machine: dict) -> str:
    """'machine: AMD EPYC (family 26, model 2), 2 cores, avx2 ... avx512_bf16' for a describe() result."""
    generation = ", ".join(f"{name} {machine[key]}" for name, key in (("family", "cpu_family"),
                                                                      ("model", "cpu_model_number")) if machine[key])
    extensions = " ".join(machine["vector_extensions"]) or "no vector extensions listed"
    accelerators = ", ".join(machine.get("accelerators", ()))
    return (f"machine: {machine['cpu_model']}" + (f" ({generation})" if generation else "")
            + f", {machine['cores']} cores, {extensions}" + (f"; accelerators: {accelerators}" if accelerators else ""))
