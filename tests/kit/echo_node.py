"""A tiny service used to test the kit itself: commands, a job, rate-capped state, events.
Run on its own: python -m tests.kit.echo_node (ROBOBUS_MQTT_URL=...)."""

from __future__ import annotations

import threading
import time

from pydantic import BaseModel, Field

from shared import CommandError, ErrorCode, JobContext, KitSettings, Node, ServiceAPI, load_settings
from shared.logs import setup_logging


class EchoRequest(BaseModel):
    text: str = Field(max_length=100)
    count: int = Field(1, ge=0, le=10)


class EchoReply(BaseModel):
    text: str
    count: int


class SlowRequest(BaseModel):
    seconds: float = Field(ge=0, le=10)


class Nothing(BaseModel):
    pass


class CountRequest(BaseModel):
    n: int = Field(ge=1, le=100000)
    delay_s: float = Field(0.0, ge=0, le=1)


class CountResult(BaseModel):
    counted: int


class Counter(BaseModel):
    """A counter that ticks at 100 Hz (published at its rate cap)."""

    value: int
    ts: float


API = ServiceAPI("echo-test", device_doc="a test device")
ECHO = API.command("echo", EchoRequest, EchoReply, doc="Echo the text back")
SLOW = API.command("slow", SlowRequest, Nothing, doc="Sleep, to prove slow handlers block nothing")
BOOM = API.command("boom", Nothing, Nothing, doc="Raise an unexpected exception")
FAIL = API.command("fail", Nothing, Nothing, doc="Fail with device_error")
class WhereReply(BaseModel):
    thread: str


WHERE = API.command("where", Nothing, WhereReply, doc="Which thread ran the handler (inline dispatch test)")
COUNT = API.job("count", CountRequest, CountResult, doc="Count to n, slowly")
COUNTER = API.state("counter", Counter, rate_hz=20)
TICK = API.event("tick", Counter, doc="Every 100th count")


def build(node: Node, device: str = "dev1") -> threading.Event:
    dev = node.device(device)
    dev.bind(ECHO, lambda r: EchoReply(text=r.text, count=r.count))

    def slow(r: SlowRequest) -> Nothing:
        time.sleep(r.seconds)
        return Nothing()

    def boom(r: Nothing) -> Nothing:
        raise RuntimeError("kaboom")

    def fail(r: Nothing) -> Nothing:
        raise CommandError(ErrorCode.DEVICE_ERROR, "the device said no")

    busy = threading.Lock()

    def admit(r: CountRequest) -> None:
        if busy.locked():
            raise CommandError(ErrorCode.BUSY, "already counting")

    def count(r: CountRequest, job: JobContext) -> CountResult:
        with busy:
            for i in range(r.n):
                job.check_cancelled()
                job.progress("counting", i + 1, r.n)
                if r.delay_s:
                    job.wait(r.delay_s)
            return CountResult(counted=r.n)

    dev.bind(WHERE, lambda r: WhereReply(thread=threading.current_thread().name), inline=True)
    dev.bind(SLOW, slow)
    dev.bind(BOOM, boom)
    dev.bind(FAIL, fail)
    dev.bind_job(COUNT, count, admit)
    dev.set_health(connection=True, operational=True, state="running")
    stop = threading.Event()

    def ticker() -> None:
        i = 0
        while not stop.wait(0.01):
            i += 1
            dev.publish(COUNTER, Counter(value=i, ts=time.time()))
            if i % 100 == 0:
                dev.emit(TICK, Counter(value=i, ts=time.time()))

    threading.Thread(target=ticker, daemon=True).start()
    return stop


def main() -> None:
    settings = load_settings(KitSettings)
    setup_logging(settings.log_level, settings.log_json)
    node = Node(API, settings)
    stop = build(node)
    node.on_shutdown(stop.set)
    node.run()


if __name__ == "__main__":
    main()
