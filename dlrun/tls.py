"""A job's own TLS certificate: made here for each job, pinned by whoever connects.

The Spark channel (``dlrun.spark.tls``) and the keepers of a detached job
(``dlrun.remote.keeper``) each trust exactly this certificate and nothing else, so only a
process that holds the job's key can complete a handshake, whatever the network. The peers'
TLS contexts live beside them (standard library only, shipped to hosts without
``cryptography``); ``client_context`` is dlrun's own side of such a connection (``dlrun logs``'
side channel, ``dlrun.run.logstream``).
"""

from __future__ import annotations

import datetime
import ssl
from dataclasses import dataclass

CERT_DAYS = 30  # long enough for any job; the key never leaves the controller's memory and a temp file


@dataclass(frozen=True)
class JobTls:
    """A job's certificate (public: it travels to the peers) and private key."""

    cert_pem: str
    key_pem: str


def make_job_tls(job_id: str) -> JobTls:
    """A fresh EC P-256 key and a self-signed certificate naming the job."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"dlrun job {job_id}")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # the hosts' clocks may lag
        .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return JobTls(
        cert_pem=cert.public_bytes(serialization.Encoding.PEM).decode("ascii"),
        key_pem=key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()).decode("ascii"),
    )


def client_context(cert_pem: str) -> ssl.SSLContext:
    """TLS 1.3 trusting exactly ``cert_pem`` (pinned): only its key's holder completes a handshake."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(cadata=cert_pem)
    return context
