"""`robobus prometheus`: one exporter for a whole bus (a site, or a fleet's centre), serving what the nodes already
publish over MQTT as Prometheus metrics. Nothing is asked of the device side: it subscribes to the few topics that
carry health and counters, keeps each one's latest payload and parses it when Prometheus scrapes.

    view.py     the bus as the exporter knows it: the latest payload per topic, its age, node lifecycles (pure:
                payloads and times in, no I/O)
    metrics.py  the metric families a scrape returns, built from the view (prometheus_client's collector API)
    cli.py      settings, the MQTT session, the HTTP server, `robobus prometheus`

docs/prometheus.md is the user's guide (metrics, alert rules, pointing a Prometheus at it)."""
