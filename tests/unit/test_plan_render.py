from __future__ import annotations

import json
from typing import Any

import pytest

from dlrun.errors import PlanError
from dlrun.inventory import Host, Inventory, parse_inline, parse_toml_inventory
from dlrun.plan import Plan, make_plan
from dlrun.render import dlrun_env, mask_env, plan_to_json, tf_config, torch_env, worker_argv, worker_commands


def plan_for(spec: str, **kw: Any) -> Plan:
    return make_plan(parse_inline(spec), job_id="job1", **kw)


def test_ranks_host_by_host_with_horovod_cross_ranks() -> None:
    plan = plan_for("a:3,b:1,c:2")
    got = [(r.rank, r.host.name, r.local_rank, r.local_size, r.cross_rank, r.cross_size) for r in plan.ranks]
    assert got == [
        (0, "a", 0, 3, 0, 3),
        (1, "a", 1, 3, 0, 2),
        (2, "a", 2, 3, 0, 1),
        (3, "b", 0, 1, 1, 3),
        (4, "c", 0, 2, 2, 3),
        (5, "c", 1, 2, 1, 2),
    ]


def test_np_uses_first_slots_and_rejects_too_many() -> None:
    plan = plan_for("a:2,b:2", np=3)
    assert [(r.host.name, r.local_rank) for r in plan.ranks] == [("a", 0), ("a", 1), ("b", 0)]
    assert plan.ranks[2].local_size == 1
    with pytest.raises(PlanError, match="--np 5 needs 5 slots"):
        plan_for("a:2,b:2", np=5)


def test_ports_per_local_rank_and_unique_on_loopback() -> None:
    plan = plan_for("a:2,b:2", base_port=30000)
    assert [r.port for r in plan.ranks] == [30000, 30001, 30000, 30001]
    loop = make_plan(parse_inline("127.0.0.2:2,127.0.0.3:2"), job_id="j", base_port=30000)
    assert [r.port for r in loop.ranks] == [30000, 30001, 30002, 30003]


def test_tf_config_for_multiworker_mirrored() -> None:
    plan = plan_for("a:2,b:1", addresses={"a": "10.0.0.1", "b": "10.0.0.2"})
    cfg = tf_config(plan, plan.ranks[2])
    assert cfg == {"cluster": {"worker": ["10.0.0.1:23456", "10.0.0.1:23457", "10.0.0.2:23456"]},
                   "task": {"type": "worker", "index": 2}}
    assert isinstance(cfg["task"]["index"], int)


def roles_inventory() -> Inventory:
    return parse_toml_inventory(
        '[[hosts]]\naddress = "c"\nrole = "chief"\n'
        '[[hosts]]\naddress = "w"\nrole = "worker"\nslots = 2\n'
        '[[hosts]]\naddress = "p"\nrole = "ps"\n'
        '[[hosts]]\naddress = "e"\nrole = "evaluator"\n'
    )


def test_tf_config_parameter_server_layout() -> None:
    plan = make_plan(roles_inventory(), job_id="j", framework="tf-ps")
    cfg = tf_config(plan, plan.ranks[2])
    # no evaluator in the cluster: the chief would wait for a server there (the evaluator runs the script)
    assert cfg["cluster"] == {"chief": ["c:23456"], "worker": ["w:23456", "w:23457"], "ps": ["p:23456"]}
    assert cfg["task"] == {"type": "worker", "index": 1}
    assert tf_config(plan, plan.ranks[-1]) == {"cluster": cfg["cluster"], "task": {"type": "evaluator", "index": 0}}
    assert plan.chief.host.name == "c"
    with pytest.raises(PlanError, match="role = 'chief'"):
        make_plan(parse_inline("a:2"), job_id="j", framework="tf-ps")
    chief_and_ps = parse_toml_inventory('[[hosts]]\naddress = "c"\nrole = "chief"\n'
                                        '[[hosts]]\naddress = "p"\nrole = "ps"\n')
    with pytest.raises(PlanError, match="one or more workers"):  # the chief would have nobody to drive
        make_plan(chief_and_ps, job_id="j", framework="tf-ps")
    with pytest.raises(PlanError, match="role = 'ps' needs --framework tf-ps"):
        make_plan(roles_inventory(), job_id="j", framework="tf")
    for other in ("none", "torch"):  # an inventory written for tf-ps still runs other jobs
        assert make_plan(roles_inventory(), job_id="j", framework=other).world_size == 5


