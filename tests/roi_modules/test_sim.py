"""The simulator on real UDP sockets, driven by a bare client: firmware behaviour as docs/reference/roi.md §3/§6."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from services.roi_modules import protocol as p
from services.roi_modules.sim import OdriveFirmware, RoiSim, SimModuleSpec
from tests.roi_modules.conftest import fresh_prefix, wait_until

HOST = 100


class Client:
    """The SBC side without the service: bound to <prefix>.100 on both ROI ports."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.gen = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.gen.bind((f"{prefix}.{HOST}", p.GENERAL_PORT))
        self.adm = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.adm.bind((f"{prefix}.{HOST}", p.SYSADMIN_PORT))
        for s in (self.gen, self.adm):
            s.settimeout(2.0)

    def general(self, octet: int, pkt: p.GeneralPacket, src: socket.socket | None = None) -> p.GeneralPacket:
        (src or self.gen).sendto(pkt.encode(), (f"{self.prefix}.{octet}", p.GENERAL_PORT))
        data, addr = self.gen.recvfrom(2048)
        assert addr == (f"{self.prefix}.{octet}", p.GENERAL_PORT) and len(data) == 64
        return p.decode_general(data)[0]

    def sysadmin(self, octet: int, pkt: p.SysAdminPacket, timeout: float = 2.0) -> p.SysAdminPacket | None:
        self.adm.settimeout(timeout)
        self.adm.sendto(pkt.encode(), (f"{self.prefix}.{octet}", p.SYSADMIN_PORT))
        try:
            data, _ = self.adm.recvfrom(2048)
        except TimeoutError:
            return None
        return p.decode_sysadmin(data)[0]

    def close(self) -> None:
        self.gen.close()
        self.adm.close()


@pytest.fixture
def net() -> Iterator[tuple[RoiSim, Client]]:
    prefix = fresh_prefix()
    sim = RoiSim(prefix, [SimModuleSpec(10, "gpio"), SimModuleSpec(20, "odrive"), SimModuleSpec(30, "actuator")],
                 seed=1).start()
    c = Client(prefix)
    yield sim, c
    c.close()
    sim.close()


def status(c: Client, octet: int) -> p.StatusReport:
    rep = c.sysadmin(octet, p.SysAdminPacket(p.SysAdminAction.STATUS_REPORT, origin=HOST))
    assert rep is not None and rep.action == p.SysAdminAction.STATUS_REPORT
    return p.StatusReport.decode(rep.payload)


def test_ping_pong_and_status_report_after_start(net: tuple[RoiSim, Client]) -> None:
    _, c = net
    rep = c.sysadmin(20, p.SysAdminPacket(p.SysAdminAction.PING, origin=HOST))
    assert rep is not None and rep.action == p.SysAdminAction.PONG and rep.origin == HOST
    assert p.Pong.decode(rep.payload) == p.Pong(True, p.ModuleType.O_DRIVE)
    st = status(c, 10)
    assert st.state == p.ModuleState.BLANK_STATE and st.module_type == p.ModuleType.GENERAL_GPIO
    assert st.supply_mv == 4950 and st.neighbour == 20 and st.mac[0] & 0x03 == 0x02


def test_general_reply_always_goes_to_the_general_port(net: tuple[RoiSim, Client]) -> None:
    sim, c = net
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as eph:
        eph.bind((f"{c.prefix}.{HOST}", 0))  # a request from an ephemeral port
        rep = c.general(10, p.GeneralPacket(12, p.GpioAction.READ), src=eph)
    assert rep.sub_device_id == 12 and rep.action == p.GpioAction.READ
    assert p.gpio_read_value(12, rep.payload) == sim.call(10, lambda fw: fw.analog[12])


