"""Notebook 07's exercises: the largest batch, thread budgets, Slurm's ranks, resuming a run.

Each grader runs the learner's answer and returns what it verified, or raises
:class:`labkit.check.NotYet` with what is wrong and a hint. The distributed ones run it on
real ranks: two jobs started together (thread settings are read when a process starts), 2 and
4 warm ranks meeting at the address the learner's Slurm translation gives, 2 and 4 warm ranks
resuming a DDP run with the learner's resume step.
"""

from __future__ import annotations

import numbers
import os
import socket
import tempfile
from pathlib import Path

from ..check import NotYet, exercise, on_ranks

NOTEBOOK = "07"
MiB = 2**20


# ---- the largest batch from the memory model ---------------------------------------------------

# (n_params, fixed activation bytes, per-sample activation bytes, budget): chosen so that each
# usual mistake gives another answer.
_MEMORY_CASES = [(2_000_000, 3 * MiB, 200 * 1024, 64 * MiB), (500_000, 0, 96 * 1024, 16 * MiB),
                 (8_000_000, 20 * MiB, 1 * MiB, 256 * MiB),
                 (5_000_000, 2 * MiB, 64 * 1024, 64 * MiB),  # not even the states fit
                 # the total at batch 50 is the budget to the byte: it fits (<=), batch 50
                 (MiB, MiB, 64 * 1024, 16 * MiB + MiB + 50 * 64 * 1024)]
# A wrong answer's likely cause: bytes per parameter counted, fixed bytes counted, and the hint.
_MEMORY_MISTAKES = [
    (8, True, "you forgot the optimizer state: Adam keeps 2 extra copies of the parameters "
              "(momentum and variance), 8 bytes per parameter in fp32"),
    (12, True, "you forgot the gradients: 4 bytes per parameter, as many as the parameters"),
    (4, True, "only the parameters were counted: fp32 Adam trains with 16 bytes per parameter "
              "(4 weights + 4 gradients + 8 optimizer state)"),
    (16, False, "you left out the fixed activation bytes (`fixed`, those that do not grow "
                "with the batch)"),
]


