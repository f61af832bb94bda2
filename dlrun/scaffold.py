"""``dlrun init``: write a commented ``hosts.toml`` and a training script for a framework.

The templates live in ``dlrun/templates/`` (also reachable as ``templates/`` at the top of the
repository). Existing files are never overwritten unless ``force`` is given.
"""

from __future__ import annotations

from pathlib import Path

from dlrun.errors import UsageError

TEMPLATES = Path(__file__).resolve().parent / "templates"
SCRIPTS = {
    "tf": "train_tf.py",
    "tf-ps": "train_tf_ps.py",
    "horovod": "train_horovod.py",
    "torch": "train_torch.py",
}


def init_files(framework: str) -> dict[str, str]:
    """Target name → template name for a framework (pure)."""
    if framework not in SCRIPTS:
        raise UsageError(f"no template for framework {framework!r} (choose from {', '.join(SCRIPTS)})")
    hosts = "hosts-tf-ps.toml" if framework == "tf-ps" else "hosts.toml"
    return {"hosts.toml": hosts, "train.py": SCRIPTS[framework]}


def write_project(directory: Path, framework: str = "tf", *, force: bool = False) -> list[Path]:
    """Write the files; refuse (and write nothing) if one exists and ``force`` is not set."""
    files = init_files(framework)
    targets = {directory / name: TEMPLATES / template for name, template in files.items()}
    existing = [t for t in targets if t.exists()]
    if existing and not force:
        raise UsageError(
            f"{', '.join(str(p) for p in existing)} already exist{'s' if len(existing) == 1 else ''}; nothing written",
            hint="pass --force to overwrite",
        )
    directory.mkdir(parents=True, exist_ok=True)
    for target, template in targets.items():
        target.write_text(template.read_text(encoding="utf-8"), encoding="utf-8")
    return list(targets)
