"""``--backend spark``: the channel between the driver and its tasks is TLS, and bad peers are refused.

One ``local-cluster[2,1,1024]`` context (executor JVMs: the task's closure crosses Spark's own
RPC on loopback too). ``tcpdump`` records every byte on ``lo`` while a job runs with
``-e SECRET_TOKEN=<random hex>``: the secret's value (and the agent's program) never appears
in the recorded bytes, while the capture did see the job (its id travels in Spark's clear
traffic) and the driver's channel. Before the stage is submitted, three bad peers knock on the
driver's listener: each is refused and reported once, and the job still succeeds.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import secrets
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dlrun.run.config import LaunchConfig
from dlrun.run.view import PlainView
from dlrun.spark.driver import SparkConfig, run_spark
from dlrun.spark.tls import client_context, make_job_tls

from support.cli import REPO
from support.spark import spark_test_context

pytestmark = pytest.mark.spark

pyspark = pytest.importorskip("pyspark", reason="pip install 'dlrun[spark]'")

TCPDUMP = shutil.which("tcpdump") or ("/usr/bin/tcpdump" if os.path.exists("/usr/bin/tcpdump") else None)
needs_capture = pytest.mark.skipif(
    TCPDUMP is None or os.geteuid() != 0,
    reason="records loopback with tcpdump, as root (apt-get install tcpdump)",
)
needs_java = pytest.mark.skipif(shutil.which("java") is None and not os.environ.get("JAVA_HOME"),
                                reason="no Java (apt-get install openjdk-17-jre-headless)")

MASTER = "local-cluster[2,1,1024]"
#: A line of the agent's own source: the program travels on the channel, so never in clear.
AGENT_LINE = b"def frame(kind: int, rank: int, payload: bytes) -> bytes:"

USES_SECRET = """
import hashlib, os
secret = os.environ["SECRET_TOKEN"]
print("secret digest", hashlib.sha256(secret.encode()).hexdigest(), flush=True)
"""


@pytest.fixture(scope="module")
def cluster_sc() -> Iterator[Any]:
    yield from spark_test_context(MASTER, {}, app="dlrun-channel-tests", executors=2)


# ============================================================================ bad peers


def plain_client(address: tuple[str, int], job_id: str) -> bytes:
    """No TLS: a hello line in clear, as the channel once took it."""
    with socket.create_connection(address, timeout=20) as sock:
        sock.sendall(json.dumps({"token": "0" * 32, "job_id": job_id, "partition": 0}).encode() + b"\n")
        return read_all(sock)


def other_cert_client(address: tuple[str, int]) -> str:
    """TLS that pins another job's certificate: the handshake fails on both sides."""
    with socket.create_connection(address, timeout=20) as sock:
        try:
            client_context(make_job_tls("impostor").cert_pem).wrap_socket(sock)
        except ssl.SSLCertVerificationError as exc:
            return exc.verify_message
    return "handshake passed"


def wrong_token_client(address: tuple[str, int], job_id: str) -> bytes:
    """TLS (trusting anything) with a well-formed hello and a wrong token."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    with socket.create_connection(address, timeout=20) as raw, context.wrap_socket(raw) as tls:
        assert tls.version() == "TLSv1.3"
        hello = {"token": secrets.token_hex(16), "job_id": job_id, "partition": 0, "host": "127.0.0.1",
                 "port": 1, "gpus": [], "python": "python3", "script": None, "pid": 1}
        tls.sendall(json.dumps(hello).encode() + b"\n")
        return read_all(tls)


def read_all(sock: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (OSError, ssl.SSLError):
        pass
    return data


class KnockFirst(PlainView):
    """A PlainView that, when the stage is announced (before it is submitted), lets bad peers
    knock on the driver's listener and keeps what they got."""

    def __init__(self, out: io.StringIO) -> None:
        super().__init__(out)
        self.got: dict[str, Any] = {}

    def notice(self, text: str) -> None:
        super().notice(text)
        match = re.search(r"\(job ([\w-]+)\); they report to (\S+):(\d+) over TLS", text)
        if match and not self.got:
            job_id, address = match.group(1), (match.group(2), int(match.group(3)))
            self.got = {"address": address, "plain": plain_client(address, job_id),
                        "other cert": other_cert_client(address),
                        "wrong token": wrong_token_client(address, job_id)}


# ============================================================================ the capture


