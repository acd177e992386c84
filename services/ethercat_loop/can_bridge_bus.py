"""python-can interface `robobus_bridge`: the hand palm's CAN bridge, reached over MQTT through ethercat-loop.

ethercat-loop's client side of its own bridge: any python-can user (can-bootloader is one) reaches the palm's
CAN buses through it; it talks to ethercat-loop over MQTT only, with the models of this package's contract.

    bus = can.Bus(interface="robobus_bridge", channel="1",            # palm CAN bus 1 or 2
                  mqtt_url="mqtt://127.0.0.1:1883", node="ethercat-loop", device="rh")

Registered through python-can's `can.interface` entry point (pyproject.toml), so every python-can user,
can-bootloader included, opens it like any adapter and cannot tell the difference.

ethercat-loop's contract (api.py): `cmd/bridge_lease` {holder, ttl_ms} -> {lease_id, expires_in_ms}
(`busy` when someone else holds it; renews for the same holder), `cmd/bridge_release` {lease_id};
`stream/can_tx` {lease_id, frames: [{bus, sid, data}]} (queued, one frame to the wire per 1 ms cycle, renews
the lease) and `stream/can_rx` {lease_id, frames: [{bus, sid, data, cycle}]}.

The palm has one bridge (one lease) for both of its CAN buses, so every BridgeBus of one process that names
the same palm shares one link: one MQTT client, one lease, one can_rx subscription, frames sorted by bus.
The lease is taken on the first frame sent and renewed every ttl/3 while the bus is in use; after
`idle_release_s` (10 s) without a frame it is released, so the hand goes back to normal operation (CAN
direct mode stops every motor).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from typing import Any

import can
from pydantic import ValidationError

from services.ethercat_loop.models import PalmCanFrameIn, PalmCanRx, PalmCanTx
from shared.messages import Status
from shared.rpc import RpcClient
from shared.settings import KitSettings, hostname

log = logging.getLogger("robobus.ethercat.can_bridge")

DEFAULT_NODE = "ethercat-loop"
DEFAULT_DEVICE = "rh"  # ethercat-loop's default device name (its `ethercat_device` setting)


class _BridgeLink:
    """One palm's bridge, shared by the BridgeBus objects (bus 1, bus 2) of this process."""

    def __init__(self, settings: KitSettings, node: str, device: str, ttl_ms: int, idle_release_s: float) -> None:
        self.settings = settings
        self.node = node
        self.device = device
        self.ttl_ms = ttl_ms
        self.idle_release_s = idle_release_s
        self.holder = f"can-bootloader-{hostname()}-{os.getpid()}-{id(self) & 0xFFFF:04x}"
        self.refs = 0
        self.queues: dict[int, queue.Queue[can.Message]] = {}
        self.lease_id: str | None = None
        self.last_tx = 0.0
        self.garbage = 0  # can_rx messages or frames that were not valid
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.client = RpcClient(settings, name=f"can-bridge-{node}-{device}")
        try:
            self.client.connect()
        except ConnectionError as exc:
            self.client.close()
            raise can.CanInitializationError(f"robobus_bridge: {exc}") from exc
        # ethercat-loop's streams (its service.py: CAN_TX / CAN_RX), carrying its PalmCanTx / PalmCanRx models
        self.tx_topic = self.client.topic(node, device, "stream", "can_tx")
        self.rx_topic = self.client.topic(node, device, "stream", "can_rx")
        self.remote_online: bool | None = None  # ethercat-loop's retained status: None until seen
        self.client.subscribe_before(self.rx_topic, self._on_rx)
        self.client.session.subscribe(f"{settings.topic_root}/{node}/status", self._on_status, qos=1)
        self._keeper = threading.Thread(target=self._keep, name=f"bridge-lease-{node}", daemon=True)
        self._keeper.start()

    # -- lease -----------------------------------------------------------------------------------------------
    def _lease(self) -> str:
        rep = self.client.call(self.node, self.device, "bridge_lease", {"holder": self.holder, "ttl_ms": self.ttl_ms},
                               timeout=5.0)
        if not rep.ok:
            err = rep.error or {}
            raise can.CanOperationError(f"palm CAN bridge {self.node}/{self.device} refused the lease: "
                                        f"{err.get('code')}: {err.get('message')}")
        lease_id = str(rep.result["lease_id"])
        if lease_id != self.lease_id:
            log.info("palm CAN bridge leased", extra={"lease_id": lease_id, "holder": self.holder})
        return lease_id

    def ensure_lease(self) -> str:
        with self._lock:
            if self.lease_id is None:
                try:
                    self.lease_id = self._lease()
                except TimeoutError as exc:
                    raise can.CanOperationError(f"palm CAN bridge {self.node}/{self.device}: {exc}") from exc
            return self.lease_id

    def release(self) -> None:
        with self._lock:
            lease_id, self.lease_id = self.lease_id, None
        if lease_id is not None:
            with contextlib.suppress(TimeoutError, Exception):
                self.client.call(self.node, self.device, "bridge_release", {"lease_id": lease_id}, timeout=2.0)
            log.info("palm CAN bridge released", extra={"lease_id": lease_id})

    def _keep(self) -> None:
        """Renew every ttl/3 while the bus is in use: quiet spells (the erase) send no can_tx, and a lease the
        palm lost (restart, expiry) is replaced within one period. Release after `idle_release_s` of silence."""
        period = max(self.ttl_ms / 3000.0, 0.05)
        while not self._stop.wait(period):
            if self.lease_id is None:
                continue
            idle = time.monotonic() - self.last_tx
            if idle >= self.idle_release_s:
                self.release()
                continue
            try:
                lease_id = self._lease()
            except (can.CanOperationError, TimeoutError) as exc:
                log.warning("palm CAN bridge lease renewal failed: %s", exc)
                lease_id = None
            with self._lock:
                if self.lease_id is not None:
                    self.lease_id = lease_id

    def _on_status(self, m: Any) -> None:
        try:
            self.remote_online = Status.model_validate_json(m.payload).online
        except ValidationError:
            self.remote_online = None
        if not self.remote_online:
            with self._lock:
                self.lease_id = None  # a restarted palm has forgotten it

    # -- frames ----------------------------------------------------------------------------------------------
    def send(self, bus: int, msg: can.Message) -> None:
        lease_id = self.ensure_lease()
        self.last_tx = time.monotonic()
        tx = PalmCanTx(lease_id=lease_id,
                       frames=[PalmCanFrameIn(bus=bus, sid=int(msg.arbitration_id), data=bytes(msg.data).hex())])
        self.client.session.publish(self.tx_topic, tx.model_dump_json(), qos=0)

    def _on_rx(self, m: Any) -> None:
        try:
            rx = PalmCanRx.model_validate_json(m.payload)
        except ValidationError:
            self.garbage += 1  # not ethercat-loop's can_rx: counted, dropped
            return
        if rx.lease_id != self.lease_id:
            return
        now = time.time()
        for f in rx.frames:
            q = self.queues.get(f.bus)
            try:
                data = bytes.fromhex(f.data)
            except ValueError:
                data = None
            if q is None or data is None or not 0 <= f.sid <= 0x7FF or len(data) > 8:
                self.garbage += 1
                continue
            q.put(can.Message(timestamp=now, arbitration_id=f.sid, data=data, is_extended_id=False,
                              channel=str(f.bus), is_rx=True))

    def close(self) -> None:
        self._stop.set()
        self.release()
        self.client.close()


