#!/bin/sh
# One ejabberd node of the clustered centre. Env: ROBOBUS_EJABBERD_NODE (this node's name, ejabberd@<hostname>),
# ROBOBUS_EJABBERD_COOKIE (the same on every node), ROBOBUS_EJABBERD_JOIN (a node to join, empty on the first),
# ROBOBUS_EJABBERD_USERS (a file of `user password` lines: registered on the first node, replicated).
set -eu
node=${ROBOBUS_EJABBERD_NODE:-ejabberd@$(hostname)}
home=/var/lib/ejabberd
mkdir -p /run/ejabberd && chown ejabberd: /run/ejabberd
printf '%s' "${ROBOBUS_EJABBERD_COOKIE:?}" > "$home/.erlang.cookie"
chown ejabberd: "$home/.erlang.cookie"; chmod 400 "$home/.erlang.cookie"
# the centre's TLS certificate and key (make_secrets.py: certs/), one PEM for ejabberd's `certfiles`
if [ -f /robobus/certs/server.crt ]; then
  cat /robobus/certs/server.crt /robobus/certs/ca.crt /robobus/certs/server.key > "$home/robobus.pem"
  chown ejabberd: "$home/robobus.pem"; chmod 400 "$home/robobus.pem"
fi
ctl() { su ejabberd -s /bin/sh -c "ejabberdctl --node $node $*"; }
# the healthcheck's file; a container started again (after `docker kill`) still has the last start's
rm -f /tmp/robobus-ejabberd.ready
export ERLANG_NODE=$node
su ejabberd -s /bin/sh -c "ERLANG_NODE=$node ejabberdctl --node $node foreground" &
pid=$!
trap 'ctl stop >/dev/null 2>&1; wait $pid' TERM INT
i=0
until ctl status >/dev/null 2>&1; do
  i=$((i + 1)); [ $i -gt 120 ] && { echo "robobus-ejabberd: $node did not start" >&2; exit 1; }
  sleep 0.5
done
if [ -n "${ROBOBUS_EJABBERD_JOIN:-}" ]; then
  if ! ctl list_cluster 2>/dev/null | grep -q "$ROBOBUS_EJABBERD_JOIN"; then
    echo "robobus-ejabberd: $node joins $ROBOBUS_EJABBERD_JOIN"
    ctl --no-timeout join_cluster "$ROBOBUS_EJABBERD_JOIN"
  fi
elif [ -n "${ROBOBUS_EJABBERD_USERS:-}" ] && [ -f "$ROBOBUS_EJABBERD_USERS" ]; then
  while read -r user password; do
    [ -n "$user" ] || continue
    ctl register "$user" robobus "$password" >/dev/null 2>&1 || ctl change_password "$user" robobus "$password"
  done < "$ROBOBUS_EJABBERD_USERS"
fi
touch /tmp/robobus-ejabberd.ready
echo "robobus-ejabberd: $node ready: $(ctl list_cluster | tr '\n' ' ')"
wait $pid
