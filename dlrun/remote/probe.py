"""The topology probe: gathers a host's raw facts and prints them as one JSON document.

Runs on the host (python >= 3.8, standard library only, nothing installed): shipped by
``dlrun topo`` through the remote bootstrap, or run inside the agent by its ``probe`` op. It
never parses what the tools print (that is ``dlrun.topo.parse``'s job) and always prints exactly
one JSON line, even when something inside it fails; a missing tool is recorded as missing.

Gathered: ``nvidia-smi`` (``--query-gpu``, retried with basic fields when a driver refuses one;
``topo -m``; ``-L``; the plain header), the IPv4 addresses (the kernel's netlink dump; where that
fails ``ip -o -4 addr show``, then ``if_nameindex`` + ioctl),
``/proc/net/route``, ``/etc/os-release``, CPU and NUMA counts, the TensorFlow version from
``*.dist-info`` names on ``sys.path``, the InfiniBand and GPU PCI sysfs files under
``$DLRUN_SYSFS_ROOT`` (default ``/``) and ``ibstat`` when sysfs shows no RDMA device. Every command
has a timeout (``$DLRUN_PROBE_TIMEOUT`` seconds, default 30).

``nvidia-smi topo -m`` and the plain header come from the login user's cache
(``~/.cache/dlrun/probe``) while the boot id, the driver's version file, the ``nvidia-smi``
binary, the GPUs the driver lists, the interpreter and this program's source are unchanged
(docs/architecture.md, "The probe cache"); everything else is asked afresh on every run.

Output (``version`` 1): ``{"version", "hostname", "python", "executable", "cpu_count",
"cpu_usable", "numa_nodes", "os_release", "platform", "tensorflow", "frameworks", "sysfs_root", "sysfs":
{path: content}, "commands": {name: {"argv", "path", "rc", "stdout", "stderr", "missing",
"timed_out", "error", "seconds"}}, "interfaces_netlink" (or the ``ip_addr`` command, then
"interfaces_ioctl"), "proc_net_route", "fatal"}``.
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import time

TYPE_CHECKING = False  # typing costs milliseconds on every host: annotations only
if TYPE_CHECKING:
    from typing import Any

VERSION = 1
#: The --query-gpu fields (dlrun.topo.parse.QUERY_GPU_FIELDS) and the basic retry's subset.
QUERY = "index,uuid,name,pci.bus_id,memory.total,driver_version,compute_cap,mig.mode.current"
BASIC = "index,uuid,name,pci.bus_id,memory.total,driver_version"
TF_DISTS = ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tensorflow-macos",
            "tensorflow-intel", "tf-nightly", "tf-nightly-cpu")
DIST_INFO = re.compile(r"^([A-Za-z0-9_.]+)-([^-/]+)\.(?:dist-info|egg-info)$")
PCI = re.compile(r"([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])")
SIOCGIFADDR = 0x8915


GPU_CACHED = ("topo", "header")  # what cannot change while the cache key stays the same
CACHE_HEADER = b"dlrun-probe 2 "


def sysfs_root() -> str:
    return os.environ.get("DLRUN_SYSFS_ROOT") or "/"


def command_timeout() -> float:
    try:
        return float(os.environ.get("DLRUN_PROBE_TIMEOUT") or 30)
    except ValueError:
        return 30.0


def text(data: bytes | None) -> str:
    return "" if data is None else data.decode("utf-8", "replace")


def which(name: str) -> str | None:
    """shutil.which for a bare name, without importing shutil (the probe runs on every launch)."""
    for folder in os.environ.get("PATH", os.defpath).split(os.pathsep):
        path = os.path.join(folder or ".", name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def run(argv: list[str], timeout: float) -> dict[str, Any]:
    result: dict[str, Any] = {"argv": list(argv), "missing": False, "timed_out": False}
    path = which(argv[0])
    if path is None:
        result["missing"] = True
        return result
    result["path"] = path
    env = dict(os.environ)
    env["LC_ALL"] = "C"
    start = time.time()
    try:
        proc = subprocess.run([path, *argv[1:]], stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=timeout, env=env)
        result["rc"] = proc.returncode
        result["stdout"] = text(proc.stdout)
        result["stderr"] = text(proc.stderr)
    except subprocess.TimeoutExpired as exc:
        result["timed_out"] = True
        result["timeout"] = timeout
        result["stdout"] = text(exc.stdout)
        result["stderr"] = text(exc.stderr)
    except (OSError, ValueError) as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    result["seconds"] = round(time.time() - start, 3)
    return result


def run_all(jobs: list[tuple[str, list[str], float]]) -> dict[str, dict[str, Any]]:
    """Run the jobs in parallel threads; their results by name. A missing tool is answered at
    once, and a single tool left runs in this thread (no thread, no threading import: most
    hosts have no nvidia-smi or ibstat, and the probe runs on every launch)."""
    out: dict[str, dict[str, Any]] = {}
    left = []
    for name, argv, timeout in jobs:
        if which(argv[0]) is None:
            out[name] = {"argv": list(argv), "missing": True, "timed_out": False}
        else:
            left.append((name, argv, timeout))
    if len(left) == 1:
        name, argv, timeout = left[0]
        out[name] = run(argv, timeout)
        return out

    def work(name: str, argv: list[str], timeout: float) -> None:
        out[name] = run(argv, timeout)

    import threading

    threads = [threading.Thread(target=work, args=job, daemon=True) for job in left]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {name: out[name] for name, _argv, _timeout in jobs}


def rel(path: str) -> str:
    return os.path.relpath(path, sysfs_root()).replace(os.sep, "/")


def read(path: str, limit: int = 65536) -> str | None:
    try:
        with open(path, "rb") as handle:
            return text(handle.read(limit))
    except (OSError, ValueError):
        return None


def listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def collect_ib(sysfs: dict[str, str]) -> list[str]:
    """Copy each RDMA device's sysfs files into ``sysfs``; the device names."""
    base = os.path.join(sysfs_root(), "sys", "class", "infiniband")
    devices = listdir(base)
    for dev in devices:
        ddir = os.path.join(base, dev)
        for name in ("hca_type", "fw_ver", "board_id", "node_guid", "device/numa_node"):
            content = read(os.path.join(ddir, name))
            if content is not None:
                sysfs[rel(os.path.join(ddir, name))] = content
        link = os.path.join(ddir, "device")
        if os.path.exists(link):
            sysfs[rel(link)] = os.path.realpath(link)
        netdir = os.path.join(ddir, "device", "net")
        for netdev in listdir(netdir):
            sysfs[rel(os.path.join(netdir, netdev))] = ""
            for attr in ("dev_port", "dev_id"):
                content = read(os.path.join(netdir, netdev, attr))
                if content is not None:
                    sysfs[rel(os.path.join(netdir, netdev, attr))] = content
        for port in listdir(os.path.join(ddir, "ports")):
            for attr in ("state", "phys_state", "rate", "link_layer"):
                path = os.path.join(ddir, "ports", port, attr)
                sysfs[rel(path)] = read(path) or ""
    return devices


