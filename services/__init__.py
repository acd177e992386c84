"""robobus services: one package per transport, each with protocol / transport / sim / service.

SERVICE_APIS names each service's declarative contract (schema export, `robobus schema`);
SERVICE_CLIS names CLI sub-commands services contribute. Out-of-tree services use the
`robobus.services` and `robobus.cli` entry points instead."""

SERVICE_APIS: dict[str, str] = {}
SERVICE_APIS["epuck-gateway"] = "services.epuck_gateway.service:API"
SERVICE_APIS["can-bootloader"] = "services.can_bootloader.service:API"
SERVICE_APIS["ethercat-loop"] = "services.ethercat_loop.service:API"

SERVICE_CLIS: dict[str, str] = {}
SERVICE_CLIS["flash"] = "services.can_bootloader.cli:flash"
SERVICE_CLIS["can"] = "services.can_bootloader.cli:can_app"
SERVICE_CLIS["epuck"] = "services.epuck_gateway.cli:epuck_app"