def test_tf_config_is_accepted_by_tensorflows_resolver(monkeypatch: pytest.MonkeyPatch) -> None:
    tf = pytest.importorskip("tensorflow")
    resolver_cls = tf.distribute.cluster_resolver.TFConfigClusterResolver
    plan = make_plan(roles_inventory(), job_id="j", framework="tf-ps")
    for spec in plan.ranks:
        env = worker_commands(plan, "t.py", [], python_for={h.name: ["python3"] for h in plan.hosts})[spec.rank].env
        monkeypatch.setenv("TF_CONFIG", env["TF_CONFIG"])
        resolver = resolver_cls()
        assert resolver.task_type == spec.task_type
        assert resolver.task_id == spec.task_index
        cluster = resolver.cluster_spec().as_dict()
        assert cluster["worker"] == ["w:23456", "w:23457"] and cluster["ps"] == ["p:23456"]
    mwms = plan_for("a:2,b:2")
    monkeypatch.setenv("TF_CONFIG", json.dumps(tf_config(mwms, mwms.ranks[3])))
    resolver = resolver_cls()
    assert (resolver.task_type, resolver.task_id) == ("worker", 3)
    assert resolver.cluster_spec().num_tasks("worker") == 4


def test_env_layers_and_dlrun_variables() -> None:
    inv = parse_toml_inventory(
        '[defaults]\nenv = { A = "d", B = "d" }\n[[hosts]]\naddress = "h"\nenv = { B = "h" }\n'
    )
    plan = make_plan(inv, job_id="J")
    (cmd,) = worker_commands(plan, "train.py", ["--x", "1"], python_for={"h": ["/venv/bin/python"]},
                             extra_env={"C": "x"})
    assert cmd.argv == ("/venv/bin/python", "train.py", "--x", "1")
    assert cmd.env["A"] == "d" and cmd.env["B"] == "h" and cmd.env["C"] == "x"
    assert dlrun_env(plan, plan.ranks[0]) == {
        "DLRUN_RANK": "0", "DLRUN_LOCAL_RANK": "0", "DLRUN_WORLD_SIZE": "1", "DLRUN_LOCAL_WORLD_SIZE": "1",
        "DLRUN_HOST": "h", "DLRUN_JOB_ID": "J", "DLRUN_RESTART_COUNT": "0"}
    assert cmd.env["PYTHONUNBUFFERED"] == "1"
    (quiet,) = worker_commands(plan, "t.py", [], python_for={"h": ["p"]}, extra_env={"PYTHONUNBUFFERED": ""})
    assert quiet.env["PYTHONUNBUFFERED"] == ""
    assert json.loads(cmd.env["TF_CONFIG"])["task"] == {"type": "worker", "index": 0}


def test_non_python_commands_run_as_given() -> None:
    assert worker_argv("./run", ["a b"], ["python3"]) == ("./run", "a b")
    assert worker_argv("./run.sh", ["a b"], ["python3"], no_python=True) == ("./run.sh", "a b")
    assert worker_argv("bash", ["-c", "echo hi"], ["python3"]) == ("bash", "-c", "echo hi")