def collect_gpu_numa(sysfs: dict[str, str], query_stdout: str) -> None:
    """Each GPU's ``numa_node`` file, for the PCI addresses the query printed."""
    for match in PCI.finditer(query_stdout):
        dom, bus, dev, fn = match.groups()
        addr = f"{int(dom, 16):04x}:{bus.lower()}:{dev.lower()}.{fn}"
        path = os.path.join(sysfs_root(), "sys", "bus", "pci", "devices", addr, "numa_node")
        content = read(path)
        if content is not None:
            sysfs[rel(path)] = content


def numa_nodes() -> list[int]:
    names = listdir(os.path.join(sysfs_root(), "sys", "devices", "system", "node"))
    return sorted(int(n[4:]) for n in names if n.startswith("node") and n[4:].isdigit())


def dist_infos() -> list[tuple[str, str]]:
    """(normalized name, version) of every ``*.dist-info``/``*.egg-info`` folder on sys.path, in
    sys.path order: importlib.metadata's names without its scan of every distribution. Read once
    per probe (each folder is listed once; only names with the suffix meet the pattern)."""
    out = []
    for entry in sys.path:
        for name in listdir(entry or "."):
            if name.endswith("-info"):
                match = DIST_INFO.match(name)
                if match:
                    out.append((match.group(1).lower().replace("-", "_").replace(".", "_"), match.group(2)))
    return out


