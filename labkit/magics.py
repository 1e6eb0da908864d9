"""``%%distributed``: run a notebook cell on N workers (``%load_ext labkit`` first)."""

from __future__ import annotations

import shlex


def run_cell(code: str, inputs: dict, outputs: list[str]) -> dict:
    """Worker side: run the cell's code with the kernel's variables and the rank in scope."""
    import torch
    import torch.distributed as dist

    scope = {
        "__name__": "__main__",
        "torch": torch,
        "dist": dist,
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        **inputs,
    }
    exec(compile(code, "<%%distributed cell>", "exec"), scope)
    missing = [name for name in outputs if name not in scope]
    if missing:
        raise NameError(f"--out names {', '.join(missing)} but the cell never assigned them")
    return {name: scope[name] for name in outputs}


def _names(text: str | None) -> list[str]:
    return [n for n in (text or "").replace(",", " ").split() if n]


def distributed(line: str, cell: str, user_ns: dict) -> dict:
    """The magic's body: parse ``line``, launch the cell, return {name: [value per rank]}."""
    import argparse

    from .launcher import launch

    parser = argparse.ArgumentParser(prog="%%distributed", add_help=False, exit_on_error=False)
    parser.add_argument("-n", "--nproc", type=int, default=2)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("--rank", type=int, default=None, help="show only this rank's output")
    parser.add_argument("--in", dest="inputs", default="", help="kernel variables to send, a,b")
    parser.add_argument("--out", dest="outputs", default="", help="worker variables to bring back")
    parser.add_argument("--warm", action="store_true", help="run on the kernel's warm workers")
    try:
        args = parser.parse_args(shlex.split(line))
    except (argparse.ArgumentError, SystemExit) as exc:
        raise ValueError(f"%%distributed {line!r}: {exc}. Usage: %%distributed -n 2 "
                         "[--backend gloo] [--timeout 60] [--rank 0] [--in a,b] [--out c,d] "
                         "[--warm]") from None
    missing = [n for n in _names(args.inputs) if n not in user_ns]
    if missing:
        raise NameError(f"--in names {', '.join(missing)}, not defined in the notebook: run the "
                        "cell that defines them first")
    inputs = {n: user_ns[n] for n in _names(args.inputs)}
    outputs = _names(args.outputs)
    # Without --warm: the kernel's default (labkit.use_warm, LABKIT_WARM), cold unless set.
    result = launch(run_cell, cell, inputs, outputs, nproc=args.nproc, backend=args.backend,
                    timeout=args.timeout, show_ranks=args.rank, warm=True if args.warm else None)
    gathered = {name: [per_rank[name] for per_rank in result.values] for name in outputs}
    user_ns.update(gathered)
    return gathered


def register(ipython) -> None:
    """Register ``%%distributed`` with an IPython shell."""

    def _magic(line, cell):
        distributed(line, cell, ipython.user_ns)

    _magic.__doc__ = """Run this cell on N workers with torch.distributed ready.

    ``rank``, ``world_size``, ``dist`` and ``torch`` are defined in the cell. ``--in a,b``
    sends kernel variables; ``--out c`` brings ``c`` back as a list with one value per rank.
    ``--warm`` runs the cell on the kernel's warm workers (milliseconds after the first
    run; see ``labkit.workers``).

    Example::

        %%distributed -n 2 --in x --out total
        t = torch.tensor([x + rank]); dist.all_reduce(t); total = t.item()
    """
    ipython.register_magic_function(_magic, magic_kind="cell", magic_name="distributed")
