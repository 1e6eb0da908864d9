"""labkit.slurm: the sbatch script's text, every bad input, the CLI, and a real Slurm job.

The end-to-end test starts munged, slurmctld and slurmd (Debian's slurm-wlm and munge, no
systemd) in a temp folder, submits a generated script with sbatch and reads the job's output.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from labkit import cli
from labkit.slurm import first_node, sbatch_script, write_sbatch


@pytest.fixture
def train(tmp_path) -> Path:
    script = tmp_path / "train.py"
    script.write_text("print('hello')\n")
    return script


def sbatch_lines(text: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in text.splitlines()
            if line.startswith("#SBATCH ")]


# ---- the node list ------------------------------------------------------------------------------


@pytest.mark.parametrize("nodelist,first", [
    ("gpu[07-08,12],cpu01", "gpu07"), ("dgx[012-013]", "dgx012"), ("node3", "node3"),
    ("a1,b2", "a1"), ("rack[2-3]-node[01-04]", "rack2-node01"), ("n[5]", "n5"),
    ("  localhost ", "localhost")])
def test_first_node_expands_the_first_host_of_a_compressed_list(nodelist, first):
    assert first_node(nodelist) == first


@pytest.mark.parametrize("bad", ["", "  ", None, 3])
def test_first_node_refuses_what_is_not_a_node_list(bad):
    with pytest.raises(ValueError, match="read it from SLURM_JOB_NODELIST"):
        first_node(bad)


# ---- the script's text -------------------------------------------------------------------------


def test_defaults_one_cpu_node_one_agent_one_worker(train):
    text = sbatch_script(train)
    assert text.startswith("#!/bin/bash\n")
    assert sbatch_lines(text) == ["--job-name=train", "--nodes=1", "--ntasks-per-node=1",
                                  "--time=01:00:00", "--output=%x-%j.out"]
    assert "srun --ntasks-per-node=1 --kill-on-bad-exit=1 \\\n" in text
    assert f"{shlex.quote(sys.executable)} -m torch.distributed.run" in text
    assert '--nnodes="$SLURM_JOB_NUM_NODES" --nproc-per-node=1' in text
    assert '--rdzv-endpoint="$head_node:$rdzv_port" --rdzv-id="$SLURM_JOB_ID"' in text
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in text
    assert text.rstrip().endswith(str(train))  # absolute: the job may start in another folder


def test_every_option_lands_where_slurm_and_torchrun_read_it(train):
    text = sbatch_script(train, "--epochs", "3", nodes=4, gpus_per_node=8, cpus_per_task=32,
                         time="1-12:00:00", partition="gpu", job_name="vgg", output="logs/%j.txt",
                         port=29400, python="python", extra_sbatch=("--account=proj", "--mem=0"))
    assert sbatch_lines(text) == ["--job-name=vgg", "--nodes=4", "--ntasks-per-node=1",
                                  "--gpus-per-node=8", "--cpus-per-task=32", "--time=1-12:00:00",
                                  "--partition=gpu", "--output=logs/%j.txt", "--account=proj",
                                  "--mem=0"]
    assert "srun --ntasks-per-node=1 --kill-on-bad-exit=1 --cpus-per-task=32" in text
    assert "--nproc-per-node=8" in text  # defaults to one worker per GPU
    assert "rdzv_port=29400\n" in text and "SLURM_JOB_ID % 20000" not in text
    assert "    python -m torch.distributed.run \\\n" in text
    assert text.rstrip().endswith(f"{train} --epochs 3")


def test_fewer_workers_than_gpus_and_arguments_are_shell_quoted(train):
    text = sbatch_script(train, "a b", "$HOME", "it's", gpus_per_node=4, nproc_per_node=2)
    assert "--nproc-per-node=2" in text
    assert text.rstrip().endswith(f"{train} 'a b' '$HOME' 'it'\"'\"'s'")


def fake_bin(folder: Path) -> Path:
    """scontrol and srun stand-ins: two nodes, and srun records the command it was given."""
    folder.mkdir()
    (folder / "scontrol").write_text("#!/bin/sh\nprintf 'node-a\\nnode-b\\n'\n")
    (folder / "srun").write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done > "$SRUN_ARGS"\n')
    for f in folder.iterdir():
        f.chmod(0o755)
    return folder


def test_the_script_runs_one_agent_per_node_meeting_at_the_first_node(tmp_path, train):
    """Run the generated script with bash, Slurm faked; parse srun's arguments as torchrun does."""
    from torch.distributed.run import get_args_parser

    job = write_sbatch(tmp_path / "job.sbatch", train, "--lr", "0.1", nodes=2, nproc_per_node=3)
    bin_dir = fake_bin(tmp_path / "bin")
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SRUN_ARGS": str(tmp_path / "srun.args"),
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "node-[a-b]"}
    out = subprocess.run(["bash", str(job)], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    port = 20000 + 4242 % 20000
    assert f"[labkit] job 4242: 2 node(s) x 3 worker(s), rendezvous at node-a:{port}" in out.stdout
    argv = (tmp_path / "srun.args").read_text().splitlines()
    assert argv[:3] == ["--ntasks-per-node=1", "--kill-on-bad-exit=1", sys.executable]
    assert argv[3:5] == ["-m", "torch.distributed.run"]
    args = get_args_parser().parse_args(argv[5:])  # every flag spelled as torchrun knows it
    assert (args.nnodes, args.nproc_per_node, args.rdzv_backend) == ("2", "3", "c10d")
    assert (args.rdzv_endpoint, args.rdzv_id) == (f"node-a:{port}", "4242")
    assert (args.training_script, args.training_script_args) == (str(train), ["--lr", "0.1"])


def test_write_sbatch_writes_the_text_and_returns_the_path(tmp_path, train):
    job = write_sbatch(tmp_path / "job.sbatch", train, nodes=2)
    assert job == tmp_path / "job.sbatch"
    assert job.read_text() == sbatch_script(train, nodes=2)


def test_writing_a_script_imports_no_framework(train):
    """The CLI runs on login nodes, where importing torch is slow or impossible."""
    probe = (f"from labkit.slurm import sbatch_script; sbatch_script({str(train)!r}); import sys; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'tensorflow')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ---- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("option", "value"), [
    ("nodes", 0), ("nodes", -1), ("nodes", 1.5), ("nodes", True), ("nodes", "2"),
    ("gpus_per_node", -1), ("nproc_per_node", 0), ("cpus_per_task", 0),
])
def test_counts_below_their_minimum_or_not_whole(train, option, value):
    flag = "--" + option.replace("_", "-")
    with pytest.raises(ValueError,
                       match=rf"{option} \({flag}\) must be a whole number >= \d.*pass"):
        sbatch_script(train, **{option: value})


