"""``--checkpoint-dir`` for a detached job's restarts: the keepers make each folder the same.

A module the keepers load from the source in their config (standard library only, Python >=
3.8). Every keeper has a ``Worker``, which runs its host's push helper (``push_helper``'s
listing, ``serve`` and push with ``sources``) for the leader's requests; the leader runs
``sync_folder`` before each restarted attempt, asking every host (its own ``Worker`` directly,
the followers over their keeper connections) and choosing copies by the rule of
``dlrun.push.checkpoint.choose_copies`` (``choose``). Files go host to host only: there is no
client to relay through. Mechanism: ``docs/checkpoints.md``.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Tuple

SUSPECT_MARGIN_S = 1.0  # dlrun.push.checkpoint.SUSPECT_MARGIN_S
HELPER_IDLE_S = 300  # dlrun.push.pull.HELPER_IDLE_S

# A listed path: [kind, size, mode, sha256 or link target, mtime_ns] (push_helper.listing)
Entry = List[Any]
# A host's listing: (host, entries by path, its clock minus the leader's, in seconds)
Listing = Tuple[str, Dict[str, Entry], float]
# The leader's question to every host at once: host -> request; answers: host -> answer
Ask = Callable[[Dict[str, Dict[str, Any]]], Dict[str, Dict[str, Any]]]


def same_content(a: Entry, b: Entry) -> bool:
    return bool(a[0] == b[0] and a[3] == b[3])


def written_at(entry: Entry, offset: float) -> float:
    """When ``entry`` was last modified, on the leader's clock."""
    return int(entry[4]) / 1e9 - offset


def choose(listings: list[Listing], failed_at: float | None,
           margin: float = SUSPECT_MARGIN_S) -> dict[str, tuple[str, Entry, bool, list[str]]]:
    """Per path any host has: (host, entry, suspect, hosts passed over), as
    ``dlrun.push.checkpoint.choose_copies``: a copy written before the failure first, then the
    newest, then the largest, then the first host."""
    order = {host: i for i, (host, _, _) in enumerate(listings)}
    offsets = {host: offset for host, _, offset in listings}
    chosen: dict[str, tuple[str, Entry, bool, list[str]]] = {}
    for path in sorted({p for _, entries, _ in listings for p in entries}):
        copies = [(host, entries[path]) for host, entries, _ in listings if path in entries]

        def suspect(host: str, entry: Entry) -> bool:
            return failed_at is not None and written_at(entry, offsets[host]) >= failed_at - margin

        def rank(copy: tuple[str, Entry]) -> tuple[bool, float, int, int]:
            host, entry = copy
            return (not suspect(host, entry), written_at(entry, offsets[host]), int(entry[1]), -order[host])

        best, entry = max(copies, key=rank)
        passed = [h for h, e in copies if suspect(h, e) and not same_content(e, entry)
                  and written_at(e, offsets[h]) > written_at(entry, offsets[best])]
        chosen[path] = (best, entry, suspect(best, entry), passed)
    return chosen


def needs(listings: list[Listing], chosen: dict[str, tuple[str, Entry, bool, list[str]]]) -> dict[str, list[str]]:
    """Per host, the chosen paths it lacks or has with other content."""
    return {host: [p for p, c in chosen.items() if p not in entries or not same_content(entries[p], c[1])]
            for host, entries, _ in listings}


def safe_path(path: str) -> bool:
    parts = path.split("/")
    return bool(path) and not path.startswith("/") and all(p not in ("", ".", "..") for p in parts) \
        and "\0" not in path


def human_bytes(count: float) -> str:  # dlrun.push.tree.human_bytes
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


def unsafe_text(unsafe: list[list[str]]) -> str:
    """The push's refusal (``dlrun.push.session.check_owners``) in one line."""
    folders = "; ".join(f"{folder} {what}: {fix}" for folder, what, fix in unsafe)
    return (f"another user could plant files the job loads: {folders}"
            " (fix the folders, or launch with --insecure-workdir to accept the risk)")


# =============================================================================== one host


