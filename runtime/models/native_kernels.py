"""radixlm's C++ CPU kernels: each built on first use, cached on disk, and loaded as `torch.ops.radixlm.*`.

A `NativeLibrary` is one source file under csrc/ that implements ops declared from Python
(`torch.library.Library("radixlm", "FRAGMENT")`). It is built with the system C++ compiler
(`runtime.platform.find_cxx_compiler`) against torch's headers and cached under $RADIXLM_CACHE_DIR/kernels
(default ~/.cache/radixlm/kernels), keyed by the source, the flags, torch's version and the CPU's flags (it
is built with -march=native, so a cache shared by two CPUs never hands one the other's build). The
directory is 0700 and a cached .so is loaded only when this user owns it and nobody else can write to it;
otherwise it is rebuilt (runtime/cache_dir.py). Processes starting together build beside the target and
rename, so none loads a half-written file.

Libraries: `w4a8` (runtime/models/w4a8.py: Q4_1 / Q8_0 GEMMs), `paged_attention` (`PAGED_ATTENTION`
below: decode and short-extend attention reading the KV pool in place, and `paged_attention_kv`, which
first stores the new tokens' K/V; used by the `cpu` attention backend), `fused_layers` (`FUSED_LAYERS`:
rope, SiLU * up, RMSNorm and residual add + RMSNorm in one call each, used by float32 models on the CPU),
`gguf_gemm` (runtime/models/gguf_linear.py: y = x @ W^T straight from a GGUF file's blocks, every common
type, and the rows of a quantized embedding) and `lora_sgmv` (`LORA_SGMV`: every LoRA adapter's update of
one projection over the batch's rows sorted by adapter, runtime/models/lora.py); `moe_fused`
(runtime/models/moe_fused.py: a mixture-of-experts MLP in one call, compiled with the w4a8 and GGUF sources).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import stat
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from runtime.cache_dir import UnsafeCacheDir, cache_subdir, unsafe_reason
from runtime.platform import cpu_flags, find_cxx_compiler

logger = logging.getLogger("radixlm.native_kernels")
CSRC = Path(__file__).parent / "csrc"


class KernelUnavailable(RuntimeError):
    """A C++ kernel could not be built or loaded here (no compiler, or it failed)."""


class NativeLibrary:
    """One C++ source built into one cached shared library; `load()` makes its ops callable."""

    def __init__(
        self,
        name: str,
        source: Path,
        what: str,
        instead: str,
        flag_envs: dict[str, str] | None = None,
        on_load: Callable[[Path], None] | None = None,
    ):
        self.name = name  # the cache file's stem
        self.source = source
        self.what = what  # "the w4a8 kernel": how messages name it
        self.instead = instead  # what to do without it: "use --quantization w8a8"
        # environment variable -> compiler flag added when it is "1" (e.g. build the scalar loops, which
        # tests compare with the vector ones); part of the cache key like every flag
        self.flag_envs = flag_envs or {}
        self.on_load = on_load  # called with the path once the library is loaded (e.g. to ask it its ISA)
        self.loaded: Path | None = None
        self._lock = threading.Lock()

    def load(self) -> Path:
        """Build (once per cache key) and load the library; returns its path. Raises KernelUnavailable."""
        with self._lock:
            if self.loaded is None:
                path = self.build()
                reason = untrusted(path)  # checked again right before loading: it is what gets executed
                if reason:
                    raise KernelUnavailable(f"refusing to load {self.what} {path}: it {reason}")
                try:
                    torch.ops.load_library(str(path))
                except OSError as e:  # a damaged cache entry: say which file to delete
                    raise KernelUnavailable(f"loading {self.what} {path} failed ({e}): delete it") from e
                if self.on_load is not None:
                    self.on_load(path)
                self.loaded = path
                logger.info("%s loaded from %s", self.what, path)
            return self.loaded

    def compile_command(self) -> list[str]:
        """The compiler invocation for the source, less its output path (the cache key is derived from it)."""
        from torch.utils import cpp_extension

        cxx = find_cxx_compiler()
        if cxx is None:
            raise KernelUnavailable(
                f"{self.what} is a C++ kernel built on first use, and no C++ compiler was found ($CXX, g++, "
                f"clang++, c++): install one (apt-get install g++) or {self.instead}"
            )
        abi = int(torch.compiled_with_cxx11_abi())
        # -fopenmp: at::parallel_for is an inline `#pragma omp parallel` (ATen/ParallelOpenMP.h); without it
        # the kernels run on one thread whatever torch.set_num_threads says. The libgomp.so.1 this links to
        # resolves at load time to the one torch already loaded (same soname): one thread pool, one setting.
        flags = ["-O3", "-march=native", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-w"]
        flags.append(f"-D_GLIBCXX_USE_CXX11_ABI={abi}")
        flags += [flag for env, flag in self.flag_envs.items() if os.environ.get(env) == "1"]
        includes = [f"-I{p}" for p in cpp_extension.include_paths()]
        libs = [f"-L{p}" for p in cpp_extension.library_paths()] + ["-lc10", "-ltorch_cpu"]
        return [cxx, *flags, *includes, str(self.source), *libs]

    def build(self) -> Path:
        """The cached library for this source/flags/torch/CPU, built (atomically, mode 0700) when missing or
        when the cached file is not safe to load (not ours, or writable by others: see `untrusted`)."""
        try:
            root = cache_subdir("kernels")
        except UnsafeCacheDir as e:
            raise KernelUnavailable(str(e)) from e
        command = self.compile_command()
        key = hashlib.sha256(
            "\0".join(
                [
                    self.source.read_text(),
                    " ".join(command[1:]),
                    torch.__version__,
                    " ".join(sorted(cpu_flags())),
                ]
            ).encode()
        ).hexdigest()[:16]
        target = root / f"{self.name}-{key}.so"
        if os.path.lexists(target):
            reason = untrusted(target)
            if reason is None:
                return target
            logger.warning(
                "the cached %s %s %s: not loading it, building a fresh one", self.what, target, reason
            )
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=root)
        os.close(fd)
        logger.info("building %s (%s), about 10 s", self.what, target.name)
        try:
            done = subprocess.run([*command, "-o", tmp], capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise KernelUnavailable(
                    f"building {self.what} failed (exit {done.returncode}): {done.stderr[-2000:]}"
                )
            os.chmod(tmp, 0o700)
            os.replace(tmp, target)
        except subprocess.TimeoutExpired as e:
            raise KernelUnavailable(f"building {self.what} took over 300 s") from e
        except OSError as e:  # $CXX names no runnable program
            raise KernelUnavailable(
                f"building {self.what} could not run the C++ compiler: {e}; set $CXX to a working compiler "
                f"or {self.instead}"
            ) from e
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return target


def untrusted(path: Path) -> str | None:
    """Why the library at `path` must not be loaded (None when it may): dlopen runs its code, so it must be
    a regular file (not a symlink) owned by this user and not group- or world-writable."""
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"cannot be checked ({e.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    return unsafe_reason(st)


# ------------------------------------------------------------------------------------------ paged attention
_LIB = torch.library.Library("radixlm", "FRAGMENT")
_LIB.define(
    "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor req_to_token, Tensor req_pool_indices, "
    "Tensor seq_lens, Tensor ext_lens, float scale, Tensor? sinks=None, float softcap=0.0) -> Tensor"
)


# paged_attention_kv: the same after storing the new tokens' k, v (cast to the pool's dtype) at out_cache_loc
_LIB.define(
    "paged_attention_kv(Tensor q, Tensor k, Tensor v, Tensor out_cache_loc, Tensor(a!) k_cache, "
    "Tensor(b!) v_cache, Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, Tensor ext_lens, "
    "float scale, Tensor? sinks=None, float softcap=0.0) -> Tensor"
)


@torch.library.register_fake("radixlm::paged_attention", lib=_LIB)
def _paged_attention_fake(
    q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, ext_lens, scale, sinks=None, softcap=0.0
):
    return q.new_empty(q.shape)  # contiguous even when q is a strided view


@torch.library.register_fake("radixlm::paged_attention_kv", lib=_LIB)
def _paged_attention_kv_fake(
    q,
    k,
    v,
    loc,
    k_cache,
    v_cache,
    req_to_token,
    req_pool_indices,
    seq_lens,
    ext,
    scale,
    sinks=None,
    softcap=0.0,
):
    return q.new_empty(q.shape)


# Set one to 1 to build the scalar loops, or the AVX2 path on an AVX-512 CPU (tests check all three agree).
PAGED_ATTENTION_PORTABLE_ENV = "RADIXLM_PAGED_ATTENTION_PORTABLE"
PAGED_ATTENTION_AVX2_ENV = "RADIXLM_PAGED_ATTENTION_AVX2"
PAGED_ATTENTION_NO_AMX_ENV = "RADIXLM_PAGED_ATTENTION_NO_AMX"  # 1: bfloat16 caches skip the AMX tiles
PAGED_ATTENTION = NativeLibrary(
    "paged_attention",
    CSRC / "paged_attention.cpp",
    "the paged attention kernel",
    "use --attention-backend torch_native",
    flag_envs={
        PAGED_ATTENTION_PORTABLE_ENV: "-DRADIXLM_PORTABLE",
        PAGED_ATTENTION_AVX2_ENV: "-DRADIXLM_FORCE_AVX2",
        PAGED_ATTENTION_NO_AMX_ENV: "-DRADIXLM_NO_AMX",
    },
)


def paged_attention_isa() -> str:
    """The vector path the loaded paged attention library was built for: "avx512", "avx2" or "scalar"
    (asked of the library itself, so a forced build is never mistaken for what the CPU flags suggest)."""
    isa = ctypes.CDLL(str(PAGED_ATTENTION.load())).radixlm_paged_attention_isa
    isa.restype = ctypes.c_char_p
    return isa().decode()


def paged_attention_uses_amx() -> bool:
    """Whether the loaded paged attention library attends over bfloat16 caches with AMX tiles (built where the
    CPU has AMX-BF16, unless RADIXLM_PAGED_ATTENTION_NO_AMX=1, and the OS lent this process the tiles)."""
    return bool(ctypes.CDLL(str(PAGED_ATTENTION.load())).radixlm_paged_attention_amx())


# ------------------------------------------------------------------------------------------- fused layers
_LIB.define("rope_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()")
_LIB.define("silu_mul(Tensor x) -> Tensor")
_LIB.define("row_argmax(Tensor x) -> (Tensor, Tensor)")
_LIB.define("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor")
_LIB.define("fused_add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()")


@torch.library.register_fake("radixlm::rope_", lib=_LIB)
def _rope_fake(q, k, cos, sin):
    return None


@torch.library.register_fake("radixlm::silu_mul", lib=_LIB)
def _silu_mul_fake(x):
    return x.new_empty(x.shape[0], x.shape[1] // 2)


@torch.library.register_fake("radixlm::row_argmax", lib=_LIB)
def _row_argmax_fake(x):
    return x.new_empty(x.shape[0], dtype=torch.int64), x.new_empty(x.shape[0])


@torch.library.register_fake("radixlm::rms_norm", lib=_LIB)
def _rms_norm_fake(x, weight, eps):
    return torch.empty_like(x)


@torch.library.register_fake("radixlm::fused_add_rms_norm_", lib=_LIB)
def _fused_add_rms_norm_fake(x, residual, weight, eps):
    return None


FUSED_LAYERS = NativeLibrary(
    "fused_layers",
    CSRC / "fused_layers.cpp",
    "the fused layer kernels (rope, silu * up, rms norm, greedy argmax)",
    "nothing: the layers run as separate torch ops",
    flag_envs={"RADIXLM_FUSED_LAYERS_PORTABLE": "-DRADIXLM_PORTABLE"},
)


# ------------------------------------------------------------------------------------------ LoRA SGMV
# every adapter's update of one projection over the batch's rows sorted by adapter (runtime/models/lora.py)
_LIB.define(
    "lora_sgmv_(Tensor(a!) y, Tensor x, Tensor a, Tensor bt, Tensor rows, Tensor seg_ptr, Tensor seg_slot, "
    "int[] splits, int rank) -> ()"
)


@torch.library.register_fake("radixlm::lora_sgmv_", lib=_LIB)
def _lora_sgmv_fake(y, x, a, bt, rows, seg_ptr, seg_slot, splits, rank):
    return None


LORA_SGMV_PORTABLE_ENV = "RADIXLM_LORA_SGMV_PORTABLE"  # 1: build the scalar loops (tests compare both)
LORA_SGMV = NativeLibrary(
    "lora_sgmv",
    CSRC / "lora_sgmv.cpp",
    "the LoRA SGMV kernel",
    "nothing: LoRA updates run as torch matmuls",
    flag_envs={LORA_SGMV_PORTABLE_ENV: "-DRADIXLM_PORTABLE"},
)
