# The compose stack's broker: Debian's mosquitto 2, run as the mosquitto user with a fixed uid (1883) so the
# generated password and ACL files (deploy/make_secrets.py) can be owned by it and kept private.
ARG ROBOBUS_BASE_IMAGE=python:3.11-slim-bookworm
# robobus's broker plugin (client ids bound to users, replies only to requests received), built against
# Debian's mosquitto 2.0 headers; only the .so reaches the broker image.
FROM ${ROBOBUS_BASE_IMAGE} AS plugin
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev mosquitto-dev libmosquitto-dev \
    && rm -rf /var/lib/apt/lists/*
COPY deploy/mosquitto/robobus_auth.c /src/robobus_auth.c
RUN gcc -O2 -Wall -Wextra -Werror -shared -fPIC -o /src/robobus_auth.so /src/robobus_auth.c -lmosquitto

FROM ${ROBOBUS_BASE_IMAGE}
RUN groupadd -g 1883 mosquitto && useradd -u 1883 -g 1883 -d /var/lib/mosquitto -s /usr/sbin/nologin mosquitto \
    && apt-get update && apt-get install -y --no-install-recommends mosquitto mosquitto-clients libmosquitto1 \
    && rm -rf /var/lib/apt/lists/* /usr/share/doc /usr/share/man \
    && mkdir -p /var/lib/mosquitto /etc/mosquitto/conf.d && chown mosquitto: /var/lib/mosquitto
COPY --from=plugin /src/robobus_auth.so /usr/lib/robobus/robobus_auth.so
COPY deploy/mosquitto/compose.conf /etc/mosquitto/mosquitto.conf
USER mosquitto
EXPOSE 1883 9001
CMD ["mosquitto", "-c", "/etc/mosquitto/mosquitto.conf"]
# every robobus image: `make up` prunes the dangling ones (an old build a new one replaced) by this label
LABEL io.robobus.image="1"
