"""``python -m labkit {lab,launch,bench,doctor,slurm}``: argument parsing only; the work lives
in the modules."""

from __future__ import annotations

import argparse
import sys


def _lab(args) -> int:
    from .jupyter import run_lab

    return run_lab(host=args.host, port=args.port, root=args.root)


def _doctor(args) -> int:
    from .doctor import main as doctor_main

    return doctor_main(json_output=args.json)


def _launch(args) -> int:
    from .launcher import LaunchError, launch

    try:
        launch(args.script, *args.script_args, nproc=args.nproc, backend=args.backend,
               timeout=args.timeout, nnodes=args.nnodes, node_rank=args.node_rank,
               rdzv_endpoint=args.rdzv_endpoint, show_ranks=args.rank)
    except (LaunchError, ValueError, FileNotFoundError) as exc:
        print(f"labkit launch: {exc}", file=sys.stderr)
        return 1
    return 0


BENCHMARKS = ("launch", "allreduce", "ddp", "vgg16")


def bench(which: str = "all", repeats: int = 5, nproc: int | None = None) -> int:
    """``python -m labkit bench [all|launch|allreduce|ddp|vgg16]``: run benchmarks, print figures.

    ``--repeats`` sets the launch benchmark's runs; ``--nproc`` the ranks of allreduce (4:
    the hand-written ring and recursive doubling beside the built-in) and ddp (2); vgg16
    picks its sizes from the device. The measuring and the printing live in the rooms that own
    them (``bench``, ``ddp``, ``perf``); the command line only calls them, so none of those
    rooms imports another to serve the command line.
    """
    chosen = BENCHMARKS if which == "all" else (which,)
    unknown = [b for b in chosen if b not in BENCHMARKS]
    if unknown:
        print(f"labkit bench: unknown benchmark {unknown[0]!r}; choose from all, "
              f"{', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    if repeats < 1:
        print(f"labkit bench: --repeats must be >= 1, got {repeats}", file=sys.stderr)
        return 2
    if nproc is not None and nproc < 2:
        print(f"labkit bench: --nproc must be >= 2 (one rank has nothing to measure), got {nproc}",
              file=sys.stderr)
        return 2
    if "launch" in chosen:
        from . import bench as timing

        timing.print_launch_overhead(timing.launch_overhead(repeats=repeats))
    if "allreduce" in chosen:
        from . import bench as timing
        from . import launcher

        ranks = nproc or 4
        algorithms = ("builtin", "ring") + (("doubling",) if ranks & (ranks - 1) == 0 else ())
        sizes = timing.message_sizes(1 << 10, 16 << 20)
        timing.print_allreduce_sweep(launcher.launch(
            timing.allreduce_sweep, sizes, iters=10, algorithms=algorithms, nproc=ranks,
            show_ranks=[]).values[0])
    if "ddp" in chosen:
        from . import ddp

        ddp.print_efficiency(ddp.ddp_efficiency(nproc or 2, repeats=repeats))
    if "vgg16" in chosen:  # in this process: one device, no workers needed
        from . import perf

        perf.print_vgg16_throughput(perf.vgg16_throughput())
    return 0


def _bench(args) -> int:
    return bench(args.which, repeats=args.repeats, nproc=args.nproc)


def _slurm(args) -> int:
    from .slurm import write_sbatch

    try:
        path = write_sbatch(args.output, args.script, *args.script_args, nodes=args.nodes,
                            gpus_per_node=args.gpus_per_node, nproc_per_node=args.nproc_per_node,
                            cpus_per_task=args.cpus_per_task, time=args.time,
                            partition=args.partition, job_name=args.job_name,
                            output=args.job_output, port=args.port, python=args.python,
                            extra_sbatch=args.sbatch)
    except (ValueError, FileNotFoundError) as exc:
        print(f"labkit slurm: {exc}", file=sys.stderr)
        return 1
    print(f"labkit slurm: wrote {path} ({args.nodes} node(s), one torchrun agent each).")
    print(f"Submit it on the cluster's login node:  sbatch {path}")
    print(f"Follow it with `squeue --me`; its output goes to {args.job_output} "
          f"(%x: the job's name, %j: its id).")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m labkit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    lab = sub.add_parser("lab", help="start JupyterLab on the notebooks (what `make lab` runs)")
    lab.add_argument("--host", default="127.0.0.1")
    lab.add_argument("--port", type=int, default=8888)
    lab.add_argument("--root", default="notebooks")
    lab.set_defaults(func=_lab)

    doctor = sub.add_parser("doctor", help="check this machine for distributed training")
    doctor.add_argument("--json", action="store_true", help="print the facts and checks as JSON")
    doctor.set_defaults(func=_doctor)

    run = sub.add_parser("launch", help="run a script on N torchrun workers, like labkit.launch()")
    run.add_argument("-n", "--nproc", type=int, default=2, help="workers on this node")
    run.add_argument("--backend", default="auto", help="auto, gloo or nccl")
    run.add_argument("--timeout", type=float, default=None,
                     help="seconds before the run is stopped")
    run.add_argument("--rank", type=int, default=None, help="show only this rank's output")
    run.add_argument("--nnodes", type=int, default=1)
    run.add_argument("--node-rank", type=int, default=0)
    run.add_argument("--rdzv-endpoint", default=None, help="host:port of node 0 (multi-node)")
    run.add_argument("script")
    run.add_argument("script_args", nargs=argparse.REMAINDER)
    run.set_defaults(func=_launch)

    slurm = sub.add_parser("slurm",
                           help="write an sbatch script: srun + torchrun, one agent per node",
                           description="Write an sbatch script that runs SCRIPT with torchrun on "
                           "every node of a Slurm job. labkit's options go before SCRIPT, the "
                           "script's own --options after `--`, e.g.: "
                           "python -m labkit slurm --nodes 2 train.py -- --epochs 3")
    slurm.add_argument("script", help="the training script (e.g. train.py)")
    slurm.add_argument("script_args", nargs="*", help="arguments for the script")
    slurm.add_argument("--nodes", type=int, default=1)
    slurm.add_argument("--gpus-per-node", type=int, default=0)
    slurm.add_argument("--nproc-per-node", type=int, default=None,
                       help="workers per node (default: --gpus-per-node, or 1)")
    slurm.add_argument("--cpus-per-task", type=int, default=None,
                       help="CPUs for each node's agent and its workers")
    slurm.add_argument("--time", default="01:00:00", help="time limit, e.g. 30 or 02:00:00")
    slurm.add_argument("--partition", default=None)
    slurm.add_argument("--job-name", default=None, help="default: the script's name")
    slurm.add_argument("--port", type=int, default=None,
                       help="rendezvous port (default: derived from the job id)")
    slurm.add_argument("--python", default=None,
                       help="interpreter on the nodes (default: this one; 'python' for PATH's)")
    slurm.add_argument("--sbatch", action="append", default=[], metavar="OPTION",
                       help="extra #SBATCH option, repeatable, e.g. --sbatch=--account=myproj")
    slurm.add_argument("--job-output", default="%x-%j.out",
                       help="the job's output file (sbatch --output), default %(default)s")
    slurm.add_argument("-o", "--output", default="job.sbatch", help="the file to write")
    slurm.set_defaults(func=_slurm)

    bench = sub.add_parser("bench", help="run benchmarks and print their figures")
    bench.add_argument("which", nargs="?", default="all", help="all, launch, allreduce, ddp, vgg16")
    bench.add_argument("--repeats", type=int, default=5)
    bench.add_argument("--nproc", type=int, default=None,
                       help="ranks for allreduce (default 4) and ddp (default 2)")
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return int(args.func(args) or 0)
