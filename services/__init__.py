"""robobus services: one package per transport, each in the same rooms (protocol, transport, sim, service,
models). Each is registered as a `robobus.services` entry point in pyproject.toml (see shared/registry.py)."""
