"""The renderer: a two-host description gives each host its units, configs and environment; bad input is
refused naming the key; the rendered units pass systemd-analyze verify; the examples are what it renders."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from xavier_services.directory.config import DirectoryConfig
from xavier_services.peer.config import PeerServiceConfig
from xavier_services.router.config import RouterConfig

from tests.deploy.rendering import read_toml, render, verify_rendered_units
from xavier_core.deploy import load_cluster, render_host
from xavier_core.runtime.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "deploy" / "examples"

TWO_HOSTS = """
[cluster]
directory = "ctl"
model = "/srv/models/m"
prefix = "/usr/local/xavier"
env = { XAVIER_UVLOOP = "1", UCX_TLS = "tcp" }

[ports]
directory = 7100
router = 7200
router_http = 8080
prefill = 7400
decode = 7500

[tls]
ca_file = "/etc/xavier/tls/ca.pem"
cert_file = "/etc/xavier/tls/{host}.pem"
key_file = "/etc/xavier/tls/{host}.key"

[hosts.ctl]
address = "10.1.0.1"
bind = "0.0.0.0"
roles = ["directory", "router"]

[hosts.gpu]
address = "10.1.0.2"
roles = ["prefill", "decode"]
prefill_gpus = [0]
decode_gpus = [1, 2]
env = { UCX_TLS = "rc,cuda_ipc,cuda_copy" }

[service.decode.engine]
num_pages = 4096

