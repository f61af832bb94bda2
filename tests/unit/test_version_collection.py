"""A push's collection of old code trees (``push_helper.collect_versions``) against a job that
resolved a tree and pins it at the same moment (``agent.resolve_pinned``): the tree is either
kept (and never leaves its name) or the job runs in the newer one, never in a tree being removed."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from dlrun.remote import agent, push_helper


def two_versions(tmp_path: Path) -> tuple[Path, Path, Path]:
    """``<tmp>/proj`` -> v-2; v-1 holds only files v-2 has too (hard links): collectable."""
    vdir = tmp_path / ".dlrun-versions" / "proj"
    old, new = vdir / "v-1", vdir / "v-2"
    old.mkdir(parents=True)
    new.mkdir()
    (old / "train.py").write_text("print(1)\n")
    os.link(old / "train.py", new / "train.py")
    root = tmp_path / "proj"
    root.symlink_to(os.path.relpath(new, tmp_path))
    return root, old, new


def test_a_tree_pinned_after_the_collections_first_look_is_kept(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    root, old, new = two_versions(tmp_path)
    real_listdir = os.listdir
    pins: list[tuple[str, int]] = []

    def listdir_then_pin(path: str) -> list[str]:
        names = real_listdir(path)
        if not pins and Path(path) == old.parent:  # a job pins v-1 right after the collection listed
            pinned = agent.pin_tree(str(old))
            assert pinned
            pins.append(pinned)
        return names

    monkeypatch.setattr(os, "listdir", listdir_then_pin)
    monkeypatch.setattr(push_helper, "versions_in_use", lambda: set())
    push_helper.collect_versions(str(root), str(new))
    monkeypatch.undo()
    assert (old / "train.py").is_file()  # kept: the pin was seen on the last look
    assert not list(old.parent.glob("*.collecting"))  # and the push's mark taken back
    os.close(pins[0][1])
    os.unlink(pins[0][0])
    push_helper.collect_versions(str(root), str(new))
    assert not old.exists() and new.is_dir()  # unpinned: collected, and nothing of it left


@pytest.mark.parametrize("collection", ["marked", "removed"])
def test_a_job_whose_tree_is_collected_before_its_pin_runs_in_the_newer_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, collection: str) -> None:
    root, old, new = two_versions(tmp_path)
    (tmp_path / "proj").unlink()
    (tmp_path / "proj").symlink_to(os.path.relpath(old, tmp_path))  # the job resolves v-1 ...
    real_pin = agent.pin_tree

    def swapped_and_collected_first(folder: str) -> tuple[str, int] | None:
        if Path(folder) == old / "sub":  # ... then a push swaps v-2 in and collects v-1 before the pin
            (tmp_path / "proj").unlink()
            (tmp_path / "proj").symlink_to(os.path.relpath(new, tmp_path))
            (old.parent / "v-1.collecting").touch()  # the push's mark: it looks for pins next
            if collection == "removed":  # ... or it looked already and removed the tree
                shutil.rmtree(old)
        return real_pin(folder)

    monkeypatch.setattr(agent, "pin_tree", swapped_and_collected_first)
    (old / "sub").mkdir()  # ranks may run in a folder inside the tree: the mark is the tree's
    (new / "sub").mkdir()
    folder, pin = agent.resolve_pinned(str(root / "sub"))
    assert folder == str(new / "sub") and pin is not None and pin[0].startswith(str(new) + ".pin-")
    assert not list(old.parent.glob("v-1.pin-*"))  # the stale pin was taken back
    os.close(pin[1])


def test_a_process_that_entered_the_tree_after_the_first_look_keeps_it(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    root, old, new = two_versions(tmp_path)
    looks = iter([set(), {str(old)}])  # a keeper chdir'd into it between the push's two looks
    monkeypatch.setattr(push_helper, "versions_in_use", lambda: next(looks))
    push_helper.collect_versions(str(root), str(new))
    assert (old / "train.py").is_file() and not list(old.parent.glob("*.collecting"))
