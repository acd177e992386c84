"""ModelBackend: the driver and the palm model in a dedicated thread (no timing assertions)."""

import sys
import threading

import pytest

from services.ethercat_loop.backend import BackendUnavailable, HandBackend
from services.ethercat_loop.control import CanFrame, CanTx, SetCanDirect, SetControlMode, SetDemands
from services.ethercat_loop.model_backend import ModelBackend
from services.ethercat_loop.service import make_backend
from services.ethercat_loop.settings import EthercatSettings
from shared.rpc import wait_for


@pytest.fixture
def backend():
    b = make_backend(EthercatSettings(backend="model", ethercat_push_config_on_start=False))
    assert isinstance(b, ModelBackend) and isinstance(b, HandBackend)
    yield b
    b.stop()


def test_cycles_reports_and_stops_with_zero_demands(backend):
    assert backend.snapshot() is None or backend.snapshot().cycle >= 0
    backend.start()
    assert wait_for(lambda: (backend.snapshot() or None) is not None and backend.snapshot().phase == "operation", 5)
    info = backend.info()
    assert info["connected"] and info["protocol"] == "0220" and info["product"] == 6 and info["backend"] == "model"
    assert set(info) >= {"vendor", "product", "revision", "serial", "protocol", "state", "error"}
    backend.submit(SetControlMode("torque"))
    backend.submit(SetDemands({7: 250}))
    assert wait_for(lambda: backend.model.motors[7].demand == 250, 2)
    assert wait_for(lambda: backend.stats().cycles > 0, 3)  # the first 1 s window
    s = backend.stats()
    assert s.period_us > 0 and s.target_period_us == 1000.0 and s.jitter_max_us >= s.jitter_p50_us >= 0
    assert s.total_cycles >= s.cycles and s.window_s >= 1.0
    backend.submit(SetDemands({7: 250}))
    backend.stop()
    rep = backend.stop_report()
    assert rep["zero_demand_cycles"] >= 20 and rep["model_demands"] == [0] * 20
    assert not backend.info()["connected"]
    backend.stop()  # idempotent


def test_lost_frames_are_counted(backend):
    backend.start()
    assert wait_for(lambda: backend.snapshot() is not None, 2)
    backend.lose_next = 3
    assert wait_for(lambda: backend.snapshot().counters["lost"] >= 4, 2)  # the very first cycle has no status


def test_can_rx_hook_gets_batches_off_the_cycle_thread(backend):
    got, threads = [], set()

    def on_rx(frames):
        threads.add(threading.current_thread().name)
        got.extend(frames)

    backend.on_can_rx(on_rx)
    backend.start()
    backend.submit(SetCanDirect(True))
    backend.submit(CanTx((CanFrame(1, 0x001, b""), CanFrame(2, 0x001, b""))))
    assert wait_for(lambda: len(got) >= 20, 3)
    assert {f.bus for f in got} == {1, 2} and "palm-cycle" not in threads
    cycles = [f.cycle for f in got]
    assert cycles == sorted(set(cycles))


def test_wire_backends_fail_clearly_without_the_cycle_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "services.ethercat_loop.transport.process_backend", None)
    with pytest.raises(BackendUnavailable, match="cannot be imported here"):
        make_backend(EthercatSettings(backend="virtual"))


def test_settings_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("ROBOBUS_ETHERCAT_BACKEND", "nic")
    monkeypatch.setenv("ROBOBUS_ETHERCAT_POLLING", '{"temperature": 0.5}')
    s = EthercatSettings()
    assert s.backend == "nic" and s.ethercat_polling == {"temperature": 0.5}
    monkeypatch.setenv("ROBOBUS_ETHERCAT_POLLING", '{"bogus": 1}')
    with pytest.raises(ValueError, match="bogus"):
        EthercatSettings()


class Peer:
    def __init__(self, model):
        self.model = model

    def on_can_frame(self, bus, sid, data):
        return [(bus, 0x7FF, b"pong")] if data == b"ping" else []


def make_peers(model):
    return [Peer(model)]


def test_can_peers_plug_into_the_model_from_settings():
    b = make_backend(EthercatSettings(ethercat_can_nodes=["tests.ethercat_loop.test_backend:make_peers"]))
    assert isinstance(b, ModelBackend)
    assert isinstance(b.model.can_nodes[0], Peer) and b.model.can_nodes[0].model is b.model
    with pytest.raises(BackendUnavailable, match="nope"):
        make_backend(EthercatSettings(ethercat_can_nodes=["tests.ethercat_loop.test_backend:nope"]))
