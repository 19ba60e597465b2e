"""The private cache directory: 0700 directories, refused when others can write to them, and the w4a8 kernel
loaded only from a file this user owns and nobody else can write (rebuilt otherwise). Builds use a stand-in
compiler script (the real build is tested in test_w4a8), since the checks run before any library is loaded.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from runtime.cache_dir import UnsafeCacheDir, cache_subdir, private_dir, use_private_inductor_cache
from runtime.models import w4a8

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
NOBODY = 65534


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


@pytest.fixture
def loose_umask():
    old = os.umask(0)  # the most permissive umask: modes must not depend on it
    yield
    os.umask(old)


def test_directories_are_created_0700_whatever_the_umask(tmp_path, monkeypatch, loose_umask):
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "root" / "cache"))
    got = cache_subdir("kernels")
    assert got == tmp_path / "root" / "cache" / "kernels"
    for p in (got, got.parent, got.parent.parent):  # every directory it created, parents included
        assert _mode(p) == 0o700, p
    monkeypatch.delenv("RADIXLM_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_subdir("x") == tmp_path / "home" / ".cache" / "radixlm" / "x"


def test_a_directory_of_ours_readable_by_others_is_tightened(tmp_path):
    d = tmp_path / "old"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    assert private_dir(d) == d and _mode(d) == 0o700


@pytest.mark.parametrize(("mode", "words"), [(0o777, "group- and world-writable"), (0o775, "group-writable")])
def test_a_directory_others_can_write_is_refused(tmp_path, mode, words):
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, mode)
    with pytest.raises(UnsafeCacheDir, match=f"cache directory {d} is {words} \\(mode {mode:o}\\)"):
        private_dir(d)
    assert _mode(d) == mode  # not "repaired": files may already have been planted in it


@needs_root
def test_a_directory_owned_by_another_user_is_refused(tmp_path):
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, NOBODY, NOBODY)
    with pytest.raises(UnsafeCacheDir, match=f"{d} is owned by uid {NOBODY}, not by this user"):
        private_dir(d)


def test_a_file_in_place_of_the_directory_is_refused(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(UnsafeCacheDir, match="is not a directory"):
        private_dir(tmp_path / "f")


# ----------------------------------------------------------------------------------------------- inductor
def test_inductor_cache_goes_under_the_cache_dir(tmp_path, monkeypatch, loose_umask):
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert use_private_inductor_cache() == tmp_path / "c" / "inductor"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "c" / "inductor")
    assert _mode(tmp_path / "c" / "inductor") == 0o700
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

    assert inductor_cache_dir() == str(tmp_path / "c" / "inductor")  # what inductor itself will use


def test_inductors_own_default_in_the_env_is_replaced(tmp_path, monkeypatch):
    """Inductor writes its /tmp default into the environment on first use (transformers' save_pretrained
    triggers it), which must not pass for a user's choice."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    default = inductor_cache_dir()  # sets the variable to the /tmp default, as inductor's first use does
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == default != str(tmp_path / "c" / "inductor")
    assert use_private_inductor_cache() == tmp_path / "c" / "inductor"
    assert inductor_cache_dir() == str(tmp_path / "c" / "inductor")


def test_a_users_inductor_cache_dir_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert use_private_inductor_cache() is None
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
    assert not (tmp_path / "c").exists()


def test_compiled_decode_sets_the_inductor_cache_before_compiling(tmp_path, monkeypatch):
    import torch

    from runtime.mem_cache.memory_pool import KVPool, ReqToTokenPool
    from runtime.model_executor import compiled_decode

    if compiled_decode.find_cxx_compiler() is None:
        pytest.skip("no C++ compiler: the runner refuses before touching inductor")
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    seen = []

    def stop_before_compiling(*args, **kwargs):
        seen.append(os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
        raise RuntimeError("stop here")

    monkeypatch.setattr(compiled_decode.torch, "compile", stop_before_compiling)
    cpu = torch.device("cpu")
    kv, rows = KVPool(8, 1, 1, 4, torch.float32, cpu), ReqToTokenPool(2, 8, cpu)
    with pytest.raises(RuntimeError, match="stop here"):
        compiled_decode.CompiledDecodeRunner(torch.nn.Identity(), kv, rows, [1])
    assert seen == [str(tmp_path / "c" / "inductor")]


# ----------------------------------------------------------------------------------------------- w4a8 kernel
@pytest.fixture
def fake_cxx(tmp_path, monkeypatch):
    """$CXX = a script that writes `built <n>` to its -o file (n counts the builds); the cache in tmp_path."""
    script = tmp_path / "cxx.sh"
    count = tmp_path / "builds"
    script.write_text(
        "#!/bin/sh\n"
        f"n=$(( $(cat {count} 2>/dev/null || echo 0) + 1 )); echo $n > {count}\n"
        'while [ $# -gt 0 ]; do if [ "$1" = -o ]; then echo "built $n" > "$2"; fi; shift; done\n'
    )
    script.chmod(0o700)
    monkeypatch.setenv("CXX", str(script))
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "cache"))
    return lambda: int(count.read_text()) if count.exists() else 0