def tensorflow_version(infos: list[tuple[str, str]] | None = None) -> dict[str, str] | None:
    """The installed TensorFlow distribution's name and version (``infos``: ``dist_infos()``)."""
    wanted = {d.replace("-", "_"): d for d in TF_DISTS}
    found: dict[str, str] = {}
    for name, version in dist_infos() if infos is None else infos:
        dist = wanted.get(name)
        if dist is not None and dist not in found:
            found[dist] = version
    for dist in TF_DISTS:
        if dist in found:
            return {"dist": dist, "version": found[dist]}
    return None


def dist_versions(names: tuple[str, ...], infos: list[tuple[str, str]] | None = None) -> dict[str, str]:
    """Versions of these distributions (normalized names), the first found on sys.path winning
    as an import would (``infos``: ``dist_infos()``)."""
    wanted = {n.replace("-", "_").lower() for n in names}
    found: dict[str, str] = {}
    for dist, version in dist_infos() if infos is None else infos:
        if dist in wanted and dist not in found:
            found[dist] = version
    return found


TORCH_CUDA = re.compile(r"""^cuda\s*(?::[^=]*)?=\s*['"]([^'"]+)['"]""", re.M)
NCCL_DISTS = ("nvidia_nccl_cu13", "nvidia_nccl_cu12", "nvidia_nccl_cu11")


def frameworks(infos: list[tuple[str, str]] | None = None) -> dict[str, Any]:
    """torch's version with its CUDA build and NCCL, Keras and tf_keras: what must agree across
    hosts. Read from metadata and ``torch/version.py`` as text, never by importing torch."""
    versions = dist_versions(("torch", "keras", "tf_keras", *NCCL_DISTS), infos)
    out: dict[str, Any] = {"keras": versions.get("keras"), "tf_keras": versions.get("tf_keras")}
    if "torch" in versions:
        cuda = None
        for entry in sys.path:
            source = read(os.path.join(entry or ".", "torch", "version.py"))
            if source is not None:
                match = TORCH_CUDA.search(source)
                cuda = match.group(1) if match else None
                break
        nccl = next((versions[d] for d in NCCL_DISTS if d in versions), None)
        out["torch"] = {"version": versions["torch"], "cuda": cuda, "nccl": nccl}
    return out


RTM_NEWADDR, RTM_GETADDR = 20, 22
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLM_F_REQUEST, NLM_F_DUMP, NLM_F_DUMP_INTR = 0x1, 0x300, 0x10
IFA_ADDRESS, IFA_LOCAL = 1, 2


