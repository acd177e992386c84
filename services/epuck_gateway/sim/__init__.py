"""Simulated e-puck2 robots, peers on real sockets and ptys: `wifi` (the radio module's TCP server), `serial` (the
F407's asercom v2 on a pty), `gdb` (the onboard programmer's GDB server on a pty), over one simulated `world`;
`harness` runs robots on a loop of their own (tests, benchmarks) and `stop_watch` times the bus stop on their wire.

Run: python -m services.epuck_gateway.sim --count 2 --base-port 11000 [--serial-count 1 --serial-link PREFIX]"""
