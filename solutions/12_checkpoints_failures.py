# Solutions to the exercises of notebooks/12_checkpoints_failures.ipynb.
# One block per exercise cell, each starting with `# %% <exercise id>`: labkit.check.solution(id)
# prints a block, and `python -m labkit.exercises` writes 12_checkpoints_failures_solution.ipynb,
# the notebook with these blocks in its exercise cells.

# %% reshard_reads
def my_reshard_reads(rows, old_world, new_world):
    def chunks(world):
        # torch.chunk's split, as FSDP2 shards: ceil(rows / world) each, the last ranks fewer
        each = -(-rows // world)
        return [(min(r * each, rows), min((r + 1) * each, rows)) for r in range(world)]

    saved = chunks(old_world)
    plan = []
    for start, stop in chunks(new_world):
        # the overlap with each saved chunk, in row order; none for a rank without rows
        plan.append([(old, max(start, a), min(stop, b)) for old, (a, b) in enumerate(saved)
                     if max(start, a) < min(stop, b)])
    return plan

# %% checkpoint_interval
def my_goodput(interval, save_s, mtbf_s, restart_s):
    # per interval of work one save (a share save/interval); per failure (1/mtbf per second)
    # half an interval of work lost on average, plus the restart
    return 1 - save_s / interval - (interval / 2 + restart_s) / mtbf_s


def my_best_interval(save_s, mtbf_s):
    # d/dτ of the goodput: save/τ² - 1/(2 mtbf) = 0; the restart only shifts the curve down
    return (2 * save_s * mtbf_s) ** 0.5

# %% peer_heal
def my_heal(model, optimizer, healthy, recovering, group):
    rank = dist.get_rank(group)
    for i, dst in enumerate(recovering):
        # round-robin over the healthy ranks: every rank computes the same pairs, so each
        # send meets its receive, and no peer sends more than ceil(R / H) copies
        src = healthy[i % len(healthy)]
        box = [{"model": model.state_dict(), "optimizer": optimizer.state_dict()}]
        if rank == src:
            dist.send_object_list(box, dst=dst, group=group)
        elif rank == dst:
            dist.recv_object_list(box, src=src, group=group)
            model.load_state_dict(box[0]["model"])
            optimizer.load_state_dict(box[0]["optimizer"])  # the momentum too
