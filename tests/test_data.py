"""labkit.data: bundled, generated, ImageFolder and torchvision datasets; the catalog."""

import functools
import hashlib
import http.server
import json
import os
import pickle
import socket
import tarfile
import threading

import numpy as np
import pytest
from PIL import Image

from labkit import data
from labkit.data import DataError, DataUnavailable, ImageSet


def _set(n=12, k=3, size=8):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8)
    return ImageSet(images, np.arange(n) % k, [f"c{i}" for i in range(k)])


def test_unknown_module_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        data.nope  # noqa: B018


# --------------------------------------------------------------------------------------------
# ImageSet, content_hash


def test_imageset_indexing_counts_and_repr():
    s = _set()
    image, label = s[4]
    assert image.shape == (8, 8, 3) and label == 1 and isinstance(label, int)
    part = s[np.array([0, 1, 2])]
    assert isinstance(part, ImageSet) and len(part) == 3 and part.classes == s.classes
    assert len(s[s.labels == 2]) == 4
    assert s.counts() == {"c0": 4, "c1": 4, "c2": 4}
    assert repr(s) == "ImageSet(12 images 8x8, 3 classes: c0, c1, c2)"
    assert s.labels.dtype == np.int64


@pytest.mark.parametrize("images, labels, classes, message", [
    (np.zeros((2, 4, 4), np.uint8), [0, 1], ["a", "b"], "uint8 of shape"),
    (np.zeros((2, 4, 4, 3), np.float32), [0, 1], ["a", "b"], "uint8 of shape"),
    (np.zeros((2, 4, 4, 3), np.uint8), [0], ["a", "b"], "one label per image"),
    (np.zeros((2, 4, 4, 3), np.uint8), [0, 2], ["a", "b"], r"lie in 0\.\.1"),
    (np.zeros((2, 4, 4, 3), np.uint8), [-1, 0], ["a", "b"], r"lie in 0\.\.1"),
    (np.zeros((2, 4, 4, 3), np.uint8), [0.0, 1.0], ["a", "b"], "must be integers"),
    (np.zeros((2, 4, 4, 3), np.uint8), ["a", "b"], ["a", "b"], "must be integers"),
])
def test_imageset_rejects_bad_arrays(images, labels, classes, message):
    with pytest.raises(DataError, match=message):
        ImageSet(images, np.array(labels), classes)


def test_content_hash_sees_every_part():
    s = _set()
    base = data.content_hash(s)
    assert base == data.content_hash(_set())
    changed = s.images.copy()
    changed[0, 0, 0, 0] ^= 1
    assert data.content_hash(ImageSet(changed, s.labels, s.classes)) != base
    assert data.content_hash(ImageSet(s.images, s.labels[::-1], s.classes)) != base
    assert data.content_hash(ImageSet(s.images, s.labels, ["x", "y", "z"])) != base


# --------------------------------------------------------------------------------------------
# digits, sample photos


def test_digits_are_upscaled_rgb_and_match_pil_bilinear():
    d = data.digits(32)
    assert d.images.shape == (1797, 32, 32, 3) and d.images.dtype == np.uint8
    assert d.classes == [str(i) for i in range(10)] and sorted(set(d.labels)) == list(range(10))
    assert (d.images[..., 0] == d.images[..., 2]).all()  # gray in three channels
    from sklearn.datasets import load_digits

    small = load_digits().images[7].astype(np.float32) * (255 / 16)
    ref = np.asarray(Image.fromarray(small, mode="F").resize((32, 32), Image.Resampling.BILINEAR))
    assert np.abs(ref - d.images[7, ..., 0]).max() <= 0.5 + 1e-3
    assert data.digits(20).images.shape == (1797, 20, 20, 3)


@pytest.mark.parametrize("size, message", [(4, "too small"), (32.0, "must be a whole number"),
                                           (True, "must be a whole number"),
                                           ("32", "must be a whole number")])
def test_bad_image_size_is_refused(size, message):
    with pytest.raises(DataError, match=message):
        data.digits(size)


