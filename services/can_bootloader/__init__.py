"""can-bootloader: flash PIC18F motor boards over CAN (a python-can bus or the palm's CAN bridge)."""
