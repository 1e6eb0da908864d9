#!/usr/bin/env bash
# Install labkit into a Python that already has torch (NVIDIA's own build, in the NGC
# container) WITHOUT replacing that torch. The Dockerfile runs this script, and
# tests/test_docker.py runs the very same script against a venv with a stand-in NVIDIA torch,
# so the command that builds the image is the command that is tested.
#
#   docker/install-labkit.sh PACKAGE...        e.g. /tmp/labkit-0.1.0-py3-none-any.whl
#                                                   '/tmp/labkit-0.1.0-py3-none-any.whl[tensorflow]'
# Environment: PYTHON (default python3), the interpreter to install into.
#
# Why a constraint file and not just `pip install`: labkit asks for torch>=2.7 and
# torchvision>=0.22, which NVIDIA's builds (e.g. torch 2.10.0a0+b4e4ee81d3) satisfy, so pip
# keeps them. But any requirement that does not fit them (a PyPI torchvision pinned to another
# torch, a package wanting torch<2.8) would make pip quietly uninstall NVIDIA's torch and
# download a PyPI one. Pinning every torch / triton / nvidia-* distribution to what is
# installed turns that into a resolver error at build time instead.
set -euo pipefail

python=${PYTHON:-python3}
me=install-labkit.sh

if [ "$#" -eq 0 ]; then
    echo "usage: $me PACKAGE...  (labkit's wheel or source folder, optionally with [extras])" >&2
    exit 2
fi

torch_version() {
    "$python" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null
}

if ! before=$(torch_version); then
    echo "$me: $python has no torch. This script installs labkit beside an existing torch" \
         "(NVIDIA's, in nvcr.io/nvidia/pytorch) and never installs one; for a laptop or CI" \
         "venv run \`make install\` instead (it takes torch from constraints.txt)." >&2
    exit 2
fi

pins=$(mktemp "${TMPDIR:-/tmp}/labkit-pins.XXXXXX")
trap 'rm -f "$pins"' EXIT
# pip list --format=freeze prints name==version even for distributions built from source,
# which is what NGC's torch is.
"$python" -m pip list --format=freeze --disable-pip-version-check 2>/dev/null \
    | grep -iE '^(torch|pytorch[-_]triton|triton|nvidia[-_])' > "$pins" || true
if ! grep -qi '^torch==' "$pins"; then
    echo "$me: \`$python -m pip list\` does not show the torch $before that Python imports;" \
         "install labkit with the pip of the Python that owns torch (set PYTHON=...)." >&2
    exit 2
fi
echo "$me: keeping $(tr '\n' ' ' < "$pins")"

# --no-cache-dir: the wheels would only bloat the image layer.
if ! "$python" -m pip install --no-cache-dir --disable-pip-version-check --constraint "$pins" "$@"
then
    echo "$me: pip could not install $* beside the torch family above (a 'conflict is" \
         "caused by' line names the package that wants another torch). torch $before is" \
         "untouched. Pin that package to a release made for this torch, or pick an NGC tag" \
         "whose torch it accepts (docker build --build-arg NGC_TAG=...)." >&2
    exit 1
fi

after=$(torch_version || echo "none")
if [ "$after" != "$before" ]; then
    echo "$me: torch changed from $before to $after during the install; NVIDIA's build is" \
         "gone. Rebuild from the base image and find the package that asked for another torch" \
         "(pip install --dry-run --report - ... shows who requires it)." >&2
    exit 1
fi
echo "$me: done, torch $after kept"
