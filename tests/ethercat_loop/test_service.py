"""ethercat-loop over MQTT with a real broker: the node runs in its own process on the palm model."""

import json
import threading
import time

import pytest

from shared.rpc import RpcClient, wait_for
from shared.tools.asyncapi import ContractValidator, build_document
from tests.fixtures import NodeProcess

NODE = "hand-a"
DEV = "rh"


def node_env(broker, node):
    return {"ROBOBUS_MQTT_URL": broker.url, "ROBOBUS_NODE": node, "ROBOBUS_ETHERCAT_BACKEND": "model",
            "ROBOBUS_STATE_RATES": json.dumps({"motors": 50, "joints": 50}), "ROBOBUS_HEALTH_INTERVAL_S": "1"}


class Watch:
    """Latest payload per topic under a filter, plus everything seen (for the contract check)."""

    def __init__(self, client: RpcClient, topic_filter: str):
        self.latest: dict[str, dict] = {}
        self.seen: list[tuple[str, bytes]] = []
        self.lock = threading.Lock()

        def on(msg):
            with self.lock:
                self.seen.append((msg.topic, bytes(msg.payload)))
                try:
                    self.latest[msg.topic] = json.loads(msg.payload)
                except ValueError:
                    pass

        client.subscribe_before(topic_filter, on)

    def get(self, suffix, node=NODE):
        with self.lock:
            return self.latest.get(f"robobus/{node}/{DEV}/{suffix}")


def wait_running(client, node, timeout=15.0):
    def ok():
        msgs = client.collect_retained(f"robobus/{node}/{DEV}/health")
        return any(json.loads(p).get("state") == "running" for _, p, _ in msgs)

    assert wait_for(ok, timeout, 0.1), f"{node} never reported running"


@pytest.fixture(scope="module")
def hand(broker_session):
    proc = NodeProcess(["-m", "services.ethercat_loop"], node_env(broker_session, NODE))
    client = RpcClient(broker_session.settings(), name="ethercat-test")
    client.connect()
    watch = Watch(client, f"robobus/{NODE}/#")
    try:
        wait_running(client, NODE)
        yield client, watch, proc
    finally:
        client.close()
        proc.stop()


def call(client, cmd, payload=None, node=NODE):
    return client.call(node, DEV, cmd, payload if payload is not None else {})


def motor(watch, mid):
    st = watch.get("state/motors")
    return st["motors"][mid] if st else None


def test_demand_moves_the_motor_and_the_deadman_zeroes_it(hand):
    client, watch, _ = hand
    assert call(client, "set_control_mode", {"mode": "torque"}).ok
    end = time.monotonic() + 5
    torque = None
    while time.monotonic() < end:
        rep = call(client, "set_demands", {"joints": {"FFJ3": 300}})
        assert rep.ok, rep.error
        assert rep.result["motors"] == {"1": 300}
        m = motor(watch, 1)
        torque = m and m["torque"]
        if torque is not None and torque > 280 and m["demand_sent"] == 300:
            break
        time.sleep(0.03)
    assert torque is not None and torque > 280  # (the default config limits torque to 400)
    # stop renewing: within demand_timeout_ms (100) the demand is zero and the torque decays
    assert wait_for(lambda: motor(watch, 1)["demand_sent"] == 0 and abs(motor(watch, 1)["torque"]) < 10, 3.0)
    joints = watch.get("state/joints")
    assert len(joints["joints"]) == 28 and "LFJ5" in joints["sensors_raw"]
    assert call(client, "set_control_mode", {"mode": "pwm"}).ok


def test_motor_ids_work_too_and_nullify(hand):
    client, watch, _ = hand
    assert call(client, "nullify_demands", {"enable": True}).ok
    assert call(client, "set_demands", {"motors": {"4": 300}}).ok
    time.sleep(0.1)
    assert motor(watch, 4)["demand_sent"] == 0
    assert call(client, "nullify_demands", {"enable": False}).ok


def test_test_adc_channels(hand):
    client, _, _ = hand
    rep = call(client, "test_adc_channels", {})
    assert rep.ok, rep.error
    assert rep.result["matches"] is True and rep.result["mismatched"] == []
    rows = {r["name"]: r for r in rep.result["sensors"]}
    assert rows["LFJ5"]["raw"] == 0x0605 and (rows["LFJ5"]["adc"], rows["LFJ5"]["channel"]) == (5, 6)
    assert len(rows) == 37


