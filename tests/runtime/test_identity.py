"""Identities in certificates: the URI a `DevCa` leaf carries parses back; `require` passes plaintext
callers (a server without TLS), the right identity, and refuses any other with PERMISSION_DENIED naming
the caller and what the call needs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from xavier_core.runtime.errors import PermissionDenied
from xavier_core.runtime.identity import Identity, identity_of_pem, require
from xavier_core.runtime.tls import DevCa, make_dev_certificates


class _Ctx:
    def __init__(self, pem: bytes | None, tls: bool = True) -> None:
        self._auth: dict[str, list[bytes]] = {}
        if tls:
            self._auth["transport_security_type"] = [b"ssl"]
        if pem is not None:
            self._auth["x509_pem_cert"] = [pem]

    def auth_context(self) -> dict[str, Any]:
        return self._auth


def test_identity_uris_round_trip_and_bad_ones_are_none() -> None:
    who = Identity("prefill", "prefill-0")
    assert Identity.from_uri(who.uri) == who and who.uri == "spiffe://xavier/prefill/prefill-0"
    for uri in ("spiffe://xavier/wizard/x", "spiffe://xavier/prefill/", "spiffe://other/prefill/p", "x"):
        assert Identity.from_uri(uri) is None
    with pytest.raises(ValueError):
        Identity("prefill", "a/b")


def test_a_leaf_names_its_identity(tmp_path: Path) -> None:
    ca = DevCa(tmp_path)
    files = ca.issue("decode-3", Identity("decode", "decode-3"))
    assert identity_of_pem(files.cert_file.read_bytes()) == Identity("decode", "decode-3")
    assert identity_of_pem(make_dev_certificates(tmp_path / "plain").cert_file.read_bytes()) is None
    assert identity_of_pem(b"not a certificate") is None
    assert oct(files.key_file.stat().st_mode & 0o777) == "0o600"


def test_require_checks_tls_callers_only(tmp_path: Path) -> None:
    ca = DevCa(tmp_path)
    decode = ca.issue("decode-0", Identity("decode", "decode-0")).cert_file.read_bytes()
    router = ca.issue("router", Identity("router", "router")).cert_file.read_bytes()
    anonymous = make_dev_certificates(tmp_path / "anon").cert_file.read_bytes()
    assert require(_Ctx(None, tls=False), "Heartbeat", peer_id="prefill-0") is None  # plaintext server
    assert require(_Ctx(decode), "Heartbeat", peer_id="decode-0") == Identity("decode", "decode-0")
    assert require(_Ctx(router), "AbortRoom", roles=("router",)) == Identity("router", "router")
    with pytest.raises(PermissionDenied) as info:
        require(_Ctx(decode), "RegisterPeer", peer_id="decode-0", peer_role="prefill")
    assert info.value.metadata == {
        "method": "RegisterPeer",
        "caller": "decode/decode-0",
        "needs": "peer prefill/decode-0",
    }
    with pytest.raises(PermissionDenied) as info:
        require(_Ctx(decode), "AbortRoom", roles=("router",))
    assert info.value.reason == "PERMISSION_DENIED" and info.value.metadata["needs"] == "role router"
    with pytest.raises(PermissionDenied) as info:
        require(_Ctx(anonymous), "Prefill", roles=("router",))
    assert info.value.metadata["caller"] == ""
