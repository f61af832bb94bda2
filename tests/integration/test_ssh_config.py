"""dlrun.transport.ssh_config against OpenSSH itself: a corpus of ssh configs, each host looked up
by dlrun and by ``ssh -G`` run here, every field dlrun uses compared; the fallback parser (no
``ssh`` binary) on the same corpus, where it differs only as README's "SSH" section says."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dlrun.errors import UsageError
from dlrun.transport.ssh_config import HostConfig, Request, SSHConfigReader

from support.cli import run_dlrun

SSH = shutil.which("ssh")
pytestmark = pytest.mark.skipif(SSH is None, reason="no ssh binary (OpenSSH client)")
HOME = os.path.expanduser("~")


@dataclass(frozen=True)
class Case:
    files: dict[str, str]  # name -> text; "config" is the one passed as -F; {dir} is the folder
    requests: tuple[Request, ...]
    fallback_differs: dict[str, set[str]] = field(default_factory=dict)  # alias -> fields (README lists why)


CORPUS = {
    "include in a Host block, Include=, trailing comments": Case(
        files={
            "config": "Include={dir}/top.conf\n"
                      "Host inc\n"
                      "    Include {dir}/inc.conf   # only for inc\n"
                      "    Include {dir}/inner.conf\n"
                      "Host *\n"
                      "    User everyone  # a trailing comment\n"
                      "    Port 2022 #another\n",
            "inc.conf": "HostName Included.Example.ORG\nIdentityFile ~/.ssh/inc_key\n",
            "top.conf": "Host top\n    HostName top.example\n    User topuser\n",
            "inner.conf": "Host inner\n    HostName inner.example\n",  # never active: the Include is in Host inc
        },
        requests=(Request("inc"), Request("top"), Request("other"), Request("top", port=2200, user="override"),
                  Request("inner")),
        fallback_differs={"inner": {"hostname"}},
    ),
    "Match, capitalised and not": Case(
        files={
            "config": "Match Host gpu*,!gpu9\n"
                      "    Port 2300\n"
                      "    ServerAliveInterval 4\n"
                      "    ServerAliveCountMax 2\n"
                      "match originalhost gpu9\n"
                      "    HostName nine.example\n"
                      "Match all\n"
                      "    ConnectTimeout 7\n"
                      "    StrictHostKeyChecking accept-new\n",
        },
        requests=(Request("gpu1"), Request("gpu9"), Request("cpu1", port=2201)),
    ),
    "tokens": Case(
        files={
            "config": "Host tok*\n"
                      "    HostName %h.example.com\n"
                      "    User tokuser\n"
                      "    IdentityFile ~/.ssh/id_%h_%r\n"
                      "    IdentityFile ${HOME}/keys/%n-%p\n"
                      "    CertificateFile %d/certs/%r@%h-cert.pub\n"
                      "    UserKnownHostsFile ~/.ssh/kh_%n %d/kh_%p\n"
                      "    ProxyCommand nc -X connect -x proxy:3128 %h %p %%\n"
                      "    HostKeyAlias TokAlias\n"
                      "    IdentitiesOnly yes\n",
        },
        requests=(Request("tok1"), Request("tok2", port=2022, user="bob")),
    ),
    "ProxyCommand before ProxyJump, ProxyJump none": Case(
        files={
            "config": "Host pc\n"
                      "    ProxyCommand ssh -W %h:%p bastion\n"
                      "    ProxyJump other\n"
                      "Host pj\n"
                      "    ProxyJump admin@bast:2200,second\n"
                      "    ProxyCommand nc %h %p\n"
                      "Host pn\n"
                      "    PROXYJUMP NONE\n"
                      "Host pn2\n"
                      "    ProxyJump None\n"
                      "Host *\n"
                      "    ProxyJump defaultjump\n",
        },
        requests=(Request("pc"), Request("pj"), Request("pn"), Request("pn2"), Request("elsewhere")),
        fallback_differs={"pc": {"proxy_jump", "proxy_command"}},
    ),
    "upper-case HostName, Host n[12] is literal": Case(
        files={
            "config": "Host n[12]\n"
                      "    HostName LITERAL.example\n"
                      "Host n1\n"
                      "    HOSTNAME N1.Example.COM\n"
                      "    GlobalKnownHostsFile /etc/ssh/other_known_hosts\n"
                      "    StrictHostKeyChecking no\n",
        },
        requests=(Request("n1"), Request("n2"), Request("n[12]")),
    ),
    "the inventory's identity file and user": Case(
        files={"config": "Host *\n    IdentityFile ~/.ssh/config_key\n    User cfg\n"},
        requests=(Request("h", identity_file="~/keys/inventory_%h", user="inv"),),
    ),
}


def write(case: Case, folder: Path) -> Path:
    for name, text in case.files.items():
        (folder / name).write_text(text.replace("{dir}", str(folder)))
    return folder / "config"


def ssh_g(config: Path, request: Request) -> dict[str, list[str]]:
    """OpenSSH's own answer, read here independently of dlrun's parser."""
    argv = [str(SSH), "-G", "-F", str(config)]
    argv += ["-p", str(request.port)] if request.port else []
    argv += ["-l", request.user] if request.user else []
    out = subprocess.run([*argv, "--", request.alias], capture_output=True, text=True, check=True, timeout=30)
    options: dict[str, list[str]] = {}
    for line in out.stdout.splitlines():
        key, _, value = line.partition(" ")
        options.setdefault(key.lower(), []).append(value)
    return options


def expected(g: dict[str, list[str]], request: Request) -> dict[str, object]:
    """Every HostConfig field from ``ssh -G``'s output; the tokens the corpus uses in options that
    ``ssh -G`` prints unexpanded (IdentityFile, CertificateFile, ProxyCommand) put in by hand."""
    hostname, port, user = g["hostname"][0], int(g["port"][0]), g["user"][0]

    def expand(value: str) -> str:
        value = HOME + value[1:] if value.startswith("~") else value
        for token, text in (("${HOME}", HOME), ("%h", hostname), ("%p", str(port)), ("%r", user),
                            ("%n", request.alias), ("%d", HOME), ("%%", "%")):
            value = value.replace(token, text)
        return value

    def one(key: str) -> str | None:
        values = g.get(key)
        return values[0] if values and values[0] != "none" else None

    identities = [request.identity_file] if request.identity_file else g["identityfile"]
    command = one("proxycommand")
    return {
        "alias": request.alias, "hostname": hostname, "port": port, "user": user,
        "identity_files": tuple(expand(i) for i in identities),
        "identities_only": g["identitiesonly"] == ["yes"],
        "certificate_files": tuple(expand(c) for c in g.get("certificatefile", [])),
        "proxy_jump": one("proxyjump"),
        "proxy_command": expand(command) if command else None,
        "user_known_hosts_files": tuple(g["userknownhostsfile"][0].split()),
        "global_known_hosts_files": tuple(g["globalknownhostsfile"][0].split()),
        "host_key_alias": one("hostkeyalias"),
        "connect_timeout": float(g["connecttimeout"][0]) if one("connecttimeout") else None,
        "server_alive_interval": float(g["serveraliveinterval"][0]),
        "server_alive_count_max": int(g["serveralivecountmax"][0]),
        "strict_host_key_checking": {"true": "yes", "false": "no"}.get(g["stricthostkeychecking"][0],
                                                                       g["stricthostkeychecking"][0]),
        "hash_known_hosts": g.get("hashknownhosts") == ["yes"],
    }


def fields(config: HostConfig) -> dict[str, object]:
    return {name: getattr(config, name) for name in HostConfig.__dataclass_fields__}


@pytest.mark.parametrize("name", CORPUS)
def test_every_field_is_what_ssh_g_says(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Twice: from ``ssh -G``, then (a new reader, no process started) from the disk cache."""
    monkeypatch.setenv("HOME", HOME)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    case = CORPUS[name]
    config = write(case, tmp_path)
    found = SSHConfigReader(str(config), SSH).lookup_all(case.requests)
    for request, host in zip(case.requests, found, strict=True):
        assert fields(host) == expected(ssh_g(config, request), request), request
    with monkeypatch.context() as patched:
        patched.setattr(subprocess, "run", no_process)
        cached = SSHConfigReader(str(config), SSH).lookup_all(case.requests)
    for request, host in zip(case.requests, cached, strict=True):
        assert fields(host) == expected(ssh_g(config, request), request), request


