# Solutions to the exercises of notebooks/02_data_parallelism_keras.ipynb.
# One block per exercise cell, each starting with `# %% <exercise id>`: labkit.check.solution(id)
# prints a block, and `python -m labkit.exercises` writes 02_data_parallelism_keras_solution.ipynb,
# the notebook with these blocks in its exercise cells.

# %% keras_global_batch_loss
def replica_loss(per_example_loss, global_batch_size):
    # This replica's sum over the GLOBAL batch: the all-reduce adds the replicas' shares up to
    # the mean over all samples. (tf.nn.compute_average_loss(per_example_loss,
    # global_batch_size=global_batch_size) is TensorFlow's name for it.)
    return tf.reduce_sum(per_example_loss) / global_batch_size

# %% keras_tf_config
def make_tf_config(worker, addresses):
    return {"cluster": {"worker": list(addresses)},        # the whole cluster, the same order
            "task": {"type": "worker", "index": worker}}  # and this worker's place in it

# %% keras_worker_shard
def shard_and_batch(dataset, ctx, global_batch):
    shard = dataset.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)  # every N-th, from i
    per_worker = ctx.get_per_replica_batch_size(global_batch)  # global_batch // N workers
    return shard.batch(per_worker, drop_remainder=True)  # full batches: as many on every worker