def test_sample_photos_are_bundled_and_read_offline(monkeypatch):
    def no_network(*args, **kwargs):
        raise OSError("network disabled by the test")

    monkeypatch.setattr(socket, "socket", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    photos = data.sample_photos()
    assert list(photos) == list(data.PHOTOS)
    for name, photo in photos.items():
        assert photo.ndim == 3 and photo.shape[2] == 3 and photo.dtype == np.uint8, name
    assert photos["coffee"].shape == (400, 600, 3)
    squares = data.sample_photos(64, names=["coffee", "rocket"])
    assert list(squares) == ["coffee", "rocket"]
    assert all(p.shape == (64, 64, 3) for p in squares.values())


def test_sample_photos_bad_input():
    with pytest.raises(DataError, match="no sample photo called 'eagle'.*astronaut"):
        data.sample_photos(names=["astronaut", "eagle"])
    with pytest.raises(DataError, match="too small"):
        data.sample_photos(2)


# --------------------------------------------------------------------------------------------
# shapes


def test_shapes_are_balanced_deterministic_and_prefix_stable():
    s = data.shapes(130)
    assert s.images.shape == (130, 32, 32, 3) and s.images.dtype == np.uint8
    assert s.classes == list(data.SHAPES)
    assert set(s.counts().values()) == {26}
    assert data.content_hash(data.shapes(130)) == data.content_hash(s)
    # The first 100 of 130 are the 100 (chunks are seeded by position, not by n).
    assert data.content_hash(data.shapes(100)) == data.content_hash(s[:100])
    assert data.content_hash(data.shapes(130, seed=1)) != data.content_hash(s)
    # Not blank: every image has a shape that differs from its background.
    assert (s.images.reshape(130, -1, 3).std(axis=1).max(axis=1) > 20).all()


def test_shapes_scale_and_class_choice():
    s = data.shapes(10, image_size=64, seed=3, classes=["star", "cross"])
    assert s.images.shape == (10, 64, 64, 3) and s.classes == ["star", "cross"]
    assert s.counts() == {"star": 5, "cross": 5}


def test_shape_masks_cover_sensible_areas():
    u, v = np.meshgrid(np.linspace(-1.5, 1.5, 301), np.linspace(-1.5, 1.5, 301))
    area = {name: data._mask(name, u, v).mean() * 9 for name in data.SHAPES}
    # Unit-circumradius shapes: circle ~2.27, square 2.25, triangle ~1.57, star ~1.4, cross ~1.8.
    assert all(1.0 < a < 2.6 for a in area.values()), area
    assert data._mask("star", u * 0, v * 0 + 1.1).all()  # the top spike's tip is inside
    assert not data._mask("star", u * 0 + 0.45, v * 0 + 0.6).any()  # between two spikes is not
    with pytest.raises(DataError, match="unknown shape 'blob'"):
        data._mask("blob", u, v)


@pytest.mark.parametrize("kwargs, message", [
    (dict(n=0), "n must be a whole number >= 1"),
    (dict(n=2.5), "n must be a whole number >= 1"),
    (dict(n=5, image_size=8), "too small for shapes"),
    (dict(n=5, classes=["circle", "hexagon"]), "hexagon"),
    (dict(n=5, classes=["circle"]), "two or more"),
    (dict(n=5, classes="circle"), "two or more"),
    (dict(n=5, classes=["star", "star"]), "different"),
])
def test_shapes_bad_input(kwargs, message):
    with pytest.raises(DataError, match=message):
        data.shapes(**kwargs)


# --------------------------------------------------------------------------------------------
# split, take


def test_split_is_stratified_disjoint_and_deterministic():
    s = data.shapes(200)
    train, val = data.split(s, 0.25, seed=0)
    assert len(train) == 150 and len(val) == 50
    assert set(val.counts().values()) == {10}
    both = np.concatenate([train.images, val.images]).reshape(200, -1)
    assert len(np.unique(both, axis=0)) == 200  # nothing lost, nothing duplicated
    again = data.split(s, 0.25, seed=0)[1]
    assert data.content_hash(again) == data.content_hash(val)
    assert data.content_hash(data.split(s, 0.25, seed=1)[1]) != data.content_hash(val)


def test_split_keeps_a_tiny_class_in_both_parts():
    s = ImageSet(np.zeros((12, 4, 4, 3), np.uint8), np.array([0] * 10 + [1] * 2), ["big", "tiny"])
    train, val = data.split(s, 0.1)
    assert train.counts() == {"big": 9, "tiny": 1} and val.counts() == {"big": 1, "tiny": 1}


@pytest.mark.parametrize("fraction", [0, 1, 1.5, -0.1, True])
def test_split_bad_fraction(fraction):
    with pytest.raises(DataError, match="strictly between 0 and 1"):
        data.split(_set(), fraction)


def test_split_needs_two_per_class():
    s = ImageSet(np.zeros((3, 4, 4, 3), np.uint8), np.array([0, 0, 1]), ["a", "lonely"])
    with pytest.raises(DataError, match="class 'lonely' has a single image"):
        data.split(s, 0.5)


def test_take_picks_n_per_class_deterministically():
    s = data.shapes(100)
    small = data.take(s, 7, seed=2)
    assert small.counts() == {name: 7 for name in data.SHAPES}
    assert data.content_hash(data.take(s, 7, seed=2)) == data.content_hash(small)
    assert data.content_hash(data.take(s, 7, seed=3)) != data.content_hash(small)
    with pytest.raises(DataError, match="class 'circle' has 20 images, fewer than n_per_class=21"):
        data.take(s, 21)
    with pytest.raises(DataError, match="n_per_class must be a whole number >= 1"):
        data.take(s, 0)


# --------------------------------------------------------------------------------------------
# image_folder


def _save(path, mode="RGB", size=(12, 10), colour=None, fmt=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    colour = colour if colour is not None else {"RGB": (200, 10, 10), "L": 128,
                                                "RGBA": (0, 0, 255, 0), "P": 3}[mode]
    Image.new(mode, size, colour).save(path, format=fmt)


def _folder(tmp_path):
    root = tmp_path / "fruit"
    _save(root / "apples" / "a1.png")
    _save(root / "apples" / "a2.JPG", fmt="JPEG")
    _save(root / "apples" / "more" / "a3.bmp")  # sub-folders of a class count
    _save(root / "pears" / "p1.png", mode="L")
    _save(root / "pears" / "p2.png", mode="RGBA")
    _save(root / "pears" / "p3.gif.png", mode="P")
    (root / ".ipynb_checkpoints").mkdir()
    (root / "pears" / ".DS_Store").write_bytes(b"\0")
    return root


def test_image_folder_reads_the_layout(tmp_path, capsys):
    s = data.image_folder(_folder(tmp_path))
    assert s.classes == ["apples", "pears"] and s.labels.tolist() == [0, 0, 0, 1, 1, 1]
    assert s.images.shape == (6, 10, 12, 3)  # PIL's (12, 10) is width x height
    assert capsys.readouterr().out == ""  # one size: nothing to say
    assert s[3][0][0, 0].tolist() == [128, 128, 128]  # gray -> RGB
    assert s[4][0][0, 0].tolist() == [255, 255, 255]  # fully transparent -> white


def test_image_folder_resizes_mixed_sizes(tmp_path, capsys):
    root = _folder(tmp_path)
    _save(root / "pears" / "big.png", size=(30, 20))
    s = data.image_folder(root)
    assert s.images.shape == (7, 10, 12, 3)
    assert "1 of 7 images resized to 12x10" in capsys.readouterr().out
    square = data.image_folder(root, image_size=16)
    assert square.images.shape == (7, 16, 16, 3)
    assert capsys.readouterr().out == ""  # a chosen size is no surprise


def test_image_folder_turns_photos_upright(tmp_path):
    root = tmp_path / "photos"
    _save(root / "b" / "plain.png", size=(10, 20))
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to view"
    path = root / "a" / "phone.jpg"
    path.parent.mkdir(parents=True)
    Image.new("RGB", (20, 10), (0, 200, 0)).save(path, exif=exif)
    s = data.image_folder(root)
    assert s.images.shape == (2, 20, 10, 3)


def test_image_folder_missing_root(tmp_path):
    with pytest.raises(DataError, match=r"no folder at .*nowhere.*one folder per class"):
        data.image_folder(tmp_path / "nowhere")


def test_image_folder_root_is_a_file(tmp_path):
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(DataError, match="is a file, not a folder"):
        data.image_folder(tmp_path / "f.txt")


def test_image_folder_no_class_folders(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="has no class folders"):
        data.image_folder(tmp_path / "empty")


def test_image_folder_images_loose_in_root(tmp_path):
    root = _folder(tmp_path)
    _save(root / "stray.png")
    with pytest.raises(DataError, match="holds files directly .stray.png.*move images there"):
        data.image_folder(root)


def test_image_folder_one_class(tmp_path):
    _save(tmp_path / "pets" / "cats" / "1.png")
    with pytest.raises(DataError, match="found one class 'cats'.*needs at least two"):
        data.image_folder(tmp_path / "pets")


def test_image_folder_empty_class(tmp_path):
    root = _folder(tmp_path)
    (root / "plums").mkdir()
    (root / "plums" / ".hidden").write_text("")  # hidden files do not make it non-empty
    with pytest.raises(DataError, match="empty class folder 'plums'"):
        data.image_folder(root)


def test_image_folder_non_image_file(tmp_path):
    root = _folder(tmp_path)
    (root / "pears" / "notes.txt").write_text("ripe")
    with pytest.raises(DataError, match=r"not image files: .*notes\.txt.*\.jpg .*\.webp.*delete"):
        data.image_folder(root)


def test_image_folder_damaged_image(tmp_path):
    root = _folder(tmp_path)
    (root / "pears" / "broken.png").write_bytes(b"not a png")
    with pytest.raises(DataError, match=r"broken\.png cannot be read as an image"):
        data.image_folder(root)


def test_image_folder_truncated_image(tmp_path):
    root = _folder(tmp_path)
    whole = tmp_path / "whole.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 40, 3), np.uint8)).save(whole)
    (root / "pears" / "cut.png").write_bytes(whole.read_bytes()[:200])
    with pytest.raises(DataError, match=r"cut\.png cannot be read as an image"):
        data.image_folder(root, image_size=8)


def test_image_folder_too_big_for_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "_MAX_BYTES", 1000)
    with pytest.raises(DataError, match="GiB of memory: pass a smaller image_size"):
        data.image_folder(_folder(tmp_path))


def test_image_folder_bad_image_size(tmp_path):
    with pytest.raises(DataError, match="too small"):
        data.image_folder(_folder(tmp_path), image_size=3)


# --------------------------------------------------------------------------------------------
# torchvision datasets


def _md5(path):
    return hashlib.md5(path.read_bytes()).hexdigest()


def _fake_cifar(folder, per_batch=3):
    """A tiny cifar-10-python.tar.gz with the real structure, and the md5s torchvision checks."""
    batches = folder / "cifar-10-batches-py"
    batches.mkdir(parents=True)
    rng = np.random.default_rng(0)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        # The real pickles are Python 2 dicts, whose keys torchvision reads as str
        # (pickle.load(..., encoding="latin1")): b"data" when read with encoding="bytes".
        batch = {"batch_label": name, "data": rng.integers(0, 256, (per_batch, 3072), np.uint8),
                 "labels": rng.integers(0, 10, per_batch).tolist(),
                 "filenames": [f"{name}_{i}.png" for i in range(per_batch)]}
        (batches / name).write_bytes(pickle.dumps(batch, protocol=2))
    meta = {"label_names": ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog",
                            "horse", "ship", "truck"], "num_cases_per_batch": per_batch,
            "num_vis": 3072}
    (batches / "batches.meta").write_bytes(pickle.dumps(meta, protocol=2))
    archive = folder / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(batches, arcname="cifar-10-batches-py")
    md5 = {name: _md5(batches / name) for name in [*names, "batches.meta"]}
    return archive, md5


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def local_http(tmp_path, monkeypatch):
    """An HTTP server on 127.0.0.1 for files in tmp_path/server: a download with no network.

    (A file:// URL does not do: torchvision's download reads ``response.length``, which only
    HTTP responses have.)
    """
    for proxy in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    folder = tmp_path / "server"
    folder.mkdir()
    handler = functools.partial(_QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield folder, f"http://127.0.0.1:{server.server_port}/"
    server.shutdown()
    server.server_close()


@pytest.fixture
def fake_cifar_server(local_http, monkeypatch):
    from torchvision.datasets import CIFAR10

    folder, url = local_http
    archive, md5 = _fake_cifar(folder)
    monkeypatch.setattr(CIFAR10, "url", url + archive.name)
    monkeypatch.setattr(CIFAR10, "tgz_md5", _md5(archive))
    monkeypatch.setattr(CIFAR10, "train_list", [[f"data_batch_{i}", md5[f"data_batch_{i}"]]
                                                for i in range(1, 6)])
    monkeypatch.setattr(CIFAR10, "test_list", [["test_batch", md5["test_batch"]]])
    monkeypatch.setattr(CIFAR10, "meta", {"filename": "batches.meta", "key": "label_names",
                                          "md5": md5["batches.meta"]})
    return archive


def test_cifar_download_verifies_and_loads_then_works_offline(tmp_path, fake_cifar_server):
    root = tmp_path / "cache"
    train = data.torchvision_dataset("CIFAR-10".replace("-", ""), root=root, download=True)
    assert (root / "cifar-10-python.tar.gz").is_file()
    assert train.images.shape == (15, 32, 32, 3) and train.images.dtype == np.uint8
    assert train.classes[0] == "airplane" and len(train.classes) == 10
    batch = pickle.loads((root / "cifar-10-batches-py" / "data_batch_1").read_bytes())
    first = batch["data"][0].reshape(3, 32, 32).transpose(1, 2, 0)  # CIFAR rows are CHW
    assert (train.images[0] == first).all() and train.labels[0] == batch["labels"][0]
    test = data.torchvision_dataset("cifar10", root=root, train=False)  # no download needed now
    assert len(test) == 3


def test_cifar_download_with_a_bad_checksum(tmp_path, fake_cifar_server, monkeypatch):
    from torchvision.datasets import CIFAR10

    monkeypatch.setattr(CIFAR10, "tgz_md5", "0" * 32)
    with pytest.raises(DataUnavailable, match="downloading cifar10 .* failed .*corrupted.*delete"):
        data.torchvision_dataset("cifar10", root=tmp_path / "cache", download=True)


def _closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cifar_download_unreachable(tmp_path, monkeypatch):
    from torchvision.datasets import CIFAR10

    monkeypatch.setattr(CIFAR10, "url", f"http://127.0.0.1:{_closed_port()}/cifar.tar.gz")
    with pytest.raises(DataUnavailable, match="failed .*may be offline.*download=True.*shapes()"):
        data.torchvision_dataset("cifar10", root=tmp_path / "cache", download=True)


def test_fashion_mnist_download_unreachable(tmp_path, monkeypatch):
    from torchvision.datasets import FashionMNIST

    monkeypatch.setattr(FashionMNIST, "mirrors", [f"http://127.0.0.1:{_closed_port()}/"])
    with pytest.raises(DataUnavailable, match="fashion_mnist .*failed.*may be offline"):
        data.torchvision_dataset("fashion_mnist", root=tmp_path / "cache", download=True)


@pytest.mark.parametrize("download", [None, False])
def test_no_local_copy_without_download_is_a_clear_error(tmp_path, download):
    root = tmp_path / "empty"
    with pytest.raises(DataUnavailable) as err:
        data.torchvision_dataset("cifar10", root=root, download=download)
    message = str(err.value)
    for part in [f"no local copy of cifar10 at {root}", "may be offline", "download=True",
                 str(root / "cifar-10-batches-py"), "labkit.data.shapes()", "digits()"]:
        assert part in message
    assert not root.exists() or not any(root.iterdir())  # nothing was fetched


def test_default_root_follows_labkit_data(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_DATA", str(tmp_path / "shared"))
    assert data.cache_dir() == tmp_path / "shared"
    with pytest.raises(DataUnavailable, match=f"at {tmp_path / 'shared' / 'fashion_mnist'}"):
        data.torchvision_dataset("fashion_mnist")
    monkeypatch.delenv("LABKIT_DATA")
    assert data.cache_dir().parts[-2:] == ("datasets", "cache")


def _idx(path, array):
    """An MNIST idx file: magic (0, 0, type 8 = ubyte, ndim), the sizes, then the bytes."""
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(n).to_bytes(4, "big")
                                                      for n in array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def test_fashion_mnist_local_copy_becomes_rgb(tmp_path):
    raw = tmp_path / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in [("train", 4), ("t10k", 2)]:
        _idx(raw / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)))
        _idx(raw / f"{prefix}-labels-idx1-ubyte", np.arange(n))
    s = data.torchvision_dataset("fashion-mnist", root=tmp_path)
    assert s.images.shape == (4, 28, 28, 3) and s.labels.tolist() == [0, 1, 2, 3]
    assert (s.images[..., 0] == s.images[..., 1]).all() and s.classes[9] == "Ankle boot"
    assert len(data.torchvision_dataset("fashion_mnist", root=tmp_path, train=False)) == 2