def test_send_can_returns_the_model_answers(hand):
    client, _, _ = hand
    rep = call(client, "send_can", {"bus": 1, "sid": 0x007, "length": 0, "data": "", "window_ms": 200})
    assert rep.ok, rep.error
    frames = rep.result["frames"]
    assert [f["sid"] for f in frames] == [0x400 | (i << 5) | 0x7 for i in range(10)]
    assert all(f["bus"] == 1 and len(f["data"]) == 8 for f in frames)
    cycles = [f["cycle"] for f in frames]
    assert cycles == sorted(set(cycles))  # one frame per cycle
    wait_running(client, NODE)  # back to normal operation


def test_bridge_lease_round_trip(hand):
    client, watch, _ = hand
    rep = call(client, "bridge_lease", {"holder": "flasher", "ttl_ms": 3000})
    assert rep.ok, rep.error
    lease = rep.result["lease_id"]
    assert 2900 <= rep.result["expires_in_ms"] <= 3000
    assert call(client, "bridge_lease", {"holder": "flasher"}).result["lease_id"] == lease  # renew
    busy = call(client, "bridge_lease", {"holder": "someone-else"})
    assert not busy.ok and busy.error["code"] == "busy"
    dem = call(client, "set_demands", {"motors": {"0": 1}})
    assert not dem.ok and dem.error["code"] == "busy"
    assert not call(client, "send_can", {"sid": 7}).ok

    rx_topic = f"robobus/{NODE}/{DEV}/stream/can_rx"

    def got():  # the watch is subscribed to the node's whole tree already
        with watch.lock:
            return [json.loads(p) for t, p in watch.seen if t == rx_topic]

    client.session.publish(f"robobus/{NODE}/{DEV}/stream/can_tx",
                           json.dumps({"lease_id": lease, "frames": [{"bus": 2, "sid": 0x003, "data": ""}]}), qos=1)
    assert wait_for(lambda: sum(len(m["frames"]) for m in got()) >= 10, 5.0)
    frames = [f for m in got() for f in m["frames"]]
    assert all(m["lease_id"] == lease for m in got())
    assert [f["sid"] for f in frames[:10]] == [0x400 | (i << 5) | 0x3 for i in range(10)]
    assert all(f["bus"] == 2 for f in frames)
    assert wait_for(lambda: (watch.get("health") or {}).get("state") == "can_direct", 3.0)

    assert call(client, "bridge_release", {"lease_id": lease}).ok
    rel = call(client, "bridge_release", {"lease_id": lease})
    assert not rel.ok and rel.error["code"] == "not_found"
    wait_running(client, NODE)
    assert call(client, "set_demands", {"motors": {"0": 1}}).ok


def test_lease_expires_when_the_holder_goes_quiet(hand):
    client, _, _ = hand
    rep = call(client, "bridge_lease", {"holder": "quiet", "ttl_ms": 200})
    assert rep.ok
    lease = rep.result["lease_id"]
    assert not call(client, "set_demands", {"motors": {"0": 1}}).ok
    time.sleep(0.5)
    assert call(client, "set_demands", {"motors": {"0": 1}}).ok
    other = call(client, "bridge_lease", {"holder": "next"})
    assert other.ok and other.result["lease_id"] != lease
    assert call(client, "bridge_release", {"lease_id": other.result["lease_id"]}).ok
    wait_running(client, NODE)


@pytest.mark.parametrize(("cmd", "payload", "code"), [
    ("set_demands", {"joints": {"FFJ3": 2000}}, "invalid_request"),  # PWM range is +-1023
    ("set_demands", {"joints": {"XXJ9": 1}}, "invalid_request"),
    ("set_demands", {"motors": {"20": 1}}, "invalid_request"),
    ("set_demands", {}, "invalid_request"),
    ("set_demands", b"\x00\xffgarbage", "invalid_request"),
    ("set_demands", "[1, 2]", "invalid_request"),
    ("set_control_mode", {"mode": "velocity"}, "invalid_request"),
    ("set_motor_config", {"motors": ["FFJ3"], "imax": 0x4000}, "invalid_request"),
    ("set_motor_config", {"motors": ["NOPE"]}, "invalid_request"),
    ("system_controls", {"motors": [1]}, "invalid_request"),
    ("send_can", {"sid": 0x800}, "invalid_request"),
    ("send_can", {"sid": 1, "data": "zz"}, "invalid_request"),
    ("send_can", {"sid": 1, "data": "00", "length": 3}, "invalid_request"),
    ("bridge_lease", {"holder": "x", "ttl_ms": 50}, "invalid_request"),
    ("bridge_lease", {"holder": "_internal"}, "invalid_request"),
    ("bridge_release", {"lease_id": "nope"}, "not_found"),
    ("no_such_command", {}, "not_found"),
])
def test_bad_commands_get_error_replies(hand, cmd, payload, code):
    client, _, proc = hand
    rep = call(client, cmd, payload)
    assert not rep.ok and rep.error["code"] == code, rep
    assert proc.alive()


