"""The tools: what runs beside the services, on the kit and the MQTT layer.

The `robobus` CLI (`cli`), the contract's documents (`asyncapi`, `codegen_schema`), recording and replay
(`record_cli`, `recorder`, `replay`, `bus_catalog`), the dashboard and Home Assistant bridge (`dashboard/`),
the fleet watch (`fleet_watch`), and what tests, benches and simulator rigs start (`localbroker`, `simrig`).
Nothing in the kit or the MQTT layer imports them (tests/kit/test_layers.py).
"""