@pytest.mark.parametrize("name, download, message", [
    ("imagenet", None, "unknown torchvision dataset 'imagenet': choose from cifar10, fashion"),
    (10, None, "unknown torchvision dataset 10"),
    ("cifar10", "yes", "download must be True"),
])
def test_torchvision_dataset_bad_arguments(name, download, message):
    with pytest.raises(DataError, match=message):
        data.torchvision_dataset(name, download=download)


# --------------------------------------------------------------------------------------------
# To the frameworks


def test_to_torch_yields_float_chw_and_feeds_a_dataloader():
    import torch

    s = data.shapes(10)
    ds = data.to_torch(s)
    assert isinstance(ds, torch.utils.data.Dataset) and len(ds) == 10
    image, label = ds[3]
    assert image.dtype == torch.float32 and image.shape == (3, 32, 32)
    assert 0 <= image.min() and image.max() <= 1 and label == 3
    assert torch.equal(image, torch.from_numpy(s.images[3]).permute(2, 0, 1).float() / 255)
    x, y = next(iter(torch.utils.data.DataLoader(ds, batch_size=4)))
    assert x.shape == (4, 3, 32, 32) and y.dtype == torch.int64
    # DataLoader workers that spawn get the dataset pickled.
    again = pickle.loads(pickle.dumps(ds))
    assert torch.equal(again[3][0], image)


