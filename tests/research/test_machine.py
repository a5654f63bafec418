"""paged_jax/research/machine.py: what every benchmark prints about the CPU it ran on."""

import os
import pathlib

import pytest

from paged_jax.research import machine

XEON_LSCPU = """\
Architecture:                         x86_64
Vendor ID:                            GenuineIntel
Model name:                           Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
CPU family:                           6
Model:                                143
Flags:          fpu sse4_2 avx avx2 fma avx512f avx512bw avx512vl avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8
"""

# Two cores of an ARM server's /proc/cpuinfo: no model name, "Features" for flags.
ARM_CPUINFO = """\
processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes asimddp sve i8mm bf16
CPU implementer\t: 0x41

processor\t: 1
Features\t: fp asimd evtstrm aes asimddp sve i8mm bf16
CPU implementer\t: 0x41
"""


def test_lscpu_names_the_model_its_generation_and_the_kernels_extensions_in_order():
    d = machine.parse(XEON_LSCPU, None, cores=4)
    assert d["cpu_model"] == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"
    assert (d["vendor"], d["cpu_family"], d["cpu_model_number"], d["cores"]) == ("GenuineIntel", "6", "143", 4)
    assert d["vector_extensions"] == ["sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl",
                                      "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"]
    line = machine.one_line(d)
    assert line.startswith("machine: Intel(R) Xeon(R) Platinum 8481C") and "family 6, model 143" in line
    assert "4 cores" in line and line.endswith("amx_int8") and d["accelerators"] == []


def test_a_gpu_is_named_after_the_cpu():
    d = machine.parse(XEON_LSCPU, None, cores=16, accelerators=("NVIDIA H200",) * 2)
    assert d["accelerators"] == ["2 x NVIDIA H200"]
    assert machine.one_line(d).endswith("amx_int8; accelerators: 2 x NVIDIA H200")


def test_cpuinfo_alone_serves_where_lscpu_is_missing_arm_included():
    d = machine.parse(None, ARM_CPUINFO, cores=2)
    assert d["vector_extensions"] == ["asimd", "asimddp", "bf16", "i8mm", "sve"]
    assert d["vendor"] == "0x41" and d["cpu_model_number"] == "" and d["cpu_model"]
    assert "model" not in machine.one_line(d).split(",")[0].removeprefix("machine: ")


@pytest.mark.skipif(not pathlib.Path("/proc/cpuinfo").exists(), reason="reads Linux's /proc/cpuinfo")
def test_this_machine_agrees_with_proc_cpuinfo_and_its_affinity():
    d = machine.describe()
    text = pathlib.Path("/proc/cpuinfo").read_text()
    flags = set()
    for line in text.splitlines():
        if line.lower().startswith(("flags", "features")):
            flags = set(line.split(":", 1)[1].split())
            break
    assert d["vector_extensions"] == [f for f in machine.VECTOR_EXTENSIONS if f in flags]
    assert d["cores"] == len(os.sched_getaffinity(0))
    names = {line.split(":", 1)[1].strip() for line in text.splitlines() if line.lower().startswith("model name")}
    assert not names or d["cpu_model"] in names