def _batch_that_fits(n_params, fixed, per_sample, budget, per_param=16, with_fixed=True):
    room = budget - per_param * n_params - (fixed if with_fixed else 0)
    return max(0, room // per_sample)


@exercise("memory_largest_batch", notebook=NOTEBOOK, title="the largest batch that fits")
def largest_batch_estimate(fn, model=None, sample=None, budget=None) -> str:
    """Exercise: ``fn(n_params, fixed, per_sample, budget)``, the largest batch under ``budget``.

    Checked on cases built so that each usual mistake gives another answer, then (with
    ``model``, ``sample``, ``budget``) against ``resources.largest_batch`` searching on
    ``resources.training_memory``, the estimator, within 1 %.

    Example::

        >>> exercise.largest_batch_estimate(my_largest_batch, vgg, SAMPLE, BUDGET)
        [pass] the largest batch that fits: 5 cases and this model in 64 MiB: 150, as the ...
    """
    for n, fixed, per_sample, limit in _MEMORY_CASES:
        got, want = fn(n, fixed, per_sample, limit), _batch_that_fits(n, fixed, per_sample, limit)
        if got == want:
            continue
        case = (f"my_largest_batch({n:_}, fixed={fixed / MiB:g} MiB, per_sample="
                f"{per_sample / 1024:g} KiB, budget={limit / MiB:g} MiB) returned {got!r}")
        if not isinstance(got, numbers.Real) or got != int(got):
            raise NotYet(f"{case}: not a whole batch", "return an int: round down, with //")
        if want == 0 and got < 0:
            raise NotYet(f"{case}: the states alone do not fit",
                         "when not even the parameter, gradient and optimizer bytes fit, no "
                         "batch does: return 0, not a negative batch")
        for per_param, with_fixed, hint in _MEMORY_MISTAKES:
            if got == _batch_that_fits(n, fixed, per_sample, limit, per_param, with_fixed):
                raise NotYet(f"{case}, the largest that fits is {want}", hint)
        if got == want - 1 and 16 * n + fixed + want * per_sample == limit:
            raise NotYet(f"{case}: at batch {want} the total is the budget to the byte, and it "
                         f"fits", "a batch fits when its total is <= budget, not < budget: "
                                  "the floor of the room over per_sample, with nothing taken off")
        need = 16 * n + fixed + got * per_sample
        if need > limit:
            raise NotYet(f"{case}, which needs {need / MiB:.2f} MiB: over the budget",
                         "round down (//): the batch must fit, 16 * n_params + fixed + batch * "
                         "per_sample <= budget")
        raise NotYet(f"{case}, the largest that fits is {want}",
                     "16 bytes per parameter (fp32 Adam) + fixed + batch * per_sample <= "
                     "budget: solve for the batch")
    done = f"{len(_MEMORY_CASES)} cases"
    if model is not None:
        from .. import resources

        est = resources.training_memory(model, sample, 1)
        n = sum(p.numel() for p in model.parameters())
        got = fn(n, est["fixed"], est["per_sample"], budget)
        search = resources.largest_batch(
            lambda b: resources.training_memory(model, sample, b)["total"] <= budget)
        if abs(got - search) > max(1, 0.01 * search):
            raise NotYet(f"for this model in {budget / MiB:g} MiB you said {got}, the "
                         f"estimator's search found {search}",
                         "pass n_params, est['fixed'] and est['per_sample'] as they are, and "
                         "the budget in bytes")
        done += f" and this model in {budget / MiB:g} MiB: {got}, as the estimator's search"
    return done


# ---- thread budgets for jobs sharing a machine ---------------------------------------------------

# (cores, jobs, ranks per job) of the machines the plan is checked on; _RUN is started for real.
# The first has jobs != ranks, so that dividing by one of them only is told apart; (2, 2, 2) has
# fewer cores than ranks: one thread each is then the least, and the most, a rank can get.
_MACHINES = [(32, 2, 4), (16, 2, 2), (12, 2, 2), (6, 2, 2), (64, 4, 2), (2, 2, 2)]
_RUN = (8, 2, 2)
_JOB = "ABCDEFGH"


def _threads_of(plan, cores, jobs, ranks) -> list[int]:
    """Each job's threads per rank from its env, after checking the env's form."""
    if not isinstance(plan, list | tuple) or len(plan) != jobs:
        raise NotYet(f"for {jobs} jobs it returned {type(plan).__name__} "
                     f"{plan!r:.80}", f"return a list of {jobs} env dicts, one per job")
    threads = []
    for job, env in zip(_JOB, plan, strict=False):
        if not isinstance(env, dict) or "OMP_NUM_THREADS" not in env:
            raise NotYet(f"job {job}'s env {env!r:.80} has no OMP_NUM_THREADS",
                         "set OMP_NUM_THREADS in each job's env: without it launch and torchrun "
                         "choose for you")
        bad = {k: v for k, v in env.items() if not isinstance(v, str)}
        if bad:
            raise NotYet(f"job {job}'s env holds {bad!r:.80}",
                         "environment values are strings: write '4', not 4 (str(n))")
        values = {env[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if k in env}
        if len(values) > 1:
            raise NotYet(f"job {job}: OMP_NUM_THREADS and MKL_NUM_THREADS differ ({env})",
                         "give every math library the same count (resources.thread_env(n))")
        value = env["OMP_NUM_THREADS"]
        if not value.isdigit() or int(value) < 1:
            raise NotYet(f"job {job}: OMP_NUM_THREADS={value!r} on {cores} cores",
                         _FEWER_CORES if value.isdigit() and cores < jobs * ranks else
                         "each rank needs a whole number of threads, at least 1")
        threads.append(int(value))
    return threads


def _oversubscribed(threads, cores, jobs, ranks) -> None:
    """NotYet naming the job(s) that take more than their share, or the cores left idle."""
    used = sum(t * ranks for t in threads)
    where = f"{jobs} jobs of {ranks} ranks on {cores} cores"
    # what an even split gives every rank: more for all would oversubscribe; at least 1
    share = max(1, cores // (jobs * ranks))
    if used > cores and any(t > share for t in threads):
        over = [f"job {j}: {ranks} ranks x {t} threads = {t * ranks}"
                for j, t in zip(_JOB, threads, strict=False) if t * ranks > cores / jobs]
        if all(t == cores // jobs for t in threads):
            hint = ("you split the cores between the jobs but not between the ranks of each job: "
                    "threads per rank = cores // (jobs x ranks per job)")
        elif all(t == cores // ranks for t in threads):
            hint = ("you split the cores between the ranks of one job, but every job took all of "
                    "them: threads per rank = cores // (jobs x ranks per job)")
        elif all(t == cores for t in threads):
            hint = "every rank takes all the cores: divide them by jobs x ranks per job"
        else:
            hint = "threads x ranks, summed over the jobs, must not exceed the cores"
        raise NotYet(f"{where}: {used} threads, oversubscribed ({'; '.join(over) or 'in all'})",
                     hint)
    short = [j for j, t in zip(_JOB, threads, strict=False) if t < share]
    if short:
        idle = cores - used
        raise NotYet(f"{where}: {used} threads, {'most' if used < cores / 2 else idle} cores "
                     f"idle (job {short[0]}: {threads[_JOB.index(short[0])]} per rank, where "
                     f"every rank can have {share})",
                     "each rank can have cores // (jobs x ranks per job) threads (at least 1) "
                     "without oversubscribing: give it all of them")


_FEWER_CORES = ("with fewer cores than ranks, cores // (jobs x ranks per job) is 0, but a "
                "process cannot run on 0 threads: every rank gets at least 1")


def _planned(plan, cores, jobs, ranks):
    """``plan(cores, jobs, ranks)``; on a machine with fewer cores than ranks, a failure named."""
    try:
        return plan(cores, jobs, ranks)
    except Exception as exc:  # the learner's code: most often thread_env(0)
        if cores >= jobs * ranks:
            raise
        raise NotYet(f"for {jobs} jobs of {ranks} ranks on {cores} cores it raised "
                     f"{type(exc).__name__}: {str(exc).strip()[:160]}", _FEWER_CORES) from None


def _threads_worker() -> dict:
    import torch
    import torch.distributed as dist

    # torch reads OMP_NUM_THREADS and MKL_NUM_THREADS (MKL_NUM_THREADS wins) when it starts,
    # and uses at most the machine's hardware threads.
    return {"rank": dist.get_rank(), "threads": torch.get_num_threads(),
            "cpus": os.cpu_count() or 1}


@exercise("thread_budget", notebook=NOTEBOOK, title="thread budgets for two jobs")
def thread_budget(plan) -> str:
    """Exercise: ``plan(cores, jobs, ranks)``, one env per job, no core oversubscribed.

    Checked on several machines by the arithmetic (threads x ranks summed over the jobs <=
    cores, and no rank with fewer threads than the even split cores // (jobs x ranks) gives it,
    at least 1: also where there are fewer cores than ranks), then started for real: two 2-rank
    jobs at once, cold (threads are read at start-up), where ``MKL_NUM_THREADS=1`` is already
    set around them, as ``make test`` and some cluster modules do; their ranks report the
    threads torch runs.

    Example::

        >>> exercise.thread_budget(my_thread_envs)
        [pass] thread budgets for two jobs: 7 machines; two 2-rank jobs started for 8 cores ...
    """
    from .. import resources
    from ..launcher import LaunchError

    for cores, jobs, ranks in [*_MACHINES, _RUN]:
        _oversubscribed(_threads_of(_planned(plan, cores, jobs, ranks), cores, jobs, ranks),
                        cores, jobs, ranks)
    cores, jobs, ranks = _RUN
    envs = plan(cores, jobs, ranks)
    planned = _threads_of(envs, cores, jobs, ranks)
    try:
        runs = resources.launch_together(
            _threads_worker, nproc=ranks, backend="gloo", show_ranks=[], timeout=180,
            warm=False, runs=[{"env": {"MKL_NUM_THREADS": "1", **env}} for env in envs])
    except (LaunchError, ValueError) as failed:  # a rank's failure, or an env launch refused
        raise NotYet(f"a job did not start: {str(failed).strip()[:300]}",
                     "the envs must hold only variable names and string values") from None
    confirmed = []  # threads per rank that the started ranks really run
    for job, run, env, want in zip(_JOB[:jobs], runs, envs, planned, strict=True):
        got = [r["threads"] for r in run.values]
        expected = min(want, min(r["cpus"] for r in run.values))  # torch caps at the cpus
        if any(g != expected for g in got):
            hint = ("MKL_NUM_THREADS was 1 around the job, and torch obeys it before "
                    "OMP_NUM_THREADS: set it too (resources.thread_env(n) sets every library's)"
                    if "MKL_NUM_THREADS" not in env else
                    "set the variables torch reads: OMP_NUM_THREADS and MKL_NUM_THREADS")
            raise NotYet(f"job {job}'s ranks run {got} threads, its env asked for {want}", hint)
        confirmed.append(want)
    return (f"{len(_MACHINES) + 1} machines; two {ranks}-rank jobs started for {cores} "
            f"cores: {' and '.join(str(t) for t in confirmed)} threads per rank, "
            f"{sum(t * ranks for t in confirmed)} of {cores} cores")


# ---- torch.distributed's variables from Slurm's --------------------------------------------

_KEYS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")


def _task_env(nodelist: str, nodes: list[str], counts: list[int], task: int, job_id: int) -> dict:
    """The Slurm variables of task ``task`` of a job with ``counts[i]`` tasks on node ``i``.

    Tasks are numbered node by node (Slurm's default block distribution). Slurm sets
    ``SLURM_NTASKS_PER_NODE`` only when the job asked for ``--ntasks-per-node``: a job of
    ``--ntasks=6`` on 3 nodes may hold 3, 1 and 2, and then it is not there.
    """
    starts = [sum(counts[:i]) for i in range(len(counts))]
    node = max(i for i, first in enumerate(starts) if first <= task)
    ntasks = str(sum(counts))
    per_node = (f"{counts[0]}(x{len(counts)})" if len(set(counts)) == 1 else
                ",".join(map(str, counts)))
    env = {"SLURM_JOB_ID": str(job_id), "SLURM_JOB_NODELIST": nodelist,
           "SLURM_NODELIST": nodelist, "SLURM_JOB_NUM_NODES": str(len(nodes)),
           "SLURM_NNODES": str(len(nodes)), "SLURM_NTASKS": ntasks, "SLURM_NPROCS": ntasks,
           "SLURM_TASKS_PER_NODE": per_node, "SLURM_NODEID": str(node),
           "SLURM_PROCID": str(task), "SLURM_LOCALID": str(task - starts[node]),
           "SLURMD_NODENAME": nodes[node]}
    if len(set(counts)) == 1:
        env["SLURM_NTASKS_PER_NODE"] = str(counts[0])
    return env


# (SLURM_JOB_NODELIST, its hosts, tasks on each, job id). The last is uneven, and its node list
# starts with a comma inside the brackets: what a hand-made parser of node[07-08] misreads.
_JOBS = [("node[07-08]", ["node07", "node08"], [2, 2], 4242),
         ("gpu-a1,gpu-b2,gpu-c3", ["gpu-a1", "gpu-b2", "gpu-c3"], [1, 1, 1], 977),
         ("dgx[012-013]", ["dgx012", "dgx013"], [4, 4], 31337),
         ("cn[9,11-12]", ["cn9", "cn11", "cn12"], [3, 1, 2], 60061)]


def _job_name(nodelist: str, counts: list[int]) -> str:
    if len(set(counts)) == 1:
        return f"a job of {len(counts)} nodes x {counts[0]} tasks ({nodelist})"
    return (f"a job of {len(counts)} nodes with {', '.join(map(str, counts[:-1]))} and "
            f"{counts[-1]} tasks ({nodelist})")


def _check_job(fn, nodelist, nodes, counts, job_id) -> None:
    tasks = [_task_env(nodelist, nodes, counts, t, job_id) for t in range(sum(counts))]
    job = _job_name(nodelist, counts)
    envs = []
    for task in tasks:
        try:
            envs.append(fn(dict(task)))
        except KeyError as missing:  # a variable this layout does not set
            name = missing.args[0] if missing.args else ""
            if not (isinstance(name, str) and name.startswith("SLURM")):
                raise
            if name != "SLURM_NTASKS_PER_NODE":
                raise NotYet(f"task {task['SLURM_PROCID']} of {job}: it read {name}, which the "
                             f"check's tasks do not set",
                             f"build the five from what they hold (srun sets these and more): "
                             f"{', '.join(sorted(task))}") from None
            raise NotYet(f"task {task['SLURM_PROCID']} of {job}: it read {name}, which this "
                         f"job does not set", "Slurm sets SLURM_NTASKS_PER_NODE only when the "
                         "job asks for --ntasks-per-node; with --ntasks alone the nodes may "
                         "hold different numbers of tasks. SLURM_PROCID, SLURM_LOCALID and "
                         "SLURM_NTASKS hold the rank, the local rank and the world size "
                         "whatever the layout") from None
    for task, env in zip(tasks, envs, strict=True):
        if not isinstance(env, dict) or any(k not in env for k in _KEYS):
            missing = [k for k in _KEYS if not isinstance(env, dict) or k not in env]
            raise NotYet(f"task {task['SLURM_PROCID']} of {job}: no {', '.join(missing)}",
                         f"return a dict with {', '.join(_KEYS)}")
        bad = {k: env[k] for k in _KEYS if not isinstance(env[k], str)}
        if bad:
            raise NotYet(f"task {task['SLURM_PROCID']}: {bad}",
                         "environment values are strings: str(...) each")
    got = {k: [e[k] for e in envs] for k in _KEYS}
    want = {"RANK": [t["SLURM_PROCID"] for t in tasks],
            "LOCAL_RANK": [t["SLURM_LOCALID"] for t in tasks],
            "WORLD_SIZE": [str(len(tasks))] * len(tasks), "MASTER_ADDR": [nodes[0]] * len(tasks)}
    if got["RANK"] != want["RANK"]:
        hint = ("RANK is the task's rank in the whole job: SLURM_PROCID (SLURM_LOCALID starts "
                "at 0 again on every node)" if got["RANK"] == want["LOCAL_RANK"] else
                "RANK is SLURM_PROCID, which numbers the job's tasks from 0")
        raise NotYet(f"{job}: RANK {got['RANK']}, expected {want['RANK']}", hint)
    if got["LOCAL_RANK"] != want["LOCAL_RANK"]:
        raise NotYet(f"{job}: LOCAL_RANK {got['LOCAL_RANK']}, expected {want['LOCAL_RANK']}",
                     "LOCAL_RANK is the task's number on its own node, SLURM_LOCALID (it picks "
                     "the GPU: cuda:LOCAL_RANK)")
    if got["WORLD_SIZE"] != want["WORLD_SIZE"]:
        raise NotYet(f"{job}: WORLD_SIZE {', '.join(sorted(set(got['WORLD_SIZE'])))}, "
                     f"expected {len(tasks)}",
                     "WORLD_SIZE counts every task of the job, on every node: SLURM_NTASKS")
    if got["MASTER_ADDR"] != want["MASTER_ADDR"]:
        if got["MASTER_ADDR"] == [t["SLURMD_NODENAME"] for t in tasks]:
            hint = ("each task named its own node: all must meet at one address, the job's "
                    "first node, slurm.first_node(SLURM_JOB_NODELIST)")
        elif nodelist in got["MASTER_ADDR"]:
            hint = ("SLURM_JOB_NODELIST is compressed (node[07-08] is node07 and node08): "
                    "slurm.first_node(...) gives its first host")
        elif any("[" in a or "," in a for a in got["MASTER_ADDR"]):
            hint = ("that is not one host: a node list can hold several ranges, with commas "
                    "inside the brackets too (cn[9,11-12] is cn9, cn11 and cn12): "
                    "slurm.first_node(SLURM_JOB_NODELIST) expands it")
        else:
            hint = "MASTER_ADDR is the job's first node: slurm.first_node(SLURM_JOB_NODELIST)"
        raise NotYet(f"{job}: MASTER_ADDR {sorted(set(got['MASTER_ADDR']))}, expected "
                     f"{nodes[0]!r} on every task", hint)
    ports = set(got["MASTER_PORT"])
    port = next(iter(ports))
    if len(ports) > 1 or not port.isdigit() or not 1024 <= int(port) <= 65535:
        raise NotYet(f"{job}: MASTER_PORT {sorted(ports)}",
                     "one port, 1024 to 65535, the same on every task: e.g. derived from "
                     "SLURM_JOB_ID, as the sbatch script does")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rendezvous_worker(fn, port: int) -> dict:
    """Rank r plays Slurm task r of a 1-node job and meets the others where fn says."""
    import datetime

    import torch.distributed as dist

    task = _task_env("localhost", ["localhost"], [dist.get_world_size()], dist.get_rank(), 555)
    env = fn(task)
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    # What init_process_group("...", init_method="env://") does first: rank 0 hosts a store
    # at MASTER_ADDR (the port is the grader's: one that is free here), the others join it.
    store = dist.TCPStore(env["MASTER_ADDR"], port, world, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=20))
    store.set(f"rank-{rank}", env["LOCAL_RANK"])
    store.wait([f"rank-{r}" for r in range(world)])
    seen = {r: store.get(f"rank-{r}").decode() for r in range(world)}
    dist.barrier()  # rank 0's store lives until every rank has read it
    return {"rank": rank, "world": world, "seen": seen}


@exercise("slurm_rank_env", notebook=NOTEBOOK, title="torch's ranks from Slurm's")
def slurm_rank_env(fn) -> str:
    """Exercise: ``fn(slurm_env)``, the five variables ``env://`` reads, for one Slurm task.

    Checked on every task of four jobs (several nodes, compressed node lists, one with another
    number of tasks on each node, where SLURM_NTASKS_PER_NODE is not set), then on 2 and on 4
    real ranks, each playing one task of a one-node job, that meet through a TCPStore hosted
    by the rank fn calls 0, at the address it gives.

    Example::

        >>> exercise.slurm_rank_env(my_rank_env)
        [pass] torch's ranks from Slurm's: 4 jobs, 21 tasks; 2 ranks, then 4, met at localhost
    """
    for job in _JOBS:
        _check_job(fn, *job)
    for world in (2, 4):
        met = on_ranks(_rendezvous_worker, fn, _free_port(), nproc=world, timeout=60)
        want = {r: str(r) for r in range(world)}
        if sorted(m["rank"] for m in met) != list(want) or any(m["seen"] != want for m in met):
            raise NotYet(f"the {world} ranks of a {world}-task job saw "
                         f"{[m['seen'] for m in met]}",
                         "each task must publish its own RANK and LOCAL_RANK")
    tasks = sum(sum(counts) for _, _, counts, _ in _JOBS)
    return f"{len(_JOBS)} jobs, {tasks} tasks; 2 ranks, then 4, met at localhost"


# ---- resuming from the newest checkpoint ---------------------------------------------------------

def _toy_model():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def _toy_data(n: int = 96):
    import torch

    x = torch.randn(n, 6, generator=torch.Generator().manual_seed(0))
    return x, (x[:, 0] > 0).long()


def _trained(steps: int, folder: Path, seed: int = 0):
    """A model and SGD-with-momentum optimizer trained ``steps`` steps, saved every 5 steps."""
    import torch
    from torch.nn import functional as F

    from ..ddp import save_on_rank0

    torch.manual_seed(seed)
    model, (x, y) = _toy_model(), _toy_data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(1, steps + 1):
        opt.zero_grad()
        F.cross_entropy(model(x[:16]), y[:16]).backward()
        opt.step()
        if step % 5 == 0:
            save_on_rank0({"model": model.state_dict(), "optimizer": opt.state_dict(),
                           "step": step}, folder / f"step-{step:06d}.pt")
    return model, opt


def _check_in_process(resume, folder: Path) -> None:
    import torch

    model, opt = _trained(0, folder, seed=1)
    try:
        got = resume(model, opt, str(folder))
    except Exception as exc:  # the learner's code: the usual failure is loading None
        raise NotYet(f"with no checkpoint in the folder yet it raised {type(exc).__name__}: "
                     f"{str(exc)[:200]}",
                     "return 0 when elastic.latest_checkpoint(folder) is None: the first "
                     "attempt starts at step 1") from None
    if got != 0:
        raise NotYet(f"with no checkpoint in the folder yet it returned {got!r}",
                     "return 0 when elastic.latest_checkpoint(folder) is None: the first "
                     "attempt starts at step 1")
    saved, saved_opt = _trained(10, folder)  # checkpoints at steps 5 and 10
    model, opt = _trained(0, folder / "fresh", seed=1)
    got = resume(model, opt, str(folder))
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), saved.parameters(),
                                                 strict=True))
    if got == 5:
        raise NotYet("with checkpoints at steps 5 and 10 it returned 5",
                     "elastic.latest_checkpoint(folder) gives the newest one (step 10)")
    if got != 10:
        raise NotYet(f"with checkpoints at steps 5 and 10 it returned {got!r}",
                     "return the step the checkpoint holds, state['step']: the training loop "
                     "goes on with the step after it")
    if not same:
        raise NotYet("the model's weights are not the checkpoint's",
                     "model.load_state_dict(state['model'])")
    momentum = [opt.state.get(p, {}).get("momentum_buffer") for p in model.parameters()]
    want = [saved_opt.state[p]["momentum_buffer"] for p in saved.parameters()]
    if any(m is None or not torch.equal(m, w) for m, w in zip(momentum, want, strict=True)):
        raise NotYet("the optimizer's state (SGD's momentum) is not the checkpoint's",
                     "optimizer.load_state_dict(state['optimizer']): without it the resumed "
                     "steps differ from the uninterrupted ones")


def _resume_worker(resume, folder: str, train, steps: int, ckpt_every: int, killed_after: int):
    """Every rank: an uninterrupted run, then one 'killed' after a step and resumed."""
    import torch.distributed as dist

    from .. import elastic

    kw = {"steps": steps, "ckpt_every": ckpt_every, "batch": 8}
    straight = elastic.resumable_training(_toy_model, train, f"{folder}/straight", **kw)
    elastic.resumable_training(_toy_model, train, f"{folder}/killed", resume=resume,
                               **{**kw, "steps": killed_after})
    if dist.get_rank() == 0:  # a kill leaves only the periodic checkpoints, not a final one
        elastic.latest_checkpoint(f"{folder}/killed").unlink()
    dist.barrier()
    again = elastic.resumable_training(_toy_model, train, f"{folder}/killed", resume=resume,
                                       **kw)
    return {"straight": straight["weights"], "weights": again["weights"],
            "resumed_from": again["resumed_from"], "steps_run": again["steps_run"]}


@exercise("checkpoint_resume", notebook=NOTEBOOK, title="resume from the newest checkpoint")
def checkpoint_resume(resume) -> str:
    """Exercise: ``resume(model, optimizer, folder) -> step``, the start of a restarted run.

    Checked here (no checkpoint yet: 0; checkpoints at steps 5 and 10: step 10, its weights
    and its momentum), then on 2 and on 4 warm ranks: a DDP run stopped after step 10
    (checkpoints every 4 steps) and run again with ``resume``, which must end bitwise on the
    weights of an uninterrupted run.

    Example::

        >>> exercise.checkpoint_resume(my_resume)
        [pass] resume from the newest checkpoint: resumed at step 8 on 2 and on 4 ranks, ...
    """
    import torch

    steps, every, killed_after = 16, 4, 10
    with tempfile.TemporaryDirectory(prefix="labkit-resume-") as folder:
        _check_in_process(resume, Path(folder) / "here")
        out = [r for world in (2, 4)   # each world size its own folders
               for r in on_ranks(_resume_worker, resume, f"{folder}/{world}", _toy_data(), steps,
                                 every, killed_after, nproc=world, timeout=60)]
    last = killed_after // every * every
    for r in out:
        if r["resumed_from"] != last or r["steps_run"] != list(range(last + 1, steps + 1)):
            raise NotYet(f"a run stopped after step {killed_after} (checkpoints at "
                         f"{list(range(every, killed_after, every))}) resumed at "
                         f"{r['resumed_from']} and ran steps {r['steps_run']}",
                         f"return the step of the newest checkpoint ({last}): the loop runs "
                         f"the steps after it")
        if not torch.equal(r["weights"], r["straight"]):
            diff = (r["weights"] - r["straight"]).abs().max().item()
            raise NotYet(f"after resuming, the weights differ from an uninterrupted run by up "
                         f"to {diff:.1e}",
                         "restore everything training carries: the model and the optimizer")
    return (f"resumed at step {last} on 2 and on 4 ranks, steps {last + 1}-{steps} redone or run, "
            f"final weights bitwise those of an uninterrupted run")


# ==== challenge: a sharded checkpoint, saved on n ranks and loaded on another number ==========
# Graded on real ranks: saved on 4 and loaded on 2, saved on 2 and loaded on 4 (each time a
# newer checkpoint over an older one), the loaded slices and step against the flat tensor they
# came from, and the route: no data over the wire, each rank reading only the files it needs.

_RS_CASES = (  # (save on, load on, numel, dtype): uneven slices, then an empty one
    (4, 2, 10, "float64"), (2, 4, 3, "float32"))
_RS_STEPS = (9, 10)  # saved in this order: the newest is 10, "10" sorts before "9" as text
_RS_SMALL = 64  # bytes: a collective this small moves metadata (a step, a flag), not the data
_RS_TIMEOUT = 120.0  # the first torch.save / torch.load in a fresh worker imports a good deal
_RS_PLAN = ("save: each rank torch.save's its own slice with where it starts (the flat offset) "
            "and the step, into a file named by step and rank (to a temporary name, then "
            "os.replace); load: find the newest complete step, work out which old slices "
            "overlap your new range [start, stop) from their offsets and sizes, read only "
            "those, and cut your range out")


def _rs_flat(numel: int, dtype: str, step: int):
    import torch

    return (torch.arange(numel, dtype=torch.float64) + 100 * step).to(getattr(torch, dtype))


def _rs_save_worker(fn, folder: str, numel: int, dtype: str) -> list:
    """Each rank: ``fn(shard, step, folder)`` for each step of ``_RS_STEPS``; the calls made."""
    import torch.distributed as dist

    from ..parallel import traffic

    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for step in _RS_STEPS:
        shard = _rs_flat(numel, dtype, step).tensor_split(world)[rank].clone()
        with traffic.count_traffic() as t:
            fn(shard, step, folder)
        dist.barrier()  # every rank's files are written before the next save, or the load
        out.append([(c.op, c.payload_bytes) for c in t.calls])
    return out


class _SimulatedCrash(Exception):
    """Raised by the patched torch.save: the process died while that file was being written."""


def _rs_crash_worker(fn, folder: str, numel: int, dtype: str, step: int) -> bool:
    """Each rank: ``fn(shard, step, folder)`` once more, the last rank dying in its first
    torch.save after writing half a file (what a killed job or a full disk leaves behind).
    Returns whether this rank's save was the one cut short."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    shard = _rs_flat(numel, dtype, step).tensor_split(world)[rank].clone()
    real = torch.save

    def dying_save(obj, f, *args, **kwargs):
        if hasattr(f, "write"):
            f.write(b"PK\x03\x04 half a file")
        else:
            with open(f, "wb") as out:
                out.write(b"PK\x03\x04 half a file")
        raise _SimulatedCrash(f"this rank died while writing {f}")

    if rank == world - 1:
        torch.save = dying_save
    try:
        fn(shard, step, folder)
    except _SimulatedCrash:
        return True
    finally:
        torch.save = real
    return False


def _rs_load_worker(fn, folder: str, numel: int) -> dict:
    """Each rank: ``fn(numel, folder) -> (shard, step)``, with the files it read counted."""
    import torch

    from ..parallel import traffic

    reads, real = [], torch.load

    def counting_load(f, *args, **kwargs):
        reads.append(str(f))
        return real(f, *args, **kwargs)

    torch.load = counting_load
    try:
        with traffic.count_traffic() as t:
            got = fn(numel, folder)
    finally:
        torch.load = real
    shard, step = got if isinstance(got, tuple | list) and len(got) == 2 else (None, None)
    return {"shard": shard.detach().clone() if isinstance(shard, torch.Tensor) else None,
            "step": step, "returned": type(got).__name__, "reads": reads,
            "calls": [(c.op, c.payload_bytes) for c in t.calls]}


def _rs_ranges(numel: int, world: int) -> list[tuple[int, int]]:
    import torch

    out, at = [], 0
    for part in torch.arange(numel).tensor_split(world):
        out.append((at, at + len(part)))
        at += len(part)
    return out


@exercise("resharded_checkpoint", notebook=NOTEBOOK,
          title="challenge: a sharded checkpoint, loaded on another number of ranks")
def resharded_checkpoint(save_fn, load_fn) -> str:
    """Challenge: ``save_fn(shard, step, folder)`` on n ranks, ``load_fn(numel, folder) ->
    (shard, step)`` on another number of them.

    Saved on 4 real ranks and loaded on 2 (10 float64 numbers: uneven slices), then saved on 2
    and loaded on 4 (3 float32 numbers: one rank's slice empty), each time a checkpoint of step
    9 and then of step 10 in the same folder. Each rank's loaded slice and step must be the
    newest checkpoint's, in its dtype; no collective may move the data (only small ones), and a
    rank may read only the files whose slices overlap its own (and one more, for metadata).
    Then step 11 is saved on 4 ranks with the last rank dying halfway through its first
    torch.save: a load on 2 ranks must still return step 10, the newest complete checkpoint.

    Example::

        >>> exercise.resharded_checkpoint(my_save, my_load)
        [pass] challenge: a sharded checkpoint, loaded on another number of ranks: ...
    """
    import contextlib
    import tempfile

    import torch

    first = None
    with contextlib.ExitStack() as folders:
        for saved_on, loaded_on, numel, dtype in _RS_CASES:
            where = f"saved on {saved_on} ranks, loaded on {loaded_on} ({numel} {dtype} numbers)"
            # kept until the end: the crash phase saves step 11 into the first case's folder
            folder = folders.enter_context(tempfile.TemporaryDirectory(prefix="labkit-reshard-"))
            first = first or folder
            saves = on_ranks(_rs_save_worker, save_fn, folder, numel, dtype, nproc=saved_on,
                             timeout=_RS_TIMEOUT)
            for rank, per_step in enumerate(saves):
                big = [(op, b) for calls in per_step for op, b in calls if b > _RS_SMALL]
                if big:
                    raise NotYet(f"{where}: saving, rank {rank} sent {big[0][0]} of "
                                 f"{big[0][1]} bytes", "each rank writes its own slice to its "
                                 "own file: gathering the data on one rank is what a sharded "
                                 "checkpoint avoids (the time and memory of the whole model on "
                                 "one rank); " + _RS_PLAN)
            loads = on_ranks(_rs_load_worker, load_fn, folder, numel, nproc=loaded_on,
                             timeout=_RS_TIMEOUT)
            new, old = _rs_ranges(numel, loaded_on), _rs_ranges(numel, saved_on)
            flat = _rs_flat(numel, dtype, _RS_STEPS[-1])
            for rank, got in enumerate(loads):
                at = f"{where}, rank {rank}"
                if got["shard"] is None:
                    raise NotYet(f"{at}: load returned {got['returned']}, not (shard, step)",
                                 "return (this rank's slice of the flat tensor, the step saved)")
                lo, hi = new[rank]
                want = flat[lo:hi]
                if got["step"] != _RS_STEPS[-1]:
                    hint = ("the newest checkpoint is the largest step as a number: step 10 is "
                            "newer than step 9, though '10' sorts before '9' as text")
                    raise NotYet(f"{at}: loaded step {got['step']}, the newest is {_RS_STEPS[-1]}",
                                 hint)
                shard = got["shard"]
                if str(shard.dtype) != f"torch.{dtype}":
                    raise NotYet(f"{at}: the slice is {shard.dtype}, it was saved as {dtype}",
                                 "keep the saved tensors' dtype: torch.cat of the loaded pieces "
                                 "does, torch.empty(n) is float32")
                if tuple(shard.shape) != tuple(want.shape) or not torch.equal(shard, want):
                    own = _rs_flat(numel, dtype, _RS_STEPS[-1]).tensor_split(saved_on)
                    kept = rank < saved_on and shard.shape == own[rank].shape and torch.equal(
                        shard, own[rank])
                    raise NotYet(f"{at}: loaded {shard.tolist()}, want elements {lo} to {hi - 1}: "
                                 f"{want.tolist()}",
                                 ("that is rank r's old slice, as if the number of ranks had not "
                                  "changed: cut the new ranges with tensor_split(new world) and "
                                  "assemble each from the old slices; " if kept else "")
                                 + _RS_PLAN)
                big = [(op, b) for op, b in got["calls"] if b > _RS_SMALL]
                if big:
                    raise NotYet(f"{at}: loading, it sent {big[0][0]} of {big[0][1]} bytes",
                                 "each rank reads what it needs from the files itself; no data "
                                 "needs to travel between ranks. " + _RS_PLAN)
                overlap = sum(1 for a, b in old if b > a and a < hi and lo < b)
                if len(got["reads"]) > overlap + 1:
                    raise NotYet(f"{at}: read {len(got['reads'])} files; only {overlap} old "
                                 f"slice(s) overlap its range [{lo}, {hi})",
                                 "read only the files whose slices overlap your range (plus at "
                                 "most one small file of metadata): a rank that reads every "
                                 "slice holds the whole model for a moment, which is what "
                                 "sharding avoids; " + _RS_PLAN)
        _rs_judge_crash(save_fn, load_fn, first)
    return ("saved on 4 and loaded on 2, saved on 2 and loaded on 4 (uneven slices, an empty "
            "one, float64 and float32): every rank got its new slice of the newest step, no "
            "data over the wire, only the overlapping files read; a save cut short on one "
            "rank left the step before it loadable")


_RS_CRASH_HINT = ("a checkpoint is complete only once every rank's file is whole: write each "
                  "file to a temporary name and os.replace it onto its real name (a rename is "
                  "atomic), and have load skip steps with a file missing and names it does "
                  "not know (the leftover temporary files)")


def _rs_judge_crash(save_fn, load_fn, folder: str) -> None:
    """In ``folder``, where the first case saved steps 9 and 10 on 4 ranks, save step 11 with
    the last rank dying mid-write; the load on 2 ranks must find step 10, the newest
    checkpoint that every rank finished."""
    import torch

    saved_on, loaded_on, numel, dtype = _RS_CASES[0]
    newest, cut = _RS_STEPS[-1], _RS_STEPS[-1] + 1
    where = (f"saved on {saved_on} ranks, then step {cut} cut short while rank {saved_on - 1} "
             f"wrote its file; loaded on {loaded_on}")
    try:
        died = on_ranks(_rs_crash_worker, save_fn, folder, numel, dtype, cut,
                        nproc=saved_on, timeout=10.0)  # a write takes milliseconds
    except NotYet as wrong:
        if not wrong.stuck:
            raise
        died = None  # the others waited in a collective for the dead rank, as in a real job
    if died is not None and not any(died):
        return  # the save never called torch.save: nothing this simulation can cut short
    try:
        loads = on_ranks(_rs_load_worker, load_fn, folder, numel, nproc=loaded_on,
                         timeout=_RS_TIMEOUT)
    except NotYet as wrong:
        raise NotYet(f"{where}: load failed ({wrong.detail.splitlines()[0]:.160})",
                     _RS_CRASH_HINT) from None
    want = _rs_flat(numel, dtype, newest)
    for rank, (got, (lo, hi)) in enumerate(zip(loads, _rs_ranges(numel, loaded_on),
                                               strict=True)):
        if got["step"] != newest or got["shard"] is None or not torch.equal(got["shard"],
                                                                           want[lo:hi]):
            raise NotYet(f"{where}: rank {rank} loaded step {got['step']}; the newest complete "
                         f"checkpoint is step {newest}", _RS_CRASH_HINT)
