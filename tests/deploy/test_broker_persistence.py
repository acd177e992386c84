"""The bus stop ({root}/_stop, retained) survives a restart of `make run`'s broker: a real mosquitto with
deploy/mosquitto/mosquitto.conf (its listeners and database folder moved to the test's own): killed -9 after its
autosave, it comes back with the stop (and with the newest value of it, a release after a stop); make run's
supervisor killed -9 stops the broker with SIGTERM, on which it saves what the autosave had not yet."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pwd
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from shared.tools.localbroker import REPO, Broker, free_port, mosquitto_bin

MAKE_RUN_CONF = REPO / "deploy" / "mosquitto" / "mosquitto.conf"
SUPERVISE = REPO / "deploy" / "dev" / "supervise.py"
TOPIC = "robobus/_stop"
START_S = 40.0  # a busy host may take this long to start a process (15 s was short beside a full suite)
# mosquitto saves once more than autosave_interval whole seconds have passed since its last save (its main loop
# wakes at least every 100 ms): the window of a kill -9 is autosave_interval + 1 s; plus slack for a busy host
SAVE_SLACK_S = 1.0


def autosave_interval() -> int:
    m = re.search(r"^autosave_interval (\d+)$", MAKE_RUN_CONF.read_text(), re.M)
    assert m, "make run's broker saves no database"
    return int(m.group(1))


def make_run_conf(tmp: Path, port: int, autosave_s: int | None = None, user: str = "root") -> Path:
    """make run's broker config on 127.0.0.1:port, its database in tmp/db. As root: `user root` keeps mosquitto
    root (the user mosquitto it would become cannot enter the test's private folder); user="mosquitto": the
    database folder is that user's, and tmp must be open to it (as `make run` gives it run/mosquitto/)."""
    db = tmp / "db"
    db.mkdir(exist_ok=True)
    text = MAKE_RUN_CONF.read_text()
    if os.geteuid() == 0 and user == "root":
        text += "\nuser root\n"
    elif os.geteuid() == 0:
        entry = pwd.getpwnam(user)
        os.chown(db, entry.pw_uid, entry.pw_gid)
    text = re.sub(r"^(listener|protocol) .*$", "", text, flags=re.M)
    text = re.sub(r"^persistence_location .*$", f"persistence_location {db}/", text, flags=re.M)
    if autosave_s is not None:
        text = re.sub(r"^autosave_interval .*$", f"autosave_interval {autosave_s}", text, flags=re.M)
    conf = tmp / "mosquitto.conf"
    conf.write_text(text + f"\nlistener {port} 127.0.0.1\nprotocol mqtt\n")
    return conf


def broker_user() -> str:
    """Who `make run`'s broker runs as here: as root, the user mosquitto (the supervisor starts it so: run-local.sh's
    --user broker=mosquitto), else this user."""
    if os.geteuid() != 0:
        return ""
    try:
        pwd.getpwnam("mosquitto")
    except KeyError:
        return ""
    return "mosquitto"


def accepts(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
        return True
    return False


def wait_for(cond: Callable[[], object], what: str, deadline_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        if cond():
            return time.monotonic() - t0
        time.sleep(0.02)
    raise AssertionError(f"not within {deadline_s} s: {what}")


def publish_retained(port: int, payload: str) -> None:
    subprocess.run(["mosquitto_pub", "-p", str(port), "-i", f"t-pub-{os.getpid()}", "-q", "1", "-r", "-t", TOPIC,
                    "-m", payload], check=True, timeout=30)


def read_retained(port: int) -> str | None:
    out = subprocess.run(["mosquitto_sub", "-p", str(port), "-i", f"t-sub-{os.getpid()}", "-t", TOPIC, "-C", "1",
                          "-W", "3"], capture_output=True, text=True, timeout=30)
    return out.stdout.strip() or None


def saved(db: Path, payload: str) -> bool:
    try:
        return payload.encode() in db.read_bytes()
    except OSError:  # not written yet
        return False


def stop_payload(active: bool) -> str:
    return json.dumps({"active": active, "source": "test", "reason": "persistence", "ts": time.time()})


@pytest.fixture
def mosquitto() -> Iterator[list[subprocess.Popen[bytes]]]:
    if mosquitto_bin() is None:
        pytest.skip("mosquitto is not installed (run `make test`, which installs it)")
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def start(procs: list[subprocess.Popen[bytes]], conf: Path, port: int) -> subprocess.Popen[bytes]:
    exe = mosquitto_bin()
    assert exe
    proc = subprocess.Popen([exe, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs.append(proc)
    wait_for(lambda: accepts(port), "mosquitto listening", START_S)
    return proc


def test_make_runs_broker_killed_9_after_its_autosave_comes_back_with_the_stop(
        mosquitto: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    port = free_port()
    conf = make_run_conf(tmp_path, port)
    db = tmp_path / "db" / "mosquitto.db"
    window_s = autosave_interval() + 1
    broker = start(mosquitto, conf, port)
    for active in (True, False, True):  # the newest value is what comes back, not the first
        payload = stop_payload(active)
        publish_retained(port, payload)
        took = wait_for(functools.partial(saved, db, payload),
                        f"the stop in the broker's database within {window_s} s", window_s + SAVE_SLACK_S)
        print(f"stop active={active} saved {took:.2f} s after its publish")
    broker.send_signal(signal.SIGKILL)
    broker.wait(10)
    start(mosquitto, conf, port)
    assert read_retained(port) == payload


def test_a_supervisor_killed_9_lets_the_broker_save_the_stop_on_its_way_out(
        mosquitto: list[subprocess.Popen[bytes]]) -> None:
    """No autosave for an hour: only the broker's own save at SIGTERM (its parent-death signal) keeps the stop. As
    root, the broker runs as the user mosquitto, as `make run` starts it: a broker that gave up root itself would
    have lost the parent-death signal and outlived its supervisor."""
    user = broker_user()
    with tempfile.TemporaryDirectory(prefix="robobus-persist-") as d:
        tmp = Path(d)
        tmp.chmod(0o755)  # open to the broker's user, as a checkout is
        port = free_port()
        conf = make_run_conf(tmp, port, autosave_s=3600, user=user or "root")
        (tmp / "Procfile").write_text(f"broker: mosquitto -c {conf}\n")
        env = dict(os.environ, PATH=f"/usr/sbin:{os.environ.get('PATH', '')}")
        sup = subprocess.Popen([sys.executable, "-S", str(SUPERVISE), "--procfile", str(tmp / "Procfile"),
                                "--rundir", str(tmp / "run"), *(["--user", f"broker={user}"] if user else [])],
                               cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                               start_new_session=True)
        mosquitto.append(sup)
        wait_for(lambda: accepts(port), "the supervised broker listening", START_S)
        ps = subprocess.run(["ps", "-o", "pid=,user=", "--ppid", str(sup.pid)], capture_output=True, text=True)
        broker_pid, broker_as = ps.stdout.split()
        try:
            if user:
                assert broker_as == user
            payload = stop_payload(True)
            publish_retained(port, payload)
            assert not (tmp / "db" / "mosquitto.db").exists()  # not saved yet
            os.kill(sup.pid, signal.SIGKILL)
            sup.wait(10)
            wait_for(lambda: not accepts(port), "the broker gone with its supervisor", 2.0)
            wait_for(lambda: saved(tmp / "db" / "mosquitto.db", payload), "the broker's database written", 2.0)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(broker_pid), signal.SIGKILL)  # what a failing run left behind
        start(mosquitto, make_run_conf(tmp, port, user=user or "root"), port)
        assert read_retained(port) == payload


def test_the_tests_broker_keeps_the_stop_across_a_restart_when_asked(tmp_path: Path) -> None:
    if mosquitto_bin() is None:
        pytest.skip("mosquitto is not installed (run `make test`, which installs it)")
    broker = Broker(free_port(), tmp_path, persistence=True, autosave_interval=1)
    broker.start()
    try:
        payload = stop_payload(True)
        publish_retained(broker.port, payload)
        db = broker.db_dir / "mosquitto.db"
        wait_for(lambda: saved(db, payload), "saved", 2 + SAVE_SLACK_S)
        broker.restart()  # kill -9, start again
        assert read_retained(broker.port) == payload
    finally:
        broker.kill()
