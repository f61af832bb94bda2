"""The job's log folder on this machine (``dlrun-logs/<job>/``): the user's own and private.
The setup step and the launch both make it; whichever comes first makes it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from dlrun.errors import UsageError


def private_folder(path: Path) -> None:
    """Make ``path`` (mode 0700, its parents as usual), or take it when it is this user's own
    folder, not a link. Another user who made it first under a shared ``dlrun-logs/`` would get
    the ranks' lines, which may hold secrets: a ``UsageError`` instead."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o700)
        return
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise UsageError(f"the job's log folder {path} is there already and is not a folder of yours",
                          hint="pass --log-dir to a folder of your own")
    path.chmod(0o700)