def test_more_workers_than_gpus(train):
    with pytest.raises(ValueError, match="nproc_per_node=4 is more workers than the 2 GPUs.*<= 2"):
        sbatch_script(train, gpus_per_node=2, nproc_per_node=4)


@pytest.mark.parametrize("port", [80, 70000, True, "29500"])
def test_bad_port(train, port):
    with pytest.raises(ValueError,
                       match="port must be a whole number from 1024 to 65535.*leave it out"):
        sbatch_script(train, port=port)


@pytest.mark.parametrize("limit", ["30", "90:00", "02:00:00", "1-12", "1-12:30", "2-00:00:00",
                                   "infinite", "UNLIMITED"])
def test_slurm_time_formats_are_accepted(train, limit):
    assert f"#SBATCH --time={limit}\n" in sbatch_script(train, time=limit)


@pytest.mark.parametrize("limit", ["1h", "", "1:2:3:4", "-5", "1-", "2 hours", "1.5", None, 30])
def test_bad_time_says_which_formats_work(train, limit):
    with pytest.raises(ValueError, match="not a Slurm time limit: use minutes.*HH:MM:SS"):
        sbatch_script(train, time=limit)


def test_missing_script_says_to_write_it_first(tmp_path):
    with pytest.raises(FileNotFoundError, match="'.*nope.py' does not exist: write it first"):
        sbatch_script(tmp_path / "nope.py")


def test_a_folder_is_not_a_script(tmp_path):
    with pytest.raises(FileNotFoundError, match="is a folder: write it first"):
        sbatch_script(tmp_path)


@pytest.mark.parametrize("options", [
    {"job_name": "my job"}, {"partition": "gpu\n#SBATCH --nodes=99"}, {"output": "my log.out"},
    {"extra_sbatch": ["account=proj"]}, {"extra_sbatch": ["--comment=two words"]},
    {"extra_sbatch": [None]},
])
def test_sbatch_options_must_be_single_flags(train, options):
    with pytest.raises(ValueError, match="must be one flag without spaces.*--account=myproj"):
        sbatch_script(train, **options)


def test_write_sbatch_into_a_missing_folder(tmp_path, train):
    with pytest.raises(FileNotFoundError, match="does not exist: create it first"):
        write_sbatch(tmp_path / "no" / "job.sbatch", train)


# ---- the command line --------------------------------------------------------------------------


