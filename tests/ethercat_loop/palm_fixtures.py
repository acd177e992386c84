"""A minimal palm firmware for wire tests that must not depend on the full palm model: it echoes
the EDC command and which_motors, counts cycles in sensors[0] and copies motor demand 0 into
sensors[1], so a test can see exactly which command produced a status."""

from __future__ import annotations

from services.ethercat_loop.protocol import PalmCommand, PalmStatus, pack_status, unpack_command


class EchoPalm:
    def __init__(self, protocol: str = "0220") -> None:
        self.protocol = protocol
        self.cycles = 0

    def exchange(self, command: bytes) -> bytes:
        self.cycles += 1
        cmd = unpack_command(command, self.protocol)
        edc, which, d0 = (cmd.edc_command, cmd.which_motors, cmd.motor_data[0]) if isinstance(cmd, PalmCommand) \
            else (0, 0, 0)
        sensors = (self.cycles & 0xFFFF, d0 & 0xFFFF) + (0,) * 35
        st = PalmStatus(edc_command=edc, sensors=sensors, which_motors=which, idle_time_us=100)
        if self.protocol == "0230":
            st = PalmStatus(edc_command=edc, sensors=sensors, which_motors=which, idle_time_us=100,
                            tactile=((0,) * 16,) * 5, tactile_mid_prox=((0,) * 8,) * 5, aux_spi_sensor=(0,) * 16)
        return pack_status(st, self.protocol)
