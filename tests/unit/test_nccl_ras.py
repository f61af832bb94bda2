"""NCCL's RAS status, asked by the stack taker and summarised for ``dlrun stack`` and
``--hang-timeout``: the summary on the texts of NCCL's guide, the client against a stand-in
speaking RAS's protocol (no NCCL here; ``scripts/gpu_smoke.sh`` asks the real one, and one of its
answers is a fixture)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dlrun.remote.stack_groups import ras_findings, ras_lines
from dlrun.remote.stacks import ask_ras, write_out

from support.nccl_ras import FIXTURES, serve


def fixture(name: str) -> str:
    return (Path(FIXTURES) / name).read_text()


def free_addr() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def test_a_healthy_job_is_one_line() -> None:
    assert ras_findings(fixture("healthy-32gpu-4node.txt")) == ["every communicator RUNNING OK"]


def test_a_real_answer_of_nccl_2_28_on_one_gpu_is_one_line() -> None:
    """NCCL's own answer, captured on a lent H100 (the guide's excerpts are joined by hand)."""
    assert ras_findings(fixture("h100-1gpu-nccl-2.28.9.txt")) == ["every communicator RUNNING OK"]


def test_the_ranks_behind_in_a_mismatch_are_named_as_a_rank_list() -> None:
    assert ras_findings(fixture("mismatch-operation-counts.txt")) == [
        "warning: #0-0 (27a079b828ff1a75) MISMATCH - Communicator ranks have different collective operation counts"
        " - 26 ranks have launched up to operation 6650 - 6 ranks have launched up to operation 6649:"
        " ranks 0,2-5,7 (on 172.16.64.210)"]


def test_errors_come_before_warnings_one_line_per_block() -> None:
    assert ras_findings(fixture("incomplete-stopped-process.txt")) == [
        "error: INCOMPLETE - Missing communicator data from 1 job process"
        " - Process 3487984 on node 172.16.64.213 managing GPU 5",
        "error: #0-0 (cf264af53edbe986) INCOMPLETE - Missing communicator data from 1 rank - The missing rank: 21",
        "warning: TIMEOUT - Encountered 2 communication timeouts while gathering communicator data"]


def test_the_first_host_that_got_an_answer_speaks_and_failures_stay_out_of_the_summary() -> None:
    answers: list[tuple[str, Mapping[str, Any]]] = [
        ("h1", {"ranks": {}}), ("h2", {"nccl_ras": {"addr": "a", "error": "nothing listens there"}}),
        ("h3", {"nccl_ras": {"addr": "b", "text": fixture("healthy-32gpu-4node.txt")}})]
    assert ras_lines(answers) == ["NCCL RAS (h3): every communicator RUNNING OK"]
    assert ras_lines(answers[:2]) == []


def test_the_client_speaks_ras_protocol_and_reads_the_whole_answer() -> None:
    addr = free_addr()
    text = fixture("mismatch-operation-counts.txt")
    asked = serve(addr, text.encode())
    found = ask_ras(addr)
    assert found == {"addr": addr, "text": text}
    assert asked == ["CLIENT PROTOCOL 2", "TIMEOUT 5", "VERBOSE STATUS"]


def test_no_ras_listening_is_said_plainly(tmp_path: Path) -> None:
    addr = free_addr()
    found = ask_ras(addr)
    assert found["addr"] == addr and "nothing listens there (NCCL older than 2.24" in found["error"]
    write_out(str(tmp_path), {"ranks": {}, "nccl_ras": found})
    assert (tmp_path / "nccl-ras.txt").read_text().startswith(f"NCCL RAS at {addr}\n\nnot asked: nothing listens")


def test_something_else_on_the_port_is_not_taken_for_ras() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        addr = f"127.0.0.1:{listener.getsockname()[1]}"

        def greet() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.sendall(b"SSH-2.0-OpenSSH_9.2\r\n")

        threading.Thread(target=greet, daemon=True).start()
        found = ask_ras(addr)
    assert "not NCCL's RAS" in found["error"] and "SSH-2.0" in found["error"]
