"""A refused SCHED_FIFO names its real cause: in a container with CAP_SYS_NICE on a kernel with RT group
scheduling, it is the cgroup's missing realtime budget (cpu_rt_runtime), not the capability."""

from __future__ import annotations

from pathlib import Path

from services.ethercat_loop.transport.realtime import has_cap_sys_nice, rt_runtime_us, why_no_fifo

WITH_NICE = "Name:\tpython\nCapEff:\t00000000a8c425fb\n"     # docker's default set + SYS_NICE (bit 23)
WITHOUT_NICE = "Name:\tpython\nCapEff:\t00000000a80425fb\n"  # docker's default set


def test_the_capability_is_read_from_the_effective_set() -> None:
    assert has_cap_sys_nice(WITH_NICE) is True
    assert has_cap_sys_nice(WITHOUT_NICE) is False
    assert has_cap_sys_nice("Name:\tpython\n") is False


def test_with_sys_nice_and_no_budget_the_budget_is_named_with_its_fix() -> None:
    why = why_no_fifo(True, 0)
    assert "no realtime budget" in why and "cpu_rt_runtime" in why and "--cpu-rt-runtime" in why
    assert "CAP_SYS_NICE or" not in why, "the capability is there: not the cause"
    assert "needs CAP_SYS_NICE" in why_no_fifo(False, 0)
    assert "needs CAP_SYS_NICE" in why_no_fifo(False, None)
    assert "CAP_SYS_NICE" in why_no_fifo(True, None) and "budget" not in why_no_fifo(True, None)


def test_the_budget_is_read_from_the_processs_cpu_cgroup(tmp_path: Path, monkeypatch: object) -> None:
    d = tmp_path / "cpu,cpuacct" / "docker" / "abc"
    d.mkdir(parents=True)
    (d / "cpu.rt_runtime_us").write_text("0\n")
    import services.ethercat_loop.transport.realtime as rt

    real = Path.read_text

    def fake(self: Path, *a: object, **k: object) -> str:
        if str(self) == "/proc/self/cgroup":
            return "4:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n"
        return real(self)

    monkeypatch.setattr(rt.Path, "read_text", fake)  # type: ignore[attr-defined]
    assert rt_runtime_us(str(tmp_path)) == 0
    (d / "cpu.rt_runtime_us").write_text("950000\n")
    assert rt_runtime_us(str(tmp_path)) == 950000
    assert rt_runtime_us(str(tmp_path / "none")) is None
