"""A detached job's keeper on a host whose home is read-only: one line naming the folder and why,
not a Python traceback (``dlrun.remote.keeper.main``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from dlrun.remote import boot_argv, boot_payload

from support.mounts import tmpfs


def test_a_read_only_home_is_named_in_one_line(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "home", "ro,size=1m") as home:
        config = {"job_id": "j1", "host": "h", "leader": False}
        out = subprocess.run(boot_argv([sys.executable], "keeper"), input=boot_payload("keeper")
                             + json.dumps(config).encode() + b"\n", capture_output=True, timeout=60,
                             env={**os.environ, "HOME": str(home)})
    err = out.stderr.decode()
    assert out.returncode == 1 and "Traceback" not in err, err
    assert err.strip() == (f"dlrun-keeper: cannot make the job's folder {home}/.dlrun: the file system is read-only"
                           " (a detached job keeps its logs and state under ~/.dlrun/jobs on each host; run attached,"
                           " or give the login user a writable home)"), err
