"""The shipped alert rules (deploy/prometheus/robobus.rules.yml) pass `promtool check rules`, the shipped Prometheus
config `promtool check config`, and each alert fires on the series that mean it, and not before its `for:`
(`promtool test rules`; annotations left out of the comparison, labels compared whole)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.prometheus.stack import RULES, promtool_bin

pytestmark = pytest.mark.skipif(promtool_bin() is None,
                                reason="promtool is not installed (deploy/dev/system-deps.sh installs Debian's "
                                       "prometheus)")

# (alert, input series, eval time, expected labels of each firing alert): every alert of the file, tested
CASES: list[tuple[str, list[dict[str, str]], str, list[dict[str, str]]]] = [
    ("RobobusNodeOffline", [{"series": 'robobus_node_online{site="site-a",node="n"}', "values": "1 0x8"}], "30s", []),
    ("RobobusNodeOffline", [{"series": 'robobus_node_online{site="site-a",node="n"}', "values": "1 0x8"}], "1m",
     [{"severity": "critical", "site": "site-a", "node": "n"}]),
    ("RobobusNodeSilent", [{"series": 'robobus_node_online{node="n"}', "values": "1x20"},
                           {"series": 'robobus_last_seen_timestamp_seconds{node="n",device="",source="stats"}',
                            "values": "0x20"}], "2m", [{"severity": "warning", "node": "n"}]),
    ("RobobusDeviceNotConnected", [{"series": 'robobus_device_connection{node="n",device="d",service="s"}',
                                    "values": "1 0x8"}], "1m",
     [{"severity": "warning", "node": "n", "device": "d", "service": "s"}]),
    ("RobobusDeviceError", [{"series": 'robobus_device_error{node="n",device="d"}', "values": "1x8"}], "90s",
     [{"severity": "warning", "node": "n", "device": "d"}]),
    ("RobobusStopActive", [{"series": 'robobus_stop_active{site="s",channel="fleet"}', "values": "0 1"}], "15s",
     [{"severity": "warning", "site": "s", "channel": "fleet"}]),
    ("RobobusStopActive", [{"series": 'robobus_stop_active{site="s",channel="site"}', "values": "0 0"}], "15s", []),
    ("RobobusStopNotReached", [{"series": 'robobus_stop_device_pending{node="n",device="d"}', "values": "1x4"}],
     "30s", [{"severity": "critical", "node": "n", "device": "d"}]),
    ("RobobusStopBrokerLost", [{"series": 'robobus_stop_answer_broker_lost{node="n"}', "values": "1"}], "0s",
     [{"severity": "critical", "node": "n"}]),
    ("RobobusEthercatLosingFrames", [{"series": 'robobus_ethercat_frames_lost_total{node="e",device="rh"}',
                                      "values": "0+60x12"}], "3m", [{"severity": "warning", "node": "e",
                                                                      "device": "rh"}]),
    ("RobobusEthercatLosingFrames", [{"series": 'robobus_ethercat_frames_lost_total{node="e",device="rh"}',
                                      "values": "0+3x12"}], "3m", []),  # 0.2 frames/s: not an alert
    ("RobobusBridgeDown", [{"series": 'robobus_bridge_reachable{site="b"}', "values": "1 0x4"}], "45s",
     [{"severity": "critical", "site": "b"}]),
    ("RobobusCommandsInternalErrors", [{"series": 'robobus_commands_failed_total{node="n",code="internal"}',
                                        "values": "0 1 1"}], "30s", [{"severity": "warning", "node": "n",
                                                                      "code": "internal"}]),
    ("RobobusFlashFailed", [{"series": 'robobus_flash_boards_total{node="c",device="m",outcome="failed",phase="v"}',
                             "values": "0 1 1"}], "30s",
     [{"severity": "warning", "node": "c", "device": "m", "outcome": "failed", "phase": "v"}]),
    ("RobobusExporterDisconnected", [{"series": 'robobus_exporter_broker_connected{instance="x:9880",job="robobus"}',
                                      "values": "0x8"}], "90s",
     [{"severity": "critical", "instance": "x:9880", "job": "robobus"}]),
    ("RobobusExporterDown", [{"series": 'up{instance="x:9880",job="robobus"}', "values": "0x8"}], "90s",
     [{"severity": "critical", "instance": "x:9880", "job": "robobus"}]),
]


def test_promtool_checks_the_shipped_rules_and_config(tmp_path: Path) -> None:
    tool = promtool_bin()
    assert tool
    r = subprocess.run([tool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    conf = yaml.safe_load((RULES.parent / "prometheus.yml").read_text())
    conf["rule_files"] = [str(RULES)]  # the image's path, here the file's own
    (tmp_path / "prometheus.yml").write_text(json.dumps(conf))
    r = subprocess.run([tool, "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_alert_has_a_case() -> None:
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r}
    assert alerts == {c[0] for c in CASES}


def test_each_alert_fires_on_what_means_it(tmp_path: Path) -> None:
    tool = promtool_bin()
    assert tool
    rules: dict[str, Any] = yaml.safe_load(RULES.read_text())
    for g in rules["groups"]:
        for r in g["rules"]:
            r.pop("annotations", None)  # their text is checked by `check rules`; here the firing is
    (tmp_path / "rules.yml").write_text(json.dumps(rules))
    tests = [{"interval": "15s", "input_series": series,
              "alert_rule_test": [{"eval_time": at, "alertname": alert,
                                   "exp_alerts": [{"exp_labels": labels} for labels in expected]}]}
             for alert, series, at, expected in CASES]
    (tmp_path / "test.yml").write_text(json.dumps({"rule_files": ["rules.yml"], "evaluation_interval": "15s",
                                                   "tests": tests}))
    r = subprocess.run([tool, "test", "rules", "test.yml"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
