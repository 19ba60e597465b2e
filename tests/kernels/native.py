"""Shared by the tests of radixlm's C++ CPU kernels (runtime.models.native_kernels)."""

from __future__ import annotations

import pytest

from runtime.models.native_kernels import KernelUnavailable, NativeLibrary


def load_native_or_skip(library: NativeLibrary) -> None:
    """Build/load `library`, or skip the calling module where it cannot be built (no C++ compiler)."""
    try:
        library.load()
    except KernelUnavailable as err:
        pytest.skip(f"{library.what} cannot be built here: {err}")
