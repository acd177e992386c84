"""Binding commands once: `@handles` / `@runs` mark a service's handlers with their specs, `Device.bind_all` binds
them, and the node refuses to start while a device leaves a command or job of its kind unbound (shared/device.py,
shared/node.py, shared/lifecycle.py; docs/kit.md, "Declare the contract")."""

from __future__ import annotations

import threading
import time

import pytest
from pydantic import BaseModel

from shared import CommandError, ErrorCode, JobContext, Node, ServiceAPI
from shared.device import handles, runs
from shared.lifecycle import run_service
from shared.node import UnboundCommands
from shared.rpc import RpcClient
from shared.settings import KitSettings
from tests.fixtures import Broker


class Num(BaseModel):
    n: int = 0


class Where(BaseModel):
    thread: str


API = ServiceAPI("bind-once-test", device_doc="a test device")
ADD = API.command("add", Num, Num, doc="Add one")
WHERE = API.command("where", Num, Where, doc="Which thread ran the handler")
SLEEP = API.command("sleep", Num, Num, doc="Sleep n ms (async)")
COUNT = API.job("count", Num, Num, doc="Count to n", errors=[ErrorCode.BUSY])
GRIP = API.command("grip", Num, Num, doc="Only grippers have it")
FULL = API.kind("full", commands=[ADD, WHERE, SLEEP], jobs=[COUNT], doc="Everything but grip")
GRIPPER = API.kind("gripper", commands=[ADD, GRIP], doc="Adds and grips")

OTHER = ServiceAPI("other-test")
FOREIGN = OTHER.command("add", Num, Num, doc="Same name, another API")


class Full:
    """Every command and job of kind `full`, marked once each."""

    def __init__(self, busy: bool = False) -> None:
        self.busy = busy
        self.fast = True  # read by `inline="fast"` when bound

    @handles(ADD)
    def add(self, req: Num) -> Num:
        return Num(n=req.n + 1)

    @handles(WHERE, inline="fast")
    def where(self, req: Num) -> Where:
        return Where(thread=threading.current_thread().name)

    @handles(SLEEP)
    async def sleep(self, req: Num) -> Num:
        return req

    def admit_count(self, req: Num) -> None:
        if self.busy:
            raise CommandError(ErrorCode.BUSY, "counting already")

    @runs(COUNT, admit="admit_count")
    def count(self, req: Num, job: JobContext) -> Num:
        return Num(n=req.n)


class Gripper:
    @handles(ADD)
    @handles(GRIP)  # one method answers two commands
    def both(self, req: Num) -> Num:
        return Num(n=-req.n)


def _node(broker: Broker | None = None, name: str = "") -> Node:
    settings = (broker.settings(node=name or f"bind-{time.monotonic_ns()}") if broker is not None
                else KitSettings(node=name or "bind-offline"))
    return Node(API, settings)


def test_bind_all_binds_every_marked_method_as_bind_and_bind_job_would() -> None:
    node = _node()
    dev = node.device("a", kind=FULL.name)
    obj = Full()
    dev.bind_all(obj)
    assert set(dev.commands) == {"add", "where", "sleep", "cancel"}
    assert dev.commands["add"][1] == obj.add
    assert dev.inline == {"where"}  # inline="fast": the object's attribute, read when bound
    spec, run, admit = dev.jobs["count"]
    assert spec is COUNT and run == obj.count and admit == obj.admit_count
    assert dev.unbound() == ([], [])
    node.check_bindings()  # nothing missing: no error

    slow = Full()
    slow.fast = False
    dev2 = node.device("b", kind=FULL.name)
    dev2.bind_all(slow)
    assert dev2.inline == set()


def test_one_method_may_answer_several_commands() -> None:
    dev = _node().device("g", kind=GRIPPER.name)
    obj = Gripper()
    dev.bind_all(obj)
    assert dev.commands["add"][1] == obj.both and dev.commands["grip"][1] == obj.both


