# The compose stack's broker: Debian's mosquitto 2, run as the mosquitto user with a fixed uid (1883) so the
# generated password and ACL files (deploy/make_secrets.py) can be owned by it and kept private.
ARG ROBOBUS_BASE_IMAGE=python:3.11-slim-bookworm
FROM ${ROBOBUS_BASE_IMAGE}
RUN groupadd -g 1883 mosquitto && useradd -u 1883 -g 1883 -d /var/lib/mosquitto -s /usr/sbin/nologin mosquitto \
    && apt-get update && apt-get install -y --no-install-recommends mosquitto mosquitto-clients \
    && rm -rf /var/lib/apt/lists/* /usr/share/doc /usr/share/man \
    && mkdir -p /var/lib/mosquitto /etc/mosquitto/conf.d && chown mosquitto: /var/lib/mosquitto
COPY deploy/mosquitto/compose.conf /etc/mosquitto/mosquitto.conf
USER mosquitto
EXPOSE 1883 9001
CMD ["mosquitto", "-c", "/etc/mosquitto/mosquitto.conf"]
