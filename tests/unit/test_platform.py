"""runtime.platform: the one C++ compiler lookup (w4a8's kernel build and --enable-torch-compile both use it)
and the free-port helper."""

from __future__ import annotations

import os
import socket
import stat

from runtime import platform


def _fake(path, name: str) -> str:
    exe = path / name
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return str(exe)


def test_cxx_lookup_order(tmp_path, monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert platform.find_cxx_compiler() is None  # nothing on PATH: callers say so (or decode eagerly)
    cxx = _fake(tmp_path, "c++")
    assert platform.find_cxx_compiler() == cxx
    gxx = _fake(tmp_path, "g++")
    assert platform.find_cxx_compiler() == gxx  # inductor's own default comes first
    mine = _fake(tmp_path, "my-cxx")
    monkeypatch.setenv("CXX", "my-cxx")
    assert platform.find_cxx_compiler() == mine  # $CXX wins, found on PATH
    missing = str(tmp_path / "no-such-compiler")
    monkeypatch.setenv("CXX", missing)
    # kept as given rather than silently replaced by g++: inductor would run $CXX anyway, and the w4a8
    # build then fails naming it
    assert platform.find_cxx_compiler() == missing


def test_free_port_can_be_bound():
    port = platform.free_port()
    assert 0 < port < 65536
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_this_machine_answers():
    assert 1 <= platform.auto_num_threads() <= (os.cpu_count() or 1)
    assert platform.cpu_has_vnni() == bool({"avx512_vnni", "avx_vnni"} & platform.cpu_flags())
