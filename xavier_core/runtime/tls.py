"""mTLS for service-to-service gRPC: server credentials that demand a client certificate, client credentials.

The files named in ``[tls]`` are checked when read (PEM parses, the key matches the certificate, the CA
bundle loads) so a bad path or file fails at start with a :class:`ConfigError` naming the key, not at the
first handshake. The server side is built on ``grpc.dynamic_ssl_server_credentials``: gRPC asks
:meth:`ServerTls.fetch` for a new certificate configuration before each handshake, and it hands one over
only after :meth:`ServerTls.request_reload` (what SIGHUP does), so rotating certificates needs no restart
and connections already open keep the certificate they were made with. A reload that finds broken files
keeps serving the old ones and logs why; the next SIGHUP tries again.
"""

from __future__ import annotations

import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

from .config import ConfigError, TlsSettings
from .logging import get_logger

__all__ = ["ServerTls", "TlsFiles", "channel_credentials", "read_tls_files"]

_log = get_logger("xavier.tls")


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
