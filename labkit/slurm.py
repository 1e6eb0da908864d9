"""Slurm batch scripts for the course's training scripts: one torchrun agent per node.

``srun`` starts exactly one task on every node of the job; each task is a torchrun agent
that starts ``nproc_per_node`` workers. The agents meet at a c10d rendezvous on the job's
first node, found from the Slurm environment when the job runs, so the same script works
for any node list Slurm hands out.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

from ._sizes import whole

# Slurm's --time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S (man sbatch).
_TIME = re.compile(r"\d+(:\d+){0,2}|\d+-\d+(:\d+){0,2}")
_TIME_WORDS = ("infinite", "unlimited")


def sbatch_script(
    target: str | Path,
    *args: str,
    nodes: int = 1,
    gpus_per_node: int = 0,
    nproc_per_node: int | None = None,
    cpus_per_task: int | None = None,
    time: str = "01:00:00",
    partition: str | None = None,
    job_name: str | None = None,
    output: str = "%x-%j.out",
    port: int | None = None,
    python: str | None = None,
    extra_sbatch: tuple[str, ...] | list[str] = (),
) -> str:
    """The text of an sbatch script that runs ``target`` with torchrun on ``nodes`` nodes.

    ``target`` is a training script (what ``%%writefile train.py`` makes); ``args`` are its
    own arguments. ``nproc_per_node`` defaults to ``gpus_per_node``, or 1 on CPU nodes.
    ``cpus_per_task`` is the CPUs for each node's agent and all its workers (Slurm gives
    one otherwise). ``port`` is the rendezvous port; by default it is derived from the job
    id so two jobs on one node do not clash. ``python`` defaults to this interpreter, which
    suits a virtual environment on a shared file system; pass ``"python"`` to use whatever
    the job's PATH finds (a container, a module system). ``extra_sbatch`` lines are added as
    they are, e.g. ``("--account=myproj", "--mem=0")``.

    Example:
        >>> text = sbatch_script("train.py", "--epochs", "3",
        ...                      nodes=2, gpus_per_node=4)  # doctest: +SKIP
        >>> "#SBATCH --nodes=2" in text and "--nproc-per-node=4" in text  # doctest: +SKIP
        True
    """
    script = _check_target(target)
    nproc = _check_sizes(nodes, gpus_per_node, nproc_per_node, cpus_per_task, port)
    _check_time(time)
    name = job_name if job_name is not None else script.stem
    options = [f"--job-name={name}", f"--nodes={nodes}", "--ntasks-per-node=1"]
    if gpus_per_node:
        options.append(f"--gpus-per-node={gpus_per_node}")
    if cpus_per_task:
        options.append(f"--cpus-per-task={cpus_per_task}")
    options.append(f"--time={time}")
    if partition:
        options.append(f"--partition={partition}")
    options += [f"--output={output}", *extra_sbatch]
    _check_sbatch_lines(options)
    return _render(options, script, args, nproc, cpus_per_task, port, python or sys.executable)


def write_sbatch(path: str | Path, target: str | Path, *args: str, **options) -> Path:
    """Write ``sbatch_script(target, *args, **options)`` to ``path`` and return the path.

    Example:
        >>> job = write_sbatch("job.sbatch", "train.py", nodes=2)  # doctest: +SKIP
        >>> # then, in a shell on the cluster's login node: sbatch job.sbatch
    """
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"folder {str(path.parent)!r} does not exist: create it first, "
                                f"or write the job file somewhere else (-o)")
    path.write_text(sbatch_script(target, *args, **options))
    return path


def first_node(nodelist: str) -> str:
    """The first host of a Slurm node list, expanded as ``scontrol show hostnames`` would.

    ``SLURM_JOB_NODELIST`` is compressed: ``gpu[07-08,12]`` is gpu07, gpu08 and gpu12. The
    first node hosts the rendezvous (``MASTER_ADDR``) in the job scripts of this module.

    Example:
        >>> first_node("gpu[07-08,12],cpu01")
        'gpu07'
        >>> first_node("rack[2-3]-node[01-04]")
        'rack2-node01'
    """
    if not isinstance(nodelist, str) or not nodelist.strip():
        raise ValueError(f"a Slurm node list is a non-empty string such as 'gpu[01-04]', got "
                         f"{nodelist!r}: read it from SLURM_JOB_NODELIST")
    first, depth = [], 0
    for char in nodelist.strip():  # up to the first comma outside brackets
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            break
        first.append(char)
    host = "".join(first)
    while (bracket := re.search(r"\[([^\]]*)\]", host)) is not None:
        lowest = bracket.group(1).split(",")[0].split("-")[0]  # keeps the zero padding
        host = host[:bracket.start()] + lowest + host[bracket.end():]
    return host


def _check_target(target) -> Path:
    """The training script as an absolute path (the job may start in another folder)."""
    script = Path(target).expanduser()
    if not script.is_file():
        what = "is a folder" if script.is_dir() else "does not exist"
        raise FileNotFoundError(f"training script {str(target)!r} {what}: write it first "
                                f"(e.g. %%writefile train.py in a notebook), then pass its path")
    return script.resolve()


def _check_sizes(nodes, gpus_per_node, nproc_per_node, cpus_per_task, port) -> int:
    """Validate the counts; return the workers per node."""
    for name, value, low in (("nodes", nodes, 1), ("gpus_per_node", gpus_per_node, 0),
                             ("nproc_per_node", nproc_per_node, 1),
                             ("cpus_per_task", cpus_per_task, 1)):
        if value is None and name in ("nproc_per_node", "cpus_per_task"):
            continue
        whole(value, f"{name} (--{name.replace('_', '-')})", low=low,
              hint=f": pass {low} or more")
    nproc = nproc_per_node or gpus_per_node or 1
    if gpus_per_node and nproc > gpus_per_node:
        raise ValueError(f"nproc_per_node={nproc} is more workers than the {gpus_per_node} GPUs "
                         f"per node: each worker needs its own GPU, so pass nproc_per_node <= "
                         f"{gpus_per_node} (or ask for more GPUs)")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int)
                             or not 1024 <= port <= 65535):
        raise ValueError(f"port must be a whole number from 1024 to 65535, got {port!r}; "
                         f"leave it out to derive one from the job id")
    return nproc


def _check_time(time) -> None:
    """Reject a --time that sbatch would refuse only after the learner submitted."""
    if not isinstance(time, str) or not (_TIME.fullmatch(time) or time.lower() in _TIME_WORDS):
        raise ValueError(f"time {time!r} is not a Slurm time limit: use minutes ('30'), "
                         f"'HH:MM:SS' ('02:00:00') or 'D-HH:MM:SS' ('1-12:00:00')")


def _check_sbatch_lines(options: list[str]) -> None:
    """Each option becomes one ``#SBATCH`` line: it must be one flag without spaces."""
    for option in options:
        if not isinstance(option, str) or not option.startswith("-") or re.search(r"\s", option):
            raise ValueError(f"sbatch option {option!r} must be one flag without spaces, like "
                             f"'--account=myproj' (check job_name, partition, output and "
                             f"extra_sbatch)")


