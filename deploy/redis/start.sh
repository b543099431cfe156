#!/bin/sh
# Starts redis-server (the command line given, e.g. `start.sh redis-server --appendonly yes`) with tokenbus's
# users: users.acl, with each user's password added as its SHA-256 from the secret file named after the user.
# The file it writes holds hashes only, readable by Redis alone. The same script runs in compose, Kubernetes
# and the tests (tests/test_redis_access.py).
#   TOKENBUS_REDIS_ACL      the rules (default: users.acl next to this script)
#   TOKENBUS_REDIS_SECRETS  the folder of secret files: tokenbus-edge, tokenbus-worker, ... (default /run/secrets)
#   TOKENBUS_REDIS_ACL_OUT  the ACL file made (default /tmp/tokenbus-users.acl)
set -eu
template=${TOKENBUS_REDIS_ACL:-$(dirname "$0")/users.acl}
secrets=${TOKENBUS_REDIS_SECRETS:-/run/secrets}
out=${TOKENBUS_REDIS_ACL_OUT:-/tmp/tokenbus-users.acl}
umask 077
: > "$out"
grep -v -e '^[[:space:]]*#' -e '^[[:space:]]*$' "$template" | while read -r keyword user rules; do
    if [ -s "$secrets/$user" ]; then
        hash=$(tr -d '\r\n' < "$secrets/$user" | sha256sum | cut -d ' ' -f 1)
        echo "$keyword $user #$hash $rules" >> "$out"
    else
        echo "$keyword $user $rules" >> "$out"
    fi
done
if [ "$(id -u)" = 0 ] && id redis > /dev/null 2>&1; then
    chown redis "$out"  # the redis image's entrypoint runs redis-server as its redis user
fi
exec "$@" --aclfile "$out"
