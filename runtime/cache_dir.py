"""The private cache directory: converted models, the built w4a8 kernel and inductor's compiled code.

Two of these hold native code the server loads (a .so), so a cache another local user can write into is a way
to run their code in our process. Every cache directory is therefore created 0700 (whatever the umask) and
checked on each use: it must be a directory owned by us and not group- or world-writable. One that is
owned by another user, or writable by others, is refused (`UnsafeCacheDir`) rather than repaired: files may
already have been planted in it, and chmod would not remove them. A directory of ours with only read bits
for others (created by an older radixlm under umask 022) is tightened to 0700.

Root: $RADIXLM_CACHE_DIR, else ~/.cache/radixlm.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

logger = logging.getLogger("radixlm.cache")

CACHE_ENV = "RADIXLM_CACHE_DIR"


class UnsafeCacheDir(PermissionError):
    """A cache directory another user could write into (or that is not a directory of ours)."""


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or "~/.cache/radixlm").expanduser()


def cache_subdir(name: str) -> Path:
    """`<cache root>/<name>`, created 0700 if missing and checked (see `private_dir`)."""
    return private_dir(cache_root() / name)


def private_dir(path: Path | str) -> Path:
    """Create `path` (and missing parents) with mode 0700; return it once it is safe to load code from.

    Raises UnsafeCacheDir naming the directory and the reason when it is not ours or others can write to it.
    """
    path = Path(path).expanduser()
    missing = []
    p = path
    while not p.exists() and not p.is_symlink() and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:  # a concurrent process made it first: checked below like any other
            continue
        os.chmod(d, 0o700)  # mkdir's mode is masked by the umask
    st = os.stat(path)
    reason = unsafe_reason(st, want_dir=True)
    if reason:
        raise UnsafeCacheDir(
            f"cache directory {path} {reason}: another user could plant code radixlm loads; "
            f"check its contents, then `chmod 700` it (or delete it), or set ${CACHE_ENV} elsewhere"
        )
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)
    return path


def unsafe_reason(st: os.stat_result, want_dir: bool = False) -> str | None:
    """Why a file/directory with this stat may not be trusted (None when it may): owner and write bits."""
    if want_dir and not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if not want_dir and not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        who = "group- and world-" if mode & 0o022 == 0o022 else ("world-" if mode & 0o002 else "group-")
        return f"is {who}writable (mode {mode:o})"
    return None


def use_private_inductor_cache() -> Path | None:
    """Point inductor's cache (it loads .so files from it) at `<cache root>/inductor` unless the user chose
    one with TORCHINDUCTOR_CACHE_DIR. Inductor's default, /tmp/torchinductor_<user>, sits in the shared /tmp,
    and inductor writes it into the environment itself on first use (transformers' save_pretrained does
    that), so that value counts as not chosen. Call before inductor compiles."""
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current and os.path.abspath(current) != _inductor_default():
        return None
    path = cache_subdir("inductor")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    return path


def _inductor_default() -> str | None:
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # another torch layout: only an unset variable counts as not chosen
        return None
    return os.path.abspath(default_cache_dir())
