from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

from dlrun.inventory import load_inventory

from support.cli import REPO, run_dlrun


@pytest.mark.parametrize("framework", ["tf", "tf-ps", "horovod", "torch"])
def test_init_writes_valid_inventory_and_script(tmp_path: Path, framework: str) -> None:
    out = run_dlrun("init", "--framework", framework, str(tmp_path / "proj"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    hosts = tmp_path / "proj" / "hosts.toml"
    inventory = load_inventory(str(hosts))
    assert inventory.hosts
    if framework == "tf-ps":
        assert {h.role for h in inventory.hosts} >= {"chief", "worker", "ps"}
    ast.parse((tmp_path / "proj" / "train.py").read_text())
    assert f"next: edit {hosts}, then: dlrun launch" in out.stdout and f"--hosts {hosts} " in out.stdout


def test_init_refuses_to_overwrite_without_force(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("mine\n")
    out = run_dlrun("init", str(tmp_path), cwd=tmp_path)
    assert out.returncode == 2 and "already exists" in out.stderr and "--force" in out.stderr
    assert (tmp_path / "train.py").read_text() == "mine\n"
    assert not (tmp_path / "hosts.toml").exists()  # nothing written
    out = run_dlrun("init", "--force", str(tmp_path), cwd=tmp_path)
    assert out.returncode == 0 and (tmp_path / "train.py").read_text() != "mine\n"


def test_every_inventory_key_is_documented_in_the_template() -> None:
    text = (REPO / "hosts.example.toml").read_text()
    doc = tomllib.loads(text)
    for key in ("user", "port", "identity_file", "python", "workdir", "env"):
        assert key in doc["defaults"]
    documented = " ".join(text.split())
    for key in ("address", "name", "slots", "role"):
        assert f"{key} =" in documented


@pytest.mark.slow
def test_tf_template_trains_on_two_local_workers(tmp_path: Path) -> None:
    pytest.importorskip("tf_keras")
    assert run_dlrun("init", str(tmp_path), cwd=tmp_path).returncode == 0
    out = run_dlrun("launch", "--plain", "train.py", cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "done:" in out.stdout