def test_kernel_is_written_0700_into_a_0700_dir_and_reused(fake_cxx, tmp_path, loose_umask):
    target = w4a8.LIBRARY.build()
    assert target.parent == tmp_path / "cache" / "kernels" and _mode(target.parent) == 0o700
    assert _mode(target) == 0o700 and target.read_text() == "built 1\n"
    assert w4a8.LIBRARY.build() == target and fake_cxx() == 1  # a trusted cached file is used as it is
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # no temp file left


def _rebuilt_after(tamper, fake_cxx, caplog) -> str:
    target = w4a8.LIBRARY.build()
    tamper(target)
    with caplog.at_level(logging.WARNING, logger="radixlm.native_kernels"):
        assert w4a8.LIBRARY.build() == target
    assert fake_cxx() == 2 and target.read_text() == "built 2\n"  # a fresh file replaced it
    st = os.lstat(target)
    assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700
    return caplog.text


def test_world_writable_cached_kernel_is_rebuilt(fake_cxx, caplog):
    log = _rebuilt_after(lambda p: os.chmod(p, 0o777), fake_cxx, caplog)
    assert "world-writable (mode 777): not loading it, building a fresh one" in log


@needs_root
def test_cached_kernel_of_another_user_is_rebuilt(fake_cxx, caplog):
    log = _rebuilt_after(lambda p: os.chown(p, NOBODY, NOBODY), fake_cxx, caplog)
    assert f"is owned by uid {NOBODY}, not by this user" in log


def test_symlinked_cached_kernel_is_rebuilt(fake_cxx, caplog, tmp_path):
    elsewhere = tmp_path / "elsewhere.so"
    elsewhere.write_text("someone else's")

    def swap(p: Path) -> None:
        p.unlink()
        p.symlink_to(elsewhere)

    assert "is a symbolic link" in _rebuilt_after(swap, fake_cxx, caplog)
    assert elsewhere.read_text() == "someone else's"


def test_load_refuses_an_unsafe_file_before_loading_it(tmp_path, monkeypatch):
    dummy = tmp_path / "w4a8_gemm-x.so"
    dummy.write_text("not a library")
    os.chmod(dummy, 0o666)
    monkeypatch.setattr(w4a8.LIBRARY, "loaded", None)
    monkeypatch.setattr(w4a8.LIBRARY, "build", lambda: dummy)
    monkeypatch.setattr(w4a8.torch.ops, "load_library", lambda p: pytest.fail(f"loaded {p}"))
    with pytest.raises(w4a8.KernelUnavailable, match=f"refusing to load the w4a8 kernel {dummy}: it is "):
        w4a8.load_kernels()


def test_unsafe_kernel_dir_is_a_kernel_error(fake_cxx, tmp_path):
    (tmp_path / "cache" / "kernels").mkdir(parents=True)
    os.chmod(tmp_path / "cache" / "kernels", 0o777)
    with pytest.raises(w4a8.KernelUnavailable, match="kernels is group- and world-writable"):
        w4a8.LIBRARY.build()
    assert fake_cxx() == 0


# ----------------------------------------------------------------------------------------------- models
def test_model_cache_root_is_private(tmp_path, loose_umask):
    from runtime.models.model_loader import resolve_model_path

    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF" + b"\0" * 60)  # GGUF magic, then a version the reader refuses
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(UnsafeCacheDir, match=f"cache directory {shared} is group- and world-writable"):
        resolve_model_path(str(src), str(shared))
    fresh = tmp_path / "fresh" / "models"
    with pytest.raises(ValueError, match="version 0"):  # the cache root is made before converting
        resolve_model_path(str(src), str(fresh))
    assert _mode(fresh) == 0o700 and _mode(fresh.parent) == 0o700
    os.chmod(fresh, 0o757)
    with pytest.raises(UnsafeCacheDir, match="is world-writable"):
        resolve_model_path(str(src), str(fresh))
