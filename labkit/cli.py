"""``python -m labkit {lab,launch,bench,doctor}``: argument parsing only; the work lives in the modules."""

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


def _bench(args) -> int:
    from . import bench

    return bench.main(args.which, repeats=args.repeats, nproc=args.nproc)


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
    run.add_argument("--timeout", type=float, default=None, help="seconds before the run is stopped")
    run.add_argument("--rank", type=int, default=None, help="show only this rank's output")
    run.add_argument("--nnodes", type=int, default=1)
    run.add_argument("--node-rank", type=int, default=0)
    run.add_argument("--rdzv-endpoint", default=None, help="host:port of node 0 (multi-node)")
    run.add_argument("script")
    run.add_argument("script_args", nargs=argparse.REMAINDER)
    run.set_defaults(func=_launch)

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
