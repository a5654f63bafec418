"""The CPU kernels' libraries: compiled on first use with the machine's C++ compiler for this CPU
(-march=native), kept in the cache directory keyed by the sources, the compiler flags and the CPU (so
later runs load them at once), loaded, and their entry points registered with XLA's FFI under the
target names below. One library holds attention.cc, linear.cc, linear_int8.cc, kv_write.cc and
lora.cc; a second, built where the oneDNN wheels are installed, oneDNN's matmul (onednn_linear.cc).

Where no compiler works, `available()` is False, `build_error()` says why, and the engine stays on the
pure-XLA paths (cpu/xla.py, XLA's dot). The library's switches (its helper threads, the AMX tile unit)
and its unwritten buffers are reached from here too.
"""

import concurrent.futures
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sysconfig
from pathlib import Path

import jax

_HERE = Path(__file__).parent
_SOURCES = tuple(_HERE / name for name in ("attention.cc", "linear.cc", "linear_int8.cc", "kv_write.cc",
                                          "lora.cc"))
_HEADERS = (_HERE / "common.h", _HERE / "linear_amx.h")
_ONEDNN_SOURCES = (_HERE / "onednn_linear.cc",)
# The FFI targets the libraries register, which the wrappers (attention.py, linear.py) call.
ATTENTION = "paged_jax_paged_attention_cpu"
LINEAR = "paged_jax_linear_cpu_f32"
ARGMAX_LINEAR = "paged_jax_argmax_linear_cpu_f32"
LORA = "paged_jax_lora_cpu_f32"
LINEAR_INT8 = "paged_jax_linear_cpu_int8"
LINEAR_ONEDNN = "paged_jax_linear_onednn_f32"
WRITE_KV = "paged_jax_write_kv_cpu_bf16"
UNWRITTEN = "paged_jax_unwritten_buffer"
# -ffast-math lets the compiler vectorise the reductions and exp (glibc's libmvec); the kernel keeps
# to finite numbers and never reads an unwritten slot, so its assumptions hold. It is given to the
# compile step only: linked with it, GCC adds crtfastmath.o, which on loading sets flush-to-zero for
# the whole process and so changes every other library's arithmetic on subnormal numbers.
_COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-std=c++20", "-fPIC"]
_LINK_FLAGS = ["-shared"]


def _cache_dir() -> Path:
    return Path(os.environ.get("PAGED_JAX_CACHE_DIR", Path.home() / ".cache" / "paged_jax")) / "kernels"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") or line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(name: str, sources: tuple[Path, ...], link_flags: tuple[str, ...] = (), include: Path | None = None) -> Path:
    """The library `name` compiled from sources (and the headers), from the cache when built before."""
    compile_flags = _COMPILE_FLAGS + ([f"-I{include}"] if include else [])
    flags = " ".join(compile_flags + _LINK_FLAGS + list(link_flags))
    code = b"".join(path.read_bytes() for path in sources + _HEADERS)
    key = hashlib.sha256(code + flags.encode() + _cpu_name().encode()).hexdigest()[:16]
    library = _cache_dir() / f"{name}-{key}.so"
    if not library.exists():
        compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
        if compiler is None:
            raise RuntimeError("no C++ compiler found (set CXX)")
        library.parent.mkdir(parents=True, exist_ok=True)
        partial = library.with_suffix(f".{os.getpid()}.tmp")
        objects = [library.with_suffix(f".{source.stem}.{os.getpid()}.o") for source in sources]
        try:
            # The sources compile side by side: a first start-up waits for the slowest, not the sum.
            with concurrent.futures.ThreadPoolExecutor(len(sources)) as pool:
                compiles = [pool.submit(subprocess.run, [compiler, *compile_flags, "-w", f"-I{jax.ffi.include_dir()}",
                                                         "-c", str(source), "-o", str(obj)],
                                        check=True, capture_output=True, text=True)
                            for source, obj in zip(sources, objects)]
                for done in compiles:
                    done.result()  # raises the first failure
            subprocess.run([compiler, *_LINK_FLAGS, *map(str, objects), *link_flags, "-o", str(partial)],
                           check=True, capture_output=True, text=True)
        finally:
            for obj in objects:
                obj.unlink(missing_ok=True)
        partial.replace(library)  # atomic, so a concurrent process never loads half a file
    return library


@functools.cache
def build_error() -> str | None:
    """Build and register the kernels once: None if that worked, else why not (the XLA paths run instead)."""
    for path in _SOURCES + _HEADERS:
        if not path.exists():
            return f"its source {path.name} is not installed beside kernels_pallas/cpu/{Path(__file__).name}"
    global _library
    try:
        library = _library = ctypes.cdll.LoadLibrary(str(_build("cpu_kernels", _SOURCES)))
    except subprocess.CalledProcessError as e:
        return f"building the CPU kernels failed: {(e.stderr or '').strip()[-500:]}"
    except (OSError, RuntimeError) as e:
        return str(e)
    jax.ffi.register_ffi_target(ATTENTION, jax.ffi.pycapsule(library.PagedAttentionCpu), platform="cpu")
    jax.ffi.register_ffi_target(LINEAR, jax.ffi.pycapsule(library.LinearCpuF32), platform="cpu")
    jax.ffi.register_ffi_target(ARGMAX_LINEAR, jax.ffi.pycapsule(library.ArgmaxLinearCpuF32), platform="cpu")
    jax.ffi.register_ffi_target(LORA, jax.ffi.pycapsule(library.LoraCpuF32), platform="cpu")
    jax.ffi.register_ffi_target(LINEAR_INT8, jax.ffi.pycapsule(library.LinearCpuInt8), platform="cpu")
    jax.ffi.register_ffi_target(WRITE_KV, jax.ffi.pycapsule(library.WriteKvCpuBf16), platform="cpu")
    jax.ffi.register_ffi_target(UNWRITTEN, jax.ffi.pycapsule(library.UnwrittenBuffer), platform="cpu")
    if os.environ.get("PAGED_JAX_CPU_HELPERS") == "0":
        library.PagedJaxCpuHelpers(0)
    if os.environ.get("PAGED_JAX_CPU_AMX") == "0":
        library.PagedJaxCpuAmx(0)
    return None


