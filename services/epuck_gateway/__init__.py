"""epuck-gateway: e-puck2 robots over WiFi TCP (port 1000) on the robobus MQTT bus."""
