"""ethercat-loop's I/O: the pysoem master (master.py), the realtime cycle process (cycle.py) with its
shared memory (shm.py) and realtime helpers (realtime.py), and the MQTT process's side of it
(process_backend.ProcessBackend). Importing this package imports none of them (pysoem is optional:
the model backend only needs realtime.next_deadline)."""
