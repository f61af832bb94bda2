"""Issue 34: what another local user (or a careless input) could do to a job, tried for real:
secrets on command lines and in printouts, input checks, file modes, workdir ownership."""

from __future__ import annotations

import hashlib
import os
import pwd
import secrets
import stat
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

import pytest

from support.cli import REPO, dlrun_argv, run_dlrun
from support.ssh_jobs import hosts_toml, shared_script
from support.sshd_cluster import SshdCluster

SECRET_WAIT = """
import hashlib, os, sys, time
print("got", hashlib.sha256((os.environ["CLI_TOKEN"] + os.environ["FILE_TOKEN"]).encode()).hexdigest(), flush=True)
deadline = time.time() + 120
while not os.path.exists(sys.argv[1]) and time.time() < deadline:
    time.sleep(0.1)
"""


def cmdline_leaks(values: Iterable[str]) -> list[str]:
    """Every process whose command line holds one of ``values`` (any user can read them all)."""
    wanted = [v.encode() for v in values]
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmdline = fh.read()
        except OSError:
            continue
        if any(w in cmdline for w in wanted):
            found.append(f"{entry}: {cmdline.replace(bytes(1), b' ')[:300]!r}")
    return found


def readable_leaks(roots: Iterable[Path], values: Iterable[str]) -> list[str]:
    """Files under ``roots`` that a group or other user may read and that hold one of ``values``."""
    wanted = [v.encode() for v in values]
    found = []
    for root in roots:
        for folder, _, files in os.walk(root):
            for name in files:
                path = os.path.join(folder, name)
                try:
                    info = os.lstat(path)
                    if not stat.S_ISREG(info.st_mode) or not info.st_mode & 0o044 or info.st_size > 1 << 22:
                        continue
                    with open(path, "rb") as fh:
                        data = fh.read()
                except OSError:
                    continue
                if any(w in data for w in wanted):
                    found.append(f"{path} ({stat.filemode(info.st_mode)})")
    return found


@pytest.mark.slow
@pytest.mark.ssh
def test_secrets_reach_the_ranks_but_no_command_line_or_shared_file(cluster: SshdCluster, tmp_path: Path) -> None:
    from_env, from_file = "env-" + secrets.token_hex(12), "file-" + secrets.token_hex(12)
    env_file = tmp_path / "job.env"
    env_file.write_text(f"# secrets\nFILE_TOKEN={from_file}\n")
    env_file.chmod(0o600)
    go = cluster.root / f"go-{secrets.token_hex(4)}"
    script = shared_script(cluster, "secret_wait.py", SECRET_WAIT)
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 2)
    argv = dlrun_argv("launch", "--plain", "--framework", "none", "--hosts", str(hosts), "--ssh-config",
                      str(cluster.ssh_config), "-e", "CLI_TOKEN", "--env-file", str(env_file), str(script), str(go))
    proc = subprocess.Popen(argv, cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(REPO), "CLI_TOKEN": from_env})
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        while sum("] got " in line for line in lines) < 2:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
        digest = hashlib.sha256((from_env + from_file).encode()).hexdigest()
        assert sum(f"] got {digest}" in line for line in lines) == 2, "".join(lines)
        assert cmdline_leaks([from_env, from_file]) == []
        homes = [Path(os.path.expanduser(f"~{cluster.user}")), tmp_path, cluster.root]
        scratch = [Path("/tmp") / n for n in os.listdir("/tmp") if n.startswith("dlrun-")]
        assert readable_leaks([*homes, *scratch, Path("/dev/shm")], [from_env, from_file]) == []
    finally:
        go.touch()
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, "".join(lines) + out
    assert from_env not in out + "".join(lines) and from_file not in out