def no_process(*args: object, **kwargs: object) -> None:
    raise AssertionError(f"a process was started: {args}")


@pytest.mark.parametrize("name", CORPUS)
def test_the_fallback_parser_differs_only_where_documented(name: str, tmp_path: Path) -> None:
    case = CORPUS[name]
    config = write(case, tmp_path)
    openssh = SSHConfigReader(str(config), SSH)
    fallback = SSHConfigReader(str(config), None)
    for request in case.requests:
        ours, theirs = fields(fallback.lookup(request)), fields(openssh.lookup(request))
        differ = {key for key in ours if ours[key] != theirs[key]}
        assert differ == case.fallback_differs.get(request.alias, set()), (request, ours, theirs)


def test_corpus_values_dlrun_relies_on(tmp_path: Path) -> None:
    """A few answers spelled out, so that the comparison above cannot pass on two wrong readings."""
    reader = SSHConfigReader(str(write(CORPUS["tokens"], tmp_path)), SSH)
    tok = reader.lookup(Request("tok2", port=2022, user="bob"))
    assert tok.hostname == "tok2.example.com" and tok.user == "bob" and tok.port == 2022
    assert tok.identity_files == (f"{HOME}/.ssh/id_tok2.example.com_bob", f"{HOME}/keys/tok2-2022")
    assert tok.proxy_command == "nc -X connect -x proxy:3128 tok2.example.com 2022 %"
    assert tok.known_hosts_name == "tokalias" and tok.identities_only
    folder = tmp_path / "p"
    folder.mkdir()
    proxies = SSHConfigReader(str(write(CORPUS["ProxyCommand before ProxyJump, ProxyJump none"], folder)), SSH)
    assert proxies.lookup(Request("pc")).proxy_command == "ssh -W pc:22 bastion"
    assert proxies.lookup(Request("pc")).proxy_jump is None
    assert proxies.lookup(Request("pj")).proxy_jump == "admin@bast:2200,second"
    assert proxies.lookup(Request("pn")).proxy_jump is None and proxies.lookup(Request("pn2")).proxy_jump is None
    folder = tmp_path / "n"
    folder.mkdir()
    literal = SSHConfigReader(str(write(CORPUS["upper-case HostName, Host n[12] is literal"], folder)), SSH)
    assert literal.lookup(Request("n1")).hostname == "n1.example.com"
    assert literal.lookup(Request("n2")).hostname == "n2"
    assert literal.lookup(Request("n1")).known_hosts_name == "n1.example.com"
    assert literal.lookup(Request("n1", port=2200)).known_hosts_name == "[n1.example.com]:2200"