def test_config_and_system_controls_reach_the_motors(hand):
    client, watch, _ = hand
    rep = call(client, "set_motor_config", {"motors": ["FFJ3", 5], "f": 400, "p": 5000, "max_pwm": 300,
                                            "torque_limit": 150, "deadband": 4})
    assert rep.ok, rep.error
    assert rep.result["motors"] == [1, 5] and rep.result["crc"] > 0
    assert call(client, "set_control_mode", {"mode": "torque"}).ok

    def limited():  # the motor accepted the config (CRC good): its torque stops at the new limit
        assert call(client, "set_demands", {"joints": {"FFJ3": 300}}).ok
        m = motor(watch, 1)
        return m["demand_sent"] == 300 and abs(m["torque"] - 150) < 3

    assert wait_for(limited, 5.0, 0.03)
    assert call(client, "set_control_mode", {"mode": "pwm"}).ok
    rep = call(client, "system_controls", {"motors": [2], "jiggle": True, "backlash": False})
    assert rep.ok and rep.result["controls"] == 0x42
    assert wait_for(lambda: "jiggling_in_progress" in motor(watch, 2)["flag_names"], 3.0)


def test_everything_published_follows_the_contract(hand):
    client, watch, _ = hand
    time.sleep(1.2)  # a loop_stats window and a health heartbeat
    doc = build_document()
    validator = ContractValidator(doc)
    with watch.lock:  # what the node published (not the test's own requests and can_tx frames)
        seen = [(t, p) for t, p in watch.seen if "/cmd/" not in t and not t.endswith("/stream/can_tx")]
    channels = {validator.validate(topic, payload) for topic, payload in seen}
    for name in ("joints", "motors", "tactile", "palm_extras", "loop_stats"):
        assert f"ethercat-loop_state_{name}" in channels
    assert "ethercat-loop_stream_can_rx" in channels and "health" in channels, (
        sorted(channels), sorted({t for t, _ in seen}))
    rep = call(client, "set_demands", {"joints": {"FFJ3": 1}})
    validator.validate_reply(doc, "ethercat-loop_cmd_set_demands", rep.raw)
    stats = watch.get("state/loop_stats")
    # (how many cycles a busy machine lets the model backend run is not under test here)
    assert stats["target_period_us"] == 1000.0 and stats["cycles"] > 0 and "jitter_p99_us" in stats


def test_sigterm_zeroes_demands_before_leaving(broker_session, spawn, client):
    node = "hand-b"  # an SR08 palm (protocol 0230) this time
    env = {**node_env(broker_session, node), "ROBOBUS_ETHERCAT_PROTOCOL": "0230"}
    proc = spawn(["-m", "services.ethercat_loop"], env)
    wait_running(client, node)
    tact = client.collect(f"robobus/{node}/{DEV}/state/tactile", 1.0)
    assert tact and len(json.loads(tact[-1][1])["sensors"][0]) == 16
    assert call(client, "set_control_mode", {"mode": "torque"}, node=node).ok
    stopped: list[dict] = []
    client.subscribe_before(f"robobus/{node}/{DEV}/event/stopped", lambda m: stopped.append(json.loads(m.payload)))
    for _ in range(5):
        assert call(client, "set_demands", {"motors": {"2": 600}}, node=node).ok
        time.sleep(0.01)
    assert proc.stop() == 0
    assert wait_for(lambda: bool(stopped), 5.0), proc.text()
    ev = stopped[0]
    assert ev["zero_demand_cycles"] >= 20
    assert ev["demands_sent_last"] == [0] * 20 and ev["model_demands"] == [0] * 20
