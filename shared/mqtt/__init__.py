"""The MQTT layer: how robobus talks MQTT 5, below the service kit.

- `session`: the paho-based session every node and client uses (`MqttSession`, properties, wills).
- `rx`, `paho_private`: the received-PUBLISH fast path and every use of paho's private API, behind one check.
- `wire`, `lean`: a small MQTT 5 codec and the lean connections of the recorder and the replayer.
- `address`: the broker URL, the client id a broker binds to its user, and what a connection needs of settings.

This layer imports neither the kit (`shared`'s own modules) nor the tools nor any service
(tests/kit/test_layers.py): a connection takes any settings object shaped like `address.ClientSettings`.
"""
