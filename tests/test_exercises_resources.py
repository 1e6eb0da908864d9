"""Notebook 07's graders: the reference solutions pass, and each usual mistake gets its hint."""

from __future__ import annotations

import math
import os
import sys

import cloudpickle
import pytest
import torch

from labkit import elastic, exercises, resources, slurm
from labkit.exercises import resources as exercise

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # wrong answers travel to ranks


@pytest.fixture(scope="module")
def solved():
    """The reference solutions, run as the solution notebook runs them."""
    names = {"resources": resources, "slurm": slurm, "elastic": elastic, "torch": torch}
    for block in exercises.solution_blocks("07_resources_multinode").values():
        exec(block, names)
    return names


def said(verdict, text):
    return not verdict and text in verdict.hint + verdict.detail


# ---- memory_largest_batch -----------------------------------------------------------------------


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def test_memory_largest_batch_the_solution_passes_and_agrees_with_the_estimator(solved):
    verdict = exercise.largest_batch_estimate(solved["my_largest_batch"], _mlp(), torch.zeros(6),
                                              64 * 1024)
    assert verdict and "as the estimator's search" in verdict.detail


def _per_param(per_param, with_fixed=True):
    def fn(n_params, fixed, per_sample, budget):
        return max(0, (budget - per_param * n_params - (fixed if with_fixed else 0))
                   // per_sample)
    return fn


def test_memory_largest_batch_wrong_no_optimizer_state():
    assert said(exercise.largest_batch_estimate(_per_param(8)), "forgot the optimizer state")


def test_memory_largest_batch_wrong_no_gradients():
    assert said(exercise.largest_batch_estimate(_per_param(12)), "forgot the gradients")


def test_memory_largest_batch_wrong_parameters_only():
    assert said(exercise.largest_batch_estimate(_per_param(4)), "only the parameters")


def test_memory_largest_batch_wrong_forgot_fixed_activations():
    assert said(exercise.largest_batch_estimate(_per_param(16, with_fixed=False)),
                "fixed activation bytes")


def test_memory_largest_batch_wrong_rounds_up():
    def fn(n_params, fixed, per_sample, budget):
        return max(0, math.ceil((budget - 16 * n_params - fixed) / per_sample))

    assert said(exercise.largest_batch_estimate(fn), "round down")


def test_memory_largest_batch_wrong_not_a_whole_batch():
    def fn(n_params, fixed, per_sample, budget):
        return (budget - 16 * n_params - fixed) / per_sample

    assert said(exercise.largest_batch_estimate(fn), "return an int")


def test_memory_largest_batch_wrong_negative_when_nothing_fits():
    def fn(n_params, fixed, per_sample, budget):
        return (budget - 16 * n_params - fixed) // per_sample

    assert said(exercise.largest_batch_estimate(fn), "return 0, not a negative batch")


def test_memory_largest_batch_wrong_strictly_under_the_budget():
    def fn(n_params, fixed, per_sample, budget):  # a batch whose total equals budget left out
        return max(0, (budget - 16 * n_params - fixed - 1) // per_sample)

    verdict = exercise.largest_batch_estimate(fn)
    assert said(verdict, "at batch 50 the total is the budget to the byte, and it fits")
    assert "<= budget, not < budget" in verdict.hint


def test_memory_largest_batch_a_division_in_floats_passes_too():
    def fn(n_params, fixed, per_sample, budget):
        return max(0, math.floor((budget - fixed - (4 + 4 + 8) * n_params) / per_sample))

    assert exercise.largest_batch_estimate(fn)


# ---- thread_budget ------------------------------------------------------------------------------


def _envs(threads_of):
    def plan(cores, jobs, ranks):
        return [resources.thread_env(threads_of(cores, jobs, ranks)) for _ in range(jobs)]
    return plan


def test_thread_budget_wrong_split_between_jobs_only():
    verdict = exercise.thread_budget(_envs(lambda cores, jobs, ranks: cores // jobs))
    assert said(verdict, "not between the ranks of each job")
    assert "job A: 4 ranks x 16 threads = 64" in verdict.detail  # names the oversubscribed job


def test_thread_budget_wrong_split_between_ranks_only():
    # on 2 jobs of 2 ranks it is the same number as the jobs-only split: 2 jobs of 4 tell them apart
    verdict = exercise.thread_budget(_envs(lambda cores, jobs, ranks: cores // ranks))
    assert said(verdict, "split the cores between the ranks of one job, but every job took all")
    assert "2 jobs of 4 ranks on 32 cores" in verdict.detail


def test_thread_budget_wrong_all_cores_each():
    assert said(exercise.thread_budget(_envs(lambda cores, jobs, ranks: cores)),
                "every rank takes all the cores")


def test_thread_budget_wrong_one_job_greedy():
    def plan(cores, jobs, ranks):
        return [resources.thread_env(cores // (jobs * ranks))] * (jobs - 1) + [
            resources.thread_env(cores)]

    verdict = exercise.thread_budget(plan)
    assert said(verdict, "oversubscribed") and "job B: 4 ranks x 32 threads" in verdict.detail
    assert "job A" not in verdict.detail


def test_thread_budget_wrong_one_thread_each():
    assert said(exercise.thread_budget(_envs(lambda cores, jobs, ranks: 1)), "most cores idle")


def test_thread_budget_wrong_a_core_kept_back():
    verdict = exercise.thread_budget(_envs(lambda cores, jobs, ranks:
                                           max(1, cores // (jobs * ranks) - 1)))
    assert said(verdict, "8 cores idle (job A: 3 per rank, where every rank can have 4)")
    assert "give it all of them" in verdict.hint


def test_thread_budget_wrong_no_thread_when_cores_are_fewer_than_ranks():
    verdict = exercise.thread_budget(_envs(lambda cores, jobs, ranks: cores // (jobs * ranks)))
    assert said(verdict, "2 jobs of 2 ranks on 2 cores it raised ValueError")
    assert "every rank gets at least 1" in verdict.hint


def test_thread_budget_wrong_zero_threads_written_as_a_string():
    def plan(cores, jobs, ranks):
        return [{"OMP_NUM_THREADS": str(cores // (jobs * ranks)),
                 "MKL_NUM_THREADS": str(cores // (jobs * ranks))}] * jobs

    verdict = exercise.thread_budget(plan)
    assert said(verdict, "OMP_NUM_THREADS='0' on 2 cores") and "at least 1" in verdict.hint


def test_thread_budget_wrong_numbers_not_strings():
    def plan(cores, jobs, ranks):
        return [{"OMP_NUM_THREADS": cores // (jobs * ranks)}] * jobs

    assert said(exercise.thread_budget(plan), "environment values are strings")


def test_thread_budget_wrong_no_thread_variable():
    assert said(exercise.thread_budget(lambda cores, jobs, ranks: [{}] * jobs),
                "no OMP_NUM_THREADS")


def test_thread_budget_wrong_one_env_for_all_jobs():
    assert said(exercise.thread_budget(lambda cores, jobs, ranks: resources.thread_env(2)),
                "return a list of")


@pytest.mark.slow
def test_thread_budget_wrong_only_omp_where_mkl_is_set():
    # The arithmetic is right, but MKL_NUM_THREADS=1 around the jobs wins: the started ranks
    # run 1 thread (on a machine with one hardware thread, torch's cap hides it).
    def plan(cores, jobs, ranks):
        return [{"OMP_NUM_THREADS": str(max(1, cores // (jobs * ranks)))}] * jobs

    verdict = exercise.thread_budget(plan)
    if verdict:
        assert os.cpu_count() == 1
    else:
        assert said(verdict, "MKL_NUM_THREADS was 1 around the job")


@pytest.mark.slow
def test_thread_budget_the_solution_passes_on_two_started_jobs(solved):
    verdict = exercise.thread_budget(solved["my_thread_envs"])
    assert verdict and "two 2-rank jobs started" in verdict.detail


@pytest.mark.slow
def test_thread_budget_the_spare_cores_given_to_the_first_job_pass_too():
    def plan(cores, jobs, ranks):
        share = max(1, cores // (jobs * ranks))
        spare = max(0, cores - share * jobs * ranks) // ranks  # whole threads for every rank
        return [resources.thread_env(share + (spare if job == 0 else 0)) for job in range(jobs)]

    assert exercise.thread_budget(plan)


# ---- slurm_rank_env -----------------------------------------------------------------------------


def _rank_env(**change):
    def fn(env):
        out = {"MASTER_ADDR": slurm.first_node(env["SLURM_JOB_NODELIST"]), "MASTER_PORT": "29500",
               "WORLD_SIZE": env["SLURM_NTASKS"], "RANK": env["SLURM_PROCID"],
               "LOCAL_RANK": env["SLURM_LOCALID"]}
        out.update({k: v(env) for k, v in change.items()})
        return out
    return fn


def test_slurm_rank_env_the_solution_passes_and_its_ranks_meet(solved):
    verdict = exercise.slurm_rank_env(solved["my_rank_env"])
    assert verdict and "2 ranks, then 4, met at localhost" in verdict.detail


def test_slurm_rank_env_wrong_rank_from_localid():
    verdict = exercise.slurm_rank_env(_rank_env(RANK=lambda e: e["SLURM_LOCALID"]))
    assert said(verdict, "SLURM_LOCALID starts at 0 again on every node")


def test_slurm_rank_env_wrong_local_rank_from_procid():
    verdict = exercise.slurm_rank_env(_rank_env(LOCAL_RANK=lambda e: e["SLURM_PROCID"]))
    assert said(verdict, "SLURM_LOCALID (it picks the GPU")


def test_slurm_rank_env_wrong_world_size_of_one_node():
    verdict = exercise.slurm_rank_env(_rank_env(WORLD_SIZE=lambda e: e["SLURM_NTASKS_PER_NODE"]))
    assert said(verdict, "SLURM_NTASKS")


def test_slurm_rank_env_wrong_master_is_the_tasks_own_node():
    verdict = exercise.slurm_rank_env(_rank_env(MASTER_ADDR=lambda e: e["SLURMD_NODENAME"]))
    assert said(verdict, "each task named its own node")


def test_slurm_rank_env_wrong_compressed_nodelist_as_address():
    verdict = exercise.slurm_rank_env(_rank_env(MASTER_ADDR=lambda e: e["SLURM_JOB_NODELIST"]))
    assert said(verdict, "SLURM_JOB_NODELIST is compressed")


def test_slurm_rank_env_wrong_numbers_not_strings():
    verdict = exercise.slurm_rank_env(_rank_env(RANK=lambda e: int(e["SLURM_PROCID"])))
    assert said(verdict, "environment values are strings")


def test_slurm_rank_env_wrong_port_differs_between_tasks():
    verdict = exercise.slurm_rank_env(
        _rank_env(MASTER_PORT=lambda e: str(29500 + int(e["SLURM_PROCID"]))))
    assert said(verdict, "the same on every task")


def _per_node(env):
    return int(env["SLURM_NTASKS_PER_NODE"])


def test_slurm_rank_env_wrong_rank_from_node_and_tasks_per_node():
    verdict = exercise.slurm_rank_env(_rank_env(
        RANK=lambda e: str(int(e["SLURM_NODEID"]) * _per_node(e) + int(e["SLURM_LOCALID"]))))
    assert said(verdict, "a job of 3 nodes with 3, 1 and 2 tasks (cn[9,11-12]): it read "
                         "SLURM_NTASKS_PER_NODE, which this job does not set")
    assert "only when the job asks for --ntasks-per-node" in verdict.hint


def test_slurm_rank_env_wrong_world_size_from_nodes_times_tasks_per_node():
    verdict = exercise.slurm_rank_env(_rank_env(
        WORLD_SIZE=lambda e: str(int(e["SLURM_NNODES"]) * _per_node(e))))
    assert said(verdict, "SLURM_NTASKS hold the rank, the local rank and the world size")


def test_slurm_rank_env_wrong_local_rank_from_procid_modulo_tasks_per_node():
    verdict = exercise.slurm_rank_env(_rank_env(
        LOCAL_RANK=lambda e: str(int(e["SLURM_PROCID"]) % _per_node(e))))
    assert said(verdict, "it read SLURM_NTASKS_PER_NODE, which this job does not set")


def test_slurm_rank_env_wrong_node_list_cut_at_the_first_dash():
    def first(nodelist):  # node[07-08] -> node07, but cn[9,11-12] -> cn9,11
        if "[" not in nodelist:
            return nodelist.split(",")[0]
        prefix, rest = nodelist.split("[", 1)
        return prefix + rest.split("-")[0]

    verdict = exercise.slurm_rank_env(
        _rank_env(MASTER_ADDR=lambda e: first(e["SLURM_JOB_NODELIST"])))
    assert said(verdict, "MASTER_ADDR ['cn9,11'], expected 'cn9'")
    assert "commas inside the brackets too" in verdict.hint


def test_slurm_rank_env_wrong_variable_the_check_does_not_set():
    verdict = exercise.slurm_rank_env(_rank_env(WORLD_SIZE=lambda e: e["SLURM_STEP_NUM_TASKS"]))
    assert said(verdict, "it read SLURM_STEP_NUM_TASKS, which the check's tasks do not set")
    assert "SLURM_PROCID" in verdict.hint


def test_slurm_rank_env_the_older_names_and_a_port_from_the_job_pass_too():
    verdict = exercise.slurm_rank_env(lambda env: {
        "MASTER_ADDR": slurm.first_node(env["SLURM_NODELIST"]),
        "MASTER_PORT": str(15000 + int(env["SLURM_JOB_ID"]) % 10000),
        "WORLD_SIZE": env["SLURM_NPROCS"], "RANK": env["SLURM_PROCID"],
        "LOCAL_RANK": env["SLURM_LOCALID"]})
    assert verdict and "4 jobs, 21 tasks; 2 ranks, then 4, met at localhost" in verdict.detail


def test_slurm_rank_env_wrong_missing_variables():
    verdict = exercise.slurm_rank_env(lambda env: {"RANK": env["SLURM_PROCID"]})
    assert said(verdict, "no MASTER_ADDR, MASTER_PORT, WORLD_SIZE, LOCAL_RANK")


# ---- checkpoint_resume --------------------------------------------------------------------------


def test_checkpoint_resume_the_solution_passes_on_2_and_4_ranks(solved):
    verdict = exercise.checkpoint_resume(solved["my_resume"])
    assert verdict and "bitwise those of an uninterrupted run" in verdict.detail
    assert "on 2 and on 4 ranks" in verdict.detail


def _resume(*, pick=-1, model=True, optimizer=True, add=0):
    def fn(net, opt, folder):
        from pathlib import Path

        found = sorted(Path(folder).glob("step-*.pt")) if Path(folder).is_dir() else []
        if not found:
            return 0
        state = torch.load(found[pick], map_location="cpu")
        if model:
            net.load_state_dict(state["model"])
        if optimizer:
            opt.load_state_dict(state["optimizer"])
        return state["step"] + add
    return fn


def test_checkpoint_resume_the_newest_file_by_its_name_passes_too():
    # glob and sort: the names are zero-padded, so the last is the newest
    verdict = exercise.checkpoint_resume(_resume())
    assert verdict and "bitwise those of an uninterrupted run" in verdict.detail


def test_checkpoint_resume_wrong_loads_none_when_nothing_was_saved():
    def fn(net, opt, folder):
        state = torch.load(elastic.latest_checkpoint(folder))
        net.load_state_dict(state["model"])
        return state["step"]

    assert said(exercise.checkpoint_resume(fn), "return 0 when elastic.latest_checkpoint")


def test_checkpoint_resume_wrong_oldest_checkpoint():
    assert said(exercise.checkpoint_resume(_resume(pick=0)), "gives the newest one")


def test_checkpoint_resume_wrong_returns_the_next_step():
    assert said(exercise.checkpoint_resume(_resume(add=1)), "return the step the checkpoint holds")


def test_checkpoint_resume_wrong_model_only():
    assert said(exercise.checkpoint_resume(_resume(optimizer=False)), "SGD's momentum")


def test_checkpoint_resume_wrong_optimizer_only():
    assert said(exercise.checkpoint_resume(_resume(model=False)), "model.load_state_dict")


# ---- what labkit adds for them ------------------------------------------------------------------


def test_training_memory_gives_the_fixed_activation_bytes_too():
    est = resources.training_memory(_mlp(), torch.zeros(6), 10)
    assert est["activations"] == est["fixed"] + 10 * est["per_sample"]
