"""`import labkit` and its framework-free rooms load neither torch nor TensorFlow.

TensorFlow notebooks import labkit too, and importing torchvision after TensorFlow in one
process crashes; each case runs in a fresh interpreter so nothing else has imported them.
"""

import subprocess
import sys

import pytest

CASES = {
    "package": "import labkit; labkit.knob(1); labkit.profile.current(); labkit.launch; "
               "labkit.LaunchError; labkit.data; labkit.augment",
    "data": "import labkit.data as d; d.digits(8); d.shapes(3); d.sample_photos(16, 'coffee'); "
            "d.split(d.shapes(10), 0.2)",
    "augment config": "from labkit.augment import AugmentConfig, IMAGENET_MEAN; "
                      "AugmentConfig(rotation=5)",
    "doctor, bench, plots": "import labkit.doctor, labkit.bench, labkit.plots",
}
FRAMEWORKS = "('torch', 'torchvision', 'tensorflow', 'keras')"


@pytest.mark.parametrize("code", CASES.values(), ids=list(CASES))
def test_stays_framework_free(code):
    probe = (f"{code}\nimport sys\n"
             f"print(sorted(m for m in sys.modules if m.split('.')[0] in {FRAMEWORKS}))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