class Capture:
    """tcpdump on ``lo`` into a file, every byte of every packet."""

    def __init__(self, path: Path) -> None:
        assert TCPDUMP is not None
        self.path = path
        path.unlink(missing_ok=True)  # an earlier capture's header is no sign that this one listens
        self.proc = subprocess.Popen([TCPDUMP, "-i", "lo", "-s", "0", "-B", "65536", "--immediate-mode", "-U", "-n",
                                      "-w", str(path)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 20
        while (not path.exists() or path.stat().st_size == 0) and time.monotonic() < deadline:
            time.sleep(0.05)  # the file's header is written once tcpdump listens
        assert path.exists(), "tcpdump did not start"
        time.sleep(0.5)

    def stop(self) -> str:
        time.sleep(0.5)
        self.proc.send_signal(signal.SIGINT)
        _, err = self.proc.communicate(timeout=30)
        return err.decode()


def tcp_streams(pcap: bytes) -> dict[tuple[int, int], bytes]:
    """(source port, destination port) → the TCP payloads of that direction, in capture order
    (IPv4 and IPv6 over the Ethernet framing tcpdump gives ``lo``)."""
    magic = struct.unpack("<I", pcap[:4])[0]
    order = "<" if magic in (0xA1B2C3D4, 0xA1B23C4D) else ">"
    linktype = struct.unpack(order + "I", pcap[20:24])[0]
    assert linktype == 1, f"link type {linktype}"
    streams: dict[tuple[int, int], bytearray] = defaultdict(bytearray)
    offset = 24
    while offset + 16 <= len(pcap):
        length = struct.unpack(order + "I", pcap[offset + 8:offset + 12])[0]
        packet = pcap[offset + 16:offset + 16 + length]
        offset += 16 + length
        ethertype = struct.unpack(">H", packet[12:14])[0]
        ip = packet[14:]
        if ethertype == 0x0800 and ip[9] == 6:
            tcp = ip[(ip[0] & 0x0F) * 4:]
        elif ethertype == 0x86DD and ip[6] == 6:
            tcp = ip[40:]
        else:
            continue
        sport, dport = struct.unpack(">HH", tcp[:4])
        streams[(sport, dport)] += tcp[(tcp[12] >> 4) * 4:]
    return {key: bytes(value) for key, value in streams.items()}


def spellings(text: str) -> list[bytes]:
    return [text.encode(), text.encode("utf-16-le"), text.encode("utf-16-be")]


# ============================================================================ the test


@needs_java
@needs_capture
def test_the_secret_never_crosses_loopback_in_clear_and_bad_peers_are_refused(
        tmp_path: Path, cluster_sc: Any) -> None:
    secret = secrets.token_hex(20)
    script = tmp_path / "uses_secret.py"
    script.write_text(USES_SECRET)
    agent_source = (REPO / "dlrun" / "remote" / "agent.py").stat().st_size
    for _ in range(2):  # a capture that missed the channel's bytes proves nothing: record the job again
        out = io.StringIO()
        view = KnockFirst(out)
        config = LaunchConfig(script=str(script), env={"SECRET_TOKEN": secret}, log_dir=str(tmp_path / "logs"),
                              grace=2, plain=True)
        capture = Capture(tmp_path / "lo.pcap")
        try:
            code = run_spark(config, SparkConfig(master=MASTER, num_workers=2), view=view)
        finally:
            stats = capture.stop()
        text = out.getvalue()
        streams = tcp_streams((tmp_path / "lo.pcap").read_bytes())
        port = view.got["address"][1]
        channel = sum(len(data) for (sport, dport), data in streams.items() if port in (sport, dport))
        if channel > agent_source:
            break

    # the job ran, and every rank had the secret
    assert code == 0, text
    digest = hashlib.sha256(secret.encode()).hexdigest()
    assert len(re.findall(rf"^\[\d task\d@127\.0\.0\.1\] secret digest {digest}$", text, re.M)) == 2, text

    # the bad peers got nothing and were each refused, and reported, once
    got = view.got
    assert got["address"][0] == "127.0.0.1"  # a local master: the listener is on loopback
    assert b"{" not in got["plain"] and len(got["plain"]) < 100, got["plain"]  # a TLS alert at most
    assert "self-signed" in got["other cert"] or "certificate" in got["other cert"], got["other cert"]
    assert got["wrong token"] in (b"", b"\x01\x00\x00\x00\x00"), got["wrong token"]  # an EOF frame at most
    refused = re.findall(r"^dlrun: spark: refused a connection: (.*)$", text, re.M)
    assert len(refused) == 3, text
    assert sum("no TLS handshake" in why for why in refused) == 2, refused
    assert sum("without this job's hello" in why for why in refused) == 1, refused

    # every byte on loopback: the secret and the agent's program never, the job and the channel yes
    assert re.search(r"^0 packets dropped by kernel$", stats, re.M), stats  # (on lo each packet counts twice)
    pcap = (tmp_path / "lo.pcap").read_bytes()
    sizes = {key: len(data) for key, data in streams.items()}
    notices = [line for line in text.splitlines() if line.startswith("dlrun: spark:")]
    assert channel > agent_source, (f"only {channel} bytes on the driver's channel (port {port}): {sizes};"
                                    f" tcpdump: {stats!r}; the job's notices: {notices}")
    job_id = re.search(r"\(job ([\w-]+)\)", text)
    assert job_id and any(job_id.group(1).encode() in data for data in streams.values()), "Spark's traffic unseen"
    for needle in [*spellings(secret), AGENT_LINE]:
        assert needle not in pcap, f"{needle[:20]!r}... in the capture"
        leaks = [key for key, data in streams.items() if needle in data]
        assert not leaks, f"{needle[:20]!r}... in clear between ports {leaks}"