def _render(options, script: Path, args, nproc: int, cpus_per_task, port, python: str) -> str:
    """The script text; shell variables are expanded when the job runs, on its nodes."""
    port_line = (f"rdzv_port={port}" if port else
                 "# Derived from the job id, so two jobs sharing a node do not clash.\n"
                 "rdzv_port=$(( 20000 + SLURM_JOB_ID % 20000 ))")
    srun = ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    if cpus_per_task:
        # srun does not inherit sbatch's --cpus-per-task (Slurm 22.05 and later).
        srun.append(f"--cpus-per-task={cpus_per_task}")
    lines = [shlex.join(srun), shlex.join([python, "-m", "torch.distributed.run"]),
             f'--nnodes="$SLURM_JOB_NUM_NODES" --nproc-per-node={nproc}',
             '--rdzv-backend=c10d --rdzv-endpoint="$head_node:$rdzv_port" '
             '--rdzv-id="$SLURM_JOB_ID"',
             shlex.join([str(script), *map(str, args)])]
    command = " \\\n    ".join(lines)
    return "\n".join([
        "#!/bin/bash",
        "# Written by labkit (python -m labkit slurm). Submit it with: sbatch <this file>",
        *(f"#SBATCH {option}" for option in options),
        "set -euo pipefail",
        "",
        "# The first node of the job hosts the rendezvous; every node's agent finds it there.",
        'nodes=( $(scontrol show hostnames "$SLURM_JOB_NODELIST") )',
        "head_node=${nodes[0]}",
        port_line,
        # two words for echo, joined by a space: the same line out, a script line that fits
        f'echo "[labkit] job $SLURM_JOB_ID: $SLURM_JOB_NUM_NODES node(s) x {nproc} worker(s),"'
        ' \\\n    "rendezvous at $head_node:$rdzv_port"',
        "",
        f"# One task per node: each is a torchrun agent that starts {nproc} worker(s).",
        command,
        "",
    ])