class Helper:
    """The host's push helper as a child process: JSON lines in, JSON lines (and bytes) out."""

    def __init__(self, argv: list[str], source: str, request: dict[str, Any]) -> None:
        self.errors = tempfile.TemporaryFile()  # noqa: SIM115 (closed by close())
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.errors,
                                     start_new_session=True)
        payload = source.encode("utf-8")
        self.write(b"%010d" % len(payload) + payload + json.dumps(request).encode() + b"\n")

    def write(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def say(self, message: dict[str, Any]) -> None:
        self.write(json.dumps(message).encode() + b"\n")

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise OSError(f"the push helper ended: {self.stderr() or 'no output'}")
        try:
            message = json.loads(line)
        except ValueError:
            raise OSError(f"the push helper said {line[:200]!r}") from None
        if not isinstance(message, dict):
            raise OSError(f"the push helper said {line[:200]!r}")
        return message

    def stderr(self) -> str:
        try:
            self.errors.seek(0)
            return self.errors.read()[-2000:].decode("utf-8", "replace").strip()
        except OSError:
            return ""

    def close(self) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.errors.close()


class Worker:
    """One keeper's side of a checkpoint copy: lists its folders, serves files to the other
    hosts' helpers, and receives files from them. ``config``: the keeper config's
    ``checkpoint`` (``root``: the job's working folder; ``helper_argv``, ``helper_source``;
    ``owner_check``)."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.root = str(config["root"])
        self.argv = [str(a) for a in config["helper_argv"]]
        self.source = str(config["helper_source"])
        self.owner_check = bool(config.get("owner_check", True))
        self.listers: dict[str, Helper] = {}  # folder -> its helper, listed (it may serve next)
        # ``end`` may come (from another thread) while a late listing still runs
        self.lock = threading.Lock()
        # tests only (DLRUN_TEST_CKPT_PAUSE on the client, docs/checkpoints.md): a listing waits
        self.pause = float(config.get("test_pause") or 0)

    def folder(self, name: str) -> str:
        if not safe_path(name):
            raise ValueError(f"not a folder inside the job's: {name!r}")
        return os.path.join(self.root, name)

    def handle(self, ask: dict[str, Any]) -> dict[str, Any]:
        """One request of the leader's; an ``error`` answer where it failed."""
        try:
            do = ask.get("do")
            if do == "list":
                return self.listing(str(ask["folder"]))
            if do == "serve":
                return self.serve(str(ask["folder"]), [str(p) for p in ask["paths"]], ask)
            if do == "receive":
                return self.receive(str(ask["folder"]), ask["files"], ask["sources"])
            if do == "end":
                self.end()
                return {}
            return {"error": f"unknown request {do!r}"}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return {"error": str(exc) or type(exc).__name__}
        except Exception as exc:  # whatever else went wrong, the leader gets an answer: it waits for one
            return {"error": f"{type(exc).__name__}: {exc}"}

    def listing(self, folder: str) -> dict[str, Any]:
        if self.pause:
            time.sleep(self.pause)
        request = {"send": {"root": self.folder(folder), "owner_check": self.owner_check}, "idle": HELPER_IDLE_S}
        helper = Helper(self.argv, self.source, request)
        with self.lock:
            old = self.listers.pop(folder, None)
            self.listers[folder] = helper
        if old is not None:
            old.close()
        listing = helper.read().get("listing")
        if not isinstance(listing, dict):
            raise OSError("the push helper did not list the folder")
        if listing.get("unsafe"):
            return {"error": unsafe_text(listing["unsafe"])}
        if listing.get("error") and not listing.get("missing"):
            return {"error": f"cannot read {listing.get('root')}: {listing['error']}"}
        if not listing.get("dir", True):
            return {"error": f"{listing.get('root')}/{folder} is a file"}
        return {"entries": listing.get("entries") or {}, "now": time.time()}

    def serve(self, folder: str, paths: list[str], ask: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            helper = self.listers.get(folder)
        if helper is None:
            return {"error": "nothing listed to serve"}
        helper.say({"serve": {"files": paths, "bind": str(ask["bind"]), "token": str(ask["token"]),
                              "cert": str(ask["cert"]), "key": str(ask["key"])}})
        answer = helper.read()
        if "port" not in answer:
            return {"error": str(answer.get("error") or answer)}
        return {"port": int(answer["port"])}

    def receive(self, folder: str, files: list[Entry], sources: list[dict[str, Any]]) -> dict[str, Any]:
        """``files`` (``[path, kind, size, mode, sha256 or target, mtime_ns]``) from ``sources``
        (``address``, ``port``, ``token``, ``cert``, ``paths``), written as a push writes."""
        paths = [str(f[0]) for f in files]
        if not all(safe_path(p) for p in paths):
            return {"error": "a path outside the folder"}
        helper = Helper(self.argv, self.source, {"targets": [{"root": self.folder(folder), "paths": paths,
                                                              "owner_check": self.owner_check}],
                                                 "idle": HELPER_IDLE_S})
        try:
            survey = (helper.read().get("targets") or [{}])[0]
            if survey.get("unsafe"):
                helper.say({"abort": True})
                return {"error": unsafe_text(survey["unsafe"])}
            if survey.get("error"):
                helper.say({"abort": True})
                return {"error": f"{survey['error']}: {survey.get('path') or survey.get('root')}"}
            plan = {"files": [[0, str(p), str(value) if kind == "file" else "", int(mode), int(mtime) // 1_000_000_000]
                              for p, kind, _size, mode, value, mtime in files],
                    "delete": [], "keep": [[]], "stage": True,  # renamed into place all at once, or none
                    "sources": [{"address": s["address"], "port": s["port"], "token": s["token"], "cert": s["cert"],
                                 "files": [f"0/{p}" for p in s["paths"]]} for s in sources]}
            helper.say(plan)
            helper.write(bytes(1024))  # no tar stream from here: every file comes from a source
            failed: list[str] = []
            replaced: list[str] = []  # renamed into place: a failed copy leaves these new beside old ones
            while True:
                message = helper.read()
                if "err" in message:
                    failed.append(f"{message.get('path')}: {message.get('msg')}")
                elif "ok" in message:
                    replaced.append(str(message["ok"]).split("/", 1)[-1])
                elif "done" in message:
                    return {"written": int(message["done"].get("written") or 0), "failed": failed,
                            "replaced": replaced}
        finally:
            helper.close()

    def end(self) -> None:
        with self.lock:
            helpers = list(self.listers.values())
            self.listers.clear()
        for helper in helpers:
            helper.close()


# =============================================================================== the leader


def sync_folder(ask: Ask, hosts: list[str], folder: str, addresses: dict[str, str], cert: str, key: str,
                failed_at: float | None, margin: float = SUSPECT_MARGIN_S) -> str:
    """Make ``folder`` the same on ``hosts`` (their workers answer ``ask``); the attempt's line:
    what moved, from and to which hosts, how long it took, as ``CheckpointSync.line``."""
    started = time.monotonic()
    try:
        return _sync(ask, hosts, folder, addresses, cert, key, failed_at, margin, started)
    finally:
        ask({h: {"do": "end"} for h in hosts})


def _sync(ask: Ask, hosts: list[str], folder: str, addresses: dict[str, str], cert: str, key: str,
          failed_at: float | None, margin: float, started: float) -> str:
    def failed(why: str) -> str:
        return f"checkpoint {folder}: not made the same ({why}) after {time.monotonic() - started:.1f} s"

    asked = time.time()
    answers = ask({h: {"do": "list", "folder": folder} for h in hosts})
    listings: list[Listing] = []
    for host in hosts:
        answer = answers.get(host) or {"error": "no answer"}
        if "error" in answer:
            return failed(f"{host}: {answer['error']}")
        entries = {str(p): e for p, e in dict(answer.get("entries") or {}).items()
                   if safe_path(str(p)) and e and e[0] in ("file", "link")}
        # the host's clock minus ours, to within the time the question took
        offset = float(answer["now"]) - (asked + time.time()) / 2 if "now" in answer else 0.0
        listings.append((host, entries, offset))
    chosen = choose(listings, failed_at, margin)
    wanted = needs(listings, chosen)
    moving = {p for paths in wanted.values() for p in paths}
    suspect = [p for p, c in chosen.items() if c[2] and p in moving]
    passed = [f"{h}:{p}" for p, c in chosen.items() for h in c[3]]
    if not moving:
        took = time.monotonic() - started
        text = (f"checkpoint {folder}: the same on every host ({len(chosen)} files) in {took:.1f} s"
                if chosen else f"checkpoint {folder}: empty on every host ({took:.1f} s)")
        return text + _remarks(passed, suspect)
    by_source: dict[str, list[str]] = {}
    for path in sorted(moving):
        by_source.setdefault(chosen[path][0], []).append(path)
    token = secrets.token_hex(16)
    served = ask({src: {"do": "serve", "folder": folder, "paths": paths, "bind": addresses.get(src, ""),
                        "token": token, "cert": cert, "key": key} for src, paths in by_source.items()})
    for src in by_source:
        if "port" not in (served.get(src) or {}):
            return failed(f"{src} cannot serve its files: {(served.get(src) or {}).get('error', 'no answer')}")
    targets = [h for h in hosts if wanted[h]]
    requests = {}
    for host in targets:
        files = [[p, *chosen[p][1][:5]] for p in wanted[host]]
        sources = [{"address": addresses[src], "port": served[src]["port"], "token": token, "cert": cert,
                    "paths": [p for p in wanted[host] if chosen[p][0] == src]} for src in by_source]
        requests[host] = {"do": "receive", "folder": folder, "files": files,
                          "sources": [s for s in sources if s["paths"]]}
    received = ask(requests)
    why = ""
    for host in targets:
        answer = received.get(host) or {"error": "no answer"}
        if "error" in answer:
            why = why or f"{host}: {answer['error']}"
        elif answer.get("failed"):
            more = f" and {len(answer['failed']) - 1} more" if len(answer["failed"]) > 1 else ""
            why = why or f"{host}: {answer['failed'][0]}{more}"
    if why:
        return failed(why) + _mixed(targets, wanted, received, {h: e for h, e, _ in listings})
    count = sum(len(wanted[h]) for h in targets)
    size = sum(int(chosen[p][1][1]) for h in targets for p in wanted[h])
    text = (f"checkpoint {folder}: {count} file{'s' if count != 1 else ''} ({human_bytes(size)})"
            f" from {', '.join(h for h in hosts if h in by_source)} to {', '.join(targets)}"
            f" in {time.monotonic() - started:.1f} s (host to host)")
    return text + _remarks(passed, suspect)


def _mixed(targets: list[str], wanted: dict[str, list[str]], received: dict[str, dict[str, Any]],
           had: dict[str, dict[str, Entry]]) -> str:
    """A failed copy's hosts whose folder now mixes new files with old (or missing) ones: each
    file is renamed into place once it arrived whole, so a copy cut short leaves some replaced."""
    parts = []
    for host in targets:
        answer = received.get(host) or {}
        if "replaced" not in answer:
            if "error" in answer or not answer:  # cut off: which arrived is unknown
                parts.append(f"{host} may have new files beside old ones (of {_few(wanted[host])})")
            continue
        done = set(answer["replaced"])
        new = [p for p in wanted[host] if p in done]
        old = [p for p in wanted[host] if p not in done and p in had.get(host, {})]
        missing = [p for p in wanted[host] if p not in done and p not in had.get(host, {})]
        if new and (old or missing):
            beside = [f"old {_few(old)}"] if old else []
            beside += [f"no {_few(missing)}"] if missing else []
            parts.append(f"{host} has new {_few(new)} beside {' and '.join(beside)}")
    return f"; mixed files: {'; '.join(parts)}" if parts else ""


def _few(paths: list[str]) -> str:
    return ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")


def _remarks(passed: list[str], suspect: list[str]) -> str:
    text = ""
    if passed:
        text += f"; written as the job failed, not taken: {', '.join(passed[:5])}"
    if suspect:
        text += f"; only copy written as the job failed: {', '.join(suspect[:5])}"
    return text
