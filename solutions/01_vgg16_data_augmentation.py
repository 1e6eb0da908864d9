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

# %% per_image_flip
def my_flip(batch, p, generator=None):
    # one coin per image, all drawn at once; then each image takes itself or its mirror
    coins = torch.rand(len(batch), generator=generator, device=batch.device) < p
    return torch.where(coins.view(-1, 1, 1, 1), batch.flip(-1), batch)

# %% fair_gap
def my_gap(model, train_set, val_set, image_size):
    plain = augment.augmentation(image_size, kind="none")  # resize and normalise, nothing random
    device = next(model.parameters()).device

    def accuracy(images):
        loader = DataLoader(data.to_torch(images, plain), batch_size=256)
        model.eval()  # BatchNorm normalises with its running statistics; dropout is off
        correct = 0
        with torch.no_grad():
            for x, y in loader:
                correct += (model(x.to(device)).argmax(1) == y.to(device)).sum().item()
        return correct / len(images)  # over the whole set, not a mean of batch accuracies

    return accuracy(train_set) - accuracy(val_set)
