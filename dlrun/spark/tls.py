"""TLS for the channel between the Spark driver and its tasks.

Each job makes its own key and self-signed certificate (``make_job_tls``, in ``dlrun.tls``).
The driver serves with both (``server_context``); a task trusts that one certificate and nothing else
(``client_context``, which lives in ``dlrun.spark.task``: standard library only, it travels
to the executors with the task's code, without ``cryptography``), so only the driver's
process can complete a handshake, whatever the network. TLS 1.3 only. The job token then
authenticates the task inside the encrypted channel.
"""

from __future__ import annotations

import ssl

from dlrun.remote import keeper
from dlrun.spark.task import client_context
from dlrun.tls import CERT_DAYS, JobTls, make_job_tls

__all__ = ["CERT_DAYS", "JobTls", "client_context", "make_job_tls", "server_context"]


def server_context(tls: JobTls) -> ssl.SSLContext:
    """The driver's side: TLS 1.3, the job's certificate and key, loaded as a detached job's
    leader loads them (``dlrun.remote.keeper.server_context``: the key goes to a memory file,
    never to disk where memfd exists)."""
    return keeper.server_context(tls.cert_pem, tls.key_pem)
