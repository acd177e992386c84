"""Fuzz targets: every binary decoder that reads bytes from a device, each with the errors it is allowed to
raise (its own documented rejection). Anything else escaping a decoder is a bug: garbage from a device must be
rejected, counted and logged, never crash a service.

Each target takes raw fuzzer bytes. `python -m tests.fuzz TARGET [atheris/libFuzzer flags]` runs one under
atheris (coverage-guided); tests/fuzz/test_fuzz.py runs each briefly; hypothesis tests of the codecs live
beside each service's tests.

A service declares its own targets in its protocol module, found through the registry (no list to edit here):

    FUZZ = {"<service>_<what>": decode_function}   # target name -> a function of raw device bytes
    FUZZ_ALLOWED = (ProtocolError,)                # what a decoder may raise: its own documented rejection

The declaration is read from the module's source (ast), so that atheris instruments the module when it is first
imported; every registered service must be covered by a target (tests/fuzz/test_fuzz.py)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Target:
    name: str
    run: Callable[[bytes], object]
    allowed: Callable[[], tuple[type[BaseException], ...]] = tuple  # imported late: atheris instruments first
    modules: tuple[str, ...] = ()  # what the target exercises (imported before atheris instruments)
    seeds: Callable[[], list[bytes]] = list  # well-formed inputs to start from (sizes the fuzzer would not guess)


def _palm_seeds() -> list[bytes]:
    from services.ethercat_loop.protocol import PROTOCOLS

    return [b"\x00" + bytes(PROTOCOLS["0220"].status_size), b"\x01" + bytes(PROTOCOLS["0230"].status_size)]


def _palm_command_seeds() -> list[bytes]:
    from services.ethercat_loop.protocol import PROTOCOLS

    return [bytes(PROTOCOLS["0220"].command_size)]


def _palm_status(data: bytes) -> object:
    from services.ethercat_loop import protocol as p

    proto = "0230" if data[:1] == b"\x01" else "0220"
    return p.unpack_status(data[1:], proto)  # a DecodeError value, never an exception


def _palm_command(data: bytes) -> object:
    from services.ethercat_loop import protocol as p

    return p.unpack_command(data, "0220")


def _ethercat_frame(data: bytes) -> object:
    from services.ethercat_loop.sim import esc_frames as f

    frame = f.parse_frame(data)
    return f.parse_datagrams(frame.payload) if hasattr(frame, "payload") else frame


def _ethercat_frame_allowed() -> tuple[type[BaseException], ...]:
    from services.ethercat_loop.sim.esc_frames import FrameError

    return (FrameError,)


def _boot_reply(data: bytes) -> object:
    from services.can_bootloader import protocol as p

    if len(data) < 2:
        return None
    frame = p.BootFrame(int.from_bytes(data[:2], "little") & 0x7FF, data[2:10])
    msg = p.decode(frame)
    if msg is not None:
        p.parse_address(msg.data) if len(msg.data) >= 3 else None
        p.is_ack(p.read_flash(msg.local_id & 0xF, 0x1000), frame)
    return msg


def _epuck_stream(data: bytes) -> object:
    from services.epuck_gateway.protocol.wifi import EpuckStreamParser

    parser = EpuckStreamParser()
    events = []
    # the first byte chooses the segmentation: the same bytes, cut into reads of 1..256 bytes
    step = (data[0] if data else 1) or 1
    for i in range(1, len(data), step):
        events += parser.feed(data[i:i + step])
    return events


def _epuck_command(data: bytes) -> object:
    from services.epuck_gateway.protocol.wifi import EpuckCommand

    return EpuckCommand.decode(data)


def _epuck_allowed() -> tuple[type[BaseException], ...]:
    from services.epuck_gateway.protocol.wifi import ProtocolError

    return (ProtocolError,)


def _roi_datagram(data: bytes) -> object:
    """What the roi-modules transport does with a datagram: decode it as the port says, then its payload."""
    from services.roi_modules import protocol as p

    if not data:
        return None
    body = data[1:]
    if data[0] & 1:
        pkt, _ = p.decode_general(body, verify=False)
        p.OdriveAll.decode(pkt.payload)
        return p.gpio_read_value(pkt.sub_device_id % 18, pkt.payload)
    spkt, _ = p.decode_sysadmin(body, verify=False)
    p.Pong.decode(spkt.payload)
    p.decode_blacklist_list(spkt.payload)
    try:
        p.decode_firmware_report(spkt.payload)
    except p.DecodeError:
        pass
    return p.StatusReport.decode(spkt.payload)


def _roi_allowed() -> tuple[type[BaseException], ...]:
    from services.roi_modules.protocol import DecodeError

    return (DecodeError,)

def _dexter_replies(data: bytes) -> object:
    from services.dexter_gateway import protocol as p

    asm = p.ReplyAssembler()
    out = []
    step = (data[0] if data else 1) or 1  # the first byte chooses the segmentation, as for the e-puck stream
    for i in range(1, len(data), step):
        for raw in asm.feed(data[i:i + step]):
            rep = p.decode_reply(raw)
            out += [p.decode_status(rep), p.decode_error(rep.error), p.decode_error(rep.error, errno_reply=True)]
            out.append(p.decode_read(rep))
    return out


def _dexter_allowed() -> tuple[type[BaseException], ...]:
    from services.dexter_gateway.protocol import ProtocolError

    return (ProtocolError,)


def _dexter_seeds() -> list[bytes]:
    from services.dexter_gateway import protocol as p

    status = p.encode_reply([1, 2, 1700000000, 5, ord("g"), 0] + [0] * 54)
    read = p.read_reply_ints([1, 3, 1700000000, 5, ord("r"), 0] + [0] * 54, b"[0, 0, 0, 0, 0]", 0)
    return [b"\x07" + status + read, b"\xf0" + read]


def _declared_run(module: str, name: str) -> Callable[[bytes], object]:
    def run(data: bytes) -> object:
        return importlib.import_module(module).FUZZ[name](data)

    return run


def _declared_allowed(module: str) -> Callable[[], tuple[type[BaseException], ...]]:
    def allowed() -> tuple[type[BaseException], ...]:
        return tuple(getattr(importlib.import_module(module), "FUZZ_ALLOWED", ()))

    return allowed


def fuzz_names(path: Path) -> list[str]:
    """The target names of a module-level `FUZZ = {"name": decoder, ...}` in the source at `path` ([] without)."""
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name) and target.id == "FUZZ":
            if not isinstance(value, ast.Dict) or not all(isinstance(k, ast.Constant) and isinstance(k.value, str)
                                                          for k in value.keys):
                raise ValueError(f"{path}: FUZZ must be a dict literal with string keys (target name -> decoder)")
            return [str(k.value) for k in value.keys if isinstance(k, ast.Constant)]
    return []


def declared_targets() -> list[Target]:
    """The targets every registered service declares in its protocol module (`FUZZ`, `FUZZ_ALLOWED`)."""
    from shared.registry import service_packages

    out = []
    for package in service_packages().values():
        module = f"{package}.protocol"
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.origin:
            continue
        for name in fuzz_names(Path(spec.origin)):
            out.append(Target(name, _declared_run(module, name), _declared_allowed(module), (module,)))
    return out


def targets() -> dict[str, Target]:
    declared = declared_targets()
    out = [
        Target("palm_status", _palm_status, tuple, ("services.ethercat_loop.protocol",), _palm_seeds),
        Target("palm_command", _palm_command, tuple, ("services.ethercat_loop.protocol",), _palm_command_seeds),
        Target("ethercat_frame", _ethercat_frame, _ethercat_frame_allowed, ("services.ethercat_loop.sim.esc_frames",)),
        Target("bootloader_reply", _boot_reply, tuple, ("services.can_bootloader.protocol",)),
        Target("epuck_stream", _epuck_stream, tuple, ("services.epuck_gateway.protocol.wifi",)),
        Target("epuck_command", _epuck_command, _epuck_allowed, ("services.epuck_gateway.protocol.wifi",),
               lambda: [b"\x80" + bytes(20)]),
        Target("roi_datagram", _roi_datagram, _roi_allowed, ("services.roi_modules.protocol",),
               lambda: [b"\x01" + bytes(64), b"\x00" + bytes(64)]),
        Target("dexter_replies", _dexter_replies, _dexter_allowed, ("services.dexter_gateway.protocol",),
               _dexter_seeds),
    ]
    found = {t.name: t for t in out}
    for t in declared:
        if t.name in found:
            raise ValueError(f"fuzz target {t.name!r} declared twice ({t.modules[0]} and {found[t.name].modules})")
        found[t.name] = t
    return found


def uncovered_services() -> dict[str, str]:
    """service -> its package, for every registered service no target exercises (no module of its package)."""
    from shared.registry import service_packages

    modules = [m for t in targets().values() for m in t.modules]
    return {s: p for s, p in service_packages().items() if not any(m.startswith(f"{p}.") for m in modules)}