def interfaces_netlink(timeout: float = 5.0) -> list[dict[str, Any]] | None:
    """Each interface's IPv4 addresses as ``ip -o -4 addr show`` lists them (interfaces and
    addresses in the kernel's order, down interfaces too, none without an address), from the
    kernel's RTM_GETADDR dump over a netlink socket: no process. None where netlink cannot answer
    whole (no AF_NETLINK, a refused socket, an error, an interrupted dump, a cut reply, a
    timeout): the caller then runs ``ip``."""
    try:
        import socket

        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
    except (ImportError, AttributeError, OSError):
        return None
    header, ifaddr = struct.Struct("=IHHII"), struct.Struct("=BBBBI")
    by_index: dict[int, list[str]] = {}
    try:
        sock.settimeout(timeout)
        sock.bind((0, 0))
        own, seq = sock.getsockname()[0], 1
        request = ifaddr.pack(socket.AF_INET, 0, 0, 0, 0)
        sock.sendto(header.pack(header.size + len(request), RTM_GETADDR, NLM_F_REQUEST | NLM_F_DUMP, seq, 0)
                    + request, (0, 0))
        done = False
        while not done:
            data, _, flags, _ = sock.recvmsg(1 << 16)
            if flags & socket.MSG_TRUNC or not data:
                return None
            pos = 0
            while pos + header.size <= len(data) and not done:
                length, kind, msg_flags, msg_seq, pid = header.unpack_from(data, pos)
                if length < header.size or pos + length > len(data):
                    return None
                body, end, pos = pos + header.size, pos + length, (pos + length + 3) & ~3
                if msg_seq != seq or pid != own:
                    continue
                if kind == NLMSG_ERROR or msg_flags & NLM_F_DUMP_INTR:
                    return None
                done = kind == NLMSG_DONE
                if done and end - body >= 4 and struct.unpack_from("=i", data, body)[0] < 0:
                    return None  # a dump the kernel ended with an error (as `ip` reads NLMSG_DONE)
                if kind == RTM_NEWADDR and end - body >= ifaddr.size:
                    family, _, _, _, index = ifaddr.unpack_from(data, body)
                    address = ifa_address(data, body + ifaddr.size, end)
                    if family == socket.AF_INET and address:
                        by_index.setdefault(index, []).append(socket.inet_ntoa(address))
        out = []
        for index, addresses in by_index.items():
            try:  # named now: one that went away since is left out, as `ip` (its own dump) leaves it
                out.append({"name": socket.if_indextoname(index), "ipv4": addresses})
            except OSError:
                pass
        return out
    except OSError:  # socket.timeout too
        return None
    finally:
        sock.close()


def ifa_address(data: bytes, at: int, end: int) -> bytes | None:
    """The address of one RTM_NEWADDR message's attributes: IFA_LOCAL, else IFA_ADDRESS (for a
    point-to-point link IFA_ADDRESS is the peer; ``ip`` prints the local one first)."""
    found: dict[int, bytes] = {}
    while at + 4 <= end:
        size, kind = struct.unpack_from("=HH", data, at)
        if size < 4 or at + size > end:
            break
        if kind in (IFA_ADDRESS, IFA_LOCAL) and size == 8:
            found[kind] = data[at + 4:at + 8]
        at += (size + 3) & ~3
    return found.get(IFA_LOCAL) or found.get(IFA_ADDRESS)


def interfaces_ioctl() -> list[dict[str, Any]]:
    """IPv4 interfaces from the kernel directly, for hosts without a usable ``ip``."""
    try:
        import fcntl
        import socket
    except ImportError:
        return []
    out: list[dict[str, Any]] = []
    try:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    except OSError:
        return out
    try:
        for _, name in socket.if_nameindex():
            addrs: list[str] = []
            try:
                packed = struct.pack("256s", name.encode("utf-8")[:15])
                res = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, packed)
                addrs.append(socket.inet_ntoa(res[20:24]))
            except OSError:
                pass
            out.append({"name": name, "ipv4": addrs})
    except (AttributeError, OSError):
        pass
    finally:
        sock.close()
    return out


# --------------------------------------------------------------------------- the GPU cache


def own_source() -> bytes | None:
    """This program's source: the loader's copy, the agent's, or the file run as a script."""
    raw = globals().get("_dlrun_raw")
    if isinstance(raw, bytes):
        return raw
    source = globals().get("__dlrun_source__")
    if isinstance(source, str):
        return source.encode("utf-8")
    path = globals().get("__file__")
    try:
        with open(str(path), "rb") as handle:
            return handle.read()
    except (OSError, TypeError):
        return None