def test_script_arguments_are_masked_in_the_dry_run_and_the_root_cause(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text("import sys\nsys.exit(3)\n")
    args = ["--password", "hunter2", "--db", "postgres://ml:hunter2@db/x", "API_KEY=hunter2"]
    for dry in (["--dry-run"], ["--dry-run", "--json"]):
        out = run_dlrun("launch", *dry, "--framework", "none", "-n", "1", str(script), *args, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        assert "hunter2" not in out.stdout + out.stderr and "postgres://ml:****@db/x" in out.stdout, out.stdout
    out = run_dlrun("launch", "--plain", "--framework", "none", "-n", "1", str(script), *args, cwd=tmp_path,
                    timeout=120)
    assert out.returncode == 3, out.stdout + out.stderr
    assert "  command: " in out.stdout + out.stderr, out.stdout + out.stderr
    assert "hunter2" not in out.stdout + out.stderr, out.stdout + out.stderr


@pytest.mark.slow
def test_script_arguments_are_masked_in_ps_and_the_stored_state(tmp_path: Path) -> None:
    script = tmp_path / "quick.py"
    script.write_text("print('done')\n")
    home = {"HOME": str(tmp_path / "home")}
    out = run_dlrun("launch", "--detach", "--framework", "none", "-n", "1", str(script), "--token", "hunter2",
                    "postgres://ml:hunter2@db/x", cwd=tmp_path, timeout=120, env=home)
    assert out.returncode == 0, out.stdout + out.stderr
    job = out.stdout.strip().splitlines()[-1].removeprefix("dlrun: detached job ")
    ps = run_dlrun("ps", cwd=tmp_path, timeout=60, env=home)
    assert job in ps.stdout and "postgres://ml:****@db/x" in ps.stdout, ps.stdout
    assert "hunter2" not in ps.stdout + out.stdout + out.stderr, ps.stdout
    folder = tmp_path / "home" / ".dlrun" / "jobs" / job
    deadline = time.monotonic() + 60
    while not list(folder.glob("*/result.json")) and time.monotonic() < deadline:
        time.sleep(0.2)
    stored = [p for p in folder.rglob("*") if p.is_file()]
    assert any(p.name == "state.json" for p in stored), stored
    assert [p for p in stored if b"hunter2" in p.read_bytes()] == []


# --------------------------------------------------------------------------- input checks


@pytest.mark.parametrize("pair", ["A\nB=1", "A B=1", "\x1b[2JX=1"])
def test_bad_env_names_are_usage_errors(tmp_path: Path, pair: str) -> None:
    script = tmp_path / "ok.py"
    script.write_text("print('ok')\n")
    out = run_dlrun("launch", "--dry-run", "-e", pair, str(script), cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "expected NAME=VALUE or NAME" in out.stderr and "\x1b" not in out.stderr, out.stderr


def test_an_over_long_script_name_and_a_folder_are_usage_errors(tmp_path: Path) -> None:
    out = run_dlrun("launch", "--plain", "x" * 10_000 + ".py", cwd=tmp_path)
    assert out.returncode == 2 and "the script's name is too long" in out.stderr, out.stderr[-500:]
    assert "Traceback" not in out.stderr
    (tmp_path / "project").mkdir()
    for name in ("project", "./project/"):
        out = run_dlrun("launch", "--plain", "--framework", "none", name, cwd=tmp_path, timeout=120)
        assert out.returncode == 2 and f"{name} is a folder, not a script" in out.stderr, out.stdout + out.stderr
        assert "[0 localhost]" not in out.stdout


def test_control_characters_in_names_and_arguments_are_escaped_in_the_dry_run(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts.toml"
    hosts.write_text('[[hosts]]\naddress = "127.0.0.9"\nslots = 1\nenv = { NOTE = "a\\u001b[2Jb" }\n')
    script = tmp_path / "run\x1b[31m.py"
    script.write_text("print(1)\n")
    out = run_dlrun("launch", "--dry-run", "--no-push", "--no-preflight", "--hosts", str(hosts), str(script),
                    "--title", "\x1b]0;pwned\x07", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "\x1b" not in out.stdout + out.stderr and "\x07" not in out.stdout + out.stderr, out.stdout + out.stderr
    assert "NOTE=a\\x1b[2Jb" in out.stdout and "run\\x1b[31m.py" in out.stderr, out.stdout + out.stderr


@pytest.mark.slow
def test_many_unresolvable_hosts_show_progress_and_fail_fast(tmp_path: Path) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"nosuch-{i:04d}.invalid slots=1\n" for i in range(300)))
    script = tmp_path / "ok.py"
    script.write_text("print('ok')\n")
    out = run_dlrun("launch", "--plain", "--no-preflight", "--framework", "none", "--hosts", str(hostfile),
                    str(script), cwd=tmp_path, timeout=600)
    assert out.returncode == 255, out.stderr[-2000:]
    assert "dlrun: connecting to 300 hosts" in out.stderr, out.stderr[-2000:]
    assert "hosts not tried); no rank was started" in out.stderr, out.stderr[-2000:]
    assert "… and " in out.stderr or out.stderr.count("cannot resolve host name") <= 20


# --------------------------------------------------------------------------- modes and caches


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.mark.slow
@pytest.mark.ssh
def test_the_push_keeps_folder_modes_and_its_record_is_private(cluster: SshdCluster, tmp_path: Path) -> None:
    project = tmp_path / f"modes-{secrets.token_hex(3)}"
    (project / "private").mkdir(parents=True)
    (project / "shared").mkdir()
    (project / "train.py").write_text("print('hi')\n")
    (project / "private" / ".env").write_text("DB_PASSWORD=abc\n")
    (project / "private" / ".env").chmod(0o600)
    (project / "shared" / "data.txt").write_text("x\n")
    (project / "private").chmod(0o700)
    (project / "shared").chmod(0o755)
    project.chmod(0o750)
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 1)
    ssh = ["--hosts", str(hosts), "--ssh-config", str(cluster.ssh_config)]
    out = run_dlrun("push", *ssh, "--code", str(project), cwd=tmp_path, timeout=120,
                    env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert out.returncode == 0, out.stdout + out.stderr
    remote = cluster.hosts[0].workdir / project.name
    assert remote.is_symlink()  # to the tree the push swapped in, whose modes are the project's
    assert (mode_of(remote.resolve()), mode_of(remote / "private"), mode_of(remote / "shared")) == (0o750, 0o700, 0o755)
    assert mode_of(remote / "private" / ".env") == 0o600
    record = cluster.hosts[0].workdir / ".dlrun-cache" / f"{project.name}.json"
    assert (mode_of(record.parent), mode_of(record)) == (0o700, 0o600)
    caches = list((tmp_path / "cache").rglob("*.json"))
    assert caches and all(mode_of(c) == 0o600 for c in caches), [(c, oct(mode_of(c))) for c in caches]
    (project / "private").chmod(0o750)  # only a folder's mode changed: the next push says so too
    out = run_dlrun("push", *ssh, "--code", str(project), cwd=tmp_path, timeout=120,
                    env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert out.returncode == 0, out.stdout + out.stderr
    assert mode_of(remote / "private") == 0o750


def test_the_local_job_log_folder_is_private(tmp_path: Path) -> None:
    script = tmp_path / "ok.py"
    script.write_text("print('ok')\n")
    out = run_dlrun("launch", "--plain", "--framework", "none", "-n", "1", str(script), cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    (job,) = list((tmp_path / "dlrun-logs").iterdir())
    assert mode_of(job) == 0o700 and (job / "rank-0.log").is_file()


# --------------------------------------------------------------------------- workdir ownership


def other_user() -> tuple[int, int]:
    """A second local user, ``mallory``, who shares the hosts with the job's login user."""
    from support.sshd_cluster import ensure_test_user

    pw = ensure_test_user("mallory", Path("/var/lib/dlrun-mallory"))
    return pw.pw_uid, pw.pw_gid


def scratch_inventory(cluster: SshdCluster, path: Path, workdir: Path) -> Path:
    path.write_text(f'[defaults]\npython = "{cluster.python}"\n[[hosts]]\naddress = "{cluster.hosts[0].name}"\n'
                    f'slots = 1\nworkdir = "{workdir}"\n')
    return path


@pytest.mark.slow
@pytest.mark.ssh
def test_a_no_push_run_from_a_folder_another_user_made_first_is_refused(cluster: SshdCluster, tmp_path: Path) -> None:
    if not cluster.is_root:
        pytest.skip("needs root to make a second user")
    uid, gid = other_user()
    tag = secrets.token_hex(3)
    scratch = Path(f"/tmp/dlrun-scratch-{tag}")  # a shared /scratch: anyone may make folders, sticky
    scratch.mkdir()
    scratch.chmod(0o1777)
    try:
        planted = scratch / "proj"  # mallory made the folder the job runs from, and left a json.py
        planted.mkdir()
        planted.chmod(0o777)
        marker = scratch / f"pwned-{tag}"
        (planted / "json.py").write_text(f"open({str(marker)!r}, 'w').write('mallory')\ndumps = str\n")
        (planted / "train.py").write_text("import json\nprint('trained', json.dumps(1))\n")
        for path in (planted, planted / "json.py"):
            os.chown(path, uid, gid)
        hosts = scratch_inventory(cluster, tmp_path / "hosts.toml", scratch)
        ssh = ["--hosts", str(hosts), "--ssh-config", str(cluster.ssh_config), "--framework", "none", "--plain",
               "--no-push"]
        out = run_dlrun("launch", *ssh, str(planted / "train.py"), cwd=tmp_path, timeout=180)
        assert out.returncode == 2, out.stdout + out.stderr
        assert f"{planted} is owned by mallory, not by {cluster.user}" in out.stderr, out.stderr
        assert "--insecure-workdir" in out.stderr and "] trained" not in out.stdout
        assert not marker.exists()
        out = run_dlrun("launch", *ssh, "train.py", cwd=tmp_path, timeout=180)  # relative: in the sticky workdir
        assert out.returncode == 2 and f"{scratch} is writable by every user" in out.stderr, out.stdout + out.stderr
        out = run_dlrun("launch", *ssh, "--insecure-workdir", str(planted / "train.py"), cwd=tmp_path, timeout=180)
        assert out.returncode == 0, out.stdout + out.stderr
        assert marker.read_text() == "mallory"  # what the check prevents: the job ran mallory's json.py

        own = scratch / f"own-{tag}"  # a folder of one's own in the sticky scratch: fine
        own.mkdir()
        (own / "train.py").write_text("print('trained')\n")
        os.chown(own, *[pwd.getpwnam(cluster.user).pw_uid, pwd.getpwnam(cluster.user).pw_gid])
        out = run_dlrun("launch", *ssh, str(own / "train.py"), cwd=tmp_path, timeout=180)
        assert out.returncode == 0 and "[0 host0] trained" in out.stdout, out.stdout + out.stderr
    finally:
        subprocess.run(["rm", "-rf", str(scratch)], check=False)


@pytest.mark.ssh
def test_a_project_folder_another_user_made_first_is_refused(cluster: SshdCluster, tmp_path: Path) -> None:
    if not cluster.is_root:
        pytest.skip("needs root to make a second user")
    uid, gid = other_user()
    tag = secrets.token_hex(3)
    scratch = Path(f"/tmp/dlrun-scratch-{tag}")  # a shared /scratch: anyone may make folders, sticky
    scratch.mkdir()
    scratch.chmod(0o1777)
    try:
        project = tmp_path / f"proj-{tag}"
        project.mkdir()
        (project / "train.py").write_text("import json\nprint('trained', json.dumps(1))\n")
        planted = scratch / project.name  # mallory was there first, and left a json.py for `import json`
        planted.mkdir()
        planted.chmod(0o777)
        marker = scratch / f"pwned-{tag}"
        (planted / "json.py").write_text(f"open({str(marker)!r}, 'w').write('mallory')\ndumps = str\n")
        for path in (planted, planted / "json.py"):
            os.chown(path, uid, gid)
        hosts = scratch_inventory(cluster, tmp_path / "hosts.toml", scratch)
        ssh = ["--hosts", str(hosts), "--ssh-config", str(cluster.ssh_config), "--framework", "none", "--plain"]
        out = run_dlrun("launch", *ssh, str(project / "train.py"), cwd=tmp_path, timeout=180)
        assert out.returncode == 2, out.stdout + out.stderr
        assert f"{planted} is owned by mallory, not by {cluster.user}" in out.stderr, out.stderr
        assert "--insecure-workdir" in out.stderr and "] trained" not in out.stdout
        assert not marker.exists()
        out = run_dlrun("launch", *ssh, "--insecure-workdir", str(project / "train.py"), cwd=tmp_path, timeout=180)
        assert out.returncode == 0, out.stdout + out.stderr
        assert marker.read_text() == "mallory"  # what the check prevents: the job ran mallory's json.py

        fresh = tmp_path / f"fresh-{tag}"  # a project of one's own in the sticky scratch: fine
        fresh.mkdir()
        (fresh / "train.py").write_text("print('trained')\n")
        out = run_dlrun("launch", *ssh, str(fresh / "train.py"), cwd=tmp_path, timeout=180)
        assert out.returncode == 0 and "[0 host0] trained" in out.stdout, out.stdout + out.stderr
    finally:
        subprocess.run(["rm", "-rf", str(scratch)], check=False)


@pytest.mark.ssh
def test_a_workdir_others_may_write_is_refused_with_its_fix(cluster: SshdCluster, tmp_path: Path) -> None:
    workdir = cluster.hosts[0].workdir / f"open-{secrets.token_hex(3)}"
    workdir.mkdir()
    workdir.chmod(0o777)  # not sticky: another user could swap the project folder for theirs
    import pwd

    pw = pwd.getpwnam(cluster.user)
    os.chown(workdir, pw.pw_uid, pw.pw_gid)
    project = tmp_path / "proj"
    project.mkdir()
    (project / "train.py").write_text("print('trained')\n")
    hosts = scratch_inventory(cluster, tmp_path / "hosts.toml", workdir)
    out = run_dlrun("push", "--hosts", str(hosts), "--ssh-config", str(cluster.ssh_config), "--code", str(project),
                    cwd=tmp_path, timeout=180)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"{workdir} is writable by every user (mode 0777): chmod o-w {workdir}" in out.stderr, out.stderr
    assert not (workdir / "proj").exists()
    out = run_dlrun("push", "--hosts", str(hosts), "--ssh-config", str(cluster.ssh_config), "--code", str(project),
                    "--insecure-workdir", cwd=tmp_path, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (workdir / "proj" / "train.py").is_file()
