#!/usr/bin/env bash
# `make container-check`: the image from docker/Dockerfile built for real and used as a learner
# uses it, on a machine with no Docker engine and no access to nvcr.io or Docker Hub.
#
# 1. Stand-ins for the two bases the Dockerfile names, built locally under those very names and
#    kept in the cache folder: python:3.12-slim (a Debian root made by debootstrap, with Python
#    and pip) and nvcr.io/nvidia/pytorch:<the Dockerfile's NGC_TAG> (that root plus a torch, NGC's
#    pip constraint file and an nvidia_entrypoint.sh that behaves like NVIDIA's; see
#    ngc-standin.Containerfile for what stands in for what).
# 2. docker/Dockerfile built unchanged with buildah (chroot isolation, overlay storage in the
#    cache folder), the host's CA bundle passed the way a user behind a TLS-inspecting proxy
#    passes it: the build argument PIP_CERT and a read-only mount of the bundle.
# 3. The image run as a learner runs it, in a network namespace of its own whose port 8888 is
#    published on the host's 127.0.0.1 only (what `docker run -p 127.0.0.1:P:8888` does):
#    JupyterLab through the image's entrypoint, answered with the token and refused without it;
#    `python -m labkit doctor`; notebooks under nbval in the smoke profile; the torch of the
#    base unchanged; a build that tries to replace torch fails.
# Nothing is left running; the stand-ins and the image stay in the cache folder for next time.
#
# Environment: LABKIT_CONTAINER_CACHE (default /var/cache/labkit-container),
# LABKIT_STANDIN_TORCH (a torch wheel for the stand-in; default the CPU wheel in /opt/wheels),
# LABKIT_CA_BUNDLE (default /etc/ssl/certs/ca-certificates.crt), CONTAINER_NOTEBOOKS.
set -euo pipefail

