"""The renderer for SGLang-hosting instances (`engine = "sglang"` on a host): each prefill, decode and
unified unit gets `engine.kind = "sglang"` and an `[sglang]` section (the venv's launcher, its GPU, fixed
loopback ports, the role's extra args), validated by the service's own config model; native mode wires the
router to the one prefill/decode pair; the units pass systemd-analyze verify; the example is what it
renders."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from xavier_services.peer.config import PeerServiceConfig

from tests.deploy.rendering import read_toml, render, verify_rendered_units
from xavier_core.deploy import load_cluster, render_host
from xavier_core.runtime.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "deploy" / "examples"

ONE_HOST = """
[cluster]
insecure = true
directory = "gpu"
model = "/srv/models/m"
prefix = "/usr/local/xavier"

[sglang]
python = "/opt/sglang/bin/python"

[hosts.gpu]
address = "10.1.0.2"
roles = ["directory", "router", "prefill", "decode", "unified"]
prefill_gpus = [0]
decode_gpus = [1]
unified_gpus = [2, 3]
engine = "sglang"

[hosts.ref]
address = "10.1.0.3"
roles = ["decode"]
decode_gpus = [0]

[service.prefill.sglang]
extra_args = ["--mem-fraction-static", "0.8"]
"""

NATIVE = ONE_HOST.replace(
    'python = "/opt/sglang/bin/python"', 'transfer_backend = "nixl"\napi_key = "k3y-for-both"'
).replace('roles = ["decode"]\ndecode_gpus = [0]', 'roles = ["unified"]\nunified_gpus = [0]')


def test_sglang_instances_get_their_section(tmp_path: Path) -> None:
    out = render(tmp_path, ONE_HOST, "gpu")
    wants = sorted(p.name for p in (out / "etc/systemd/system/xavier.target.wants").iterdir())
    assert [w for w in wants if "@" in w] == [
        "xavier-decode@1.service",
        "xavier-prefill@0.service",
        "xavier-unified@2.service",
        "xavier-unified@3.service",
    ]
    role = (out / "etc/systemd/system/xavier-unified@.service.d/role.conf").read_text()
    assert "ExecStart=/usr/local/xavier/bin/xavier-decode --role unified --config" in role
    etc = out / "etc/xavier"
    prefill = load_config(PeerServiceConfig, etc / "xavier-prefill@0.toml")
    assert prefill.engine.kind == "sglang" and prefill.engine.model == Path("/srv/models/m")
    assert prefill.peer.peer_id == "gpu-prefill-0" and prefill.peer.advertise_host == "10.1.0.2"
    sg = prefill.sglang
    assert sg.command == ["/opt/sglang/bin/python", "-m", "sglang.launch_server"]
    assert sg.base_gpu_id == 0 and sg.port == 30000 and sg.transfer_backend == "xavier"
    assert sg.extra_args == ["--mem-fraction-static", "0.8"] and not sg.api_key
    decode = load_config(PeerServiceConfig, etc / "xavier-decode@1.toml")
    assert decode.sglang.base_gpu_id == 1 and decode.sglang.port == 30001 and decode.sglang.extra_args == []
    unified = load_config(PeerServiceConfig, etc / "xavier-unified@3.toml")
    assert unified.listen == "10.1.0.2:7603" and unified.peer.peer_id == "gpu-unified-3"
    assert (
        unified.engine.kind == "sglang" and unified.sglang.base_gpu_id == 3 and unified.sglang.port == 30003
    )
    router = read_toml(etc / "xavier-router.toml")
    assert "native" not in router  # the xavier backend: the router pairs peers through the directory

    # A reference-engine host of the same mesh is untouched; the launcher defaults to the prefix's python.
    ref = read_toml(render(tmp_path, ONE_HOST, "ref") / "etc/xavier/xavier-decode@0.toml")
    assert "sglang" not in ref and "kind" not in ref["engine"]
    default = ONE_HOST.replace('python = "/opt/sglang/bin/python"', "")
    (tmp_path / "d").mkdir()
    prefill = load_config(
        PeerServiceConfig, render(tmp_path / "d", default, "gpu") / "etc/xavier/xavier-prefill@0.toml"
    )
    assert prefill.sglang.command[0] == "/usr/local/xavier/bin/python"


def test_native_mode_wires_the_router_to_the_pair(tmp_path: Path) -> None:
    etc = render(tmp_path, NATIVE, "gpu") / "etc/xavier"
    prefill = load_config(PeerServiceConfig, etc / "xavier-prefill@0.toml").sglang
    decode = load_config(PeerServiceConfig, etc / "xavier-decode@1.toml").sglang
    assert prefill.transfer_backend == decode.transfer_backend == "nixl"
    assert prefill.bootstrap_port == 8998 and prefill.api_key == decode.api_key == "k3y-for-both"
    assert "bootstrap_port" not in read_toml(etc / "xavier-decode@1.toml")["sglang"]
    unified = load_config(PeerServiceConfig, etc / "xavier-unified@2.toml").sglang
    assert unified.transfer_backend == "xavier" and not unified.api_key  # native is P/D only
    assert read_toml(etc / "xavier-router.toml")["native"] == {
        "prefill_url": "http://127.0.0.1:30000",
        "decode_url": "http://127.0.0.1:30001",
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": 8998,
        "api_key": "k3y-for-both",
    }


@pytest.mark.parametrize(
    ("text", "key"),
    [
        # SGLang listens on loopback: the router must share the pair's host.
        (NATIVE.replace('"directory", "router", "prefill"', '"directory", "prefill"')
         + '[hosts.ctl]\naddress = "10.1.0.9"\nroles = ["router"]\n', "sglang.transfer_backend"),
        (NATIVE.replace("decode_gpus = [1]", "decode_gpus = [1, 4]"), "sglang.transfer_backend"),
        (NATIVE.replace('api_key = "k3y-for-both"', ""), "sglang"),
        (ONE_HOST.replace('python = "/opt/sglang/bin/python"', 'python = "python3"'), "sglang.python"),
        (ONE_HOST.replace('engine = "sglang"', 'engine = "vllm"'), "hosts.gpu.engine"),
        (ONE_HOST.replace("unified_gpus = [2, 3]", "unified_gpus = [1, 2]"), "hosts.gpu"),
        (ONE_HOST + "\n[ports]\nsglang = 7400\n", "ports"),  # SGLang's port is the prefill's gRPC port
        (ONE_HOST + "\n[ports]\nsglang = 65535\n", "service.decode.sglang.port"),
        (ONE_HOST.replace('"0.8"]', '"0.8", "--port", "1"]'), "service.prefill.sglang.extra_args"),
        (ONE_HOST + "\n[service.decode.sglang]\nport = 31000\n", "service.decode.sglang.port"),
    ],
)  # fmt: skip
def test_bad_sglang_description_names_the_key(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        cluster = load_cluster(_write(tmp_path, text))
        for host in cluster.hosts:
            render_host(cluster, host, tmp_path / host)
    assert key in [issue[0] for issue in info.value.issues], info.value


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "hosts.toml"
    path.write_text(text)
    return path


def test_the_sglang_example_is_what_the_renderer_writes(tmp_path: Path) -> None:
    render_host(load_cluster(EXAMPLES / "sglang-pd.toml"), "gpu", tmp_path)
    examples = sorted((EXAMPLES / "etc-xavier-sglang").iterdir())
    assert {p.name for p in examples} >= {"xavier-prefill@0.toml", "xavier-decode@1.toml"}
    for example in examples:
        assert example.read_text() == (tmp_path / "etc/xavier" / example.name).read_text(), example.name


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_rendered_sglang_units_verify(tmp_path: Path) -> None:
    units = verify_rendered_units(tmp_path, ONE_HOST, "gpu")
    assert any(u.name.startswith("xavier-unified@") for u in units)