def test_to_torch_applies_a_v2_transform_to_uint8_tensors():
    import torch
    from torchvision.transforms import v2

    seen = []

    def spy(image):
        seen.append((image.dtype, tuple(image.shape)))
        return image

    pipeline = v2.Compose([spy, v2.RandomHorizontalFlip(p=1.0),
                           v2.ToDtype(torch.float32, scale=True)])
    s = data.shapes(4)
    image, _ = data.to_torch(s, transform=pipeline)[0]
    assert seen == [(torch.uint8, (3, 32, 32))]
    expected = torch.from_numpy(s.images[0][:, ::-1].copy()).permute(2, 0, 1).float() / 255
    assert torch.allclose(image, expected)


def test_to_torch_bad_input():
    with pytest.raises(DataError, match="needs an ImageSet, got ndarray"):
        data.to_torch(np.zeros((2, 4, 4, 3), np.uint8))
    with pytest.raises(DataError, match="transform must be callable"):
        data.to_torch(_set(), transform="flip")


def test_to_tensors_and_to_numpy_float():
    import torch

    s = _set()
    images, labels = data.to_tensors(s)
    assert images.dtype == torch.uint8 and images.shape == (12, 3, 8, 8)
    assert torch.equal(images[5], torch.from_numpy(s.images[5]).permute(2, 0, 1))
    assert labels.tolist() == s.labels.tolist()
    x, y = data.to_numpy_float(s)
    assert x.dtype == np.float32 and x.shape == (12, 8, 8, 3) and y.dtype == np.int64
    assert np.allclose(x * 255, s.images) and 0 <= x.min() and x.max() <= 1