me=container-check
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
cache=${LABKIT_CONTAINER_CACHE:-/var/cache/labkit-container}
ca_bundle=${LABKIT_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
notebooks=${CONTAINER_NOTEBOOKS:-00_environment_check.ipynb 06_custom_algorithms.ipynb}
image=localhost/labkit:pytorch
base_image=localhost/labkit-check/debian-python:bookworm
wheel_image=docker.io/library/python:3.12-slim
start=$(date +%s)

skip() {
    echo "$me: skipped: $*"
    exit 0
}

[ "$(id -u)" -eq 0 ] \
    || skip "it needs root (buildah's overlay storage, chroot isolation, a network namespace)."
for tool in buildah debootstrap socat curl ip ss flock; do
    command -v "$tool" >/dev/null \
        || skip "$tool is missing; as root: apt-get install buildah debootstrap socat curl iproute2."
done
torch_wheel=${LABKIT_STANDIN_TORCH:-$(compgen -G '/opt/wheels/torch-*+cpu-cp311-*.whl' | head -n 1 || true)}
[ -f "$torch_wheel" ] \
    || skip "no torch wheel for the NGC stand-in; set LABKIT_STANDIN_TORCH=/path/to/torch-*.whl."
torch_version=$(basename "$torch_wheel" | cut -d- -f2)
ngc_tag=$(sed -n 's/^ARG NGC_TAG=//p' "$repo/docker/Dockerfile")
ngc_image=nvcr.io/nvidia/pytorch:$ngc_tag

mkdir -p "$cache"
exec 9>"$cache/lock"
flock -w 1800 9 || { echo "$me: another container check holds $cache/lock" >&2; exit 1; }
logs=$(mktemp -d "${TMPDIR:-/tmp}/labkit-container.XXXXXX")
export BUILDAH_ISOLATION=chroot
# Short names (python:3.12-slim) resolve to Docker Hub's, which are the stand-ins here.
printf 'unqualified-search-registries = ["docker.io"]\nshort-name-mode = "permissive"\n' \
    > "$cache/registries.conf"
export CONTAINERS_REGISTRIES_CONF=$cache/registries.conf
bah() { buildah --root "$cache/storage" --runroot "$cache/run" --storage-driver overlay "$@"; }

# The proxy user's way: a build argument naming a path, and the bundle mounted there read-only
# (never over the image's own bundle, which dpkg owns).
ca_args=()
if [ -f "$ca_bundle" ]; then
    ca_args=(--build-arg PIP_CERT=/run/host-ca.crt --volume "$ca_bundle:/run/host-ca.crt:ro")
fi

passed=0
failed=0
check() {  # check NAME COMMAND...: one line PASS/FAIL per claim
    local name=$1
    shift
    if "$@"; then
        echo "  PASS  $name"
        passed=$((passed + 1))
    else
        echo "  FAIL  $name"
        failed=$((failed + 1))
    fi
}
seconds() { echo $(( $(date +%s) - $1 )); }

ns=labkit-check-$$
ctr=""
bg_groups=()
cleanup() {
    local pg
    for pg in "${bg_groups[@]}"; do
        kill -TERM -- "-$pg" 2>/dev/null || true
    done
    sleep 1
    for pg in "${bg_groups[@]}"; do
        kill -KILL -- "-$pg" 2>/dev/null || true
    done
    if ip netns list | grep -qw "$ns"; then
        ip netns pids "$ns" | xargs -r kill -KILL 2>/dev/null || true
        ip netns del "$ns"
    fi
    # The storage is this check's own: every container in it is one of ours.
    bah rm --all >/dev/null 2>&1 || true
    rm -rf "$logs"
}
trap cleanup EXIT

# ---- 1. the stand-in bases ---------------------------------------------------------------------
t=$(date +%s)
if ! bah inspect --type image "$base_image" >/dev/null 2>&1; then
    echo ">> $me: debootstrap bookworm (minbase, python3, pip) for the stand-in bases"
    rootfs=$cache/rootfs-bookworm
    rm -rf "$rootfs"
    debootstrap --variant=minbase --include=python3,python3-pip,python3-venv,ca-certificates \
        bookworm "$rootfs" "${LABKIT_DEBIAN_MIRROR:-http://deb.debian.org/debian}" \
        > "$logs/debootstrap.log" 2>&1 || { tail -n 20 "$logs/debootstrap.log"; exit 1; }
    # As in python:3.12-slim and NGC: `python` exists and pip installs into the system Python.
    ln -sf python3 "$rootfs/usr/bin/python"
    rm -f "$rootfs"/usr/lib/python3*/EXTERNALLY-MANAGED
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    new=$(bah from scratch)
    cp -a "$rootfs/." "$(bah mount "$new")/"
    bah umount "$new" >/dev/null
    bah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --env LANG=C.UTF-8 --cmd python3 "$new"
    bah commit --quiet --rm "$new" "$base_image" >/dev/null
    rm -rf "$rootfs"
fi
bah tag "$base_image" "$wheel_image"
echo ">> $me: stand-in $ngc_image (torch $torch_version)"
bah bud --layers --pull=never --quiet -f "$here/ngc-standin.Containerfile" \
    --build-arg BASE="$base_image" --build-arg TORCH_WHEEL="$(basename "$torch_wheel")" \
    --build-arg TORCH_VERSION="$torch_version" --build-arg NGC_RELEASE="${ngc_tag%%-*}" \
    --volume "$(dirname "$torch_wheel"):/host-wheels:ro" "${ca_args[@]}" \
    -t "$ngc_image" "$here" > "$logs/standin.log" 2>&1 \
    || { tail -n 30 "$logs/standin.log"; exit 1; }
standin_s=$(seconds "$t")

# ---- 2. docker/Dockerfile, unchanged -----------------------------------------------------------
echo ">> $me: buildah bud -f docker/Dockerfile --target pytorch (log: build.log)"
t=$(date +%s)
build_ok=0
bah bud --layers --pull=never -f "$repo/docker/Dockerfile" \
    --ignorefile "$repo/docker/Dockerfile.dockerignore" --target pytorch "${ca_args[@]}" \
    -t "$image" "$repo" > "$logs/build.log" 2>&1 || build_ok=$?
build_s=$(seconds "$t")
grep -E 'STEP [0-9]+/[0-9]+: (FROM|RUN)|install-labkit.sh|Successfully (built|tagged)|^Error' \
    "$logs/build.log" | cut -c1-160 | sed 's/^/   | /' || true
if [ "$build_ok" -ne 0 ]; then
    tail -n 40 "$logs/build.log"
    echo "$me: docker/Dockerfile did not build (exit $build_ok)"
    exit 1
fi
size() { bah images --format '{{.Size}}' "$1" | head -n 1; }

# ---- 3. run as a learner would -----------------------------------------------------------------
echo ">> $me: running $image in network namespace $ns"
ip netns add "$ns"
ip netns exec "$ns" ip link set lo up
ctr=$(bah from --pull=never --name "labkit-check-$$" "$image")
read_config() {  # the image's ENTRYPOINT or CMD, one word a line
    bah inspect --type image "$image" | python3 -c \
        'import json, sys; print("\n".join(json.load(sys.stdin)["OCIv1"]["config"][sys.argv[1]] or []))' "$1"
}
mapfile -t entrypoint < <(read_config Entrypoint)
mapfile -t default_cmd < <(read_config Cmd)
# Docker writes the container's /etc/hosts (localhost, and the container at its address); a
# minbase root has none. (An earlier run without this file and eth0 hung in torchrun's store.)
# Like Docker's bridge it also has an eth0 with an address, the one its hostname resolves to:
# here a veth whose other end stays in the same namespace (a cable to nowhere).
ip netns exec "$ns" ip link add eth0 type veth peer name eth1
ip netns exec "$ns" ip link set eth1 up
ip netns exec "$ns" ip addr add 10.88.0.2/24 dev eth0
ip netns exec "$ns" ip link set eth0 up
bah config --hostname labkit-container "$ctr"
printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost\n10.88.0.2\tlabkit-container\n' \
    > "$logs/hosts"
in_container() {  # docker run IMAGE ARGS...: the image's entrypoint, then ARGS
    ip netns exec "$ns" buildah --root "$cache/storage" --runroot "$cache/run" \
        --storage-driver overlay run --volume "$logs/hosts:/etc/hosts:ro" "$ctr" -- \
        "${entrypoint[@]}" "$@"
}

# -- the torch of the base, kept
record='import glob, hashlib, torch; print(torch.__version__, hashlib.sha256(open(glob.glob(
"/usr/local/lib/python3*/dist-packages/torch-*.dist-info/RECORD")[0], "rb").read()).hexdigest())'
base_torch=$(bah run "$(bah from --pull=never --name "labkit-base-$$" "$ngc_image")" -- \
    python3 -c "$record" 2>/dev/null; bah rm "labkit-base-$$" >/dev/null)