def test_cli_writes_the_job_and_says_how_to_submit_it(tmp_path, train, capsys):
    job = tmp_path / "job.sbatch"
    assert cli.main(["slurm", "--nodes", "2", "--cpus-per-task", "4", "--sbatch=--account=p",
                     "-o", str(job), str(train), "--", "--epochs", "3"]) == 0
    out = capsys.readouterr().out
    assert f"sbatch {job}" in out and "squeue" in out
    assert job.read_text() == sbatch_script(train, "--epochs", "3", nodes=2, cpus_per_task=4,
                                            extra_sbatch=["--account=p"])


def test_cli_options_may_follow_plain_script_arguments(tmp_path, train, capsys):
    job = tmp_path / "job.sbatch"
    assert cli.main(["slurm", str(train), "data", "--gpus-per-node", "2", "--time", "30",
                     "--partition", "gpu", "--job-name", "j", "--job-output", "o-%j.log",
                     "--port", "29400", "--python", "python", "-o", str(job)]) == 0
    assert job.read_text() == sbatch_script(train, "data", gpus_per_node=2, time="30",
                                            partition="gpu", job_name="j", output="o-%j.log",
                                            port=29400, python="python")
    assert "o-%j.log" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [
    (["--nodes", "0"], "nodes (--nodes) must be a whole number >= 1"),
    (["--nproc-per-node", "0"], "nproc_per_node (--nproc-per-node) must be"),
    (["--time", "1h"], "not a Slurm time limit"),
    (["--sbatch", "account=p"], "must be one flag without spaces"),
])
def test_cli_bad_input_exits_1_with_a_message(tmp_path, train, capsys, argv, message):
    job = tmp_path / "job.sbatch"
    assert cli.main(["slurm", *argv, "-o", str(job), str(train)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("labkit slurm: ") and message in err
    assert not job.exists()


def test_cli_missing_script_exits_1(tmp_path, capsys):
    assert cli.main(["slurm", "-o", str(tmp_path / "job.sbatch"), str(tmp_path / "nope.py")]) == 1
    assert "does not exist: write it first" in capsys.readouterr().err


# ---- a real single-node Slurm ------------------------------------------------------------------

_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
_BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol", "sinfo",
             "scancel")
_DAEMONS = (("slurmd", "slurmd.pid"), ("slurmctld", "slurmctld.pid"),
            ("munged", "munge/munged.pid"))
_DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE", "PREEMPTED"}


@dataclass
class Cluster:
    folder: Path
    env: dict

    def run(self, *command: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(command, env=self.env, capture_output=True, text=True,
                              timeout=timeout, cwd=self.folder)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted(self.folder.glob("*.log")))


def _free_ports(n: int) -> list[int]:
    """Distinct free TCP ports, all held open together while chosen."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _slurm_conf(folder: Path, host: str) -> str:
    """A one-node cluster: no cgroups, no accounting, everything inside ``folder``."""
    ctld_port, slurmd_port = _free_ports(2)
    cpus = len(os.sched_getaffinity(0))  # what `nproc` says
    return textwrap.dedent(f"""\
        ClusterName=labkit
        SlurmctldHost={host}(127.0.0.1)
        SlurmUser=root
        SlurmctldPort={ctld_port}
        SlurmdPort={slurmd_port}
        AuthType=auth/munge
        CredType=cred/munge
        AuthInfo=socket={folder}/munge/munge.socket
        StateSaveLocation={folder}/state
        SlurmdSpoolDir={folder}/spool
        SlurmctldPidFile={folder}/slurmctld.pid
        SlurmdPidFile={folder}/slurmd.pid
        SlurmctldLogFile={folder}/slurmctld.log
        SlurmdLogFile={folder}/slurmd.log
        ProctrackType=proctrack/linuxproc
        TaskPlugin=task/none
        SelectType=select/cons_tres
        SelectTypeParameters=CR_Core
        SlurmdParameters=config_overrides
        JobAcctGatherType=jobacct_gather/none
        AccountingStorageType=accounting_storage/none
        JobCompType=jobcomp/none
        MpiDefault=none
        MailProg=/bin/true
        ReturnToService=2
        NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=256 State=UNKNOWN
        PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
        """)


def _start(cluster: Cluster, host: str) -> None:
    """munged with its own key and socket, then slurmctld and slurmd; wait for the node to idle."""
    folder = cluster.folder
    try:
        socket.gethostbyname(host)
    except OSError as exc:
        raise RuntimeError(f"this machine's name {host!r} does not resolve ({exc}); the job's "
                           f"rendezvous uses the node name: add it to /etc/hosts") from exc
    for sub in ("munge", "state", "spool", "tmp"):
        (folder / sub).mkdir(mode=0o755)
    key = folder / "munge" / "munge.key"
    key.write_bytes(os.urandom(128))  # what `dd if=/dev/urandom bs=1 count=128` makes
    key.chmod(stat.S_IRUSR)
    (folder / "slurm.conf").write_text(_slurm_conf(folder, host))
    m = folder / "munge"
    starts = [
        ["munged", f"--key-file={key}", f"--socket={m}/munge.socket", f"--pid-file={m}/munged.pid",
         f"--log-file={m}/munged.log", f"--seed-file={m}/munged.seed"],
        ["slurmctld", "-f", str(folder / "slurm.conf")],
        ["slurmd", "-f", str(folder / "slurm.conf")],
    ]
    for command in starts:
        # Daemons fork and keep no pipe of ours; their early errors go to a file.
        with open(folder / f"{command[0]}.err", "w") as err:
            rc = subprocess.run([shutil.which(command[0], path=_PATH), *command[1:]],
                                env=cluster.env, stdin=subprocess.DEVNULL, stdout=err,
                                stderr=err, timeout=30).returncode
        if rc != 0:
            raise RuntimeError(f"{command[0]} exited {rc}: "
                               f"{(folder / f'{command[0]}.err').read_text()}\n{cluster.logs()}")
    deadline = time.monotonic() + 30
    while (state := cluster.run("sinfo", "-h", "-o", "%T").stdout.strip()) != "idle":
        if time.monotonic() > deadline:
            raise RuntimeError(f"the node is {state!r}, not idle, after 30 s\n{cluster.logs()}")
        time.sleep(0.2)


def _ours(conf: Path) -> list[psutil.Process]:
    """Every live process of this cluster: daemons, job steps and workers all carry SLURM_CONF."""
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if (p.status() != psutil.STATUS_ZOMBIE
                    and p.environ().get("SLURM_CONF") == str(conf) and p.pid != os.getpid()):
                found.append(p)
        except psutil.Error:
            pass
    return found


def _daemon(pid_file: Path, name: str) -> psutil.Process | None:
    """The daemon named in ``pid_file``, if it is still that daemon."""
    try:
        proc = psutil.Process(int(pid_file.read_text().split()[0]))
        return proc if proc.name() == name else None
    except (FileNotFoundError, ValueError, IndexError, psutil.Error):
        return None


def _stop(cluster: Cluster) -> None:
    """Cancel jobs, stop each daemon by its pid file, then kill any process of ours still left."""
    try:
        jobs = cluster.run("squeue", "-h", "-o", "%i", timeout=10).stdout.split()
        if jobs:
            cluster.run("scancel", *jobs, timeout=10)
    except (OSError, subprocess.SubprocessError):
        pass  # no controller to ask: whatever ran is found by _ours below
    # slurmd and slurmctld stop together (each takes a second or two); munged last, as they
    # need it to sign their last messages.
    for group in (_DAEMONS[:2], _DAEMONS[2:]):
        procs = [p for p in (_daemon(cluster.folder / pid_file, name)
                             for name, pid_file in group) if p]
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in psutil.wait_procs(procs, timeout=15)[1]:
            p.kill()
    left = _ours(cluster.folder / "slurm.conf")
    for p in left:
        p.kill()
    psutil.wait_procs(left, timeout=10)


def _cannot_run(path: str) -> str | None:
    """Why this machine cannot start the one-node Slurm, or None."""
    missing = [b for b in _BINARIES if shutil.which(b, path=path) is None]
    if missing:
        return (f"needs Debian's slurm-wlm and munge packages (missing {', '.join(missing)}): "
                f"apt-get install slurm-wlm munge (.ci/run installs them)")
    if os.geteuid() != 0:
        return "the one-node Slurm runs its daemons as root (SlurmUser=root); CI runs as root"
    return None


def test_without_slurm_the_skip_names_the_packages(tmp_path):
    reason = _cannot_run(str(tmp_path))
    assert "slurm-wlm and munge" in reason and "munged" in reason and "sbatch" in reason


@pytest.fixture(scope="module")
def slurm_cluster():
    """A real one-node Slurm in a temp folder; afterwards no process, mount or file is left."""
    if reason := _cannot_run(_PATH):
        pytest.skip(reason)
    host = socket.gethostname().split(".")[0]
    mounts = Path("/proc/self/mounts").read_text()
    # Short path: the munge socket's path must fit a unix socket address (108 bytes).
    folder = Path(tempfile.mkdtemp(prefix="labkit-slurm-", dir="/tmp"))
    folder.chmod(0o755)  # munged refuses a socket folder that others cannot search
    env = {**os.environ, "SLURM_CONF": str(folder / "slurm.conf"), "TMPDIR": str(folder / "tmp"),
           "PATH": _PATH}
    for stale in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SRUN_"))
                  and k != "SLURM_CONF"]:
        del env[stale]  # a test run inside a Slurm job must not leak that job into this cluster
    cluster = Cluster(folder, env)
    try:
        _start(cluster, host)
        yield cluster
    finally:
        _stop(cluster)
        shutil.rmtree(folder, ignore_errors=True)
    assert not _ours(folder / "slurm.conf"), "a process of the test's Slurm outlived it"
    assert Path("/proc/self/mounts").read_text() == mounts
    assert not folder.exists()


TRAIN = """\
import os, sys
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

steps = int(sys.argv[sys.argv.index("--steps") + 1])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)  # the same initial weights on every rank
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
g = torch.Generator().manual_seed(100 + rank)  # each rank its own data shard
x = torch.randn(64, 4, generator=g)
y = x @ torch.tensor([[1.0], [-2.0], [3.0], [0.5]])
losses = []
for _ in range(steps):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    losses.append(loss.item())
weights = torch.stack([p.detach().sum() for p in model.parameters()]).sum()
total = weights.clone()
dist.all_reduce(total)
# One write per line: both ranks share the job's output file, and an unbuffered print writes
# the text and its newline separately, so two ranks' lines could run together.
os.write(1, (f"rank={rank} world={world} job={os.environ['SLURM_JOB_ID']} steps={steps} "
             f"first_loss={losses[0]:.4f} last_loss={losses[-1]:.4f} "
             f"weights={weights.item():.6f} allreduced={total.item():.6f}\\n").encode())