def test_gpio_handler_and_blank_state(net: tuple[RoiSim, Client]) -> None:
    sim, c = net
    assert c.general(10, p.GeneralPacket(3, p.GpioAction.SET_OUTPUT, b"\x01")).payload[0] == 0  # not an output
    assert c.general(10, p.GeneralPacket(8, p.GpioAction.SET_PIN_MODE, b"\x03")).payload[0] == 0  # reserved pin
    assert c.general(10, p.GeneralPacket(3, p.GpioAction.SET_PIN_MODE, b"\x04")).payload[0] == 0  # bad mode
    assert status(c, 10).state == p.ModuleState.BLANK_STATE
    assert c.general(10, p.GeneralPacket(3, p.GpioAction.SET_PIN_MODE, b"\x03")).payload[0] == 1
    assert status(c, 10).state == p.ModuleState.OPERATING  # configured, chain of three formed
    assert c.general(10, p.GeneralPacket(3, p.GpioAction.SET_OUTPUT, b"\x01")).payload[0] == 1
    assert c.general(10, p.GeneralPacket(3, p.GpioAction.READ)).payload[:2] == b"\x01\x00"
    c.general(10, p.GeneralPacket(4, p.GpioAction.SET_PIN_MODE, b"\x02"))
    assert c.general(10, p.GeneralPacket(4, p.GpioAction.READ)).payload[0] == 1  # pull-up, floating
    sim.reboot(10)
    assert status(c, 10).state == p.ModuleState.BLANK_STATE


def test_odrive_get_all_motion_and_fet_code_collision(net: tuple[RoiSim, Client]) -> None:
    sim, c = net
    assert c.general(20, p.odrive_request(p.OdriveAction.SET_CONTROL_MODE, p.ControlMode.POSITION)).payload[0] == 1
    c.general(20, p.odrive_request(p.OdriveAction.SET_POSITION, 2.0))

    def pos() -> float:
        return p.OdriveAll.decode(c.general(20, p.odrive_request(p.OdriveAction.GET_ALL)).payload).position

    assert wait_until(lambda: abs(pos() - 2.0) < 1e-3, 5)
    allv = p.OdriveAll.decode(c.general(20, p.odrive_request(p.OdriveAction.GET_ALL)).payload)
    assert allv.bus_voltage == 24.0 and allv.error == 0
    c.general(20, p.odrive_request(p.OdriveAction.SET_CONTROL_MODE, p.ControlMode.VELOCITY))
    # "GET_FET_TEMPERATURE" as the firmware defines it (0x00, empty payload) switches back to POSITION_MODE
    c.general(20, p.GeneralPacket(0, p.GET_FET_TEMPERATURE_FIRMWARE))
    assert sim.call(20, lambda fw: fw.control_mode) == p.ControlMode.POSITION
    # invalid sub-device: answered [0] = 0
    assert c.general(20, p.odrive_request(p.OdriveAction.SET_POSITION, 1.0, sub_device_id=3)).payload[0] == 0


def test_odrive_watchdog_pauses_the_axis(net: tuple[RoiSim, Client]) -> None:
    sim, c = net
    c.general(20, p.odrive_request(p.OdriveAction.SET_CONTROL_MODE, p.ControlMode.VELOCITY))
    c.general(20, p.odrive_request(p.OdriveAction.SET_VELOCITY, 1.0))
    wait_until(lambda: sim.call(20, lambda fw: fw.vel) > 0.9, 5)
    assert wait_until(lambda: sim.call(20, lambda fw: fw.paused), 5)  # no traffic for 500 ms
    p1 = sim.call(20, lambda fw: fw.pos)
    time.sleep(0.1)
    assert sim.call(20, lambda fw: fw.pos) == p1  # idle: not moving
    c.general(20, p.odrive_request(p.OdriveAction.GET_ALL))
    assert not sim.call(20, lambda fw: fw.paused)  # traffic resumes the axis


def test_odrive_getter_bug_option_answers_control_mode() -> None:
    prefix = fresh_prefix()
    sim = RoiSim(prefix, [SimModuleSpec(20, "odrive")], getter_bug=True).start()
    c = Client(prefix)
    try:
        c.general(20, p.odrive_request(p.OdriveAction.SET_CONTROL_MODE, p.ControlMode.TORQUE))
        rep = c.general(20, p.odrive_request(p.OdriveAction.GET_ALL))
        assert rep.payload[:4] == b"\x02\x00\x00\x00"
    finally:
        c.close()
        sim.close()