image_torch=$(in_container python3 -c "$record" 2>/dev/null | tail -n 1)
echo "   torch in the base: $base_torch"
echo "   torch in the image: $image_torch"
if grep -q "install-labkit.sh: keeping" "$logs/build.log"; then
    check "install-labkit.sh said it kept torch $torch_version" \
        grep -q "install-labkit.sh: done, torch $torch_version kept" "$logs/build.log"
else
    echo "   (labkit-install's layer came from the cache; its output was checked when built)"
fi
check "torch in the image is the base's, file for file (version and RECORD hash)" \
    test -n "$base_torch" -a "$base_torch" = "$image_torch"

# -- labkit doctor
in_container python3 -m labkit doctor > "$logs/doctor.log" 2>&1 || true
sed 's/^/   | /' "$logs/doctor.log" | head -n 60
check "NVIDIA's banner prints the container's versions" \
    grep -q "PyTorch Version $torch_version" "$logs/doctor.log"
check "NVIDIA's banner warns that no GPU is visible" \
    grep -q "WARNING: The NVIDIA Driver was not detected" "$logs/doctor.log"
check "labkit doctor reports the container's torch" grep -q "torch $torch_version" "$logs/doctor.log"
check "labkit doctor reports the missing GPU" grep -q "no CUDA GPU found" "$logs/doctor.log"

# -- JupyterLab, published on the host's loopback only
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
token=$(python3 -c 'import secrets; print(secrets.token_hex(24))')
sock=$logs/publish.sock
bah config --env LABKIT_TOKEN="$token" --env LABKIT_HOST_PORT="$port" "$ctr"
setsid ip netns exec "$ns" buildah --root "$cache/storage" --runroot "$cache/run" \
    --storage-driver overlay run --volume "$logs/hosts:/etc/hosts:ro" "$ctr" -- \
    "${entrypoint[@]}" "${default_cmd[@]}" \
    > "$logs/lab.log" 2>&1 &
bg_groups+=("$!")
setsid ip netns exec "$ns" socat "UNIX-LISTEN:$sock,fork" TCP:127.0.0.1:8888 \
    > /dev/null 2>&1 &
bg_groups+=("$!")
setsid socat "TCP-LISTEN:$port,bind=127.0.0.1,reuseaddr,fork" "UNIX-CONNECT:$sock" \
    > /dev/null 2>&1 &
bg_groups+=("$!")
url=""
code=000
t=$(date +%s)
while [ "$(seconds "$t")" -lt 180 ]; do
    url=$(grep -o "http://127.0.0.1:$port/lab?token=[0-9a-f]*" "$logs/lab.log" | head -n 1 || true)
    if [ -n "$url" ]; then
        code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 10 "$url" || true)
        [ "$code" = 200 ] && break
    fi
    sleep 2
done
lab_s=$(seconds "$t")
http() { curl -s -o /dev/null -w '%{http_code}' --max-time 10 "$@" || true; }
api=http://127.0.0.1:$port/api/contents
with_token=$(http -H "Authorization: token $token" "$api")
without_token=$(http "$api")
wrong_token=$(http -H "Authorization: token not-$token" "$api")
lab_without=$(http "http://127.0.0.1:$port/lab")
listeners=$(ss -ltnH "( sport = :$port )" | awk '{print $4}' | sort -u | tr '\n' ' ')
echo "   entrypoint printed: ${url:-nothing}  (JupyterLab answered after ${lab_s} s)"
echo "   GET /lab?token=... -> $code; /api/contents with token -> $with_token, without ->" \
     "$without_token, wrong token -> $wrong_token; /lab without token -> $lab_without"
