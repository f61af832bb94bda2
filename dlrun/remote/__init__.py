"""Programs that run on the hosts: the agent, the topology probe, the push helper, the
TensorFlow server entry point, a detached job's keeper and jobs program, the bench, and the Horovod
rendezvous (a module the leader keeper loads). Standard library only, Python >= 3.8, nothing
from dlrun: each is shipped as its source, never imported on the host.

One bootstrap ships them all (SSH hosts, localhost, Spark tasks): the command line is
``python3 -c <LOADER> dlrun-<name> [args]`` (over SSH it reaches ``/bin/sh`` on stdin, behind
the login shell's ``exec /bin/sh -s``: ``dlrun.transport.shell``), a few hundred bytes that ``ps`` shows whole, and
the program's source arrives on stdin first (10 ASCII digits of length, then the source).
The loader reads exactly that much with ``os.read``, so the program's own input that follows
is untouched, and runs it as ``__main__`` with ``sys.argv = ["dlrun-<name>", args...]``.
Tracebacks show the program's lines: the loader gives ``linecache`` its source when an exception
leaves the program, and a program that prints one itself calls ``_dlrun_lines()`` first
(``linecache`` imports ``tokenize``: about a millisecond of every host's CPU at every start).
"""

from __future__ import annotations

import binascii
from collections.abc import Sequence
from importlib import resources

#: The host programs, by the name the controller ships them under.
PROGRAMS = ("agent", "probe", "push_helper", "tf_server", "keeper", "jobs", "bench", "stacks")
#: Modules a host program loads from source it was given (keepers: the rank policy, the checkpoint
#: copies of --checkpoint-dir; the leader: the rendezvous, and the stack grouping for a detached
#: --hang-timeout).
MODULES = ("rendezvous", "rankpolicy", "stack_groups", "ckptsync")


def source_of(name: str) -> str:
    """The source of host program (or module) ``name``, read from the installed package (a wheel too)."""
    if name not in PROGRAMS and name not in MODULES:
        raise ValueError(f"no host program {name!r}")
    return resources.files(__name__).joinpath(f"{name}.py").read_text(encoding="utf-8")


#: Where a host keeps the compiled host programs: ``$XDG_CACHE_HOME/dlrun/code`` or ``~/.cache/dlrun/code``.
CODE_CACHE = ("dlrun", "code")

#: Runs on the host (Python >= 3.8): read the program from fd 0, run it as __main__. What comes
#: first may be a stage (a ``+`` and 9 digits of length instead of 10 digits): the code cache,
#: ``CACHE_STAGE``, which defines ``_dlrun_code``; without it the program is compiled.
LOADER = """import os, sys
def _dlrun_read(n):
    b = b""
    while len(b) < n:
        c = os.read(0, n - len(b))
        if not c:
            sys.exit("dlrun: the program did not arrive on stdin")
        b += c
    return b
_dlrun_n = _dlrun_read(10)
if _dlrun_n[:1] == b"+":
    exec(compile(_dlrun_read(int(_dlrun_n[1:])), "<dlrun-loader>", "exec"))
    _dlrun_n = _dlrun_read(10)
_dlrun_raw = _dlrun_read(int(_dlrun_n))
_dlrun_src = _dlrun_raw.decode("utf-8")
sys.argv = sys.argv[1:]
_dlrun_name = "<" + sys.argv[0] + ">"
def _dlrun_lines():
    import linecache
    linecache.cache[_dlrun_name] = (len(_dlrun_src), None, _dlrun_src.splitlines(True), _dlrun_name)
_dlrun_c = _dlrun_code(_dlrun_raw, _dlrun_name) if "_dlrun_code" in globals() else None
try:
    exec(_dlrun_c or compile(_dlrun_src, _dlrun_name, "exec"))
except SystemExit:
    raise
except BaseException:
    _dlrun_lines()
    raise
"""