def test_bound_by_decorator_answers_on_the_wire(broker_session: Broker, client: RpcClient) -> None:
    node = _node(broker_session)
    obj = Full()
    node.device("a", kind=FULL.name).bind_all(obj)
    node.start()
    try:
        assert node.session.wait_ready(10)
        rep = client.call(node.name, "a", "add", {"n": 41})
        assert rep.ok and rep.result == {"n": 42}, rep
        rep = client.call(node.name, "a", "where", {})
        assert rep.ok and not rep.result["thread"].startswith("cmd"), rep  # inline: the network thread
        obj.busy = True
        rep, result = client.call_job(node.name, "a", "count", {"n": 3}, lambda p: None, timeout=30)
        assert not rep.ok and rep.error is not None and rep.error["code"] == "busy", rep  # admit ran first
        obj.busy = False
        rep, result = client.call_job(node.name, "a", "count", {"n": 3}, lambda p: None, timeout=30)
        assert rep.ok and result is not None and result["ok"] and result["result"] == {"n": 3}, (rep, result)
    finally:
        node.stop()


def test_an_inline_async_handler_is_refused() -> None:
    with pytest.raises(ValueError, match="inline handler must be synchronous"):
        class Bad:
            @handles(ADD, inline=True)
            async def add(self, req: Num) -> Num:
                return req

    class Later:  # inline named by an attribute: refused when bound, as Device.bind refuses it
        fast = True

        @handles(WHERE, inline="fast")
        async def where(self, req: Num) -> Where:
            return Where(thread="")

    dev = _node().device("a", kind=FULL.name)
    with pytest.raises(ValueError, match="inline handler must be synchronous"):
        dev.bind_all(Later())
    assert "where" not in dev.commands


def test_a_command_spec_is_not_a_job_and_back() -> None:
    with pytest.raises(TypeError, match="@runs"):
        handles(COUNT)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="@handles"):
        runs(ADD)  # type: ignore[arg-type]


def test_a_missing_handler_is_refused_at_build_naming_service_device_kind_and_commands() -> None:
    class Partial:
        @handles(ADD)
        def add(self, req: Num) -> Num:
            return req

    node = _node()
    node.device("arm1", kind=FULL.name).bind_all(Partial())
    node.device("arm2", kind=FULL.name).bind_all(Full())
    with pytest.raises(UnboundCommands) as err:
        node.start()  # before the session: nothing is published
    msg = str(err.value)
    assert msg.startswith("bind-once-test: device 'arm1' (kind 'full') has no handler for "), msg
    assert "command where, command sleep, job count (" in msg, msg  # cancel comes with the job
    assert "arm2" not in msg
    assert not node.session.connected.is_set()


def test_a_service_without_kinds_binds_its_whole_api() -> None:
    api = ServiceAPI("one-kind-test")
    ping = api.command("ping", Num, Num)
    api.command("pong", Num, Num)
    node = Node(api, KitSettings(node="one-kind"))
    node.device("d").bind(ping, lambda r: r)
    with pytest.raises(UnboundCommands, match=r"device 'd' \(kind 'device'\) has no handler for command pong"):
        node.check_bindings()


