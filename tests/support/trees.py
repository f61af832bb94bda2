"""Folders of files that tests push, written from a mapping of relative path to content."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path


def make_tree(root: Path, files: Mapping[str, str | bytes]) -> None:
    """Write each relative path under ``root`` (folders made as needed): text as text, bytes as bytes."""
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
