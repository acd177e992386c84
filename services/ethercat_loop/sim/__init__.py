"""ethercat-loop's simulator: the device side on the real wire. `virtual_hand.py` runs two software
EtherCAT slave controllers (esc.py: registers, AL state machine, SII, SyncManagers, FMMUs; esc_frames.py:
the frame and datagram codec; esc_sii.py: SII images) on a raw socket, the bridge and the palm, with the
palm model (../palm_model.py) behind the palm's mailboxes; `netns.py` puts it on a veth pair in a
private network namespace."""
