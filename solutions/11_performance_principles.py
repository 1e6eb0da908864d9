# Solutions to the exercises of notebooks/11_performance_principles.ipynb.
# One block per exercise cell, each starting with `# %% <exercise id>`: labkit.check.solution(id)
# prints a block, and `python -m labkit.exercises` writes 11_performance_principles_solution.ipynb,
# the notebook with these blocks in its exercise cells.

# %% attention_bytes
def my_attention_bytes(batch, heads, seq, head_dim, bytes_per_element, fused):
    # Q, K and V are read once and O is written once: 4 (seq x head_dim) tensors per head
    elements = 4 * batch * heads * seq * head_dim
    if not fused:
        # S = QK^T is written, then read by softmax; P is written, then read by P @ V
        elements += 4 * batch * heads * seq * seq
    return elements * bytes_per_element

# %% exposed_communication
def my_exposed_communication(events, is_comm, is_compute):
    def union(keep):
        # the events' spans merged: time covered by several counts once
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if keep(e))
        merged = []
        for start, end in spans:
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            elif end > start:
                merged.append([start, end])
        return merged

    exposed = 0.0
    busy = union(is_compute)
    for start, end in union(is_comm):
        # the part of [start, end) that no compute span covers
        covered = sum(max(0.0, min(end, b) - max(start, a)) for a, b in busy)
        exposed += (end - start) - covered
    return exposed / 1e6  # trace times are microseconds

# %% delayed_scaling
def my_delayed_scales(amaxes, fmt_max, history_len, margin=0):
    scales, history, scale = [], [], 1.0
    for amax in amaxes:
        scales.append(scale)  # this step is cast with what the earlier steps decided
        history = (history + [amax])[-history_len:]
        largest = max(history)
        if 0 < largest < float("inf"):
            scale = fmt_max / largest / 2 ** margin
    return scales