[service.router]
api_token_file = "/etc/xavier/token"
"""


def _env(path: Path) -> dict[str, str]:
    lines = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
    return {k: v.strip('"') for k, v in (line.split("=", 1) for line in lines)}


def test_two_hosts_each_get_their_units(tmp_path: Path) -> None:
    ctl, gpu = render(tmp_path, TWO_HOSTS, "ctl"), render(tmp_path, TWO_HOSTS, "gpu")
    wants = sorted(p.name for p in (ctl / "etc/systemd/system/xavier.target.wants").iterdir())
    assert wants == ["xavier-directory.service", "xavier-router.service"]
    wants = sorted(p.name for p in (gpu / "etc/systemd/system/xavier.target.wants").iterdir())
    assert wants == ["xavier-decode@1.service", "xavier-decode@2.service", "xavier-prefill@0.service"]
    link = gpu / "etc/systemd/system/xavier.target.wants/xavier-decode@2.service"
    assert os.readlink(link) == "../xavier-decode@.service" and link.resolve().is_file()
    assert not (ctl / "etc/systemd/system/xavier-prefill@.service").exists()
    # The GPU roles' one unit under each role's name (the role is %j), and the roles' drop-ins.
    unit = (gpu / "etc/systemd/system/xavier-prefill@.service").read_text()
    assert "ExecStart=/usr/local/xavier/bin/xavier-%j " in unit and "/opt/xavier" not in unit
    assert (gpu / "etc/systemd/system/xavier-decode@.service").read_text() == unit
    dropins = sorted(p.relative_to(gpu / "etc/systemd/system") for p in gpu.glob("etc/systemd/system/*.d/*"))
    assert dropins == [Path("xavier-decode@.service.d/role.conf")]
    assert "After=xavier-prefill@%i.service" in (gpu / "etc/systemd/system" / dropins[0]).read_text()

    etc = ctl / "etc/xavier"
    directory = load_config(DirectoryConfig, etc / "xavier-directory.toml")
    assert directory.listen == "0.0.0.0:7100" and directory.metrics_listen == "127.0.0.1:8100"
    router = read_toml(etc / "xavier-router.toml")
    assert router["listen"] == "0.0.0.0:7200" and router["http_listen"] == "0.0.0.0:8080"
    assert router["directory"] == "10.1.0.1:7100" and router["model"] == "/srv/models/m"
    # DynamicUser units read their secrets from LoadCredential= copies.
    creds = (ctl / "etc/systemd/system/xavier-router.service.d/credentials.conf").read_text()
    assert "LoadCredential=api-token:/etc/xavier/token\n" in creds
    assert "LoadCredential=tls-key.pem:/etc/xavier/tls/ctl.key\n" in creds
    assert router["api_token_file"] == "/run/credentials/xavier-router.service/api-token"
    assert router["tls"] == {
        "ca_file": "/run/credentials/xavier-router.service/tls-ca.pem",
        "cert_file": "/run/credentials/xavier-router.service/tls-cert.pem",
        "key_file": "/run/credentials/xavier-router.service/tls-key.pem",
    }
    assert _env(etc / "xavier-router.env") == {"XAVIER_UVLOOP": "1", "UCX_TLS": "tcp"}

    etc = gpu / "etc/xavier"
    decode = load_config(PeerServiceConfig, etc / "xavier-decode@2.toml")
    assert decode.listen == "10.1.0.2:7502" and decode.metrics_listen == "127.0.0.1:8502"
    assert decode.peer.directory == "10.1.0.1:7100" and decode.peer.advertise_host == "10.1.0.2"
    assert decode.peer.peer_id == "gpu-decode-2" and decode.engine.device == "cuda:2"
    assert decode.engine.num_pages == 4096
    prefill = load_config(PeerServiceConfig, etc / "xavier-prefill@0.toml")
    assert prefill.listen == "10.1.0.2:7400" and prefill.engine.num_pages != 4096
    # The GPU units' static user reads the files in place (so SIGHUP sees rotated ones).
    assert prefill.tls is not None and prefill.tls.key_file == Path("/etc/xavier/tls/gpu.key")
    assert not (gpu / "etc/systemd/system/xavier-prefill@0.service.d").exists()
    assert _env(etc / "xavier-prefill@0.env")["UCX_TLS"] == "rc,cuda_ipc,cuda_copy"
    assert (etc / "xavier-prefill@0.toml").stat().st_mode & 0o777 == 0o640


def test_router_config_loads_the_rendered_token_path(tmp_path: Path) -> None:
    out = render(tmp_path, TWO_HOSTS, "ctl")
    config = read_toml(out / "etc/xavier/xavier-router.toml")
    token = tmp_path / "token"
    token.write_text("t0k\n")
    config["api_token_file"] = str(token)  # as /run/credentials would hold it on the host
    assert RouterConfig.model_validate(config).bearer_token == "t0k"


@pytest.mark.parametrize(
    ("edit", "key"),
    [
        (('directory = "ctl"', 'directory = "nope"'), "cluster.directory"),
        (("prefill_gpus = [0]", "prefill_gpus = [1]"), "hosts.gpu"),
        (("prefill_gpus = [0]\n", ""), "hosts.gpu"),
        (('roles = ["directory", "router"]', 'roles = ["router"]'), "cluster.directory"),
        (('address = "10.1.0.1"', 'adress = "10.1.0.1"'), "hosts.ctl.adress"),
        (("router = 7200", "router = 70000"), "ports.router"),
        (("router = 7200", "router = 7100"), "ports"),
        (("num_pages = 4096", "num_pagez = 4096"), "service.decode.engine.num_pagez"),
        (("num_pages = 4096", 'num_pages = "many"'), "service.decode.engine.num_pages"),
        (("[service.router]", "[service.router]\nlisten = '0.0.0.0:1'"), "service.router.listen"),
        (('UCX_TLS = "tcp"', '"UCX TLS" = "tcp"'), "cluster.env"),
        (("[tls]", "[tls_off]"), "tls_off"),  # an unknown section
        (("[tls]\n", "[unused]\n"), "unused"),
    ],
)
def test_bad_description_names_the_key(tmp_path: Path, edit: tuple[str, str], key: str) -> None:
    assert edit[0] in TWO_HOSTS
    with pytest.raises(ConfigError) as info:
        hosts = tmp_path / "hosts.toml"
        hosts.write_text(TWO_HOSTS.replace(*edit))
        cluster = load_cluster(hosts)
        for host in cluster.hosts:
            render_host(cluster, host, tmp_path / host)
    assert key in [issue[0] for issue in info.value.issues], info.value


def test_a_cluster_without_tls_is_refused_unless_it_says_insecure(tmp_path: Path) -> None:
    start, end = TWO_HOSTS.index("[tls]"), TWO_HOSTS.index("[hosts.ctl]")
    plain = TWO_HOSTS[:start] + TWO_HOSTS[end:]
    hosts = tmp_path / "hosts.toml"
    hosts.write_text(plain)
    with pytest.raises(ConfigError) as info:
        load_cluster(hosts)
    assert [issue[0] for issue in info.value.issues] == ["tls"]
    hosts.write_text(plain.replace('directory = "ctl"', 'directory = "ctl"\ninsecure = true', 1))
    render_host(load_cluster(hosts), "ctl", tmp_path / "out")
    assert "tls" not in read_toml(tmp_path / "out/etc/xavier/xavier-router.toml")


def test_per_service_certificates(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts.toml"
    hosts.write_text(TWO_HOSTS.replace("{host}.pem", "{host}-{service}.pem"))
    render_host(load_cluster(hosts), "gpu", tmp_path / "gpu")
    tls = read_toml(tmp_path / "gpu/etc/xavier/xavier-prefill@0.toml")["tls"]
    assert tls["cert_file"] == "/etc/xavier/tls/gpu-gpu-prefill-0.pem"
    assert tls["ca_file"] == "/etc/xavier/tls/ca.pem"


def test_module_entry_point(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts.toml"
    hosts.write_text(TWO_HOSTS)
    cmd = [
        sys.executable,
        "-m",
        "xavier_core.deploy",
        "render",
        "--hosts",
        str(hosts),
        "--out",
        str(tmp_path),
    ]
    done = subprocess.run([*cmd, "--host", "gpu"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert str(tmp_path / "etc/xavier/xavier-decode@1.toml") in done.stdout.split()
    done = subprocess.run([*cmd, "--host", "gpu-z"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "config error: host: 'gpu-z' is not in [hosts]" in done.stderr


def test_examples_are_what_the_renderer_writes(tmp_path: Path) -> None:
    cluster = load_cluster(EXAMPLES / "hosts.toml")
    for host in ("ctl", "gpu-a"):
        render_host(cluster, host, tmp_path)
    for example in sorted((EXAMPLES / "etc-xavier").iterdir()):
        assert example.read_text() == (tmp_path / "etc/xavier" / example.name).read_text(), example.name


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_rendered_units_verify(tmp_path: Path) -> None:
    verify_rendered_units(tmp_path, TWO_HOSTS, "gpu")


REPLICAS = (
    TWO_HOSTS.replace('directory = "ctl"', 'directory = ["ctl", "gpu"]').replace(
        'roles = ["prefill", "decode"]', 'roles = ["directory", "prefill", "decode"]'
    )
    + '\n[service.directory.directory]\nbackend = "etcd"\netcd_endpoints = ["10.1.0.1:2379"]\n'
)


def test_directory_replicas_on_etcd(tmp_path: Path) -> None:
    """Two directory hosts: each runs one, and every client dials both (one comma-separated address)."""
    ctl, gpu = render(tmp_path, REPLICAS, "ctl"), render(tmp_path, REPLICAS, "gpu")
    for out in (ctl, gpu):
        directory = load_config(DirectoryConfig, out / "etc/xavier/xavier-directory.toml")
        assert directory.directory.backend == "etcd"
    router = read_toml(ctl / "etc/xavier/xavier-router.toml")  # (its token file exists only under systemd)
    decode = load_config(PeerServiceConfig, gpu / "etc/xavier/xavier-decode@2.toml")
    assert router["directory"] == decode.peer.directory == "10.1.0.1:7100,10.1.0.2:7100"
    # Replicas without etcd would each hold a different mesh: refused, naming the key.
    (tmp_path / "mem").mkdir()
    with pytest.raises(ConfigError) as info:
        render(tmp_path / "mem", REPLICAS.replace('backend = "etcd"', 'backend = "memory"'), "ctl")
    assert [i[0] for i in info.value.issues] == ["service.directory.directory.backend"]
