#!/bin/bash
# Stand-in for NVIDIA's /opt/nvidia/nvidia_entrypoint.sh, baked into the local stand-in for
# nvcr.io/nvidia/pytorch that tests/container/check.sh builds (never pushed, never used outside
# that check). It behaves like NVIDIA's: a banner with the container's versions, a warning when
# no GPU is visible or /dev/shm is Docker's default, then it runs its arguments (bash if none),
# so that docker/Dockerfile's ENTRYPOINT starts labkit's entrypoint through it as on NGC.
set -e

cat <<BANNER

=============
== PyTorch ==
=============

NVIDIA Release ${NVIDIA_PYTORCH_VERSION:-unknown} (stand-in built by tests/container/check.sh)
PyTorch Version ${PYTORCH_VERSION:-unknown}

BANNER

# NVIDIA's script asks the driver; with no /dev/nvidia0 and no nvidia-smi there is none.
if ! { [ -e /dev/nvidia0 ] && command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; }
then
    echo "WARNING: The NVIDIA Driver was not detected.  GPU functionality will not be available."
    echo "   Use the NVIDIA Container Toolkit to start this container with GPU support; see"
    echo "   https://docs.nvidia.com/datacenter/cloud-native/ ."
    echo
fi

shm_kb=$(df -k --output=size /dev/shm 2>/dev/null | tail -n 1 | tr -d ' ' || echo 0)
if [ "${shm_kb:-0}" -le 65536 ] 2>/dev/null; then
    echo "NOTE: The SHMEM allocation limit is set to the default of 64MB.  This may be"
    echo "   insufficient for PyTorch.  NVIDIA recommends the use of the following flags:"
    echo "   docker run --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 ..."
    echo
fi

if [ "$#" -eq 0 ]; then
    exec /bin/bash
fi
exec "$@"