def test_a_config_openssh_rejects_is_a_usage_error_naming_file_and_line(tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.write_text("Host a\n    HostName a.example\n    NoSuchOption yes\n")
    with pytest.raises(UsageError) as caught:
        SSHConfigReader(str(config), SSH).lookup_all([Request("a"), Request("b")])
    assert f"{config}: line 3: Bad configuration option: nosuchoption" in str(caught.value)
    assert caught.value.exit_code == 2


def test_certificate_file_is_loaded_onto_its_identity(tmp_path: Path) -> None:
    """CertificateFile pairs with the IdentityFile whose key it certifies (paramiko's public
    PKey.from_path and load_certificate); one that certifies none of them is a clear error."""
    from dlrun.errors import AuthenticationFailed
    from dlrun.inventory import Host
    from dlrun.transport.ssh import SSHTransport, _certified_key

    def keygen(path: Path) -> None:
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)

    for name in ("ca", "id_user", "id_other"):
        keygen(tmp_path / name)
    subprocess.run(["ssh-keygen", "-q", "-s", str(tmp_path / "ca"), "-I", "dlrun-test", "-n", "alice",
                    str(tmp_path / "id_user.pub")], check=True)
    (tmp_path / "id_user-cert.pub").rename(tmp_path / "alice.cert")  # not where paramiko looks by itself
    config = tmp_path / "config"
    config.write_text(f"Host good\n    IdentityFile {tmp_path}/id_other\n    IdentityFile {tmp_path}/id_user\n"
                      f"Host bad\n    IdentityFile {tmp_path}/id_other\n"
                      f"Host *\n    CertificateFile {tmp_path}/%r.cert\n    User alice\n")
    transport = SSHTransport(config_file=str(config))
    key = _certified_key(transport.target("good"))
    assert key is not None and key.public_blob is not None
    assert key.public_blob.key_type == "ssh-ed25519-cert-v01@openssh.com"
    with pytest.raises(AuthenticationFailed, match=r"bad: CertificateFile .*alice.cert belongs to none of the"):
        _certified_key(transport.target("bad"))
    bob = Host(address="good", name="good", user="bob")
    assert _certified_key(SSHTransport(config_file=str(config)).target(bob)) is None  # no bob.cert: none


