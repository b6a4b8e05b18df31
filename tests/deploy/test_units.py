"""`systemd-analyze verify` on every unit in deploy/systemd as a host installs it (the GPU roles' one unit
under each role's name, beside its drop-ins), templates as instances, binaries as installed."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from xavier_core.deploy.hosts import ENGINE_ROLES

UNITS = Path(__file__).resolve().parents[2] / "deploy" / "systemd"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze") or "/usr/bin/systemd-analyze"
VENV_BIN = Path(sys.executable).parent
pytestmark = pytest.mark.skipif(
    not Path(SYSTEMD_ANALYZE).exists(),
    reason="systemd-analyze is not installed (Debian: apt install systemd)",
)


def _stage(
    target: Path, units: dict[str, str], dropins: dict[str, dict[str, str]] | None = None
) -> list[Path]:
    """Write units under their instance names, and their drop-ins beside them, ExecStart pointed at this
    venv's console scripts.

    verify checks that ExecStart names an executable; the units name the install prefix
    /opt/xavier/.venv, so the same scripts from the venv running the tests stand in for it.
    """
    staged = []
    for name, text in units.items():
        instance = name.replace("@.", "@0.")
        path = target / instance
        path.write_text(text.replace("/opt/xavier/.venv/bin/", f"{VENV_BIN}/"))
        staged.append(path)
        for conf, conf_text in (dropins or {}).get(name, {}).items():
            (target / f"{name}.d").mkdir(exist_ok=True)
            (target / f"{name}.d" / conf).write_text(
                conf_text.replace("/opt/xavier/.venv/bin/", f"{VENV_BIN}/")
            )
    return staged


def _verify(paths: list[Path]) -> str:
    """Everything verify says; it exits 0 on unknown keys and bad values, warning on stderr instead."""
    result = subprocess.run(
        [SYSTEMD_ANALYZE, "verify", "--man=no", *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=paths[0].parent,
    )
    return (
        f"exit {result.returncode}\n{result.stdout}{result.stderr}"
        if result.returncode
        else result.stdout + result.stderr
    )


def _units() -> dict[str, str]:
    """The unit files of deploy/systemd, by file name."""
    return {p.name: p.read_text() for p in sorted(UNITS.iterdir()) if p.suffix in (".service", ".target")}


def _installed() -> dict[str, str]:
    """The units as a host installs them: the engine unit under each GPU role's name."""
    units = _units()
    engine = units.pop("xavier-engine@.service")
    return units | {f"xavier-{role}@.service": engine for role in ENGINE_ROLES}


def _dropins() -> dict[str, dict[str, str]]:
    """The drop-ins of deploy/systemd: unit name -> file name -> text."""
    return {
        d.name.removesuffix(".d"): {c.name: c.read_text() for c in sorted(d.glob("*.conf"))}
        for d in sorted(UNITS.glob("*.service.d"))
    }


def _values(name: str, key: str) -> list[str]:
    """What `key` of installed unit `name` ends as, unit then drop-ins (an empty value clears the list),
    with the role specifier %j of the GPU units resolved."""
    texts = [_installed()[name], *_dropins().get(name, {}).values()]
    values: list[str] = []
    for text in texts:
        for line in text.splitlines():
            if line.startswith(f"{key}="):
                value = line.split("=", 1)[1]
                values = [*values, value] if value else []
    role = name.split("@")[0].rpartition("-")[2]
    return [v.replace("%j", role) for v in values]


def test_every_service_has_a_unit() -> None:
    assert set(_units()) == {
        "xavier.target",
        "xavier-directory.service",
        "xavier-router.service",
        "xavier-pagestore.service",
        "xavier-engine@.service",
    }
    assert set(_dropins()) == {"xavier-decode@.service", "xavier-unified@.service"}


def test_each_gpu_role_starts_its_own_command() -> None:
    cmd = "--config /etc/xavier/%N.toml"
    assert _values("xavier-prefill@.service", "ExecStart") == [f"/opt/xavier/.venv/bin/xavier-prefill {cmd}"]
    assert _values("xavier-decode@.service", "ExecStart") == [f"/opt/xavier/.venv/bin/xavier-decode {cmd}"]
    assert _values("xavier-unified@.service", "ExecStart") == [
        f"/opt/xavier/.venv/bin/xavier-decode --role unified {cmd}"
    ]
    assert _values("xavier-unified@.service", "Description") == ["Xavier unified engine on GPU %i"]


def test_units_verify_clean(tmp_path: Path) -> None:
    units = _installed()
    for name in units:
        if name.endswith(".service"):
            (command,) = _values(name, "ExecStart")
            match = re.match(r"/opt/xavier/\.venv/bin/(\S+)", command)
            assert match and (VENV_BIN / match.group(1)).exists(), (
                f"{name}: ExecStart names no console script"
            )
    assert _verify(_stage(tmp_path, units, _dropins())) == ""


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        ("Type=notify", "Unknown key"),  # replaced by a misspelt key
        ("NotifyAccess=main", "Failed to parse"),  # replaced by a bad value
    ],
)
def test_verify_reports_a_broken_unit(tmp_path: Path, edit: str, expected: str) -> None:
    bad = "Tpye=notify" if edit == "Type=notify" else "NotifyAccess=mainly"
    units = {"xavier-prefill@.service": _units()["xavier-engine@.service"].replace(edit, bad)}
    assert expected in _verify(_stage(tmp_path, units))


def test_verify_reads_the_drop_ins(tmp_path: Path) -> None:
    name = "xavier-unified@.service"
    dropins = {name: {c: t.replace("After=", "Aftr=") for c, t in _dropins()[name].items()}}
    assert "Unknown key 'Aftr' in section [Unit]" in _verify(
        _stage(tmp_path, {name: _installed()[name]}, dropins)
    )


def test_hardening_as_promised() -> None:
    for name, text in _installed().items():
        if not name.endswith(".service"):
            continue
        keys = dict(
            line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#")
        )
        assert keys["Type"] == "notify" and keys["NotifyAccess"] == "main", name
        assert keys["Restart"] == "on-failure" and int(keys["WatchdogSec"]) > 0, name
        assert keys["ProtectSystem"] == "strict" and keys["NoNewPrivileges"] == "yes", name
        assert keys["EnvironmentFile"] == "/etc/xavier/%N.env", name
        gpu = "@" in name
        assert ("DynamicUser" in keys) is not gpu, name
        assert ("PrivateDevices" in keys) is not gpu and ("DeviceAllow" in keys) is gpu, name
        # GPU units may host an SGLang server: SIGTERM goes to the service alone, which drains first.
        assert (keys.get("KillMode") == "mixed") is gpu, name


def test_engines_sharing_a_gpu_start_one_after_another() -> None:
    """Instances of one number share a GPU: the decode there waits for the prefill to be READY and the
    unified one for both (an SGLang server sizes its KV pool from the memory free when it starts);
    Type=notify is what makes After= wait for READY=1, not just for the process to start."""

    def after(name: str) -> set[str]:
        return {u for value in _values(name, "After") for u in value.split()}

    assert "xavier-prefill@%i.service" in after("xavier-decode@.service")
    assert {"xavier-prefill@%i.service", "xavier-decode@%i.service"} <= after("xavier-unified@.service")
    assert not any("@%i" in u for u in after("xavier-prefill@.service"))  # the first on its GPU
