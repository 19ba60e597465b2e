"""What this machine offers: CPU feature flags, how many threads to run, a free port, a C++ compiler.

One implementation of each for the whole runtime; the standard library only, so every layer (and every
process, the torch-free ones too) may import it.
"""

from __future__ import annotations

import os
import shutil
import socket


def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of /proc/cpuinfo (empty where there is none: not Linux, or no access)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_native_bf16() -> bool:
    """True where the CPU has bf16 dot-product instructions (AVX512-BF16 or AMX-BF16), which oneDNN uses for
    bf16 matmuls; without them bf16 matmul takes slower paths (0.85 against 89 GFLOP/s for fp32
    on a CPU without them).

    Why bf16 is then the CPU default where w4a8 is not (runtime/models/quantization.py; SmolLM2-135M,
    `bench.decode_throughput` and `bench/quant_accuracy.py` on a 2-core EPYC with avx512_bf16; figures in
    docs/numerics.md): decode at batch 8-32 is 1.5-3.6x
    faster (batch 1: 0.8-1.6x, run to run), next-token top-1 agreement with fp32 over 114 positions is 1.000
    (mean KL 0.0018) and MMLU cloze is 31.2% against fp32's 31.1% (930 items).
    """
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_has_amx_bf16() -> bool:
    """True where the CPU has AMX tiles with bf16 products (Sapphire Rapids on); the paged attention kernel
    then attends over a bfloat16 KV cache with tile products (runtime/models/csrc/paged_attention.cpp)."""
    return {"amx_tile", "amx_bf16", "avx512_bf16"} <= cpu_flags()


def cpu_has_vnni() -> bool:
    """True when /proc/cpuinfo lists AVX512-VNNI or AVX-VNNI (int8 dot products without int16 saturation)."""
    flags = cpu_flags()
    return "avx512_vnni" in flags or "avx_vnni" in flags


def auto_num_threads() -> int:
    """Threads = CPUs this process may actually run on: its affinity mask, capped by a cgroup CPU quota.

    torch's default counts the machine's cores and ignores both, so in a container or under taskset it
    starts more OpenMP threads than it gets CPUs, and every parallel region then waits for a descheduled
    thread. Measured on the 2-core EPYC (SmolLM2-135M fp32, eager) while other jobs kept both CPUs busy
    (load average ~13), so each thread got well under a CPU: 1 vs 2 threads gave decode bs 1 3.5 vs 1.1
    tok/s, decode bs 8 14.8 vs 2.0 tok/s, a 256-token prefill 68 vs 14 tok/s. More threads than granted
    CPUs is a 3-7x cliff; this rule never crosses it for CPUs it can see. With the box nearly idle (load
    ~1): decode bs 1 15.8 vs 16.1, bs 8 58.6 vs 62.5 tok/s, prefill 280 vs 402 tok/s, so every CPU granted
    helps (prefill +44%, decode +2-7%). The rule cannot see other processes' load (pass --num-threads 1 on
    a shared, busy host). On this 2-CPU box it gives 2, as torch does.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:  # cgroup v2: "QUOTA PERIOD" or "max PERIOD"
            quota, period = f.read().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


def usable_cpus() -> list[int]:
    """The CPU numbers this process may run on (its affinity mask; every CPU where there is none)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def cpu_busy_ticks(cpus: list[int]) -> int | None:
    """Clock ticks (USER_HZ) the CPUs `cpus` spent busy since boot, by any process (/proc/stat: all but
    idle and iowait); None where there is no /proc/stat."""
    wanted = {f"cpu{c}" for c in cpus}
    busy = 0
    try:
        with open("/proc/stat") as f:
            for line in f:
                name, _, rest = line.partition(" ")
                if name in wanted:
                    ticks = [int(x) for x in rest.split()]
                    busy += sum(ticks) - ticks[3] - ticks[4]  # idle, iowait
    except (OSError, ValueError, IndexError):
        return None
    return busy


def process_cpu_ticks() -> int | None:
    """Clock ticks (USER_HZ) this process's threads have run (/proc/self/stat utime + stime)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, ValueError, IndexError):
        return None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS's pick; another process may still take
    it before it is bound again)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def find_cxx_compiler() -> str | None:
    """The C++ compiler to build with, or None: $CXX when set (as given, like inductor; a wrong one then
    fails loudly where it is run), else the first of g++, clang++, c++ on PATH (inductor's default is g++)."""
    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(cxx) or cxx
    for name in ("g++", "clang++", "c++"):
        if path := shutil.which(name):
            return path
    return None
