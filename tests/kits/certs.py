"""A CA for tests of issued certificates (module-scoped fixtures) and peer identities on disk."""

from __future__ import annotations

import pytest

from shoal.common.certs import init_certs
from shoal.common.identity import load_or_create_key, peer_id_of, public_bytes
from shoal.coordinator.ca import CertificateAuthority


@pytest.fixture(scope="module")
def tls_dir(tmp_path_factory):
    """A fresh `shoal certs init` directory, shared by the module's tests."""
    return init_certs(tmp_path_factory.mktemp("tls")).dir


@pytest.fixture(scope="module")
def ca(tls_dir) -> CertificateAuthority:
    """The coordinator's CA over `tls_dir`, issuing certificates valid for an hour."""
    return CertificateAuthority.from_dir(tls_dir, lifetime_s=3600)


def identity(tmp_path, name: str):
    """A key file `name`.key under `tmp_path` (created once) and its peer id."""
    key = load_or_create_key(tmp_path / f"{name}.key")
    return key, peer_id_of(public_bytes(key))