def gpu_cache_key(smi: str) -> str | None:
    """What the cached ``nvidia-smi`` answers depend on, as text (an entry repeats it whole);
    None where it cannot be told (no boot id, no source)."""
    from binascii import crc32

    boot_id = read("/proc/sys/kernel/random/boot_id")
    source = own_source()
    if not boot_id or source is None:
        return None
    try:
        st = os.stat(smi)
    except OSError:
        return None
    parts = [
        "boot " + boot_id.strip(),
        "driver " + repr(read("/proc/driver/nvidia/version")),
        "gpus " + repr(listdir("/proc/driver/nvidia/gpus")),
        "devices " + repr([n for n in listdir("/dev") if n.startswith("nvidia")]),
        f"smi {os.path.realpath(smi)} {st.st_size} {st.st_mtime_ns} {st.st_ctime_ns} {st.st_ino}",
        f"python {sys.executable} {sys.version}",
        "sysfs " + sysfs_root(),
        f"uid {os.geteuid()}",
        f"probe {len(source)} {crc32(source):08x}",
    ]
    return "\n".join(parts)


def gpu_cache_head(key: str) -> tuple[str, bytes]:
    """(file name, header) of ``key``'s entry: named by the key's CRC-32 and length, it starts
    with the key itself, then the CRC-32 of the answers (8 hex digits), then the answers (JSON).
    CRC-32, not SHA-256: ``hashlib`` loads libcrypto, 3 ms of every GPU host's CPU per launch."""
    from binascii import crc32

    raw = key.encode("utf-8", "surrogateescape")
    name = f"{crc32(raw):08x}-{len(raw)}"
    return name, CACHE_HEADER + name.encode() + b"\n" + raw + b"\n"


def _cache_dir(create: bool) -> int | None:
    """The cache folder, opened, when it is the user's own and no one else may write to it."""
    top = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dlrun", "probe")
    try:
        if create:
            os.makedirs(top, 0o700, exist_ok=True)
        fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        os.close(fd)
        return None
    return fd


def read_gpu_cache(key: str) -> dict[str, Any] | None:
    """The cached answers for ``key``: only from a regular file of the user's own, mode 0600 or
    less, one link, whose header repeats ``key`` and whose checksum checks out."""
    from binascii import crc32

    d = _cache_dir(False)
    if d is None:
        return None
    name, head = gpu_cache_head(key)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=d)
        with os.fdopen(fd, "rb") as handle:
            st = os.fstat(handle.fileno())
            data = handle.read(1 << 22)
    except OSError:
        return None
    finally:
        os.close(d)
    body = data[len(head) + 8:]
    if (st.st_uid != os.geteuid() or st.st_mode & 0o077 or (st.st_mode & 0o170000) != 0o100000
            or st.st_nlink != 1 or not data.startswith(head)
            or data[len(head):len(head) + 8] != b"%08x" % crc32(body)):
        return None
    try:
        found = json.loads(body.decode("utf-8"))
    except ValueError:
        return None
    if (not isinstance(found, dict) or sorted(found) != sorted(GPU_CACHED)
            or not all(isinstance(value, dict) for value in found.values())):
        return None
    return found


def write_gpu_cache(key: str, answers: dict[str, Any]) -> None:
    """Store ``answers`` under ``key`` (atomically, mode 0600); a failure leaves no entry."""
    from binascii import crc32

    d = _cache_dir(True)
    if d is None:
        return
    name, head = gpu_cache_head(key)
    body = json.dumps(answers, sort_keys=True).encode("utf-8")
    # random, not the pid: agents in PID namespaces of their own share pids, hosts share homes
    tmp, fd = f"{name}.{os.urandom(8).hex()}.tmp", -1
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=d)
        with os.fdopen(fd, "wb") as handle:
            handle.write(head + b"%08x" % crc32(body) + body)
        os.replace(tmp, name, src_dir_fd=d, dst_dir_fd=d)
        prune_gpu_cache(d)
    except OSError:
        if fd >= 0:  # never another writer's file
            try:
                os.unlink(tmp, dir_fd=d)
            except OSError:
                pass
    finally:
        os.close(d)


def prune_gpu_cache(d: int, keep: int = 1024) -> None:
    """Keeps the newest ``keep`` entries (each boot leaves one; a shared home holds many hosts')."""
    names = os.listdir(d)
    if len(names) <= keep:
        return
    aged = []
    for name in names:
        try:
            aged.append((os.stat(name, dir_fd=d, follow_symlinks=False).st_mtime_ns, name))
        except OSError:
            pass
    for _, name in sorted(aged)[:len(aged) - keep]:
        try:
            os.unlink(name, dir_fd=d)
        except OSError:
            pass


