"""The contract catalog: which channel and schema a topic gets, and what replay must not resend."""

from __future__ import annotations

import json

import jsonschema
from pydantic import BaseModel

from shared import ServiceAPI
from shared.tools.asyncapi import build_document, standalone_schema
from shared.tools.bus_catalog import TopicCatalog
from tests.record.helpers import document


def cat() -> TopicCatalog:
    return TopicCatalog.from_document(document(), "site1/robobus")


def test_kit_topics_get_their_schemas() -> None:
    c = cat()
    st = c.info("site1/robobus/epuck-gateway/status")
    assert (st.kind, st.channel, st.schema_name) == ("status", "status", "Status")
    h = c.info("site1/robobus/epuck-gateway/epuck1/health")
    assert (h.kind, h.schema_name, h.node_receives) == ("health", "Health", False)
    s = c.info("site1/robobus/epuck-gateway/_node/state/stats")
    assert (s.kind, s.schema_name) == ("stats", "NodeStats")


def test_state_schema_is_standalone_and_valid_draft_2020_12() -> None:
    info = cat().info("site1/robobus/epuck-gateway/epuck1/state/sensors")
    assert info.kind == "state" and info.channel == "epuck-gateway_state_sensors"
    assert info.schema is not None
    schema = json.loads(info.schema)
    jsonschema.Draft202012Validator.check_schema(schema)
    assert "#/components" not in info.schema.decode()  # every $ref resolved locally
    assert schema["title"] == info.schema_name


def test_binary_topic_keeps_its_content_type_and_has_no_json_schema() -> None:
    info = cat().info("site1/robobus/epuck-gateway/epuck2/state/image")
    assert info.content_type == "image/jpeg" and info.schema is None


def test_commands_and_inbound_streams_are_what_nodes_receive() -> None:
    c = cat()
    cmd = c.info("site1/robobus/epuck-gateway/epuck1/cmd/set_speed")
    assert cmd.kind == "cmd" and cmd.node_receives and cmd.schema_name
    reply = c.info("site1/robobus/epuck-gateway/epuck1/cmd/set_speed/reply")
    assert reply.kind == "reply" and not reply.node_receives and reply.channel == "epuck-gateway_cmd_set_speed_reply"
    streams_in = [cid for cid in c.receives if "_stream_" in cid]
    for cid in streams_in:  # e.g. the palm's CAN bridge: frames sent *to* the node move hardware too
        addr = document()["channels"][cid]["address"].replace("{root}", "site1/robobus")
        addr = addr.replace("{node}", "n").replace("{device}", "d")
        assert c.info(addr).node_receives, cid


def test_unknown_topics_default_to_safe() -> None:
    c = cat()
    assert c.info("elsewhere/thing").kind == "other"
    odd = c.info("site1/robobus/custom/dev/cmd/go")
    assert odd.node_receives  # not in the contract but addressed as a command: never replayed by default
    assert c.info("site1/robobus/_client/abc/reply").kind == "reply"


class RecTestTempA(BaseModel):
    celsius: float


class RecTestTempB(BaseModel):
    kelvin: int


def test_ambiguous_state_name_resolved_by_the_node_s_status() -> None:
    a, b = ServiceAPI("rec-test-a"), ServiceAPI("rec-test-b")
    a.state("temp", RecTestTempA)
    b.state("temp", RecTestTempB)
    c = TopicCatalog.from_document(build_document([a, b]), "robobus")
    topic = "robobus/lab-node/d/state/temp"
    first = c.info(topic)
    assert set(first.candidates) == {"rec-test-a_state_temp", "rec-test-b_state_temp"}
    c.learn("robobus/lab-node/status", json.dumps({"online": True, "service": "rec-test-b"}).encode())
    assert c.info(topic).schema_name == "RecTestTempB"
    c.learn("robobus/lab-node/d/health", json.dumps({"service": "rec-test-a"}).encode())
    assert c.info(topic).schema_name == "RecTestTempA"
    # before anything is learnt, a node named after its service (the default) decides
    assert c.info("robobus/rec-test-b/d/state/temp").schema_name == "RecTestTempB"


def test_standalone_schema_inlines_nested_refs() -> None:
    schemas = {"A": {"type": "object", "properties": {"b": {"$ref": "#/components/schemas/B"}}},
               "B": {"type": "integer"}}
    out = standalone_schema({"$ref": "#/components/schemas/A"}, schemas, title="A")
    assert out["$ref"] == "#/$defs/A" and set(out["$defs"]) == {"A", "B"}
    jsonschema.validate({"b": 3}, out)
    try:
        jsonschema.validate({"b": "x"}, out)
        raise AssertionError("should not validate")
    except jsonschema.ValidationError:
        pass
