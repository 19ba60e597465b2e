"""Tenants: whose API key a request came with, and the cache scope that key gives it.

`--api-keys-file FILE` lists one key per line, `KEY TENANT [admin]` (blank lines and `#` comments
skipped). A request's tenant is its key's. Every tenant's requests are salted with the tenant
(`scoped_salt`), so tenants share no cached KV, no speculative drafts (salted requests neither teach nor read
the shared drafting index) and no sessions; a request's own `cache_salt` subdivides its tenant's scope.
`--share-cache-across-tenants` lets tenants share cached KV and drafts again; sessions, pins, stored responses
and explainer records stay each tenant's own either way (they are keyed by the tenant as well).

The keys file holds secrets: like the cache directory it must be a regular file of ours, and it must not be
readable or writable by the group or others (`load_keys_file` refuses it otherwise, naming the reason).

Standard library only: the HTTP process (keys, quotas on concurrent requests and stored responses) and the
scheduler (pin quotas, session keys) both import it.
"""

from __future__ import annotations

import contextvars
import hashlib
import os
import re
import stat
from dataclasses import dataclass

TENANT_NAME = re.compile(r"[A-Za-z0-9_.@-]{1,64}")
_SEP = "\x1f"  # cannot occur in a tenant name or (see `generate_input.parse_cache_salt`) in a cache salt


@dataclass(frozen=True)
class Tenant:
    name: str
    admin: bool = False  # may call the admin routes (/flush_cache, abort_all) as --admin-api-key may


# The tenant of the HTTP request being handled (None: no --api-keys-file, or a --api-key / --admin-api-key
# holder). Set by the request guard for the handler's task; read where a request is built or looked up.
current_tenant: contextvars.ContextVar[Tenant | None] = contextvars.ContextVar("radixlm_tenant", default=None)


def tenant_name() -> str | None:
    t = current_tenant.get()
    return None if t is None else t.name


def scoped_salt(tenant: str | None, cache_salt: str | None, share_across_tenants: bool = False) -> str | None:
    """The salt the radix cache and the drafting index see: the tenant's scope, subdivided by the
    request's own `cache_salt`. Injective: tenant names and cache salts cannot hold the separator."""
    if tenant is None or share_across_tenants:
        return cache_salt
    return f"tenant{_SEP}{tenant}" if cache_salt is None else f"tenant{_SEP}{tenant}{_SEP}{cache_salt}"


def key_digest(key: bytes | str) -> bytes:
    """What the key table is indexed by: a lookup by a hash of the presented key, not a compare of the key
    itself, leaks nothing usable through its timing."""
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


class KeysFileError(ValueError):
    """The --api-keys-file cannot be used; the message names the file, the line and the problem."""


def load_keys_file(path: str) -> dict[bytes, Tenant]:
    """{sha256(key): tenant} from a keys file (see the module docstring)."""
    flag = "--api-keys-file"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise KeysFileError(f"{flag} {path!r} cannot be opened: {e.strerror}") from None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise KeysFileError(f"{flag} {path!r} is not a regular file")
        if st.st_uid != os.geteuid():
            raise KeysFileError(f"{flag} {path!r} is owned by uid {st.st_uid}, not by this user")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            raise KeysFileError(
                f"{flag} {path!r} is readable or writable by others (mode {mode:o}): it holds API keys; "
                f"`chmod 600 {path}`"
            )
        text = f.read()
    keys: dict[bytes, Tenant] = {}
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        where = f"{flag} {path!r} line {number}"
        if len(fields) not in (2, 3) or (len(fields) == 3 and fields[2] != "admin"):
            raise KeysFileError(f"{where}: expected 'KEY TENANT' or 'KEY TENANT admin'")
        key, name = fields[0], fields[1]
        if not key.isascii() or not key.isprintable():
            raise KeysFileError(f"{where}: the key must be printable ASCII (it is sent in an HTTP header)")
        if not TENANT_NAME.fullmatch(name):
            raise KeysFileError(f"{where}: tenant name {name!r} must match {TENANT_NAME.pattern}")
        digest = key_digest(key)
        if digest in keys:
            raise KeysFileError(f"{where}: this key is listed twice")
        keys[digest] = Tenant(name, admin=len(fields) == 3)
    if not keys:
        raise KeysFileError(f"{flag} {path!r} lists no key")
    return keys
