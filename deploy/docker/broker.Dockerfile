ARG ROBOBUS_BASE_IMAGE=python:3.11-slim-bookworm
FROM ${ROBOBUS_BASE_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends mosquitto && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /var/lib/mosquitto && chown mosquitto /var/lib/mosquitto
COPY deploy/mosquitto/compose.conf /etc/mosquitto/mosquitto.conf
USER mosquitto
EXPOSE 1883 9001
CMD ["mosquitto", "-c", "/etc/mosquitto/mosquitto.conf"]
