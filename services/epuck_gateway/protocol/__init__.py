"""How the gateway talks to an e-puck2, one module a protocol (docs/reference/epuck2.md): `wifi` (the radio module's
TCP stream: commands, sensors and image packets, the command state) and `asercom` (asercom v2 over a serial port:
binary chains and replies, ASCII mode) are sans-I/O codecs; `firmware` is the update through the onboard
programmer's GDB server (the ELF check, gdb-multiarch driven over its machine interface).

Nothing is imported here: the contract (models.py) reads `wifi` alone, without the others' dependencies."""