dist.destroy_process_group()
# torch 2.14's gloo threads may still be releasing the last collective's tensors when the
# interpreter shuts down; releasing one takes the GIL, which then ends the thread, and the rank
# aborts ("terminate called without an active exception") after its work is done: about one
# run in ten here (gdb: ProcessGroupGloo::runLoop, ~AsyncWork, take_gil, pthread_exit). The
# line above went out with os.write, so the rank leaves without the interpreter's shutdown.
os._exit(0)
"""


def _wait_for(cluster: Cluster, job_id: str, within: float) -> dict:
    """Poll scontrol (sbatch --wait would add up to 10 s) until the job ends; its fields."""
    deadline = time.monotonic() + within
    while True:
        line = cluster.run("scontrol", "-o", "show", "job", job_id).stdout
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        if fields.get("JobState") in _DONE:
            return fields
        if time.monotonic() > deadline:
            cluster.run("scancel", job_id)
            raise AssertionError(f"job {job_id} still {fields.get('JobState')} after {within} s\n"
                                 f"{cluster.logs()}")
        time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_real_slurm_job_trains_and_all_reduces_on_two_ranks(slurm_cluster):
    folder = slurm_cluster.folder
    (folder / "train.py").write_text(TRAIN)
    job = write_sbatch(folder / "job.sbatch", folder / "train.py", "--steps", "5", nodes=1,
                       nproc_per_node=2, time="5", job_name="labkit-e2e",
                       output=str(folder / "%x-%j.out"))
    t0 = time.monotonic()
    submitted = slurm_cluster.run("sbatch", "--parsable", str(job))
    assert submitted.returncode == 0, submitted.stderr + slurm_cluster.logs()
    job_id = submitted.stdout.strip().split(";")[0]
    fields = _wait_for(slurm_cluster, job_id, within=240)
    output = (folder / f"labkit-e2e-{job_id}.out").read_text()
    print(f"--- job {job_id} output ({time.monotonic() - t0:.1f} s from sbatch to done):\n{output}")
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), \
        output + slurm_cluster.logs()
    assert f"[labkit] job {job_id}: 1 node(s) x 2 worker(s), rendezvous at " in output
    ranks = {int(m["rank"]): m for m in (
        dict(re.findall(r"(\w+)=(\S+)", line)) for line in output.splitlines()
        if line.startswith("rank="))}
    assert sorted(ranks) == [0, 1], output
    for r in ranks.values():
        assert (r["world"], r["job"], r["steps"]) == ("2", job_id, "5")
        assert float(r["last_loss"]) < float(r["first_loss"])  # it trained
    # DDP keeps the replicas equal, so the all-reduced sum is twice each rank's own.
    assert ranks[0]["allreduced"] == ranks[1]["allreduced"]
    assert ranks[0]["weights"] == ranks[1]["weights"]
    assert float(ranks[0]["allreduced"]) == pytest.approx(2 * float(ranks[0]["weights"]), abs=1e-5)