def test_torch_env() -> None:
    plan = make_plan(parse_inline("a:2,b:2"), job_id="j", framework="torch", addresses={"a": "10.1.1.1"})
    env = torch_env(plan, plan.ranks[3])
    assert env == {"MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "23456", "RANK": "3", "WORLD_SIZE": "4",
                   "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2",
                   "ROLE_NAME": "default", "ROLE_RANK": "3", "ROLE_WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "j",
                   "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
                   "TORCHELASTIC_ERROR_FILE": "/tmp/dlrun-j/attempt_0/3/error.json"}
    cmds = worker_commands(plan, "t.py", [], python_for={"a": ["p"], "b": ["p"]})
    assert cmds[0].env["OMP_NUM_THREADS"] == "1"
    # a restart is a new attempt of the same run, as under torchrun
    again = make_plan(parse_inline("a:2,b:2"), job_id="j-r1", framework="torch", restart_count=1, max_restarts=2,
                      run_id="j")
    env = torch_env(again, again.ranks[0])
    assert (env["TORCHELASTIC_RUN_ID"], env["TORCHELASTIC_RESTART_COUNT"], env["TORCHELASTIC_MAX_RESTARTS"]) == (
        "j", "1", "2")


def test_secrets_masked_everywhere() -> None:
    env = {"WANDB_API_KEY": "abc", "HF_TOKEN": "t", "DB_PASSWORD": "p", "MY_SECRET": "s", "PLAIN": "v"}
    assert mask_env(env) == {"WANDB_API_KEY": "****", "HF_TOKEN": "****", "DB_PASSWORD": "****",
                             "MY_SECRET": "****", "PLAIN": "v"}
    more = {n: "s3" for n in ("DB_PASS", "MYSQL_PWD", "SMTP_PASSWD", "GIT_CREDENTIALS", "HTTP_AUTH", "SSH_PRIVATE")}
    assert set(mask_env(more).values()) == {"****"}
    urls = {"DATABASE_URL": "postgres://u:s7@db/x", "PIP_INDEX_URL": "https://tok:s8@pypi.example/simple",
            "MASTER": "spark://m:7077", "NOTE": "a:b@c", "AT": "postgres://u:p@ss@db/x",
            "SLASH": "redis://u:pa/ss@h:6379/0", "TWO": "http://a:b@h1/x http://c:d@h2/y"}
    assert mask_env(urls) == {
        "DATABASE_URL": "postgres://u:****@db/x", "PIP_INDEX_URL": "https://tok:****@pypi.example/simple",
        "MASTER": "spark://m:7077", "NOTE": "a:b@c", "AT": "postgres://u:****@db/x",
        "SLASH": "redis://u:****@h:6379/0", "TWO": "http://a:****@h1/x http://c:****@h2/y"}
    plan = make_plan(Inventory(hosts=(Host(address="h", name="h", env={"HF_TOKEN": "hunter2"}),)), job_id="j")
    doc = plan_to_json(worker_commands(plan, "t.py", [], python_for={"h": ["python3"]}))
    assert "hunter2" not in json.dumps(doc)


HETERO_NICS = """
[[hosts]]
address = "10.0.0.1"
iface = "eth0"
slots = 2

[[hosts]]
address = "10.0.0.2"
iface = "enp65s0f1"
env = { NCCL_SOCKET_IFNAME = "ib0" }

[[hosts]]
address = "10.0.0.3"
"""


def socket_vars(framework: str, iface: str | None = None, found: dict[str, str] | None = None) -> list[dict[str, str]]:
    from dlrun.run.addresses import socket_ifaces

    plan = make_plan(parse_toml_inventory(HETERO_NICS), job_id="j", framework=framework)
    commands = worker_commands(plan, "t.py", [], python_for={h.name: ["python3"] for h in plan.hosts},
                               rendezvous=("10.0.0.9", 1), ifaces=socket_ifaces(plan, iface, found or {}))
    names = ("GLOO_SOCKET_IFNAME", "HOROVOD_GLOO_IFACE", "NCCL_SOCKET_IFNAME")
    return [{k: c.env[k] for k in names if k in c.env} for c in commands]


