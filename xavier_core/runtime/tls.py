"""mTLS for service-to-service gRPC: server credentials that demand a client certificate, client credentials.

The files named in ``[tls]`` are checked when read (PEM parses, the key matches the certificate, the CA
bundle loads) so a bad path or file fails at start with a :class:`ConfigError` naming the key, not at the
first handshake. The server side is built on ``grpc.dynamic_ssl_server_credentials``: gRPC asks
:meth:`ServerTls.fetch` for a new certificate configuration before each handshake, and it hands one over
only after :meth:`ServerTls.request_reload` (what SIGHUP does), so rotating certificates needs no restart
and connections already open keep the certificate they were made with. A reload that finds broken files
keeps serving the old ones and logs why; the next SIGHUP tries again. The channels a service dials
follow the same SIGHUP (``client_tls``).
"""

from __future__ import annotations

import ssl
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from .config import ConfigError, TlsSettings
from .identity import Identity
from .logging import get_logger

__all__ = [
    "DevCa",
    "DevCertificates",
    "ServerTls",
    "TlsFiles",
    "channel_credentials",
    "make_dev_certificates",
    "read_tls_files",
]

_log = get_logger("xavier.tls")


def _pem_encoding() -> Any:
    from cryptography.hazmat.primitives import serialization

    return serialization.Encoding.PEM


@dataclass(frozen=True)
class TlsFiles:
    """The PEM bytes of one ``[tls]`` section, checked to belong together."""

    cert: bytes
    key: bytes
    ca: bytes


def _read(settings: TlsSettings, field: str) -> bytes:
    path: Path = getattr(settings, field)
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError([(f"tls.{field}", f"cannot read {path}: {exc.strerror or exc}", "tls")]) from None


def read_tls_files(settings: TlsSettings) -> TlsFiles:
    """Read and check the three files; :class:`ConfigError` names the key at fault."""
    files = TlsFiles(_read(settings, "cert_file"), _read(settings, "key_file"), _read(settings, "ca_file"))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_verify_locations(cadata=files.ca.decode("ascii", "replace"))
    except (ssl.SSLError, ValueError) as exc:
        raise ConfigError([("tls.ca_file", f"not a PEM CA bundle: {exc}", str(settings.ca_file))]) from None
    try:
        # ssl loads a chain only from paths; the files were just read, so a swap in between is caught
        # by the next reload, never served half old, half new (gRPC gets the bytes read above).
        context.load_cert_chain(settings.cert_file, settings.key_file)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(
            [
                (
                    "tls.cert_file",
                    f"certificate and key_file do not load as a pair: {exc}",
                    str(settings.cert_file),
                )
            ]
        ) from None
    return files


class ServerTls:
    """Server credentials requiring a client certificate from ``ca_file``, reloadable at run time."""

    def __init__(self, settings: TlsSettings) -> None:
        self.settings = settings
        self._files = read_tls_files(settings)
        self._reload = threading.Event()
        self.reloads = 0
        """Certificate configurations handed to gRPC after the first (for logs and tests)."""

    def _configuration(self, files: TlsFiles) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration(
            [(files.key, files.cert)], root_certificates=files.ca
        )

    def credentials(self) -> grpc.ServerCredentials:
        """Credentials for ``add_secure_port``: plaintext and unknown client certificates are refused."""
        return grpc.dynamic_ssl_server_credentials(
            self._configuration(self._files), self.fetch, require_client_authentication=True
        )

    def request_reload(self) -> None:
        """Re-read the files before the next handshake (safe from a signal handler or any thread)."""
        self._reload.set()

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's certificate-configuration fetcher: None keeps the current configuration."""
        if not self._reload.is_set():
            return None
        self._reload.clear()
        try:
            files = read_tls_files(self.settings)
        except ConfigError as err:
            _log.error("tls reload failed; keeping the current certificate", error=str(err))
            return None
        self._files = files
        self.reloads += 1
        _log.info("tls certificates reloaded", cert_file=str(self.settings.cert_file))
        return self._configuration(files)


def channel_credentials(settings: TlsSettings) -> grpc.ChannelCredentials:
    """Client credentials: trust ``ca_file`` and present ``cert_file``/``key_file``.

    Pair with ``("grpc.ssl_target_name_override", settings.server_name)`` in the channel options when
    ``server_name`` is set (certificates issued to names other than the dialled address).
    """
    files = read_tls_files(settings)
    return grpc.ssl_channel_credentials(
        root_certificates=files.ca, private_key=files.key, certificate_chain=files.cert
    )


@dataclass(frozen=True)
class DevCertificates:
    """Paths of a throwaway CA and one leaf certificate (``xavier up --tls``, tests)."""

    ca_file: Path
    cert_file: Path
    key_file: Path

    def settings(self, server_name: str = "") -> TlsSettings:
        """The ``[tls]`` section that uses these files."""
        return TlsSettings(
            cert_file=self.cert_file, key_file=self.key_file, ca_file=self.ca_file, server_name=server_name
        )


def make_dev_certificates(
    directory: Path, names: tuple[str, ...] = ("localhost", "127.0.0.1")
) -> DevCertificates:
    """A new CA and a leaf for ``names`` (client and server use, no Xavier identity) written under
    ``directory`` (mode 0600). For tests: the CA key is not kept, so nothing else can be signed by it."""
    return DevCa(directory).issue("", None, names)


class DevCa:
    """A throwaway CA held in memory (``xavier up``): ``ca.pem`` under ``directory`` and, per
    :meth:`issue`, one leaf certificate naming one service's identity (a URI SAN, see ``identity``).
    ECDSA P-256, valid 30 days; the CA key is never written, so nothing outlives this object's owner."""

    def __init__(self, directory: Path) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec

        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._cert = (
            _builder(_name("xavier mesh CA"), _name("xavier mesh CA"), self._key)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        self.ca_file = directory / "ca.pem"
        _write(self.ca_file, self._cert.public_bytes(_pem_encoding()))

    def issue(
        self,
        name: str,
        identity: Identity | None,
        names: tuple[str, ...] = ("localhost", "127.0.0.1"),
    ) -> DevCertificates:
        """A leaf for ``names`` (server and client use) naming ``identity``, as ``<name>cert.pem`` and
        ``<name>key.pem`` (``name`` "" gives ``cert.pem``/``key.pem``)."""
        import ipaddress

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID

        alt: list[x509.GeneralName] = []
        for n in names:
            try:
                alt.append(x509.IPAddress(ipaddress.ip_address(n)))
            except ValueError:
                alt.append(x509.DNSName(n))
        if identity is not None:
            alt.append(x509.UniformResourceIdentifier(identity.uri))
        key = ec.generate_private_key(ec.SECP256R1())
        usage = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
        leaf = (
            _builder(_name(str(identity or names[0])), self._cert.subject, key)
            .add_extension(x509.SubjectAlternativeName(alt), critical=False)
            .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        prefix = f"{name}-" if name else ""
        files = DevCertificates(
            self.ca_file, self.directory / f"{prefix}cert.pem", self.directory / f"{prefix}key.pem"
        )
        _write(files.cert_file, leaf.public_bytes(_pem_encoding()))
        pkcs8, none = serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        _write(files.key_file, key.private_bytes(_pem_encoding(), pkcs8, none))
        return files


def _name(common_name: str) -> Any:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(subject: Any, issuer: Any, key: Any) -> Any:
    import datetime

    from cryptography import x509

    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=30))
    )


def _write(path: Path, data: bytes) -> None:
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_bytes(data)