def answered(result: dict[str, Any]) -> bool:
    return result.get("rc") == 0 and not result.get("missing") and not result.get("timed_out")


def gather(doc: dict[str, Any]) -> None:
    """Fill ``doc`` with everything the probe reports (may raise: the caller notes it)."""
    timeout = command_timeout()
    uname = os.uname()
    doc["hostname"] = uname.nodename
    doc["python"] = ".".join(str(v) for v in sys.version_info[:3])
    doc["executable"] = sys.executable
    doc["platform"] = f"{uname.sysname}-{uname.release}-{uname.machine}"
    doc["cpu_count"] = os.cpu_count()
    try:
        doc["cpu_usable"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        doc["cpu_usable"] = None
    doc["os_release"] = read("/etc/os-release") or read("/usr/lib/os-release")
    doc["proc_net_route"] = read("/proc/net/route")
    doc["numa_nodes"] = numa_nodes()
    sysfs: dict[str, str] = {}
    doc["sysfs"] = sysfs
    ib_devices = collect_ib(sysfs)
    jobs: list[tuple[str, list[str], float]] = [
        ("query_gpu", ["nvidia-smi", "--query-gpu=" + QUERY, "--format=csv"], timeout),
        ("topo", ["nvidia-smi", "topo", "-m"], timeout),
        ("list", ["nvidia-smi", "-L"], timeout),
        ("header", ["nvidia-smi"], timeout),
    ]
    netlink = interfaces_netlink(min(timeout, 5.0))
    if netlink is None:
        jobs.append(("ip_addr", ["ip", "-o", "-4", "addr", "show"], min(timeout, 5.0)))
    else:
        doc["interfaces_netlink"] = netlink
    if not ib_devices:
        jobs.append(("ibstat", ["ibstat"], min(timeout, 10.0)))
    smi = which("nvidia-smi")
    key = gpu_cache_key(smi) if smi else None
    cached = read_gpu_cache(key) if key else None
    if cached is not None:
        jobs = [job for job in jobs if job[0] not in GPU_CACHED]
    commands = run_all(jobs)
    if cached is not None:
        commands.update({name: dict(cached[name], cached=True) for name in GPU_CACHED})
    elif (key is not None and all(answered(commands[name]) for name in GPU_CACHED)
          and gpu_cache_key(smi or "") == key):  # nothing changed while nvidia-smi ran
        write_gpu_cache(key, {name: commands[name] for name in GPU_CACHED})
    query = commands["query_gpu"]
    if not query["missing"] and query.get("rc") not in (0, None):
        commands["query_gpu_full"] = query
        query = run(["nvidia-smi", "--query-gpu=" + BASIC, "--format=csv"], timeout)
        commands["query_gpu"] = query
    doc["commands"] = commands
    collect_gpu_numa(sysfs, str(query.get("stdout") or ""))
    infos = dist_infos()
    doc["tensorflow"] = tensorflow_version(infos)
    doc["frameworks"] = frameworks(infos)
    ip_addr = commands.get("ip_addr")
    if ip_addr is not None and (ip_addr.get("rc") != 0 or not str(ip_addr.get("stdout") or "").strip()):
        doc["interfaces_ioctl"] = interfaces_ioctl()


def main() -> None:
    doc: dict[str, Any] = {"version": VERSION, "sysfs_root": sysfs_root(),
                           "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    try:
        gather(doc)
    except Exception as exc:  # the caller must always get a document
        import traceback

        globals().get("_dlrun_lines", lambda: None)()  # the loader's source, for the lines shown
        doc["fatal"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    sys.stdout.write(json.dumps(doc, sort_keys=True) + "\n")
    sys.stdout.flush()


# a program of its own (the bootstrap runs it as __main__), or run inside the agent's probe op
if __name__ in ("__main__", "__dlrun_probe__"):
    main()
