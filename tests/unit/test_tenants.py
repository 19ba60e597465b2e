"""The --api-keys-file loader and the tenant cache scope (`runtime.tenants`): a keys file others can read is
refused, every malformed line is named, and a tenant's scope cannot be spelled by another tenant or by a
client's own cache_salt."""

from __future__ import annotations

import os

import pytest

from runtime.entrypoints.generate_input import parse_cache_salt
from runtime.server_args import ServerArgs
from runtime.tenants import KeysFileError, Tenant, key_digest, load_keys_file, scoped_salt


def keys_file(tmp_path, text: str, mode: int = 0o600) -> str:
    path = tmp_path / "keys"
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def test_keys_file_maps_keys_to_tenants(tmp_path):
    path = keys_file(tmp_path, "# comment\n\nk-one  alpha\nk-two beta admin  # trailing comment\n")
    keys = load_keys_file(path)
    assert keys == {key_digest("k-one"): Tenant("alpha"), key_digest("k-two"): Tenant("beta", admin=True)}


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o666])
def test_a_keys_file_others_can_read_or_write_is_refused(tmp_path, mode):
    with pytest.raises(KeysFileError, match="chmod 600"):
        load_keys_file(keys_file(tmp_path, "k alpha\n", mode))


def test_a_symlinked_keys_file_is_refused(tmp_path):
    target = keys_file(tmp_path, "k alpha\n")
    link = tmp_path / "link"
    os.symlink(target, link)
    with pytest.raises(KeysFileError, match="cannot be opened"):
        load_keys_file(str(link))


@pytest.mark.parametrize(
    "text,problem",
    [
        ("k\n", "line 1: expected 'KEY TENANT'"),
        ("k alpha root\n", "line 1: expected"),
        ("k alpha\nk beta\n", "line 2: this key is listed twice"),
        ("k al/pha\n", "line 1: tenant name"),
        ("k\u00e9 alpha\n", "printable ASCII"),
        ("# nothing\n", "lists no key"),
    ],
)
def test_a_malformed_keys_file_names_the_line(tmp_path, text, problem):
    with pytest.raises(KeysFileError, match=problem):
        load_keys_file(keys_file(tmp_path, text))


def test_a_tenant_scope_cannot_be_spelled_by_another_tenant_or_a_salt():
    scopes = {
        scoped_salt(None, None),
        scoped_salt(None, "x"),
        scoped_salt("a", None),
        scoped_salt("a", "x"),
        scoped_salt("b", None),
        scoped_salt("b", "x"),
    }
    assert len(scopes) == 6
    assert scoped_salt("a", "x", share_across_tenants=True) == "x"  # sharing: the client's salt alone
    # a client salt cannot carry the separator that would let it name a tenant's scope
    with pytest.raises(ValueError, match="printable"):
        parse_cache_salt(scoped_salt("a", None))


def test_share_cache_across_tenants_needs_tenants():
    with pytest.raises(ValueError, match="needs --api-keys-file"):
        ServerArgs(share_cache_across_tenants=True)
    with pytest.raises(ValueError, match="--tenant-max-pins"):
        ServerArgs(tenant_max_pins=-1)
