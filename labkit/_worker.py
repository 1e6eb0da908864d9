"""The worker shim: what torchrun starts on every rank for :func:`labkit.launch`.

``python -m labkit._worker RUN_DIR`` reads the job from ``RUN_DIR/job.pkl``, prepares the rank
(output prefix, stack dumps on demand, controller watchdog, GPU binding, process group), runs
it, and leaves the outcome in ``RUN_DIR``: ``result-<rank>.pkl`` or ``error-<rank>.pkl``.
Nothing here imports torch at module level: TensorFlow workers must stay torch-free.
"""

from __future__ import annotations

import faulthandler
import json
import os
import shutil
import signal
import sys
import threading
import time
import traceback

STACK_SIGNAL = signal.SIGUSR1


def _env_int(name: str, default: int = 0) -> int:
    return int(os.environ.get(name, default))


def _prefix_output(rank: int) -> threading.Thread:
    """Route fds 1 and 2 through a pipe so every line, C++ logs included, starts with the rank."""
    read_fd, write_fd = os.pipe()
    upstream = os.dup(1)
    os.dup2(write_fd, 1)
    os.dup2(write_fd, 2)
    os.close(write_fd)
    prefix = f"[rank{rank}] ".encode()

    def pump():
        pending = b""
        while True:
            chunk = os.read(read_fd, 65536)
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            if lines:
                # One write per batch keeps lines whole when ranks interleave.
                os.write(upstream, b"".join(prefix + line + b"\n" for line in lines))
        if pending:
            os.write(upstream, prefix + pending + b"\n")
        os.close(read_fd)

    thread = threading.Thread(target=pump, name="labkit-output", daemon=True)
    thread.start()
    thread.upstream = upstream  # type: ignore[attr-defined]
    return thread


def _close_output(thread: threading.Thread) -> None:
    """Flush Python's streams and let the pump drain before the process exits."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os.dup2(thread.upstream, 1)  # type: ignore[attr-defined]
    os.dup2(thread.upstream, 2)  # type: ignore[attr-defined]
    thread.join(timeout=2.0)


def process_start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except OSError:
        return None


def _watch_controller(pid: int, start: str, agent_pid: int, run_dir: str) -> None:
    """Die with the notebook kernel: if the controller is gone, stop the agent and this rank.

    The dead controller cannot remove the run folder any more, so the first rank to notice does.
    """
    while True:
        time.sleep(0.5)
        alive = process_start_time(pid) == start if start else _pid_alive(pid)
        if not alive:
            shutil.rmtree(run_dir, ignore_errors=True)
            try:
                os.kill(agent_pid, signal.SIGTERM)
            except OSError:
                pass
            os.kill(os.getpid(), signal.SIGKILL)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _write(run_dir: str, name: str, payload: bytes) -> None:
    tmp = os.path.join(run_dir, f".{name}.tmp")
    with open(tmp, "wb") as f:
        f.write(payload)
    os.replace(tmp, os.path.join(run_dir, name))


def _error_payload(exc: BaseException, rank: int, what: str = "") -> bytes:
    import cloudpickle

    return cloudpickle.dumps(
        {
            "rank": rank,
            "type": type(exc).__name__,
            "message": what or str(exc),
            "traceback": _user_traceback(exc),
            "time": time.time(),
        }
    )


def _user_traceback(exc: BaseException) -> str:
    """The traceback without this shim's own frames: they are the same in every run."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _to_cpu(value):
    """Move tensors (also inside lists, tuples and dicts) to the CPU so the kernel can load them."""
    torch = sys.modules.get("torch")
    if torch is None:
        return value
    if isinstance(value, torch.Tensor | torch.nn.Module):
        return value.detach().cpu() if isinstance(value, torch.Tensor) else value.cpu()
    if isinstance(value, dict):
        return type(value)((k, _to_cpu(v)) for k, v in value.items())
    if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _bind_device(job: dict, local_rank: int):
    """Give each local rank its own GPU; TensorFlow ranks see only theirs (TF grabs all by default)."""
    gpus = job["gpus"]
    if not gpus:
        return None
    gpu = local_rank % gpus
    if job["framework"] == "tensorflow":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(gpus)]
        os.environ["CUDA_VISIBLE_DEVICES"] = ids[gpu]
        return None
    import torch

    torch.cuda.set_device(gpu)
    return torch.device("cuda", gpu)


