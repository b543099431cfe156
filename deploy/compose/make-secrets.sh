#!/usr/bin/env sh
# Makes the passwords docker-compose.yml hands over as secrets, once, before the first `docker compose up`:
# Grafana's admin and the Redis users' (deploy/redis/users.acl). A file that exists is kept, so running it again
# changes nothing. The folder is this machine's owner's only; the files are readable because compose mounts a
# file as it is and the services' users are not root.
set -eu
cd "$(dirname "$0")/secrets"
chmod 700 .
for name in grafana-admin-password tokenbus-edge tokenbus-worker tokenbus-admin; do
  if [ ! -s "$name" ]; then
    od -An -N32 -tx1 /dev/urandom | tr -d ' \n' > "$name"
    echo "made deploy/compose/secrets/$name"
  fi
  chmod 644 "$name"
done
