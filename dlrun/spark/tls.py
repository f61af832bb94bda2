"""TLS for the channel between the Spark driver and its tasks.

Each job makes its own key and self-signed certificate (``make_job_tls``). The driver serves
with both (``server_context``); a task trusts that one certificate and nothing else
(``client_context``, which lives in ``dlrun.spark.task``: standard library only, it travels
to the executors with the task's code, without ``cryptography``), so only the driver's
process can complete a handshake, whatever the network. TLS 1.3 only. The job token then
authenticates the task inside the encrypted channel.
"""

from __future__ import annotations

import datetime
import os
import ssl
import tempfile
from dataclasses import dataclass

from dlrun.spark.task import client_context

__all__ = ["CERT_DAYS", "JobTls", "client_context", "make_job_tls", "server_context"]

CERT_DAYS = 30  # long enough for any job; the key never leaves the driver's memory and a temp file


@dataclass(frozen=True)
class JobTls:
    """A job's certificate (public: it travels to the tasks) and private key (driver only)."""

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
        .not_valid_before(now - datetime.timedelta(minutes=5))  # executors' clocks may lag
        .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return JobTls(
        cert_pem=cert.public_bytes(serialization.Encoding.PEM).decode("ascii"),
        key_pem=key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()).decode("ascii"),
    )


def server_context(tls: JobTls) -> ssl.SSLContext:
    """The driver's side: TLS 1.3, the job's certificate and key."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    # ssl loads a key only from a file: a private folder, gone once it is read
    with tempfile.TemporaryDirectory(prefix="dlrun-tls-") as folder:
        os.chmod(folder, 0o700)
        cert, key = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
        for path, text in ((cert, tls.cert_pem), (key, tls.key_pem)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(text)
        context.load_cert_chain(cert, key)
    return context
