# The clustered centre (compose profile `cluster`, deploy/compose.cluster.yaml): Debian's ejabberd, its MQTT
# service (mod_mqtt, MQTT 5.0) only, one node per container; the nodes form an ejabberd cluster of their own
# (deploy/ejabberd/entrypoint.sh joins it).
ARG ROBOBUS_BASE_IMAGE=python:3.11-slim-bookworm
FROM ${ROBOBUS_BASE_IMAGE}
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends ejabberd procps \
    && rm -rf /var/lib/apt/lists/* /usr/share/doc /usr/share/man
EXPOSE 1883
# the entrypoint (deploy/ejabberd/entrypoint.sh) and the configuration are mounted by compose.cluster.yaml
LABEL io.robobus.image="1"
