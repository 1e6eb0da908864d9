#!/usr/bin/env bash
# The container's entrypoint: JupyterLab on the notebooks, behind LABKIT_TOKEN.
#
#   entrypoint.sh            start JupyterLab (the default command)
#   entrypoint.sh lab        the same
#   entrypoint.sh CMD...     run CMD instead (bash, python3 -m labkit doctor, ...): no token needed
#
# Inside the container JupyterLab listens on 0.0.0.0 (Docker's port forwarding arrives on the
# container's own interface, not on its loopback); the compose file and the documented
# `docker run` line publish that port on the host's 127.0.0.1 only. The token is what stands
# between a notebook kernel, which runs any code as the container's user, and whoever can
# reach the port, so an empty one is refused rather than replaced by a random one nobody sees.
set -euo pipefail

if [ "$#" -gt 0 ] && [ "$1" != "lab" ]; then
    exec "$@"
fi

token=${LABKIT_TOKEN:-}
if [ -z "${token//[[:space:]]/}" ]; then  # unset, empty or only blanks
    cat >&2 <<'MSG'
labkit: LABKIT_TOKEN is empty; JupyterLab will not start without a token.
Set one, for example:
    export LABKIT_TOKEN=$(python3 -c 'import secrets; print(secrets.token_hex(24))')
    docker compose -f docker/compose.yaml up          (compose passes LABKIT_TOKEN through)
or  docker run -e LABKIT_TOKEN ... labkit:pytorch     (see the README's docker run line)
MSG
    exit 2
fi

port=${LABKIT_PORT:-8888}             # inside the container
host_port=${LABKIT_HOST_PORT:-$port}  # where compose / docker run publish it on the host
root=${LABKIT_NOTEBOOKS:-/workspace/notebooks}

# The URL to open is the host's, not the 0.0.0.0 that JupyterLab is about to print.
echo "labkit: open http://127.0.0.1:${host_port}/lab?token=${LABKIT_TOKEN}"
echo "labkit: notebooks from ${root}; profile ${LABKIT_PROFILE:-chosen from the hardware}"
exec python3 -m labkit lab --host 0.0.0.0 --port "$port" --root "$root"