_library = None


def _onednn_dirs() -> tuple[Path, Path] | None:
    """(include, lib) of the oneDNN wheels in this environment (onednn-devel-cpu-gomp's headers,
    onednn-cpu-gomp's library: pyproject.toml installs them on x86-64 Linux), or None."""
    data = Path(sysconfig.get_paths()["data"])
    include, lib = data / "include", data / "lib"
    if (include / "oneapi" / "dnnl" / "dnnl.hpp").exists() and (lib / "libdnnl.so.3").exists():
        return include, lib
    return None


@functools.cache
def onednn_error() -> str | None:
    """Build and register the oneDNN matmul once: None if that worked, else why not (linear_cpu serves)."""
    if build_error() is not None:
        return build_error()
    dirs = _onednn_dirs()
    if dirs is None:
        return "the oneDNN wheels (onednn-cpu-gomp, onednn-devel-cpu-gomp) are not installed"
    include, lib = dirs
    # oneDNN's OpenMP threads spin after each call unless told otherwise, taking the cores from the
    # XLA threads that run the step's next ops. Read when libgomp loads, so before the library does.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        library = ctypes.cdll.LoadLibrary(str(_build("onednn_kernels", _ONEDNN_SOURCES,
                                                     ("-L" + str(lib), "-ldnnl", f"-Wl,-rpath,{lib}"), include)))
    except subprocess.CalledProcessError as e:
        return f"building the oneDNN matmul failed: {(e.stderr or '').strip()[-500:]}"
    except (OSError, RuntimeError) as e:
        return str(e)
    jax.ffi.register_ffi_target(LINEAR_ONEDNN, jax.ffi.pycapsule(library.LinearOneDnnF32), platform="cpu")
    global _onednn_library
    _onednn_library = library
    return None


_onednn_library = None


def prepare_onednn(shapes: tuple[tuple[int, int], ...], max_rows: int) -> int:
    """Make now every oneDNN primitive linear_onednn_cpu can need for weights [K, N] of `shapes` and
    x of up to max_rows rows (it computes the real ones rounded up to a multiple of 16); how many that
    is. Making one generates its code, which a step would otherwise wait for."""
    if not onednn_available():
        raise RuntimeError(f"the oneDNN matmul is not available: {onednn_error()}")
    made = 0
    for rows in range(16, max_rows + 16, 16):
        for k, n in shapes:
            _onednn_library.PagedJaxOneDnnPrepare(ctypes.c_int64(min(rows, max_rows)), ctypes.c_int64(k),
                                                  ctypes.c_int64(n))
            made += 1
    return made


def onednn_available() -> bool:
    return onednn_error() is None


def use_helpers(on: bool) -> None:
    """Whether kernel calls of few rows share their work with the library's own threads, which stay
    awake between calls (common.h: Helpers; the default), or with XLA's pool, as all larger calls do.
    For comparing the two in one process (scripts/measure_step_time.py --compare-helpers);
    PAGED_JAX_CPU_HELPERS=0 turns them off for a whole process."""
    if not available():
        raise RuntimeError("the CPU kernel library could not be built")
    _library.PagedJaxCpuHelpers(int(on))


def amx_usable() -> bool:
    """Whether linear_cpu multiplies calls of many rows on the CPU's tile unit (linear_amx.h): built
    for a CPU with AMX, and the OS lends it."""
    return available() and bool(_library.PagedJaxCpuAmxUsable())


def use_amx(on: bool) -> None:
    """Whether linear_cpu takes the tile unit where it can (the default) or its FMA kernel at every
    size. For comparing the two in one process (scripts/bench_matmul_cpu.py --fma);
    PAGED_JAX_CPU_AMX=0 keeps to the FMA kernel for a whole process."""
    if not available():
        raise RuntimeError("the CPU kernel library could not be built")
    _library.PagedJaxCpuAmx(int(on))


def available() -> bool:
    """Whether the kernel is built and registered (building it on the first call)."""
    return build_error() is None


def unwritten(shape: tuple[int, ...], dtype) -> jax.Array:
    """An array on the CPU whose memory is allocated but never written: the OS maps its pages as
    they are first written, so allocating costs nothing up front. Its contents are undefined."""
    if not available():
        raise RuntimeError("the CPU kernel library could not be built; allocate with jnp.zeros")
    return jax.ffi.ffi_call(UNWRITTEN, jax.ShapeDtypeStruct(shape, dtype))()
