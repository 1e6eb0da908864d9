# Solutions to the exercises of notebooks/01_vgg16_data_augmentation.ipynb.
# One block per exercise cell, each starting with `# %% <exercise id>`: labkit.check.solution(id)
# prints a block, and `python -m labkit.exercises` writes 01_vgg16_data_augmentation_solution.ipynb,
# the notebook with these blocks in its exercise cells.

# %% augmentation_pipeline
my_pipeline = v2.Compose([
    v2.RandomResizedCrop(image_size, scale=(0.7, 1.0), antialias=True),
    v2.RandomHorizontalFlip(),
    v2.RandomRotation(15),
    v2.ToDtype(torch.float32, scale=True),
    v2.Normalize(augment.IMAGENET_MEAN, augment.IMAGENET_STD),
])

# %% frozen_base
for p in model.features.parameters():
    p.requires_grad = False