_links: dict[tuple[str, str, str, str], _BridgeLink] = {}
_links_lock = threading.Lock()


class BridgeBus(can.BusABC):  # type: ignore[misc]
    """One palm CAN bus (channel 1 or 2) through ethercat-loop's leased CAN bridge."""

    def __init__(self, channel: Any = 1, *, mqtt_url: str | None = None, topic_root: str | None = None,
                 node: str = DEFAULT_NODE, device: str = DEFAULT_DEVICE, ttl_ms: int = 2000,
                 idle_release_s: float = 10.0, can_filters: Any = None, **kwargs: Any) -> None:
        try:
            self.bus_no = int(str(channel).removeprefix("bus"))
        except ValueError:
            raise can.CanInitializationError(f"robobus_bridge channel must be 1 or 2, got {channel!r}") from None
        if self.bus_no not in (1, 2):
            raise can.CanInitializationError(f"robobus_bridge channel must be 1 or 2, got {channel!r}")
        overrides: dict[str, Any] = {}
        if mqtt_url:
            overrides["mqtt_url"] = mqtt_url
        if topic_root:
            overrides["topic_root"] = topic_root
        settings = KitSettings(**overrides)
        key = (settings.mqtt_url, settings.topic_root, node, device)
        with _links_lock:
            link = _links.get(key)
            if link is None:
                link = _BridgeLink(settings, node, device, ttl_ms, idle_release_s)
                _links[key] = link
            if self.bus_no in link.queues:
                raise can.CanInitializationError(f"palm CAN bus {self.bus_no} of {node}/{device} is already open "
                                                 "in this process")
            link.queues[self.bus_no] = queue.Queue()
            link.refs += 1
        self._link = link
        self._key = key
        self._closed = False
        self.channel_info = f"palm CAN bus {self.bus_no} via {settings.topic_root}/{node}/{device} (robobus_bridge)"
        super().__init__(channel=channel, can_filters=can_filters, **kwargs)

    @property
    def remote_online(self) -> bool | None:
        """ethercat-loop's node status (retained `{root}/{node}/status`): False when it is offline."""
        return self._link.remote_online

    def send(self, msg: can.Message, timeout: float | None = None) -> None:
        if self._closed:
            raise can.CanOperationError("robobus_bridge bus is shut down")
        if msg.is_extended_id or msg.is_remote_frame or msg.is_error_frame or msg.is_fd or len(msg.data) > 8:
            raise can.CanOperationError("the palm CAN bridge carries classic data frames with 11-bit ids only")
        self._link.send(self.bus_no, msg)

    def _recv_internal(self, timeout: float | None) -> tuple[can.Message | None, bool]:
        q = self._link.queues[self.bus_no]
        try:
            if timeout is None:
                return q.get(), False
            if timeout <= 0:
                return q.get_nowait(), False
            return q.get(timeout=timeout), False
        except queue.Empty:
            return None, False

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        with _links_lock:
            self._link.queues.pop(self.bus_no, None)
            self._link.refs -= 1
            last = self._link.refs <= 0
            if last:
                _links.pop(self._key, None)
        if last:
            self._link.close()
        super().shutdown()
