"""Where ``dlrun pull`` puts a file (``dlrun.push.pull._make_parents``): the folders above it,
made by several hosts' fetches at once, and what is never replaced."""

from __future__ import annotations

from pathlib import Path

import pytest

from dlrun.push.pull import _make_parents


def test_a_folder_another_host_made_a_moment_ago_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    made_by_other = tmp_path / "out"
    real_is_dir = Path.is_dir
    asked: list[Path] = []

    def is_dir_then_made(self: Path) -> bool:
        if self == made_by_other and not asked:  # checked just before the other host's mkdir
            asked.append(self)
            made_by_other.mkdir()
            return False
        return real_is_dir(self)

    monkeypatch.setattr(Path, "is_dir", is_dir_then_made)
    _make_parents(tmp_path / "out" / "sub" / "weights.bin", tmp_path)
    assert asked and (tmp_path / "out" / "sub").is_dir()


def test_a_file_or_a_link_where_a_folder_belongs_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "out").write_text("a file")
    with pytest.raises(FileExistsError):
        _make_parents(tmp_path / "out" / "config.json", tmp_path)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "linked").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(NotADirectoryError, match="link is in the way"):
        _make_parents(tmp_path / "linked" / "config.json", tmp_path)
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_many_hosts_making_the_same_folders_at_once(tmp_path: Path) -> None:
    import threading

    for round_ in range(20):
        root = tmp_path / str(round_)
        root.mkdir()
        start = threading.Barrier(8)
        errors: list[BaseException] = []

        def fetch(i: int, root: Path = root, start: threading.Barrier = start,
                  errors: list[BaseException] = errors) -> None:
            start.wait()
            try:
                _make_parents(root / "out" / "a" / "b" / f"{i}.bin", root)
            except OSError as exc:
                errors.append(exc)

        threads = [threading.Thread(target=fetch, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