def _init_torch(job: dict, device):
    import torch.distributed as dist

    kwargs = {}
    if job["backend"] == "nccl" and device is not None:
        kwargs["device_id"] = device  # eager NCCL init: a bad setup fails here, not mid-step
    # torchrun keeps one store for all attempts of a run (launch(max_restarts=...)), and a
    # dead attempt's keys stay in it: the new ranks could read the old ranks' addresses and
    # fail to connect. A prefix per attempt gives each attempt a clean namespace.
    store, rank, world_size = next(dist.rendezvous("env://"))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(job["backend"], store=dist.PrefixStore(f"labkit/attempt-{attempt}", store),
                            rank=rank, world_size=world_size, **kwargs)
    return dist


def _tf_config(job: dict, rank: int) -> None:
    workers = [f"127.0.0.1:{port}" for port in job["tf_ports"]]
    os.environ["TF_CONFIG"] = json.dumps(
        {"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}}
    )


def _wait_for_peers(dist, world_size: int) -> None:
    """Finished ranks wait (off the collectives' path) until every rank is done.

    A rank that returns early must not tear down the group under ranks still in a
    collective: they would fail with a connection error instead of showing the real hang.
    """
    store = dist.distributed_c10d._get_default_store()
    store.add("labkit/done", 1)
    while int(store.add("labkit/done", 0)) < world_size:
        time.sleep(0.05)


def _run(job: dict, rank: int):
    mode = job["mode"]
    if mode == "script":
        import runpy

        sys.argv = [job["script"], *job["script_args"]]
        try:
            runpy.run_path(job["script"], run_name="__main__")
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise
        return None
    fn, args, kwargs = job["payload"]
    return fn(*args, **kwargs)


def main(run_dir: str) -> int:
    import cloudpickle

    rank = _env_int("RANK")
    local_rank = _env_int("LOCAL_RANK")
    world_size = _env_int("WORLD_SIZE", 1)
    pump = _prefix_output(rank)
    with open(os.path.join(run_dir, f"stack-{rank}.txt"), "w") as stack_file:
        faulthandler.register(STACK_SIGNAL, file=stack_file, all_threads=True)
        faulthandler.enable(file=stack_file)  # a native crash leaves its stack too
        _write(run_dir, f"pid-{rank}", json.dumps({"pid": os.getpid(), "local_rank": local_rank}).encode())
        threading.Thread(
            target=_watch_controller,
            args=(_env_int("LABKIT_CONTROLLER_PID"), os.environ.get("LABKIT_CONTROLLER_START", ""), os.getppid(),
                  run_dir),
            name="labkit-watchdog",
            daemon=True,
        ).start()
        code = _main_body(run_dir, rank, local_rank, world_size, cloudpickle)
        _close_output(pump)
    return code


def _load_job(run_dir: str, cloudpickle) -> dict:
    """Install the controller's sys.path and source lines (for tracebacks), then unpickle the job."""
    import linecache

    with open(os.path.join(run_dir, "job.pkl"), "rb") as f:
        outer = cloudpickle.load(f)
    # Functions from the notebook's own modules are pickled by reference: make them importable.
    sys.path.extend(p for p in outer["sys_path"] if p not in sys.path)
    for filename, lines in outer["sources"].items():
        linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
    return cloudpickle.loads(outer["job"])


def _main_body(run_dir, rank, local_rank, world_size, cloudpickle) -> int:
    dist = None
    try:
        job = _load_job(run_dir, cloudpickle)
        device = _bind_device(job, local_rank)
        if job["framework"] == "tensorflow":
            _tf_config(job, rank)
        elif job["mode"] != "script":
            dist = _init_torch(job, device)
        value = _to_cpu(_run(job, rank))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the controller
        _write(run_dir, f"error-{rank}.pkl", _error_payload(exc, rank))
        return 1
    try:
        payload = cloudpickle.dumps(value)
    except Exception as exc:
        what = (
            f"the return value of rank {rank} ({type(value).__name__}) cannot be pickled: {exc}. "
            "Return plain data (numbers, lists, dicts, tensors) instead"
        )
        _write(run_dir, f"error-{rank}.pkl", _error_payload(exc, rank, what))
        return 1
    _write(run_dir, f"result-{rank}.pkl", payload)
    if dist is not None and dist.is_initialized():
        _wait_for_peers(dist, world_size)
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
