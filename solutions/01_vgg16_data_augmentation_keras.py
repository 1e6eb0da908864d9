# Solutions to the exercises of notebooks/01_vgg16_data_augmentation_keras.ipynb.
# One block per exercise cell, each starting with `# %% <exercise id>`: labkit.check.solution(id)
# prints a block, and `python -m labkit.exercises` writes
# 01_vgg16_data_augmentation_keras_solution.ipynb, the notebook with these blocks in its exercise
# cells.

# %% keras_flip_rotate
my_flip_rotate = keras.Sequential([
    keras.Input((None, None, 3)),
    layers.RandomFlip("horizontal"),               # left-right, with probability 1/2
    layers.RandomRotation(config.rotation / 360),  # Keras counts in turns: 30 degrees is 30/360
], name="my_flip_rotate")

# %% keras_transfer_stages
def prepare_stage(model, base, stage):
    base.trainable = stage == "finetune"  # "head": the base frozen; "finetune": everything trains
    # trainable takes effect when the model is compiled: compile again, at the stage's rate
    compile_model(model, HEAD_LR if stage == "head" else FINETUNE_LR)

# %% keras_brightness
my_augment = keras.Sequential([
    keras.Input((None, None, 3)),  # images of any size (the photo below is larger than ours)
    layers.RandomFlip("horizontal"),
    layers.RandomRotation(config.rotation / 360),
    layers.RandomBrightness(0.1, value_range=(0, 1)),  # up to a tenth of 0..1, lighter or darker
], name="my_augment")