def test_run_service_refuses_to_start_with_the_missing_commands(monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("ROBOBUS_NODE", "bind-refused")
    monkeypatch.setattr("shared.lifecycle.setup_logging", lambda *a: None)  # the test process's logging stays
    started: list[str] = []

    class Svc:
        def hooks(self) -> object:
            started.append("hooks")
            raise AssertionError("hooks asked for: the node was built")

    def build(node: Node, settings: KitSettings) -> Svc:
        node.device("g1", kind=GRIPPER.name).bind(ADD, lambda r: r)
        return Svc()

    with pytest.raises(SystemExit) as exc:
        run_service(API, KitSettings, build)  # type: ignore[arg-type]
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "robobus: bind-once-test: device 'g1' (kind 'gripper') has no handler for command grip" in err, err
    assert started == []


def test_a_handler_for_an_undeclared_command_is_refused() -> None:
    class Foreign:
        @handles(FOREIGN)  # declared on another API under the same name
        def add(self, req: Num) -> Num:
            return req

    dev = _node().device("a", kind=FULL.name)
    with pytest.raises(KeyError, match="not declared on bind-once-test's API"):
        dev.bind_all(Foreign())

    class Gripping(Full):
        @handles(GRIP)  # declared, but not a command of kind `full`
        def grip(self, req: Num) -> Num:
            return req

    with pytest.raises(KeyError, match="not one of kind 'full'"):
        _node().device("b", kind=FULL.name).bind_all(Gripping())


def test_two_handlers_for_one_command_are_refused() -> None:
    class Twice(Full):
        @handles(ADD)
        def add_again(self, req: Num) -> Num:
            return req

    with pytest.raises(ValueError, match="'add' has two handlers"):
        _node().device("a", kind=FULL.name).bind_all(Twice())


def test_an_admit_that_is_not_a_method_is_refused() -> None:
    class NoAdmit:
        @runs(COUNT, admit="nowhere")
        def count(self, req: Num, job: JobContext) -> Num:
            return req

    with pytest.raises(TypeError, match="admit 'nowhere' is not a method"):
        _node().device("a", kind=FULL.name).bind_all(NoAdmit())


def test_kinds_are_checked_when_declared_and_when_a_device_is_made() -> None:
    api = ServiceAPI("kinds-test")
    a = api.command("a", Num, Num)
    with pytest.raises(ValueError, match="command 'add' is not declared on the API"):
        api.kind("k", commands=[ADD])
    api.kind("k", commands=[a])
    node = Node(api, KitSettings(node="kinds"))
    with pytest.raises(ValueError, match="name the device's kind"):
        node.device("d")
    with pytest.raises(ValueError, match="no kind of device 'x'"):
        node.device("d", kind="x")
    node.device("d", kind="k")
    with pytest.raises(ValueError, match="of kind 'k', not 'j'"):
        node.device("d", kind="j")


def test_an_override_answers_what_the_method_it_overrides_was_marked_for() -> None:
    class Base(Full):
        pass

    class Override(Base):
        def add(self, req: Num) -> Num:  # unmarked: still the handler of `add`, this body
            return Num(n=req.n + 100)

    dev = _node().device("a", kind=FULL.name)
    obj = Override()
    dev.bind_all(obj)
    assert dev.commands["add"][1] == obj.add and dev.commands["add"][1](Num(n=1)) == Num(n=101)
    assert dev.unbound() == ([], [])


def test_the_contract_and_settings_are_imported_from_api_and_settings_not_from_service() -> None:
    """A service.py re-exports nothing of its api.py or settings.py: tests and benches import the contract (API, the
    specs) from <package>.api and the settings from .settings, and service.py's __all__ names only its own. Every
    registered service (shared.registry) is held to it."""
    import ast
    import importlib

    from shared.registry import service_packages
    from tests.fixtures import REPO

    owned: dict[str, set[str]] = {}
    for svc, package in service_packages().items():
        api = importlib.import_module(f"{package}.api")
        try:
            settings = importlib.import_module(f"{package}.settings")
        except ImportError:
            raise AssertionError(f"{svc}: no {package}.settings: its KitSettings subclass lives there") from None
        owned[package] = {n for n in vars(api) if n.isupper()} | {
            n for n, v in vars(settings).items() if isinstance(v, type) and v.__module__ == settings.__name__}
        service = importlib.import_module(f"{package}.service")
        assert not set(getattr(service, "__all__", ())) & owned[package], svc
    found = []
    paths = [*(REPO / "tests").rglob("*.py"), *(REPO / "bench").glob("*.py")]
    for path in paths:
        if "node_modules" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.endswith(".service"):
                package = node.module.removesuffix(".service")
                names = {a.name for a in node.names} & owned.get(package, set())
                if names:
                    found.append(f"{path.relative_to(REPO)}: {sorted(names)} from {node.module}")
    assert found == []


def test_the_asyncapi_document_says_which_kinds_answer_each_command() -> None:
    from shared.tools.asyncapi import build_document

    ops = build_document([API])["operations"]
    kinds = {cid.removeprefix("bind-once-test_cmd_"): op["x-robobus"]["kinds"]
             for cid, op in ops.items() if "x-robobus" in op}
    assert kinds == {"add": ["full", "gripper"], "grip": ["gripper"], "where": ["full"], "sleep": ["full"],
                     "count": ["full"], "cancel": ["full"]}
    assert "Devices of kind: full, gripper." in ops["bind-once-test_cmd_add"]["summary"]
    plain = build_document([OTHER])["operations"]  # no kinds declared: every device answers every command
    assert [op for op in plain.values() if "kinds" in op.get("x-robobus", {})] == []
