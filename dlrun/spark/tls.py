"""TLS for the channel between the Spark driver and its tasks.

Each job makes its own key and self-signed certificate (``make_job_tls``, in ``dlrun.tls``).
The driver serves with both (``server_context``); a task trusts that one certificate and nothing else
(``client_context``, which lives in ``dlrun.spark.task``: standard library only, it travels
to the executors with the task's code, without ``cryptography``), so only the driver's
process can complete a handshake, whatever the network. TLS 1.3 only. The job token then
authenticates the task inside the encrypted channel.
"""

from __future__ import annotations

import os
import ssl
import tempfile

from dlrun.spark.task import client_context
from dlrun.tls import CERT_DAYS, JobTls, make_job_tls

__all__ = ["CERT_DAYS", "JobTls", "client_context", "make_job_tls", "server_context"]


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