echo "   listening on the host for port $port: $listeners"
check "the entrypoint prints the host's URL with the token" test -n "$url"
check "JupyterLab answers that URL from outside the container (200)" test "$code" = 200
check "the API answers with the token (200)" test "$with_token" = 200
check "the API refuses without a token (403)" test "$without_token" = 403
check "the API refuses a wrong token (403)" test "$wrong_token" = 403
check "/lab without a token sends to the login page (302)" test "$lab_without" = 302
check "published on 127.0.0.1 only" test "$listeners" = "127.0.0.1:$port "
check "the container's network leads nowhere (loopback, and eth0 wired to its own eth1)" \
    test "$(ip netns exec "$ns" ip -o link show | awk -F': ' '{print $2}' | sort | tr '\n' ' ')" \
    = "eth0@eth1 eth1@eth0 lo "
for pg in "${bg_groups[@]}"; do kill -TERM -- "-$pg" 2>/dev/null || true; done
sleep 3
bg_groups=()
check "JupyterLab stopped with its container (no process left in $ns)" \
    test -z "$(ip netns pids "$ns")"

# -- notebooks under nbval, smoke profile
echo ">> $me: notebooks inside the container: $notebooks"
t=$(date +%s)
nb_paths=()
for nb in $notebooks; do nb_paths+=("/workspace/notebooks/$nb"); done
in_container env LABKIT_PROFILE=smoke LABKIT_HOME=/tmp/labkit-home OMP_NUM_THREADS=1 \
    MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 python3 -m pytest -p no:cacheprovider -q \
    --nbval-lax --nbval-current-env --nbval-cell-timeout=600 "${nb_paths[@]}" \
    > "$logs/nbval.log" 2>&1 || true
nb_s=$(seconds "$t")
tail -n 15 "$logs/nbval.log" | sed 's/^/   | /'
nb_summary=$(grep -E '[0-9]+ (passed|failed)' "$logs/nbval.log" | tail -n 1 || true)
check "notebooks pass under nbval inside the container ($nb_summary)" \
    grep -qE '^=* *[0-9]+ passed[^,]*(, [0-9]+ (skipped|warnings?))* in ' "$logs/nbval.log"
for _ in 1 2 3 4 5 6 7 8 9 10; do  # the kernel and its workers get a few seconds to exit
    [ -z "$(ip netns pids "$ns")" ] && break
    sleep 1
done
check "no process left in $ns after the notebooks" test -z "$(ip netns pids "$ns")"

# -- a build that tries to replace torch fails, torch untouched
echo ">> $me: a build asking for a torchaudio that pins another torch (must fail)"
variant_rc=0
bah bud --pull=never --no-cache --force-rm -f "$here/replaces-torch.Containerfile" \
    --build-arg BASE="$image" "${ca_args[@]}" -t localhost/labkit-check/replaces-torch \
    "$here" > "$logs/variant.log" 2>&1 || variant_rc=$?
grep -E 'conflict is caused|depends on torch|untouched' "$logs/variant.log" | cut -c1-200 \
    | sed 's/^/   | /' || true
check "that build fails" test "$variant_rc" -ne 0
check "pip names the culprit (torchaudio 2.9.1 depends on torch==2.9.1)" \
    grep -q "torchaudio 2.9.1 depends on torch==2.9.1" "$logs/variant.log"
check "install-labkit.sh says torch is untouched" \
    grep -q "torch $torch_version is untouched" "$logs/variant.log"
check "no image was made from it" \
    test -z "$(bah images -q localhost/labkit-check/replaces-torch 2>/dev/null)"

bah rm "$ctr" >/dev/null
ctr=""
ip netns del "$ns"
# buildah 1.28 keeps a failed build's working container despite --force-rm: remove them all
# (this storage is the check's own), then look for any process still inside a container root.
bah rm --all > /dev/null
running=$(for p in /proc/[0-9]*; do readlink "$p/root" 2>/dev/null; done | grep -c buildah || true)
check "no container left, none running (processes inside a container root: $running)" \
    test -z "$(bah containers -q)" -a "$running" -eq 0

echo ">> $me: summary"
echo "   stand-in bases: ${standin_s} s (cached after the first run, in $cache)"
echo "   docker/Dockerfile build: ${build_s} s"
echo "   image $image: $(size "$image"); stand-in $ngc_image: $(size "$ngc_image")"
echo "   notebooks inside the container: ${nb_s} s ($nb_summary)"
echo "   cache folder: $(du -sh "$cache" 2>/dev/null | cut -f1)"
echo "   total: $(seconds "$start") s"
echo "$me: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