def test_actuator_replies_zero_and_stays_blank(net: tuple[RoiSim, Client]) -> None:
    sim, c = net
    rep = c.general(30, p.GeneralPacket(1, p.ActuatorAction.SET_ABSOLUTE_LENGTH, p.u16(100)))
    assert rep.payload == bytes(56)
    assert c.general(30, p.GeneralPacket(1, p.ActuatorAction.GET_CURRENT_LENGTH)).payload == bytes(56)
    assert wait_until(lambda: sim.call(30, lambda fw: fw.length[1]) == 100.0, 5)
    assert status(c, 30).state == p.ModuleState.BLANK_STATE


def test_blacklist_applied_but_never_answered(net: tuple[RoiSim, Client]) -> None:
    sim, c = net
    rep = c.sysadmin(10, p.SysAdminPacket(p.SysAdminAction.BLACK_LIST, p.blacklist_payload(p.BlacklistOp.ADD, 77),
                                          origin=HOST), timeout=0.3)
    assert rep is None
    assert sim.call(10, lambda fw: 77 in fw.blacklist)


def test_faults_drop_corrupt_duplicate_delay_offline(net: tuple[RoiSim, Client]) -> None:
    sim, c = net
    sim.set_faults(10, drop_next=1)
    c.gen.settimeout(0.3)
    c.gen.sendto(p.GeneralPacket(12, p.GpioAction.READ).encode(), (f"{c.prefix}.10", p.GENERAL_PORT))
    with pytest.raises(TimeoutError):
        c.gen.recvfrom(2048)
    c.gen.settimeout(2)
    sim.set_faults(10, corrupt_rate=1.0)
    c.gen.sendto(p.GeneralPacket(12, p.GpioAction.READ).encode(), (f"{c.prefix}.10", p.GENERAL_PORT))
    with pytest.raises(p.DecodeError):
        p.decode_general(c.gen.recvfrom(2048)[0])
    sim.set_faults(10, corrupt_rate=0.0, duplicate=True, delay_s=0.05)
    t0 = time.monotonic()
    c.gen.sendto(p.GeneralPacket(12, p.GpioAction.READ).encode(), (f"{c.prefix}.10", p.GENERAL_PORT))
    c.gen.recvfrom(2048)
    assert time.monotonic() - t0 >= 0.04
    c.gen.recvfrom(2048)  # the duplicate
    sim.set_faults(10, offline=True, duplicate=False, delay_s=0)
    assert c.sysadmin(10, p.SysAdminPacket(p.SysAdminAction.PING, origin=HOST), timeout=0.2) is None
    # garbage does not kill the simulator
    c.gen.sendto(b"\x01\x02", (f"{c.prefix}.20", p.GENERAL_PORT))
    assert c.general(20, p.odrive_request(p.OdriveAction.GET_ALL)).action == p.OdriveAction.GET_ALL


def test_odrive_error_sets_module_state(net: tuple[RoiSim, Client]) -> None:
    sim, c = net
    c.general(20, p.odrive_request(p.OdriveAction.SET_CONTROL_MODE, 0))
    sim.set_error(20, 0x2000, operable=False)
    assert status(c, 20).state == p.ModuleState.NOT_OPERABLE
    assert p.OdriveAll.decode(c.general(20, p.odrive_request(p.OdriveAction.GET_ALL)).payload).error == 0x2000
    c.general(20, p.odrive_request(p.OdriveAction.CLEAR_ERRORS))
    assert status(c, 20).state == p.ModuleState.OPERATING
    assert isinstance(sim.module(20), OdriveFirmware)


def test_firmware_report_only_from_head_firmware() -> None:
    prefix = fresh_prefix()
    sim = RoiSim(prefix, [SimModuleSpec(10, "gpio"), SimModuleSpec(11, "gpio")], head_firmware=True).start()
    c = Client(prefix)
    try:
        rep = c.sysadmin(10, p.SysAdminPacket(p.SysAdminAction.FIRMWARE_REPORT, origin=HOST))
        assert rep is not None and rep.action == p.SysAdminAction.FIRMWARE_REPORT
        t, d = p.decode_firmware_report(rep.payload)
        assert t.count(":") == 2 and d.endswith("2025")
        sim.call(11, lambda fw: setattr(fw, "head_firmware", False))  # a1c7216: unknown action, BLANK reply
        assert c.sysadmin(11, p.SysAdminPacket(p.SysAdminAction.FIRMWARE_REPORT, origin=HOST), timeout=0.3) is None
    finally:
        c.close()
        sim.close()