#: The loader's stage: ``_dlrun_code(source bytes, name)``, the program's compiled code from the
#: login user's cache when a valid entry for this source and interpreter is there, else compiled
#: (and written there). docs/architecture.md, "The code cache"; anything wrong means compile. An
#: entry holds the source it was compiled from, compared byte for byte: no SHA-256 on the host
#: (``hashlib`` loads libcrypto, 3 ms of every host's CPU at every launch); CRC-32 (``binascii``,
#: built in) names the entry and checks the marshalled code. The temporary file's name is random,
#: not the pid: agents in PID namespaces of their own are all pid 1 or 2, and hosts sharing a home
#: (one machine under several names, NFS) write the same folder.
CACHE_STAGE = """def _dlrun_code(raw, name):
    import marshal
    from binascii import crc32
    uid, n = os.geteuid(), len(raw)
    key = "%s-%d-%08x-%s" % (name[1:-1], n, crc32(raw), sys.implementation.cache_tag)
    head, d = ("dlrun-code 2 " + key + "\\n").encode(), -1
    try:
        top = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dlrun", "code")
        os.makedirs(top, 0o700, exist_ok=True)
        d = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        st = os.fstat(d)
        if st.st_uid != uid or st.st_mode & 0o022:
            os.close(d)
            d = -1
        else:
            f = os.open(key, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=d)
            with os.fdopen(f, "rb") as fh:
                st, data = os.fstat(f), fh.read(1 << 24)
            at = len(head) + n
            body = data[at + 8:]
            if (st.st_uid == uid and not st.st_mode & 0o022 and (st.st_mode & 0o170000) == 0o100000
                    and data.startswith(head) and data[len(head):at] == raw
                    and data[at:at + 8] == b"%08x" % crc32(body)):
                code = marshal.loads(body)
                if type(code) is type(_dlrun_code.__code__):
                    os.close(d)
                    return code
    except (OSError, ValueError, EOFError, TypeError):
        pass
    code = compile(raw.decode("utf-8"), name, "exec")
    if d >= 0:
        tmp, f = "%s.%s.tmp" % (key, os.urandom(8).hex()), -1
        try:
            body = marshal.dumps(code)
            f = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=d)
            with os.fdopen(f, "wb") as fh:
                fh.write(head + raw + b"%08x" % crc32(body) + body)
            os.replace(tmp, key, src_dir_fd=d, dst_dir_fd=d)
        except (OSError, ValueError):
            if f >= 0:
                try:
                    os.unlink(tmp, dir_fd=d)
                except OSError:
                    pass
        os.close(d)
    return code
"""


def cache_entry(name: str, source: bytes, cache_tag: str) -> tuple[str, bytes]:
    """(file name, what comes before the checksum) of program ``dlrun-<name>``'s entry in the code
    cache, as the loader makes them for a host whose ``sys.implementation.cache_tag`` is
    ``cache_tag``; the entry is a header line, the source, the CRC-32 of the marshalled code (8
    hex digits), then that code."""
    key = f"dlrun-{name}-{len(source)}-{binascii.crc32(source):08x}-{cache_tag}"
    return key, f"dlrun-code 2 {key}\n".encode() + source


def boot_argv(python: Sequence[str], name: str, *args: str) -> list[str]:
    """The command line that starts host program ``name``: send :func:`boot_payload` first."""
    if name not in PROGRAMS:
        raise ValueError(f"no host program {name!r}")
    return [*python, "-c", LOADER, f"dlrun-{name}", *args]


def boot_payload(name: str) -> bytes:
    """What the loader reads from stdin before the program runs: the code cache's stage (``+``
    and 9 digits of length, then ``CACHE_STAGE``), then the program (10 digits, its source)."""
    stage = CACHE_STAGE.encode("utf-8")
    source = source_of(name).encode("utf-8")
    return b"+%09d" % len(stage) + stage + b"%010d" % len(source) + source