# --------------------------------------------------------------------------------------------
# The catalog


def test_catalog_describes_every_dataset():
    cat = data.catalog()
    assert set(cat) == {"shapes", "digits", "sample_photos", *data.TORCHVISION_SETS}
    for name, entry in cat.items():
        for key in ("source", "licence", "size", "checksum", "build", "how_to_build"):
            assert entry.get(key), (name, key)
        assert entry["build"]["call"].startswith("labkit.data.")


@pytest.mark.parametrize("name", ["shapes", "digits"])
def test_generated_sets_match_their_catalog_checksum(name):
    entry = data.catalog()[name]
    function = getattr(data, entry["build"]["call"].rsplit(".", 1)[1])
    built = function(**entry["build"]["kwargs"])
    assert len(built) == entry["size"]["items"]
    assert built.images.nbytes == entry["size"]["bytes"]
    assert data.content_hash(built) == entry["checksum"]["content_hash"], (
        f"{name} is no longer what the catalog recorded: if the change is intended, "
        f"update datasets/catalog.json")


def test_sample_photo_files_match_the_catalog():
    import skimage.data

    items = data.catalog()["sample_photos"]["items"]
    assert [item["name"] for item in items] == list(data.PHOTOS)
    for item in items:
        path = os.path.join(skimage.data.data_dir, item["file"])
        assert os.path.getsize(path) == item["bytes"], item["name"]
        assert hashlib.sha256(open(path, "rb").read()).hexdigest() == item["sha256"], item["name"]


