# The pattern every service image follows (services/<name>/Dockerfile): the kit plus ONE extra.
#   docker build -f deploy/docker/service.Dockerfile --build-arg EXTRA=epuck --build-arg MODULE=services.epuck_gateway .
ARG ROBOBUS_BASE_IMAGE=python:3.11-slim-bookworm
FROM ${ROBOBUS_BASE_IMAGE}
ARG EXTRA
ARG MODULE
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 ROBOBUS_LOG_JSON=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
# Only this service's extra: no pysoem in the e-puck image, no Pillow in the EtherCAT one.
# Builds reach the package index through the host's CA bundle when one is given as a BuildKit secret:
#   docker build --secret id=ca,src=/etc/ssl/certs/ca-certificates.crt ...
RUN --mount=type=secret,id=ca,required=false \
    if [ -f /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi; \
    pip install --no-cache-dir ".[${EXTRA}]"
ENV ROBOBUS_SERVICE_MODULE=${MODULE}
CMD python -m "$ROBOBUS_SERVICE_MODULE"
