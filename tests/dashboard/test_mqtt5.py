"""The page's own MQTT 5 client (static/mqtt5.js), its packet codec in headless chromium: packets split across
websocket frames and several in one frame, the PUBLISH properties of requests and replies, the QoS 1 ack, and
malformed input refused with an error rather than a crash. The end-to-end tests (test_browser.py,
test_auth_and_server.py) use it against mosquitto."""

from __future__ import annotations

from typing import Any

import pytest

from shared.tools.asyncapi import build_document
from shared.tools.dashboard.server import DashboardServer, MissingAssets, PageConfig
from tests.dashboard.stack import browser, browser_missing

# Runs in the page: a client whose socket is a recorder, fed crafted frames through receive().
CODEC_JS = """async () => {
  const m = await import('/static/mqtt5.js');
  const c = Object.create(m.MqttClient.prototype);
  Object.assign(c, { handlers: {}, acks: new Map(), rest: null, opts: {}, nextId: 1, connected: true });
  const sent = [];
  c.ws = { readyState: WebSocket.OPEN, send: (b) => sent.push(Array.from(b)) };
  const got = [];
  c.on('message', (topic, payload, p) => got.push({ topic, payload: new TextDecoder().decode(payload),
      qos: p.qos, retain: p.retain, ct: p.properties.contentType || null, rt: p.properties.responseTopic || null,
      cd: p.properties.correlationData ? new TextDecoder().decode(p.properties.correlationData) : null }));
  // a QoS 1 publish as the client encodes it (retained, with the three properties), then a QoS 0 one
  c.publish('a/b', '{"x":1}', { qos: 1, retain: true, properties: { contentType: 'application/json',
            responseTopic: 'r/t', correlationData: new TextEncoder().encode('c0ffee') } });
  c.publish('c', new Uint8Array(300).fill(65));
  const [p1, p2] = sent.splice(0).map((x) => Uint8Array.from(x));
  const both = new Uint8Array(p1.length + p2.length);
  both.set(p1); both.set(p2, p1.length);
  // byte by byte, then both packets in one frame
  for (let i = 0; i < both.length; i++) c.receive(both.subarray(i, i + 1));
  c.receive(both);
  const acks = sent.splice(0);
  let malformed = null;
  try { c.receive(Uint8Array.of(0x30, 0xff, 0xff, 0xff, 0xff, 0x01)); } catch (e) { malformed = e.code; }
  c.rest = null;
  let badProp = null;
  try { c.receive(Uint8Array.of(0x30, 0x06, 0, 1, 0x61, 2, 0x7f, 0)); } catch (e) { badProp = e.code; }
  return { got, acks, malformed, badProp, p1: Array.from(p1.subarray(0, 1)), p2len: p2.length };
}"""


@pytest.fixture
def page() -> Any:
    why = browser_missing()
    if why:
        pytest.skip(why)
    try:
        server = DashboardServer(build_document(), PageConfig(ws_url="ws://127.0.0.1:1"), port=0).start()
    except MissingAssets as exc:
        pytest.skip(str(exc))
    try:
        with browser() as ctx:
            p = ctx.new_page()
            p.goto(server.url)
            yield p
    finally:
        server.stop()


def test_codec_round_trip_split_and_malformed(page: Any) -> None:
    r = page.evaluate(CODEC_JS)
    assert r["p1"] == [0x33]  # PUBLISH, QoS 1, retain
    msg1 = {"topic": "a/b", "payload": '{"x":1}', "qos": 1, "retain": True, "ct": "application/json", "rt": "r/t",
            "cd": "c0ffee"}
    msg2 = {"topic": "c", "payload": "A" * 300, "qos": 0, "retain": False, "ct": None, "rt": None, "cd": None}
    assert r["got"] == [msg1, msg2, msg1, msg2]
    assert r["p2len"] > 300  # a two-byte remaining length
    assert r["acks"] == [[0x40, 2, 0, 1], [0x40, 2, 0, 1]]  # PUBACK of packet id 1, once per delivery
    assert r["malformed"] == 0x81 and r["badProp"] == 0x81
