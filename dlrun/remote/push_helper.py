"""The push helper: runs on each host for one push, standard library only, Python >= 3.8.

Shipped by the bootstrap (``dlrun.remote.boot_argv``/``boot_payload``), never imported on the
host. It answers the push's survey (what the host has at the pushed paths, free space, a
permission problem), then receives the plan and one tar stream, and writes each file under a
temporary name, verifies its sha256 and renames it into place. The protocol is described in
``dlrun.push.session``; ``dlrun.remote.agent`` runs this module's :func:`survey` in-process
for a launch's first question.

The same helper runs the other way for ``dlrun pull`` and ``--checkpoint-dir``
(``dlrun.push.pull``): a request with ``"send"`` gets the listing of a tree (every file's
size, mode, sha256 and mtime, links as links, and the host's clock), then a list of paths, and
answers with one tar stream of exactly those files, as they were listed (over the TLS side
channel dlrun offers with the list, ``side_channel``, where it can be reached); or, asked to
``serve``, listens (TLS, a token) and gives those files to other hosts' push helpers, which
fetch them when their plan names ``sources`` (host-to-host checkpoint copies).
"""

from __future__ import annotations

import _thread
import io
import json
import os
import signal
import stat
import sys
import time

TYPE_CHECKING = False  # typing costs milliseconds on every host (each launch's survey): annotations only
if TYPE_CHECKING:
    from types import FrameType
    from typing import Any, Dict, List, Tuple

    # A record: per pushed path, ["link"] or [size, mtime_ns, ctime_ns, inode, sha256]
    Record = Dict[str, List[Any]]
    # One survey entry: [kind, size, mode, sha256 or link target, pushed by dlrun]
    Entry = List[Any]
    PlanItem = Tuple[int, str, str, int, int]  # target, path, sha256, mode, mtime

IN: io.BufferedReader = sys.stdin.buffer  # type: ignore[assignment]  # stdin's buffer is one
PART = ".dlrun-part-"
TEMPS: list[str] = []
IDLE = [0]  # seconds without a byte from dlrun after which the helper gives up (0: never)


def heard() -> None:
    # re-arm the idle alarm: a helper whose dlrun vanished (host cut off, no EOF ever comes)
    # ends, and its partial file goes with it
    if IDLE[0]:
        signal.alarm(IDLE[0])


def say(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def resolve(root: str) -> str:
    return os.path.normpath(os.path.join(os.path.expanduser("~"), os.path.expanduser(root)))


def record_file(root: str) -> str:
    parent, name = os.path.split(root)
    return os.path.join(parent, ".dlrun-cache", name + ".json")


def temp_for(final: str) -> str:
    # per helper process: two hosts that share a workdir (one machine under two names, an NFS
    # home) may write the same file at once, and each must rename its own temporary file
    folder, name = os.path.split(final)
    return os.path.join(folder, f"{PART}{tag(name)}-{os.getpid()}")


def stamp(st: os.stat_result) -> list[Any]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


# One buffer for the files hashed one after another: a fresh megabyte per read costs its page
# faults (listing 50 MB: 0.058 -> 0.042 s of CPU). A second thread at once gets its own.
HASH_BUF = memoryview(bytearray(1 << 20))
HASH_LOCK = _thread.allocate_lock()


def sha256_of(path: str) -> str:
    import hashlib  # here, not at the top: libcrypto costs 3 ms, and a survey with nothing changed hashes nothing

    digest = hashlib.sha256()
    mine = HASH_LOCK.acquire(False)
    buf = HASH_BUF if mine else memoryview(bytearray(1 << 20))
    try:
        with open(path, "rb", buffering=0) as fh:
            while True:
                n = fh.readinto(buf)
                if not n:
                    break
                digest.update(buf[:n])
    finally:
        if mine:
            HASH_LOCK.release()
    return digest.hexdigest()


def nearest_existing(path: str) -> str:
    while not os.path.lexists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def under_link(root: str, rel: str, seen: dict[str, bool]) -> bool:
    # True when a directory between root and rel is a symlink (or not a directory): nothing
    # there is read, written or deleted through it. ``seen`` caches the answer per directory.
    folder = os.path.dirname(rel)
    if not folder:
        return False
    if folder not in seen:
        linked = under_link(root, folder, seen)
        if not linked:
            try:
                linked = not stat.S_ISDIR(os.lstat(os.path.join(root, folder)).st_mode)
            except OSError:
                linked = False  # missing: nothing below it exists either
        seen[folder] = linked
    return seen[folder]


def user_name(uid: int) -> str:
    try:
        import pwd
        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return f"uid {uid}"


def own_group(st: os.stat_result, uid: int) -> bool:
    # a group only this user is in (a user private group, umask 002): its write bit lets no one else in
    try:
        import grp
        import pwd
        me = pwd.getpwuid(uid)
        group = grp.getgrgid(st.st_gid)
    except (ImportError, KeyError):
        return False
    return st.st_gid == me.pw_gid and group.gr_name == me.pw_name and set(group.gr_mem) <= {me.pw_name}


def user_namespace_overflow() -> int | None:
    # in a user namespace (the agent's, for its PID namespace) a file of an unmapped user, root
    # included, shows as the overflow uid: that owner is unknown. None outside one.
    try:
        with open("/proc/self/uid_map") as fh:
            fields = fh.read().split()
        if fields[:3] == ["0", "0", "4294967295"]:
            return None
        with open("/proc/sys/fs/overflowuid") as fh:
            return int(fh.read())
    except (OSError, ValueError, IndexError):
        return None


def unsafe_folders(root: str) -> tuple[list[list[str]], bool]:
    # As OpenSSH's StrictModes asks of ~/.ssh: the pushed folder and every folder above it (as
    # resolved: links followed) belong to this user or root, and no one else may write there, except
    # in a sticky folder above the pushed one (/tmp). Else another user could plant code the job
    # runs (<workdir>/<project>/json.py) or swap a folder for theirs. [path, what is wrong, fix]
    # each; and whether an owner could not be seen (a user namespace): the push helper, outside
    # one, must look again.
    uid = os.geteuid()
    overflow = user_namespace_overflow()
    path = nearest_existing(root)
    leaf = path == root
    near = 2  # the pushed folder and the workdir: their owner must be known
    problems = []
    unsure = False
    current = os.path.realpath(path)
    while True:
        try:
            st = os.stat(current)
        except OSError:
            break
        mode = stat.S_IMODE(st.st_mode)
        sticky_ok = bool(mode & stat.S_ISVTX) and not leaf
        owner_ok = st.st_uid in (uid, 0)
        if not owner_ok and st.st_uid == overflow:  # root or another user: the mode must say enough
            owner_ok = True
            unsure = unsure or near > 0
        if not owner_ok:
            problems.append([current, f"is owned by {user_name(st.st_uid)}, not by {user_name(uid)}",
                             "use a workdir of your own (workdir in the inventory), or remove it"])
        elif mode & 0o002 and not sticky_ok:
            problems.append([current, f"is writable by every user (mode {mode:04o})", "chmod o-w " + current])
        elif mode & 0o020 and not sticky_ok and not own_group(st, uid):
            problems.append([current, f"is writable by group {group_name(st.st_gid)} (mode {mode:04o})",
                             "chmod g-w " + current])
        leaf = False
        near -= 1
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    return problems, unsure


def group_name(gid: int) -> str:
    try:
        import grp
        return grp.getgrgid(gid).gr_name
    except (ImportError, KeyError):
        return f"gid {gid}"


def load_record(root: str) -> Record:
    try:
        with open(record_file(root)) as fh:
            loaded = json.load(fh)
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


CLAIM_PREFIX = ".dlrun-claim-"
CLAIM_MAX_AGE = 600.0  # seconds: an older claim file is an earlier launch's, removed by the next claim


def tag(text: str) -> str:
    """A short name for ``text`` in a file name (16 hex digits: two CRC-32s)."""
    from binascii import crc32

    raw = text.encode("utf-8", "surrogateescape")
    return f"{crc32(raw):08x}{crc32(raw[::-1]):08x}"


def claim(root: str, token: str, claimant: str) -> str | None:
    """Which host of this launch (``token``) claimed the folder ``root`` first, itself or another:
    hosts that see one folder (an NFS home) get the same answer. The claim is a file in ``root``,
    or its nearest folder that exists, made with ``link`` (atomic, on NFS too) and holding the
    claimant's name. None when no claim could be made or read."""
    base = nearest_existing(root)
    rest = os.path.relpath(root, base)
    marker = os.path.join(base, CLAIM_PREFIX + token + ("" if rest == "." else "-" + tag(rest)))
    mine = f"{marker}.{os.getpid()}.{tag(claimant)}"
    try:
        now = time.time()
        for name in os.listdir(base):  # earlier launches' claims (another host's may come and go now)
            path = os.path.join(base, name)
            try:
                if name.startswith(CLAIM_PREFIX) and now - os.lstat(path).st_mtime > CLAIM_MAX_AGE:
                    os.unlink(path)
            except OSError:
                pass
        with open(mine, "w") as fh:
            fh.write(claimant)
        try:
            os.link(mine, marker)
            return claimant
        except FileExistsError:
            with open(marker) as fh:
                return fh.read() or None
        finally:
            os.unlink(mine)
    except OSError:
        return None


def unclaim(root: str) -> None:
    """Remove the claim files in ``root`` and its nearest folder that exists. A concurrent
    launch's claim may go too: its hosts then each push, as without claims."""
    for folder in {nearest_existing(root), root}:
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            if name.startswith(CLAIM_PREFIX):
                try:
                    os.unlink(os.path.join(folder, name))
                except OSError:
                    pass


# =============================================================================== versions (tree-atomic push)
#
# A code target (``versioned`` in its spec) lives in <workdir>/.dlrun-versions/<project>/<id>/,
# and <workdir>/<project> is a symlink to the current one. A push builds ``next`` there (a clone
# of the current tree by hard links, then the plan's writes and deletions), then renames it to a
# new id and swaps the symlink with one rename: a host holds the old tree or the new one, whole.
# A push cut off leaves ``next`` (and ``next.json``, its record) for the next push to resume.
# The mechanism is in docs/push.md.

VERSIONS = ".dlrun-versions"
NEXT = "next"
VERSION_PREFIX = "v-"
COLLECTING = ".collecting"  # <version>.collecting: a push removes that version now (``agent.COLLECTING``)


def versions_dir(root: str) -> str:
    parent, name = os.path.split(root)
    return os.path.join(parent, VERSIONS, name)


def can_version(root: str) -> bool:
    # the swap needs the workdir writable (a symlink and the versions folder go there)
    # and the folder or link there ours: another user's cannot be moved aside (--insecure-workdir)
    # (a link the user made to a folder elsewhere stays theirs: that folder is written in place)
    parent = nearest_existing(os.path.dirname(root))
    try:
        st = os.lstat(root)
        if st.st_uid != os.geteuid():
            return False
        if stat.S_ISLNK(st.st_mode) and os.path.dirname(os.path.realpath(root)) != os.path.realpath(versions_dir(root)):
            return False
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK)


