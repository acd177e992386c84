"""Settings: environment over config file; invalid settings stop the process with one clear line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shared.settings import KitSettings, load_settings, parse_broker_url

REPO = Path(__file__).resolve().parents[2]


def test_env_and_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "robobus.toml"
    cfg.write_text('topic_root = "site1/robobus"\nnode = "from-file"\nstate_rates = { joints = 200.0 }\n')
    monkeypatch.setenv("ROBOBUS_CONFIG", str(cfg))
    monkeypatch.setenv("ROBOBUS_NODE", "from-env")
    s = load_settings(KitSettings)
    assert s.topic_root == "site1/robobus"
    assert s.node == "from-env"  # the environment wins over the file
    assert s.state_rates == {"joints": 200.0}


def test_yaml_and_json_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    y = tmp_path / "c.yaml"
    y.write_text("log_level: debug\nhealth_interval_s: 2\n")
    monkeypatch.setenv("ROBOBUS_CONFIG", str(y))
    s = load_settings(KitSettings)
    assert s.log_level == "DEBUG" and s.health_interval_s == 2
    j = tmp_path / "c.json"
    j.write_text('{"mqtt_url": "mqtts://u:p%40ss@broker.example:8884"}')
    monkeypatch.setenv("ROBOBUS_CONFIG", str(j))
    b = load_settings(KitSettings).broker()
    assert (b.host, b.port, b.username, b.password, b.tls) == ("broker.example", 8884, "u", "p@ss", True)


def test_broker_url_defaults() -> None:
    assert parse_broker_url("localhost").port == 1883
    assert parse_broker_url("mqtts://h").port == 8883
    with pytest.raises(ValueError):
        parse_broker_url("http://h")


def _run_with_env(**env: str) -> subprocess.CompletedProcess[str]:
    code = "from shared.settings import KitSettings, load_settings; load_settings(KitSettings); print('ok')"
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", **env}, timeout=30)


@pytest.mark.parametrize(("env", "field"), [
    ({"ROBOBUS_HEALTH_INTERVAL_S": "-1"}, "health_interval_s"),
    ({"ROBOBUS_NODE": "bad/name"}, "node"),
    ({"ROBOBUS_MQTT_URL": "http://x"}, "mqtt_url"),
    ({"ROBOBUS_STATE_RATES": "not json"}, "state_rates"),
    ({"ROBOBUS_CONFIG": "/nonexistent.toml"}, "ROBOBUS_CONFIG"),
])
def test_invalid_setting_stops_with_one_clear_line(env: dict[str, str], field: str) -> None:
    r = _run_with_env(**env)
    assert r.returncode == 2, r
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert field in lines[0] and "Traceback" not in r.stderr


def test_aliased_field_is_named_once() -> None:
    from pydantic import Field

    class Aliased(KitSettings):
        backend: str = Field("model", alias="ROBOBUS_THING_BACKEND", pattern="^(model|nic)$")

    import os

    os.environ["ROBOBUS_THING_BACKEND"] = "bogus"
    try:
        with pytest.raises(SystemExit):
            load_settings(Aliased)
    finally:
        del os.environ["ROBOBUS_THING_BACKEND"]


def test_formatter_names_alias_once() -> None:
    from pydantic import BaseModel, Field, ValidationError

    from shared.settings import format_validation_error

    class M(BaseModel):
        x: int = Field(alias="ROBOBUS_THING_X")

    with pytest.raises(ValidationError) as e:
        M.model_validate({"ROBOBUS_THING_X": "nope"})
    msg = format_validation_error(e.value)
    assert "[ROBOBUS_THING_X]" in msg and "ROBOBUS_ROBOBUS" not in msg