def test_catalog_md5s_are_the_ones_torchvision_checks():
    from torchvision.datasets import CIFAR10, FashionMNIST

    cat = data.catalog()
    assert cat["cifar10"]["checksum"]["md5"] == CIFAR10.tgz_md5
    assert cat["cifar10"]["source"].startswith(CIFAR10.url)
    assert cat["fashion_mnist"]["checksum"]["md5"] == dict(FashionMNIST.resources)


def test_missing_catalog(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "_CATALOG", tmp_path / "catalog.json")
    with pytest.raises(DataUnavailable, match="no dataset catalog at .*pip install -e"):
        data.catalog()


def test_catalog_file_is_plain_json():
    with open(data._CATALOG, encoding="utf-8") as f:
        assert isinstance(json.load(f)["datasets"], list)


def test_docstring_examples_hold():
    import doctest

    failed, tried = doctest.testmod(data, optionflags=doctest.ELLIPSIS)
    assert tried > 10 and failed == 0


def test_to_float_tensors_centres_pixels_on_zero_and_matches_to_tensors():
    import torch

    s = _set()
    s.images[0, 0, 0] = 0
    s.images[0, 0, 1] = 255
    x, y = data.to_float_tensors(s)
    images, labels = data.to_tensors(s)
    assert x.dtype == torch.float32 and x.shape == (12, 3, 8, 8)
    assert y.dtype == torch.int64 and torch.equal(y, labels)
    assert x.min().item() == -0.5 and x.max().item() == 0.5
    assert torch.allclose(x, images.float() / 255 - 0.5)
    assert x[0, :, 0, 2].tolist() == pytest.approx([v / 255 - 0.5 for v in s.images[0, 0, 2]])