def base_is_root(root: str) -> bool:
    return not os.path.lexists(os.path.join(versions_dir(root), NEXT))


def tree_base(root: str, versioned: bool) -> tuple[str, Record]:
    """The tree a push starts from, and its record: an interrupted push's ``next``, else the root."""
    if versioned:
        stage = os.path.join(versions_dir(root), NEXT)
        try:
            if stat.S_ISDIR(os.lstat(stage).st_mode):
                # without its record (the helper itself was killed), the current tree's: next's
                # files cloned from it are the same inodes, so what a push wrote is still known
                return stage, load_path(stage + ".json") if os.path.exists(stage + ".json") else load_record(root)
        except OSError:
            pass
    return root, load_record(root)


def load_path(path: str) -> Record:
    try:
        with open(path) as fh:
            loaded = json.load(fh)
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def save_path(path: str, record: Record) -> None:
    try:
        temp = f"{path}.{os.getpid()}.tmp"
        with os.fdopen(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600), "w") as fh:
            json.dump(record, fh)
        os.replace(temp, path)
    except OSError:
        pass


def lock_versions(vdir: str) -> Any:
    """Hold ``<versions>/lock`` (flock) while building: a second push to this folder waits."""
    os.makedirs(vdir, mode=0o700, exist_ok=True)
    os.chmod(os.path.dirname(vdir), 0o700)
    fd = os.open(os.path.join(vdir, "lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        import fcntl
        fcntl.flock(fd, fcntl.LOCK_EX)
    except (ImportError, OSError):
        pass
    return fd


def carry(src: str, dst: str, skip: set[str], modes: list[tuple[str, int]],
          eager: bool = True) -> dict[str, os.stat_result]:
    """Bring every file, link and folder of ``src`` that ``dst`` lacks into ``dst``, files as hard
    links (a copy where linking fails), never through a link, except paths in ``skip`` (and
    temporary and claim files). Returns the carried files' new stats by path; ``modes`` gets
    each folder made and its mode (set at the end: the build needs to write there)."""
    carried: dict[str, os.stat_result] = {}
    if not os.path.isdir(src):
        return carried
    device = os.stat(src).st_dev
    for folder, dirs, files in os.walk(src):
        for name in list(dirs):  # a filesystem mounted inside the tree is not the push's to copy
            try:
                if os.lstat(os.path.join(folder, name)).st_dev != device:
                    dirs.remove(name)
            except OSError:
                dirs.remove(name)
        rel_folder = os.path.relpath(folder, src)
        rel_folder = "" if rel_folder == "." else rel_folder
        names = list(files)
        for name in list(dirs):
            if os.path.islink(os.path.join(folder, name)):
                dirs.remove(name)
                names.append(name)
        for name in list(dirs):
            rel = f"{rel_folder}/{name}" if rel_folder else name
            target = os.path.join(dst, rel)
            try:
                st = os.lstat(target)
                if not stat.S_ISDIR(st.st_mode):
                    dirs.remove(name)  # the new tree has a file or link there: its own
                continue
            except FileNotFoundError:
                pass
            if rel in skip:
                dirs.remove(name)
                continue
            if not eager:  # made when a file below it is carried: a folder the push emptied stays gone
                continue
            try:
                mode = stat.S_IMODE(os.lstat(os.path.join(folder, name)).st_mode)
                os.mkdir(target, 0o700)
                modes.append((target, mode))
            except OSError:
                dirs.remove(name)
        for name in names:
            if name.startswith(PART) or name.startswith(CLAIM_PREFIX):
                continue
            if not eager and os.path.basename(folder) == "__pycache__":
                continue  # bytecode: the push dropped what its new sources make stale
            rel = f"{rel_folder}/{name}" if rel_folder else name
            path, target = os.path.join(folder, name), os.path.join(dst, rel)
            if rel in skip or os.path.lexists(target):
                continue
            try:
                st = os.lstat(path)
                if not eager:
                    make_parents(src, dst, rel_folder, modes)
                if stat.S_ISLNK(st.st_mode):
                    os.symlink(os.readlink(path), target)
                elif stat.S_ISREG(st.st_mode):
                    try:
                        os.link(path, target)
                    except OSError:
                        copy_file(path, target, st)
                    carried[rel] = os.lstat(target)
            except OSError:
                continue
    return carried


def make_parents(src: str, dst: str, rel_folder: str, modes: list[tuple[str, int]]) -> None:
    path = ""
    for part in rel_folder.split("/") if rel_folder else ():
        path = f"{path}/{part}" if path else part
        target = os.path.join(dst, path)
        if not os.path.lexists(target):
            os.mkdir(target, 0o700)
            modes.append((target, stat.S_IMODE(os.lstat(os.path.join(src, path)).st_mode)))


def copy_file(path: str, target: str, st: os.stat_result) -> None:
    import shutil
    temp = temp_for(target)
    TEMPS.append(temp)
    try:
        shutil.copyfile(path, temp, follow_symlinks=False)
        os.chmod(temp, stat.S_IMODE(st.st_mode))
        os.utime(temp, ns=(st.st_atime_ns, st.st_mtime_ns))
        os.rename(temp, target)
    finally:
        TEMPS.remove(temp)
        if os.path.lexists(temp):
            os.unlink(temp)


def restamp(root: str, record: Record) -> None:
    # a hard link changes the file's ctime, and a copy is a new inode: the digest still holds
    for rel, old in list(record.items()):
        if len(old) != 5:
            continue
        try:
            st = os.lstat(os.path.join(root, rel))
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and old[0] == st.st_size and old[1] == st.st_mtime_ns:
            record[rel] = [*stamp(st), old[4]]


def swap_in(root: str, stage: str) -> str:
    """Rename ``stage`` to a new version and point ``root`` at it with one rename (a folder
    left by an older dlrun first moves into the versions folder). Returns the version's path."""
    vdir = os.path.dirname(stage)
    name = f"{VERSION_PREFIX}{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{time.time_ns() % 1000000:06d}"
    version = os.path.join(vdir, name)
    os.rename(stage, version)
    try:
        os.rename(stage + ".json", version + ".json")
    except OSError:
        pass
    link = os.path.join(os.path.dirname(root), f".dlrun-link-{os.getpid()}")
    if os.path.lexists(link):
        os.unlink(link)
    os.symlink(os.path.relpath(version, os.path.dirname(root)), link)
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISDIR(st.st_mode):  # an older dlrun's folder: kept as a version
        legacy = os.path.join(vdir, f"{VERSION_PREFIX}0-legacy-{os.getpid()}")
        save_path(legacy + ".json", load_record(root))
        os.rename(root, legacy)
    os.replace(link, root)
    return version


def versions_in_use() -> set[str]:
    """The working folders (resolved) of this user's processes: a job started in a version keeps it."""
    used: set[str] = set()
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return used
    for pid in pids:
        try:
            used.add(os.readlink(f"/proc/{pid}/cwd"))
        except OSError:
            continue
    return used


def collect_versions(root: str, current: str) -> list[str]:
    """Remove the versions no process runs in whose files all live on elsewhere (a hard link in a
    newer version, or a file a push wrote, as its record says); returns the versions kept
    because they hold files found nowhere else (a job's output written after a later push)."""
    import shutil
    vdir = os.path.dirname(current)
    used = versions_in_use()
    kept: list[str] = []
    try:
        names = sorted(os.listdir(vdir))
    except OSError:
        return kept
    for name in names:
        path = os.path.join(vdir, name)
        if not name.startswith(VERSION_PREFIX) or "." in name or path == current:
            continue
        if any(u == path or u.startswith(path + os.sep) for u in used) or pinned(path, names):
            continue
        record = load_path(path + ".json")
        if own_files(path, record):
            kept.append(path)
            continue

        def writable(func: Any, failed: str, exc: Any) -> None:
            try:
                os.chmod(os.path.dirname(failed), 0o700)
                func(failed)
            except OSError:
                pass

        # marked first, then the pins and the processes once more: a job that resolved the tree
        # before and pins it now either is seen here (kept) or sees the mark, or the tree gone, and
        # resolves again (``agent.resolve_pinned``); the tree keeps its name while it is looked at
        mark = path + COLLECTING
        try:
            os.close(os.open(mark, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        except FileExistsError:  # another push collects it now, or one that died left its mark
            try:
                if time.time() - os.lstat(mark).st_mtime > 3600:
                    os.unlink(mark)
            except OSError:
                pass
            continue
        except OSError:
            continue
        try:
            held = pinned(path, sorted(os.listdir(vdir))) or any(
                u == path or u.startswith(path + os.sep) for u in versions_in_use())
        except OSError:
            held = True
        if not held:
            shutil.rmtree(path, onerror=writable)
            if not os.path.lexists(path):
                try:
                    os.unlink(path + ".json")
                except OSError:
                    pass
        try:
            os.unlink(mark)
        except OSError:
            pass
    return kept


def pinned(path: str, names: list[str]) -> bool:
    """Whether a job's agent or keeper marks the tree at ``path`` as used: a mark
    (``<version>.pin-<token>``, ``dlrun.remote.keeper.pin_tree``) whose lock is held. A mark
    whose lock is free (its process is gone) is removed."""
    prefix = os.path.basename(path) + ".pin-"
    used = False
    for name in names:
        if not name.startswith(prefix):
            continue
        mark = os.path.join(os.path.dirname(path), name)
        try:
            import fcntl
            fd = os.open(mark, os.O_RDWR | os.O_NOFOLLOW)
        except (ImportError, OSError):
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(mark)
        except OSError:
            used = True  # held: the job runs
        finally:
            os.close(fd)
    return used


def own_files(path: str, record: Record) -> bool:
    """Whether the tree at ``path`` holds a file with no other link that no push wrote."""
    for folder, _dirs, files in os.walk(path):
        for name in files:
            full = os.path.join(folder, name)
            try:
                st = os.lstat(full)
            except OSError:
                continue
            if (not stat.S_ISREG(st.st_mode) or st.st_nlink > 1 or name.startswith((PART, CLAIM_PREFIX))
                    or os.path.basename(folder) == "__pycache__"):  # bytecode: made again from the source
                continue
            rel = os.path.relpath(full, path)
            old = record.get(rel)
            if not (old and len(old) == 5 and old[3] == st.st_ino):
                return True
    return False


def survey(spec: dict[str, Any]) -> tuple[dict[str, Any], Record, Record]:
    """What the host has at ``spec["root"]``: the reply to send, the record an earlier push
    left, and the fresh record of what is there now."""
    root = resolve(spec["root"])
    versioned = bool(spec.get("versioned")) and can_version(root)
    tree, record = tree_base(root, versioned)
    wanted: set[str] = set(spec["paths"])
    entries: dict[str, Entry] = {}
    fresh: Record = {}
    seen: dict[str, bool] = {}
    for rel in wanted.union(record):
        path = os.path.join(tree, rel)
        if under_link(tree, rel, seen):
            continue
        old = record.get(rel)
        try:
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                # ours: the record says a push made a link here
                entries[rel] = ["link", 0, 0, os.readlink(path), old == ["link"]]
                fresh[rel] = ["link"]
            elif stat.S_ISREG(st.st_mode):
                if old and old[:4] == stamp(st):
                    digest = str(old[4])
                elif rel in wanted:
                    digest = sha256_of(path)
                else:
                    digest = ""
                # ours: the very file a push wrote (same inode), even if changed in place since
                ours = bool(old) and old is not None and len(old) == 5 and old[3] == st.st_ino
                entries[rel] = ["file", st.st_size, stat.S_IMODE(st.st_mode), digest, ours]
                fresh[rel] = [*stamp(st), digest]
            else:
                entries[rel] = ["other", 0, 0, "", False]
        except OSError:
            continue
    base = nearest_existing(root)
    error = None
    if not os.path.isdir(base):
        error = "not a directory"
    elif versioned:
        base = nearest_existing(os.path.dirname(root))  # checked by can_version
    elif not os.access(base, os.W_OK | os.X_OK):
        why = "permission denied"
        try:  # root may write anywhere but a read-only mount: say which it is
            if os.statvfs(base).f_flag & getattr(os, "ST_RDONLY", 1):
                why = "read-only file system"
        except OSError:
            pass
        error = why if base == root else f"{why} (cannot create {root})"
    try:
        vfs = os.statvfs(base)
        free, block, device = vfs.f_bavail * vfs.f_frsize, vfs.f_frsize, os.stat(base).st_dev
    except OSError:
        free, block, device = 0, 4096, 0
    # settled: a push that sends and deletes nothing would leave the record as it is, so
    # nothing needs writing at all (dlrun.remote.agent answers this survey in-process)
    # (and no record of a path that is gone or is no longer the file the push wrote)
    # (and a root that exists: an empty tree's push still makes its directory)
    settled = (os.path.isdir(root) and (not versioned or (os.path.islink(root) and base_is_root(root)))
               and all(record.get(rel) == value for rel, value in fresh.items() if rel in wanted)
               and all(rel in entries and entries[rel][4] for rel in record)
               and not folder_modes(root, spec.get("folders") or []))
    unsafe, unsure = unsafe_folders(root) if spec.get("owner_check") else ([], False)
    reply = {"root": root, "entries": entries, "free": free, "block": block, "device": device,
             "error": error, "path": base if error else None, "settled": settled and not unsafe and not unsure,
             "unsafe": unsafe, "versioned": versioned}
    if spec.get("claim") and not error and not unsafe:  # a launch asks which of its hosts share this folder
        reply["claimed_by"] = claim(root, str(spec["claim"]["token"]), str(spec["claim"]["host"]))
    return reply, record, fresh


def read_exact(n: int) -> bytes:
    data = IN.read(n)
    heard()
    if len(data) != n:
        raise EOFError
    return data


def number(field: bytes) -> int:
    if field[:1] and ord(field[:1]) & 0x80:
        return int.from_bytes(field[1:], "big")
    return int(field.strip(b"\0 ") or b"0", 8)


def pax(data: bytes) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    pos = 0
    while pos < len(data):
        space = data.index(b" ", pos)
        length = int(data[pos:space])
        key, _, value = data[space + 1:pos + length - 1].partition(b"=")
        out[key.decode()] = value
        pos += length
    return out


def os_problem(exc: OSError, path: str) -> tuple[str, str]:
    """``(where, what)`` of a failed write: the path it names (the final one rather than our
    temporary file) and the system's message."""
    where = exc.filename if isinstance(exc.filename, str) else path
    if os.path.basename(where).startswith(PART):
        where = path
    return where, exc.strerror or str(exc)


class Receiver:
    def __init__(self, roots: list[str], plan: dict[str, Any], records: list[Record]) -> None:
        self.roots, self.records = roots, records
        self.expect: dict[str, PlanItem] = {}
        for t, rel, digest, mode, mtime in plan["files"]:
            self.expect[f"{t}/{rel}"] = (int(t), str(rel), str(digest), int(mode), int(mtime))
        self.made: set[str] = set()
        self.pycs: dict[str, list[str]] = {}  # __pycache__ folder -> its entries
        self.buf = bytearray(1 << 20)
        self.view = memoryview(self.buf)
        self.written = self.deleted = self.failed = 0
        self.done: set[str] = set()  # names written
        self.prefix = ""  # prepended to the names of a stream from another host (fetch_from)
        # ``"stage"`` (a checkpoint copy): files wait under their temporary names until every one
        # arrived, then all are renamed into place (``commit``), or none is
        self.stage = bool(plan.get("stage"))
        self.staged: list[tuple[str, PlanItem, str, str, bool]] = []  # name, item, temp, final, link

    def fail(self, name: str, where: str, what: str) -> None:
        self.failed += 1
        say({"err": name, "path": where, "msg": what})

    def makedirs(self, t: int, rel: str) -> None:
        # the directories of rel below the root; a symlink where one belongs is replaced by the
        # directory, never followed (as rsync -a does)
        root, folder = self.roots[t], os.path.dirname(rel)
        full = os.path.join(root, folder)
        if full in self.made:
            return
        path = root
        for part in folder.split("/") if folder else ():
            path = os.path.join(path, part)
            try:
                if stat.S_ISLNK(os.lstat(path).st_mode):
                    os.unlink(path)
            except FileNotFoundError:
                break
        os.makedirs(full, exist_ok=True)
        self.made.add(full)

    def drop_bytecode(self, final: str) -> None:
        # Python trusts a cached .pyc whose source has the same size and mtime second: a module
        # rewritten within a second of its last import would otherwise run as the old code
        folder, name = os.path.split(final)
        if not name.endswith(".py"):
            return
        cache = os.path.join(folder, "__pycache__")
        if cache not in self.pycs:
            try:
                self.pycs[cache] = os.listdir(cache)
            except OSError:
                self.pycs[cache] = []
        prefix = name[:-3] + "."
        for entry in self.pycs[cache]:
            if entry.startswith(prefix) and entry.endswith(".pyc"):
                try:
                    os.unlink(os.path.join(cache, entry))
                except OSError:
                    pass

    def delete(self, t: int, rel: str) -> None:
        root = self.roots[t]
        path = os.path.join(root, rel)
        if under_link(root, rel, {}):  # not ours to delete through a link
            self.records[t].pop(rel, None)
            return
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            self.fail(f"{t}/{rel}", *os_problem(exc, path))
            return
        self.records[t].pop(rel, None)
        self.deleted += 1
        folder = os.path.dirname(path)
        while folder != root and folder.startswith(root + os.sep):
            try:
                os.rmdir(folder)
            except OSError:
                break
            folder = os.path.dirname(folder)
        say({"deleted": f"{t}/{rel}"})

    def run(self) -> None:
        extra: dict[str, bytes] = {}
        while True:
            header = read_exact(512)
            if not header.strip(b"\0"):
                return
            kind = header[156:157]
            size = number(header[124:136])
            raw_name = header[0:100].split(b"\0", 1)[0]
            prefix = header[345:500].split(b"\0", 1)[0] if header[257:262] == b"ustar" else b""
            if prefix:
                raw_name = prefix + b"/" + raw_name
            raw_link = header[157:257].split(b"\0", 1)[0]
            if "size" in extra:
                size = int(extra["size"])
            padded = size + (-size % 512)
            if kind in (b"x", b"g"):
                data = read_exact(padded)[:size]
                if kind == b"x":
                    extra = pax(data)
                continue
            name = self.prefix + extra.get("path", raw_name).decode("utf-8", "surrogateescape")
            linkname = extra.get("linkpath", raw_link).decode("utf-8", "surrogateescape")
            extra = {}
            item = self.expect.get(name)
            if item is None:
                self.skip(padded)
                self.fail(name, name, "not in the plan")
            elif kind == b"2":
                self.skip(padded)
                self.link(name, item, linkname)
            else:
                self.file(name, item, size)
                self.skip(padded - size)

    def skip(self, n: int) -> None:
        while n > 0:
            got = IN.readinto(self.view[:min(n, len(self.buf))])
            heard()
            if not got:
                raise EOFError
            n -= got

    def link(self, name: str, item: PlanItem, target: str) -> None:
        t, rel = item[0], item[1]
        final = os.path.join(self.roots[t], rel)
        temp = temp_for(final)
        try:
            self.makedirs(t, rel)
            if os.path.lexists(temp):
                os.unlink(temp)
            os.symlink(target, temp)
            if self.stage:
                TEMPS.append(temp)
                self.staged.append((name, item, temp, final, True))
                self.done.add(name)
                return
            os.replace(temp, final)
        except OSError as exc:
            if os.path.lexists(temp):
                os.unlink(temp)
            self.fail(name, *os_problem(exc, final))
            return
        self.records[t][rel] = ["link"]
        self.written += 1
        self.done.add(name)
        say({"ok": name})

    def file(self, name: str, item: PlanItem, size: int) -> None:
        t, rel, digest, mode, mtime = item
        final = os.path.join(self.roots[t], rel)
        temp = temp_for(final)
        fd: int | None = None
        problem: tuple[str, str] | None = None  # (where, what) of the first failure
        try:
            self.makedirs(t, rel)
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            TEMPS.append(temp)
        except OSError as exc:
            problem = os_problem(exc, final)
        import hashlib

        hasher = hashlib.sha256()
        left = size
        while left > 0:
            got = IN.readinto(self.view[:min(left, len(self.buf))])
            heard()
            if not got:
                raise EOFError
            chunk = self.view[:got]
            hasher.update(chunk)
            left -= got
            while fd is not None and chunk:
                try:
                    chunk = chunk[os.write(fd, chunk):]
                except OSError as exc:
                    problem = os_problem(exc, final)
                    os.close(fd)
                    fd = None
        try:
            if fd is not None:
                os.fchmod(fd, mode)
                os.close(fd)
                fd = None
                if problem is None and hasher.hexdigest() != digest:
                    problem = (final, "content does not match its sha256 (changed while pushing?)")
                if problem is None:
                    os.utime(temp, (mtime, mtime))
                    if self.stage:  # stays in TEMPS: ``commit`` renames it, or the end removes it
                        self.staged.append((name, item, temp, final, False))
                        self.done.add(name)
                        return
                    os.replace(temp, final)
                    self.records[t][rel] = [*stamp(os.lstat(final)), digest]
                    self.drop_bytecode(final)
        except OSError as exc:
            problem = os_problem(exc, final)
        if temp in TEMPS:
            TEMPS.remove(temp)
            if problem is not None and os.path.lexists(temp):
                os.unlink(temp)
        if problem is not None:
            self.fail(name, *problem)
            return
        self.written += 1
        self.done.add(name)
        say({"ok": name})


    def commit(self) -> None:
        """A staged plan: rename every staged file into place if nothing failed, else none."""
        staged, self.staged = self.staged, []
        for name, item, temp, final, link in staged:
            if self.failed:
                break
            try:
                os.replace(temp, final)
            except OSError as exc:
                self.fail(name, *os_problem(exc, final))
                break
            TEMPS.remove(temp)
            self.records[item[0]][item[1]] = ["link"] if link else [*stamp(os.lstat(final)), item[2]]
            self.written += 1
            say({"ok": name})
        for _name, _item, temp, _final, _link in staged:
            if temp in TEMPS:
                TEMPS.remove(temp)
                try:
                    os.unlink(temp)
                except OSError:
                    pass


def save_record(root: str, record: Record) -> None:
    # private (0600 in a 0700 folder): it lists the sha256 of every pushed file, and that of a
    # short secret (.env) lets anyone who reads it test guesses offline
    path = record_file(root)
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        os.chmod(os.path.dirname(path), 0o700)
        temp = f"{path}.{os.getpid()}.tmp"
        with os.fdopen(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600), "w") as fh:
            json.dump(record, fh)
        os.replace(temp, path)
    except OSError:
        pass


def folder_modes(root: str, folders: list[list[Any]]) -> list[tuple[str, int]]:
    # the pushed folders that exist here (not through a link) whose mode differs from the pushed one
    wrong = []
    seen: dict[str, bool] = {}
    for rel, mode in folders:
        path = os.path.join(root, rel) if rel else root
        if rel and under_link(root, rel + "/x", seen):
            continue
        try:
            st = os.lstat(path) if rel else os.stat(path)  # the root: a link to the current version
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) != int(mode):
            wrong.append((str(rel), int(mode)))
    return wrong


def set_folder_modes(root: str, folders: list[list[Any]]) -> None:
    # after every file is written (a folder the owner may not write would refuse them)
    for rel, mode in folder_modes(root, folders):
        try:
            os.chmod(os.path.join(root, rel) if rel else root, mode)
        except OSError:
            pass


def widen(fd: int) -> None:
    # sshd reads what the helper sends from this pipe. At 1 MiB (Linux's default limit for a
    # user) instead of 64 KiB the helper fills it in fewer, larger sendfile calls and both sides
    # wake less often: host CPU of a 200 MB pull from 4 hosts 0.83 -> 0.71 s (docs/benchmarks.md).
    if sys.platform.startswith("linux"):
        try:
            import fcntl
            fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
        except (ImportError, OSError, ValueError):
            pass


def widen_stdin() -> None:
    # sshd writes what it decrypts into this pipe; at 1 MiB (Linux's default limit for a user)
    # instead of 64 KiB it blocks less often and each read takes more (host CPU -15 %).
    widen(IN.fileno())


# =============================================================================== sending


HASHES = ".hashes"  # the sender's own stat cache: <parent>/.dlrun-cache/<name>.hashes.json


def listed(path: str, st: os.stat_result, cache: Record, fresh: Record, rel: str) -> Entry | None:
    """``[kind, size, mode, sha256 or link target, mtime_ns]`` of one path (None: not sent)."""
    if stat.S_ISLNK(st.st_mode):
        return ["link", 0, 0, os.readlink(path), st.st_mtime_ns]
    if not stat.S_ISREG(st.st_mode):
        return None
    old = cache.get(rel)
    digest = str(old[4]) if old and len(old) == 5 and old[:4] == stamp(st) else sha256_of(path)
    # a file modified in the last second may change again within the same mtime: not cached
    if max(st.st_mtime_ns, st.st_ctime_ns) < time.time_ns() - 1_000_000_000:
        fresh[rel] = [*stamp(st), digest]
    return ["file", st.st_size, stat.S_IMODE(st.st_mode), digest, st.st_mtime_ns]


def listing(spec: dict[str, Any]) -> dict[str, Any]:
    """What is at ``spec["root"]``: a directory's tree (paths relative to it), or one file
    (its name), without the push's caches and temporary files; ``missing`` when absent. With
    ``owner_check``, the push's ``unsafe_folders`` first: where there are any, nothing is listed."""
    root = resolve(spec["root"])
    reply: dict[str, Any] = {"root": root, "entries": {}, "missing": False, "dir": True}
    if spec.get("owner_check"):  # a checkpoint copy: files another user planted would reach every host
        reply["unsafe"] = unsafe_folders(root)[0]
        if reply["unsafe"]:
            return reply
    try:
        top = os.lstat(root)
        if stat.S_ISLNK(top.st_mode) and f"{os.sep}{VERSIONS}{os.sep}" in os.path.realpath(root):
            top = os.stat(root)  # a pushed project folder: the link to its current tree
    except FileNotFoundError:
        reply["missing"] = True
        return reply
    except OSError as exc:
        reply["error"] = exc.strerror or str(exc)
        return reply
    entries: dict[str, Entry] = {}
    fresh: Record = {}
    if not stat.S_ISDIR(top.st_mode):
        reply["dir"] = False
        reply["root"] = os.path.dirname(root)
        entry = listed(root, top, {}, fresh, "")
        if entry is not None:
            entries[os.path.basename(root)] = entry
        reply["entries"] = entries
        return reply
    cache = load_record(root + HASHES)  # <parent>/.dlrun-cache/<name>.hashes.json
    for record in (load_record(root),):  # what a push wrote is hashed already
        for rel, value in record.items():
            cache.setdefault(rel, value)
    errors: list[str] = []
    for folder, dirs, files in os.walk(root, onerror=lambda exc: errors.append(str(exc))):
        rel_folder = os.path.relpath(folder, root)
        dirs[:] = sorted(d for d in dirs if d != ".dlrun-cache")
        names = list(files)
        for name in list(dirs):  # a link to a directory is sent as a link, never followed
            if os.path.islink(os.path.join(folder, name)):
                dirs.remove(name)
                names.append(name)
        for name in sorted(names):
            if name.startswith(PART):
                continue
            rel = name if rel_folder == "." else f"{rel_folder}/{name}"
            path = os.path.join(folder, name)
            try:
                entry = listed(path, os.lstat(path), cache, fresh, rel)
            except OSError:
                continue  # gone since the walk saw it
            if entry is not None:
                entries[rel] = entry
    if errors:
        reply["error"] = errors[0]
    if fresh != {rel: v for rel, v in cache.items() if rel in fresh}:
        save_record(root + HASHES, fresh)
    reply["entries"] = entries
    return reply


def fd_writer(fd: int) -> tuple[Any, Any]:
    """``(write, sendfile)`` for a file descriptor (stdout): ``sendfile(src_fd, n)`` returns the
    bytes sent, or raises OSError where the kernel cannot."""

    def write(data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]

    def sendfile(src: int, count: int) -> int:
        return os.sendfile(fd, src, None, count)

    return write, sendfile


def send_tree(root: str, entries: dict[str, Entry], paths: list[str], write: Any, sendfile: Any = None) -> None:
    """One tar stream of ``paths`` through ``write``, each file exactly as listed: one that grew
    is cut at its listed size and one that shrank or vanished is padded with zeros, so the
    receiver's sha256 check names it."""
    import tarfile  # here: a push (and the agent's survey) never pays for it

    zero = bytes(1 << 16)
    buf = memoryview(bytearray(1 << 20))  # one buffer for every read (no fresh megabyte per read)
    for rel in paths:
        kind, size, mode, value, mtime_ns = entries[rel]
        info = tarfile.TarInfo(rel)
        info.mtime = mtime_ns // 1_000_000_000
        if kind == "link":
            info.type, info.linkname, info.mode = tarfile.SYMTYPE, value, 0o777
            write(info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape"))
            continue
        info.size, info.mode = size, mode
        write(info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape"))
        left = size
        try:
            fd = os.open(os.path.join(root, rel), os.O_RDONLY)
        except OSError:  # vanished or unreadable since the listing: zeros, which the receiver names
            fd = -1
        try:
            while fd >= 0 and left > 0:
                n = 0
                if sendfile is not None:
                    try:
                        n = sendfile(fd, min(left, 1 << 22))
                    except OSError:  # no sendfile to this kind of fd: read and write (a lost pipe fails there)
                        sendfile = None
                if sendfile is None:
                    try:
                        n = os.readv(fd, [buf[:min(left, len(buf))]])
                    except OSError:  # a failed read only: a failed write ends the helper
                        n = 0
                    write(buf[:n])
                if n == 0:
                    break
                left -= n
                heard()
        finally:
            if fd >= 0:
                os.close(fd)
        while left > 0:
            write(zero[:min(left, len(zero))])
            left -= min(left, len(zero))
        write(zero[:-size % 512])
        heard()
    write(zero[:1024])


# =============================================================================== host to host


def server_context(cert_pem: str, key_pem: str) -> Any:
    """TLS 1.3 with the certificate dlrun made for this copy; the key goes to an anonymous
    memory file (or a 0600 temporary file, removed at once), as the keeper's does."""
    import ssl
    import tempfile

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    with tempfile.TemporaryDirectory(prefix="dlrun-push-") as private:
        paths = []
        fds = []
        for i, text in enumerate((cert_pem, key_pem)):
            try:
                fd = os.memfd_create("dlrun-push", os.MFD_CLOEXEC)  # type: ignore[attr-defined,unused-ignore]
                os.write(fd, text.encode())
                fds.append(fd)
                paths.append(f"/proc/self/fd/{fd}")
            except (AttributeError, OSError):
                path = os.path.join(private, f"{i}.pem")
                with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as fh:
                    fh.write(text)
                paths.append(path)
        try:
            context.load_cert_chain(paths[0], paths[1])
        finally:
            for fd in fds:
                os.close(fd)
    return context


def client_context(cert_pem: str) -> Any:
    """TLS 1.3 trusting exactly that certificate (pinned)."""
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(cadata=cert_pem)
    return context


def serve(root: str, entries: dict[str, Entry], spec: dict[str, Any]) -> None:
    """Send files of this listing to the other hosts of a copy: listen on ``spec["bind"]``
    (TLS with dlrun's certificate), say the port, and give each connection that shows the
    token the files it names (only those dlrun allowed), until dlrun closes stdin."""
    import hmac
    import socket
    import threading

    allowed = set(spec["files"]) & set(entries)
    token = str(spec["token"]).encode()
    try:
        context = server_context(spec["cert"], spec["key"])
        family = socket.AF_INET6 if ":" in spec["bind"] else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.bind((spec["bind"], 0))
        listener.listen(16)
    except (OSError, ValueError) as exc:
        say({"error": f"cannot listen on {spec['bind']}: {exc}"})
        return
    say({"port": listener.getsockname()[1]})

    def give(conn: Any) -> None:
        try:
            conn.settimeout(60)
            with context.wrap_socket(conn, server_side=True) as tls:
                reader = tls.makefile("rb")
                shown = reader.readline(len(token) + 2).rstrip(b"\n")
                if not hmac.compare_digest(shown, token):
                    return
                asked = [str(p) for p in json.loads(reader.readline(1 << 24))]
                tls.settimeout(IDLE[0] or None)
                send_tree(root, entries, [p for p in asked if p in allowed], tls.sendall)
                tls.unwrap()
        except (OSError, ValueError):
            pass
        finally:
            conn.close()

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=give, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    while IN.read(1 << 16):  # until dlrun closes stdin (each read re-arms nothing: dlrun is quiet)
        pass


def fetch_from(source: dict[str, Any], receiver: Receiver) -> str | None:
    """Receive ``source["files"]`` (``<target>/<path>`` names) straight from another host's
    helper (``serve``); None, or why that host could not be reached (its files then failed)."""
    global IN
    import socket

    names = [str(n) for n in source["files"]]
    try:
        conn = socket.create_connection((source["address"], int(source["port"])), timeout=10)
        tls = client_context(source["cert"]).wrap_socket(conn)
        tls.settimeout(IDLE[0] or None)
        tls.sendall(str(source["token"]).encode() + b"\n" + json.dumps([n.split("/", 1)[1] for n in names]).encode()
                    + b"\n")
    except (OSError, ValueError) as exc:
        return f"cannot reach {source['address']}:{source['port']}: {exc}"
    stdin = IN
    IN = tls.makefile("rb")
    try:
        receiver.prefix = names[0].split("/", 1)[0] + "/" if names else ""
        receiver.run()
    except (EOFError, OSError) as exc:
        return f"the transfer from {source['address']} broke off: {exc or 'end of stream'}"
    finally:
        IN = stdin
        receiver.prefix = ""
        tls.close()
    return None


def sender(request: dict[str, Any]) -> int:
    """``dlrun pull``'s side: the listing, then the files asked for (the protocol in
    ``dlrun.push.pull``)."""
    reply = listing(request["send"])
    reply["now"] = time.time()
    say({"listing": reply})
    line = IN.readline()
    heard()
    if not line:
        return 0
    asked = json.loads(line)
    if asked.get("abort"):
        return 0
    if "serve" in asked:
        serve(reply["root"], reply["entries"], asked["serve"])
        return 0
    paths = [str(p) for p in asked["files"]]
    if asked.get("side"):
        jobs, tls = side_channel(asked["side"])
        if tls is not None:
            try:
                send_tree(reply["root"], reply["entries"], paths, side_writer(tls, asked["side"].get("test_break")))
            except (OSError, ValueError):  # the side channel is lost (dlrun gone, a dropped flow): as a lost pipe
                tls.close()
                return 3
            jobs.close_side(tls)
            return 0
    sys.stdout.flush()
    widen(sys.stdout.fileno())
    write, sendfile = fd_writer(sys.stdout.fileno())
    send_tree(reply["root"], reply["entries"], paths, write, sendfile)
    return 0


def side_channel(side: dict[str, Any]) -> tuple[Any, Any]:
    """The TLS side channel dlrun offers for the files (``dlrun.transport.side``): the jobs
    program's own (``side_channel`` of ``dlrun.remote.jobs``, whose source dlrun sends with the
    offer): it says ``T {"port"}`` and takes dlrun's connection, or is None (then this says
    ``T {}`` if it had not said a port, and the files go on stdout). (the module, the socket)."""
    said = []

    class Out:
        def write(self, data: bytes) -> None:
            said.append(data)
            sys.stdout.buffer.write(data)

        def flush(self) -> None:
            sys.stdout.buffer.flush()

    sys.stdout.flush()
    jobs = tls = None
    try:
        jobs = load_module(str(side["source"]), "jobs")
        tls = jobs.side_channel(side, Out())
    except Exception:  # whatever fails here, the files go over SSH
        tls = None
    if tls is None and not said:
        sys.stdout.buffer.write(b"T {}\n")
        sys.stdout.buffer.flush()
    return jobs, tls


def side_writer(tls: Any, test_break: Any = None) -> Any:
    """``tls.sendall``; for tests only (``DLRUN_TEST_SIDE_BREAK`` in dlrun's environment,
    docs/checkpoints.md), ``"reset:N"`` resets the connection after N bytes and ``"stall:N"``
    sends nothing more after N bytes until stdin ends (dlrun gave up on the side channel)."""
    if not test_break:
        return tls.sendall
    how, _, count = str(test_break).partition(":")
    left = [int(count)]

    def write(data: Any) -> None:
        view = memoryview(data)
        if len(view) < left[0]:
            left[0] -= len(view)
            tls.sendall(view)
            return
        tls.sendall(view[:left[0]])
        if how == "stall":
            while os.read(0, 1 << 16):
                pass
        else:
            import socket
            import struct

            tls.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        tls.close()
        raise BrokenPipeError("the side channel was broken for a test")

    return write


def load_module(source: str, name: str) -> Any:
    """A ``dlrun.remote`` module from its source (as the keeper loads its modules)."""
    import types

    module = types.ModuleType("dlrun_" + name)
    sys.modules[module.__name__] = module
    cached = globals().get("_dlrun_code")  # the bootstrap loader's code cache (dlrun.remote.LOADER)
    where = "<dlrun-" + name + ">"
    exec(cached(source.encode("utf-8"), where) if cached else compile(source, where, "exec"), module.__dict__)
    return module


def final_record(record: Record, before: Record, ours: set[str], t: int, plan: dict[str, Any]) -> None:
    deleted = {rel for u, rel in plan["delete"] if u == t}
    for rel in ours:  # a write that failed or never came left the old file: still ours
        if rel not in record and rel in before and rel not in deleted:
            record[rel] = before[rel]


def start_build(root: str) -> tuple[str, int, list[tuple[str, int]]]:
    """``next`` for a push to ``root``, locked: an interrupted push's, or a new clone of the
    current tree (hard links). Returns it, the lock and the folder modes to set at the end."""
    vdir = versions_dir(root)
    lock = lock_versions(vdir)
    stage = os.path.join(vdir, NEXT)
    modes: list[tuple[str, int]] = []
    if not os.path.isdir(stage) or os.path.islink(stage):
        if os.path.lexists(stage):
            os.unlink(stage)
        os.mkdir(stage, 0o700)
        try:
            modes.append((stage, stat.S_IMODE(os.stat(root).st_mode)))
        except OSError:
            pass
        carry(os.path.realpath(root), stage, set(), modes)
    return stage, lock, modes


def main() -> int:
    widen_stdin()
    request = json.loads(IN.readline())
    IDLE[0] = int(request.get("idle") or 0)
    heard()
    if "send" in request:
        return sender(request)
    roots: list[str] = []
    records: list[Record] = []
    freshes: list[Record] = []
    replies: list[dict[str, Any]] = []
    for spec in request["targets"]:
        reply, record, fresh = survey(spec)
        replies.append(reply)
        roots.append(reply["root"])
        records.append(record)
        freshes.append(fresh)
    say({"targets": replies})
    line = IN.readline()
    heard()
    if not line:
        return 0
    plan = json.loads(line)
    if plan.get("abort"):
        return 0
    for root in roots:  # a push: every host of the launch has claimed its folder by now
        unclaim(root)
    before = [dict(r) for r in records]
    new: list[Record] = []
    ours: list[set[str]] = []
    for t, keep in enumerate(plan["keep"]):
        wanted = set(request["targets"][t]["paths"])
        # the files a push wrote that are still there as written; a gone or replaced one drops out
        ours.append({rel for rel, e in replies[t]["entries"].items() if e[4]})
        merged = {rel: v for rel, v in records[t].items() if rel not in wanted and rel in ours[t]}
        for rel in keep:
            if rel in freshes[t]:
                merged[rel] = freshes[t][rel]
        new.append(merged)
    finals = list(roots)  # where the ranks see each tree; a versioned one is built in its ``next``
    builds: dict[int, tuple[str, int, list[tuple[str, int]]]] = {}  # t -> (stage, lock, folder modes)
    for t, root in enumerate(finals):
        changes = any(int(f[0]) == t for f in plan["files"]) or any(int(d[0]) == t for d in plan["delete"])
        if replies[t].get("versioned") and (changes or not os.path.islink(root) or not base_is_root(root)):
            builds[t] = start_build(root)
            roots[t] = builds[t][0]
    receiver = Receiver(roots, plan, new)
    committed: set[int] = set()
    kept: list[str] = []
    try:
        for t, root in enumerate(roots):  # the root itself, even for a tree with no files
            try:
                receiver.makedirs(t, "")
            except OSError as exc:
                receiver.fail(f"{t}/", *os_problem(exc, root))
            if request["targets"][t].get("folders"):  # a private project is never open, not even at first
                try:
                    os.chmod(root, 0o700)
                except OSError:
                    pass  # not ours (--insecure-workdir): its owner's mode stays
        for t, rel in plan["delete"]:
            receiver.delete(t, rel)
        receiver.run()
        for source in plan.get("sources", ()):  # files another host sends straight here
            problem = fetch_from(source, receiver)
            if problem is not None:
                for name in source["files"]:
                    if name in receiver.expect and name not in receiver.done:
                        receiver.fail(name, name, problem)
        receiver.commit()  # a staged plan's files, all or none
        for t, (stage, _lock, _modes) in builds.items():
            for rel in plan["keep"][t]:  # unchanged, so not sent: the clone must have brought it
                if not os.path.lexists(os.path.join(stage, rel)):
                    receiver.fail(f"{t}/{rel}", os.path.join(finals[t], rel),
                                  "could not be linked or copied into the new tree; the next push sends it")
        for t, (stage, _lock, modes) in builds.items():
            if receiver.failed:
                break  # the old tree stays in place; ``next`` waits for the next push to resume it
            # what the job wrote in the current tree since ``next`` was begun (a resumed push)
            pushed = set(before[t]) | set(load_record(finals[t])) | {rel for u, rel in plan["delete"] if u == t}
            carry(os.path.realpath(finals[t]), stage, pushed, modes, eager=False)
            for path, mode in reversed(modes):
                try:
                    os.chmod(path, mode)
                except OSError:
                    pass
        for t, root in enumerate(roots):  # folder modes, as pushed (0700 stays 0700)
            set_folder_modes(root, request["targets"][t].get("folders") or [])
        for t, (stage, _lock, _modes) in builds.items():
            if receiver.failed:
                break
            final_record(new[t], before[t], ours[t], t, plan)
            try:
                version = swap_in(finals[t], stage)
            except OSError as exc:
                receiver.fail(f"{t}/", *os_problem(exc, finals[t]))
                break
            committed.add(t)
            kept += collect_versions(finals[t], version)
            restamp(version, new[t])  # removing an old version's links changed the files' ctime
            save_path(version + ".json", new[t])
            save_record(finals[t], new[t])
    finally:
        for t, root in enumerate(roots):
            final_record(new[t], before[t], ours[t], t, plan)
            if t in builds:
                if t not in committed:  # for the next push to resume
                    restamp(root, new[t])
                    save_path(builds[t][0] + ".json", new[t])
                os.close(builds[t][1])
            elif new[t] != before[t]:
                save_record(root, new[t])
    if kept:
        say({"kept": kept})
    say({"done": {"written": receiver.written, "deleted": receiver.deleted, "failed": receiver.failed}})
    return 0


def stop(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def run() -> None:
    """The helper's life: signals end it cleanly, and no temporary file outlives it."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGALRM):
        signal.signal(sig, stop)
    try:
        code = main()
    except (EOFError, BrokenPipeError, SystemExit, KeyboardInterrupt):
        code = 3
    finally:
        for temp in TEMPS:
            try:
                os.unlink(temp)
            except OSError:
                pass
    sys.exit(code)


if __name__ == "__main__":
    run()
