# recorder image: the kit plus the `record` extra (mcap, zstandard); records the bus into MCAP files
# under /recordings (mount a volume there). The schemas come from docs/asyncapi.yaml, copied in, so the
# image needs no service extra (no pysoem, python-can or Pillow).
#   docker build -f deploy/docker/recorder.Dockerfile -t robobus/recorder .
#   docker run --rm -v $PWD/recordings:/recordings -e ROBOBUS_MQTT_URL=mqtt://broker:1883 robobus/recorder
ARG ROBOBUS_BASE_IMAGE=python:3.11-slim-bookworm
FROM ${ROBOBUS_BASE_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 ROBOBUS_LOG_JSON=1 \
    ROBOBUS_RECORD_PATH=/recordings/robobus-{time}.mcap ROBOBUS_RECORD_ASYNCAPI=/app/docs/asyncapi.yaml \
    ROBOBUS_RECORD_MAX_DURATION_S=3600
WORKDIR /app
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
COPY docs/asyncapi.yaml ./docs/asyncapi.yaml
RUN --mount=type=secret,id=ca,required=false \
    if [ -f /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi; \
    pip install --no-cache-dir ".[record]"
# A new named volume mounted here takes this directory's owner: the recorder (nobody) can write to it.
RUN mkdir -p /recordings && chown 65534:65534 /recordings
USER nobody
# SIGTERM closes the current file cleanly (summary, indexes); a SIGKILL leaves one `robobus recover` repairs.
STOPSIGNAL SIGTERM
CMD ["python", "-m", "shared.tools.record_cli", "record", "--wait-broker", "0"]
# every robobus image: `make up` prunes the dangling ones (an old build a new one replaced) by this label
LABEL io.robobus.image="1"
