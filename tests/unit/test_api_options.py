"""The grouped Python API: ``dlrun.launch``'s width, the option records named as ``--help``'s
sections, and one mapping from the command line's options to those records to ``LaunchConfig``."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
import pytest

import dlrun
from dlrun import api, options
from dlrun.cli import LAUNCH_KEYWORDS, SECTIONS, launch_arguments, main
from dlrun.errors import UsageError
from dlrun.options import JobOptions, OutputOptions, PushOptions, SparkOptions, SSHOptions, check_backend
from dlrun.plan import DEFAULT_HOST_TIMEOUT
from dlrun.run.config import LaunchConfig
from dlrun.transport.factory import SSHOptions as SSHSettings

RECORDS = {"Job": JobOptions, "Output": OutputOptions, "SSH": SSHOptions, "Push": PushOptions, "Spark": SparkOptions}


def test_dlrun_launch_takes_at_most_20_parameters() -> None:
    parameters = inspect.signature(dlrun.launch).parameters
    assert len(parameters) <= 20, list(parameters)
    assert not any(p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) for p in parameters.values())


def test_every_api_function_takes_the_one_ssh_record() -> None:
    for function in (api.launch, api.topo, api.push, api.pull, api.ps, api.logs, api.attach, api.stack, api.stop):
        parameters = inspect.signature(function).parameters
        assert parameters["ssh"].annotation == "SSHOptions | None", function.__name__
        assert not any(p.kind is p.VAR_KEYWORD for p in parameters.values()), function.__name__
        assert not {"ssh_config", "known_hosts", "connect_timeout", "transport"} & set(parameters), function.__name__


def test_the_records_are_frozen_and_exported() -> None:
    for record in RECORDS.values():
        assert getattr(dlrun, record.__name__) is record and record.__name__ in dlrun.__all__
        assert record.__dataclass_params__.frozen
    with pytest.raises(dataclasses.FrozenInstanceError):
        JobOptions().grace = 1  # type: ignore[misc]


def launch_options() -> dict[str, tuple[str, str]]:
    """Each option of ``dlrun launch``: its name → (its ``--help`` section, its first flag)."""
    command = main.commands["launch"]
    return {p.name: (getattr(p, "group", ""), p.opts[0]) for p in command.params
            if isinstance(p, click.Option) and p.name and p.name != "help"}


def test_each_launch_option_is_one_field_of_its_sections_record_or_a_keyword() -> None:
    seen: set[str] = set()
    for name, (section, flag) in launch_options().items():
        if name in LAUNCH_KEYWORDS:
            assert name in inspect.signature(api.launch).parameters, flag
            continue
        if name == "backend":  # --backend spark: the Spark record given
            continue
        assert section in SECTIONS and section in RECORDS, (flag, section)
        holders = [r for r in RECORDS.values() if name in {f.name for f in dataclasses.fields(r)}]
        assert holders == [RECORDS[section]], (flag, section, holders)
        seen.add(name)
    every_field = {f.name for r in RECORDS.values() for f in dataclasses.fields(r)}
    assert every_field == seen  # no field that the command line cannot set


def parsed(argv: Sequence[str]) -> dict[str, Any]:
    """``dlrun launch ARGV``'s options as the command gets them, mapped to ``dlrun.launch``'s arguments."""
    with main.commands["launch"].make_context("launch", list(argv)) as ctx:
        settings = dict(ctx.params)
    return launch_arguments(settings.pop("script"), settings.pop("args"), settings)


def config_of(argv: Sequence[str]) -> LaunchConfig:
    return api.launch_config(**parsed(argv))


def test_a_plain_command_line_gives_the_default_config() -> None:
    arguments = parsed(["train.py"])
    assert arguments["spark"] is None and arguments["job"] == JobOptions() and arguments["ssh"] == SSHOptions()
    assert arguments["output"] == OutputOptions() and arguments["push"] == PushOptions()
    assert config_of(["train.py"]) == LaunchConfig(script="train.py", framework="auto", ssh=SSHSettings())


def test_a_full_hosts_command_line_gives_the_config_it_gave_before(tmp_path: Path) -> None:
    (tmp_path / "proj").mkdir()
    (tmp_path / "ds").mkdir()
    env_file = tmp_path / "job.env"
    env_file.write_text("B=2\nA=0\n")
    env_file.chmod(0o600)
    argv = ["-H", "h1:2,h2:2", "-n", "4", "--framework", "torch", "-e", "A=1", "--env-file", str(env_file),
            "--base-port", "3000", "--iface", "eth1", "--grace", "5", "--max-restarts", "2", "--min-hosts", "1",
            "--checkpoint-dir", "ckpt", "--checkpoint-dir", "out/ckpt", "--no-pidns", "--bench", "--bench-seconds",
            "20", "--hang-timeout", "30", "--log-dir", "L", "--ranks", "0,2", "--plain", "--gpu-every", "0.5",
            "--gpu-idle-after", "10", "--ssh-config", "cfg", "--known-hosts", "kh", "--accept-new-host-keys",
            "--connect-timeout", "3", "--host-timeout", "0", "--transport", "ssh", "--code", str(tmp_path / "proj"),
            "--max-push-size", "1G", "--setup", "pip install .", "--setup-always", "--insecure-workdir",
            "--data", str(tmp_path / "ds"), "--shard", "size", "train.py", "--epochs", "3"]
    assert config_of(argv) == LaunchConfig(
        script="train.py", args=("--epochs", "3"), hosts="h1:2,h2:2", np=4, base_port=3000, framework="torch",
        log_dir="L", grace=5.0, ranks_shown=(0, 2), env={"B": "2", "A": "1"},
        ssh=SSHSettings(config_file="cfg", accept_new_host_keys=True, connect_timeout=3.0, known_hosts="kh",
                        host_timeout=0.0, host_timeout_given=True, transport="ssh"),
        pidns=False, plain=True, iface="eth1", bench=20.0, data=str(tmp_path / "ds"), shard="size",
        max_restarts=2, min_hosts=1, code=str(tmp_path / "proj"), max_push_size="1G", setup="pip install .",
        setup_always=True, gpu_every=0.5, gpu_idle_after=10.0, insecure_workdir=True,
        checkpoint_dirs=("ckpt", "out/ckpt"), hang_timeout=30.0)


def test_a_dry_run_of_a_module_and_a_detached_job_give_the_configs_they_gave_before() -> None:
    argv = ["--dry-run", "--json", "-m", "--no-preflight", "--no-push", "pkg.train", "--lr", "1"]
    assert config_of(argv) == LaunchConfig(script="pkg.train", args=("--lr", "1"), framework="auto", dry_run=True,
                                           json_output=True, preflight=False, push=False, module=True,
                                           ssh=SSHSettings())
    assert config_of(["-d", "--no-python", "--host-timeout", "60", "./run.sh"]) == LaunchConfig(
        script="./run.sh", framework="auto", detach=True, no_python=True,
        ssh=SSHSettings(host_timeout=60.0, host_timeout_given=True))


def test_a_spark_command_line_gives_the_spark_record_and_config() -> None:
    argv = ["--backend", "spark", "--master", "local[2]", "-n", "3", "--conf", "a=b", "--cores-per-worker", "2",
            "--start-timeout", "30", "--host-timeout", "9", "--grace", "2", "train.py"]
    arguments = parsed(argv)
    assert arguments["spark"] == SparkOptions(master="local[2]", cores_per_worker=2, conf={"a": "b"},
                                              start_timeout=30.0)
    assert config_of(argv) == LaunchConfig(script="train.py", np=3, framework="auto", grace=2.0,
                                           ssh=SSHSettings(host_timeout=9.0, host_timeout_given=True))
    spark = api.spark_config(arguments["spark"], 3)
    assert (spark.master, spark.num_workers, spark.cores_per_worker, spark.gpus_per_worker, spark.conf,
            spark.start_timeout) == ("local[2]", 3, 2, 0, {"a": "b"}, 30.0)
    assert api.spark_config(SparkOptions(master="local[2]"), None).num_workers == 2
    with pytest.raises(UsageError, match="--backend spark needs --master URL"):
        parsed(["--backend", "spark", "train.py"])


def test_options_only_the_ssh_backend_takes_are_refused_with_spark_in_one_check() -> None:
    spark = SparkOptions(master="local[2]")
    check_backend(None, JobOptions(grace=1, max_restarts=2, hang_timeout=3), SSHOptions(host_timeout=5),
                  PushOptions(), spark)  # what Spark takes too
    check_backend("h1,h2", JobOptions(detach=True, module=True), SSHOptions(transport="ssh"),
                  PushOptions(data="ds"), None)  # the hosts backend takes everything
    for job, ssh, push, words in (
            (JobOptions(), SSHOptions(), PushOptions(data="ds"), "--data goes with the SSH backend"),
            (JobOptions(base_port=3000), SSHOptions(), PushOptions(push=False), "--push/--no-push, --base-port go"),
            (JobOptions(module=True, detach=True, checkpoint_dir=("c",)), SSHOptions(), PushOptions(),
             "--module, --detach, --checkpoint-dir go"),
            (JobOptions(min_hosts=1), SSHOptions(ssh_config="cfg", transport="srun"), PushOptions(),
             "--ssh-config, --min-hosts, --transport go")):
        with pytest.raises(UsageError, match=words):
            check_backend(None, job, ssh, push, spark)
    with pytest.raises(UsageError, match="drop --hosts"):
        check_backend("h1", JobOptions(), SSHOptions(), PushOptions(), spark)
    with pytest.raises(UsageError, match="--detach goes with the SSH backend"):  # the API's own path
        dlrun.launch("train.py", job=JobOptions(detach=True), spark=spark)


def test_the_ssh_record_becomes_the_transports_settings() -> None:
    assert api.ssh_settings(None) == SSHSettings() == api.ssh_settings(SSHOptions())
    assert SSHSettings().host_timeout == DEFAULT_HOST_TIMEOUT
    assert api.ssh_settings(SSHOptions(ssh_config="c", known_hosts="k", accept_new_host_keys=True,
                                       connect_timeout=2, host_timeout=7, transport="srun")) == SSHSettings(
        config_file="c", known_hosts="k", accept_new_host_keys=True, connect_timeout=2, host_timeout=7,
        host_timeout_given=True, transport="srun")
    with pytest.raises(UsageError, match="--transport rsh: expected one of auto, ssh, srun"):
        SSHOptions(transport="rsh")
    assert options.TRANSPORTS == ("auto", "ssh", "srun")


def test_the_records_carry_the_apis_checks() -> None:
    for kwargs, words in (({"output": OutputOptions(json_output=True)}, "--json goes with --dry-run"),
                          ({"job": JobOptions(module=True, no_python=True)}, "exclude each other"),
                          ({"job": JobOptions(bench=True, preflight=False)}, "--bench runs after the preflight"),
                          ({"job": JobOptions(hang_timeout=-1)}, "--hang-timeout takes seconds"),
                          ({"output": OutputOptions(gpu_every=-1)}, "--gpu-every and --gpu-idle-after")):
        with pytest.raises(UsageError, match=words):
            api.launch_config("train.py", **kwargs)


def test_dlrun_stacks_json_answer_is_read_into_one_record() -> None:
    from dlrun.run.stackcmd import StackReport, stack_report

    attached = {"summary": ["ranks 0-1: train.py:3"], "cause": "rank 1", "folder": "/tmp/logs/stacks",
                "notes": {"b": "py-spy not shipped"}, "methods": ["py-spy"]}
    assert stack_report(attached) == StackReport(("ranks 0-1: train.py:3",), "rank 1", ("/tmp/logs/stacks",),
                                                 {"b": "py-spy not shipped"}, ("py-spy",))
    detached: dict[str, Any] = {"summary": [], "cause": None, "folder": None, "notes": {}, "methods": [],
                "folders": ["a:/j/stacks", "b:/j/stacks"]}
    assert stack_report(detached) == StackReport(folders=("a:/j/stacks", "b:/j/stacks"))
    assert inspect.signature(api.stack).return_annotation == "StackReport"