def test_each_host_names_its_own_socket_interface() -> None:
    # hosts need not share NIC names: each gets its own; a value the user set stays
    assert socket_vars("torch") == [
        {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"},
        {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"},
        {"GLOO_SOCKET_IFNAME": "enp65s0f1", "NCCL_SOCKET_IFNAME": "ib0"},
        {},
    ]
    assert [v.get("HOROVOD_GLOO_IFACE") for v in socket_vars("horovod")] == ["eth0", "eth0", "enp65s0f1", None]
    assert [v.get("NCCL_SOCKET_IFNAME") for v in socket_vars("tf")] == ["eth0", "eth0", "ib0", None]
    assert socket_vars("none") == [{}, {}, {"NCCL_SOCKET_IFNAME": "ib0"}, {}]


def test_found_interface_goes_to_gloo_only_and_named_ones_win() -> None:
    # found by the preflight (the interface holding the address dlrun reached the host at):
    # Gloo must bind there; NCCL keeps its own choice (it prefers InfiniBand and fast NICs)
    found = {"10.0.0.1": "bond0", "10.0.0.2": "bond0", "10.0.0.3": "ens7"}
    assert socket_vars("torch", found=found)[3] == {"GLOO_SOCKET_IFNAME": "ens7"}
    assert socket_vars("tf", found=found)[3] == {}
    assert socket_vars("torch", found=found)[0]["GLOO_SOCKET_IFNAME"] == "eth0"  # the inventory's
    assert socket_vars("torch", "em1", found)[3] == {"GLOO_SOCKET_IFNAME": "em1", "NCCL_SOCKET_IFNAME": "em1"}


def test_every_rank_on_loopback_uses_lo() -> None:
    from dlrun.run.addresses import socket_ifaces

    plan = make_plan(parse_inline("127.0.0.2:1,127.0.0.3:1"), job_id="j", framework="horovod")
    assert {h: i.name for h, i in socket_ifaces(plan, None, {"127.0.0.2": "eth0"}).items()} == {
        "127.0.0.2": "lo", "127.0.0.3": "lo"}


def test_interfaces_at_finds_the_one_holding_the_hosts_address() -> None:
    # this machine's own probe: the interface holding each of its IPv4 addresses
    from dlrun.run.addresses import interfaces_at
    from dlrun.topo.probe import probe_local

    report = probe_local("here")
    assert report.error is None, report.error
    for iface in report.interfaces:
        for ipv4 in iface.ipv4:
            assert interfaces_at([report], {"here": ipv4}) == {"here": iface.name}
    assert interfaces_at([report], {"here": "localhost"}) == {"here": "lo"}  # a name is resolved
    assert interfaces_at([report], {"here": "192.0.2.77"}) == {}  # TEST-NET: nobody holds it


def test_local_hosts_in_a_job_with_remote_ones_get_the_address_facing_them(monkeypatch: pytest.MonkeyPatch) -> None:
    # MASTER_ADDR, TF_CONFIG and HOROVOD_HOSTNAME at 127.0.0.1 would send the remote ranks to themselves
    import dlrun.run.addresses
    from dlrun.run.addresses import reachable_addresses

    mixed = parse_inline("localhost:1,10.0.0.5:1").hosts
    monkeypatch.setattr(dlrun.run.addresses, "facing_address",
                        lambda remote: "10.0.0.9" if remote == ["10.0.0.5"] else "")
    assert reachable_addresses(mixed, {"localhost": "127.0.0.1"}) == {"localhost": "10.0.0.9", "10.0.0.5": "10.0.0.5"}
    plan = make_plan(parse_inline("localhost:1,10.0.0.5:1"), job_id="j", framework="torch",
                     addresses=reachable_addresses(mixed, {}))
    assert torch_env(plan, plan.ranks[1])["MASTER_ADDR"] == "10.0.0.9"
    monkeypatch.setattr(dlrun.run.addresses, "facing_address", lambda remote: "0.0.0.0")  # no route: left as found
    assert reachable_addresses(mixed, {"localhost": "127.0.0.1"})["localhost"] == "127.0.0.1"
    monkeypatch.undo()
    # hosts on loopback addresses (the sshd test cluster) keep theirs, and so does this machine
    on_loopback = (Host(address="localhost", name="localhost"), Host(address="127.0.0.2", name="h", port=2222))
    assert reachable_addresses(on_loopback, {"localhost": "127.0.0.1"}) == {"localhost": "127.0.0.1", "h": "127.0.0.2"}
    assert reachable_addresses(parse_inline("localhost:2").hosts, {}) == {"localhost": "localhost"}