def test_timeouts_and_strict_host_key_checking_from_the_config_where_dlrun_sets_none(tmp_path: Path) -> None:
    from dlrun.plan import DEFAULT_HOST_TIMEOUT
    from dlrun.transport.ssh import SSHTransport

    config = tmp_path / "config"
    config.write_text("Host a\n    ConnectTimeout 3\n    ServerAliveInterval 2\n    ServerAliveCountMax 4\n"
                      "    StrictHostKeyChecking accept-new\nHost b\n    StrictHostKeyChecking yes\n")
    a = SSHTransport(config_file=str(config)).target("a")
    assert (a.connect_timeout, a.alive_limit, a.accept_new) == (3.0, 8.0, True)
    b = SSHTransport(config_file=str(config)).target("b")
    assert (b.connect_timeout, b.alive_limit, b.accept_new) == (10.0, DEFAULT_HOST_TIMEOUT, False)
    given = SSHTransport(config_file=str(config), connect_timeout=5, host_timeout=0, accept_new_host_keys=True)
    assert (given.target("a").connect_timeout, given.target("a").alive_limit) == (5, None)
    assert given.target("b").accept_new


@pytest.mark.slow
def test_the_command_line_uses_the_configs_connect_timeout_unless_given(tmp_path: Path) -> None:
    """A port that accepts and never speaks SSH: the wait is the ssh config's ConnectTimeout,
    unless --connect-timeout says otherwise."""
    import socket

    silent = socket.create_server(("127.0.0.1", 0))
    try:
        config = tmp_path / "config"
        config.write_text(f"Host slowhost\n    HostName 127.0.0.1\n    Port {silent.getsockname()[1]}\n"
                          "    ConnectTimeout 1\n")
        from_config = run_dlrun("topo", "--hosts", "slowhost:1", "--ssh-config", str(config), cwd=tmp_path,
                                timeout=60)
        given = run_dlrun("topo", "--hosts", "slowhost:1", "--ssh-config", str(config), "--connect-timeout", "2",
                          cwd=tmp_path, timeout=60)
    finally:
        silent.close()
    assert "within 1 s" in from_config.stdout + from_config.stderr, from_config.stdout + from_config.stderr
    assert "within 2 s" in given.stdout + given.stderr, given.stdout + given.stderr
