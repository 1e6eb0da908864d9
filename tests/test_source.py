"""labkit.show: a taught function's source, with its file and line, without its docstring."""

import pytest

import labkit
from labkit.exercises import augmentation


def test_show_prints_the_source_without_the_docstring(capsys):
    text = labkit.show(augmentation.frozen_base)
    assert text.startswith("# labkit/exercises/augmentation.py, line ")
    assert "def frozen_base(" in text and "base_params = list(" in text
    assert "Exercise: the convolutional base frozen" not in text
    assert capsys.readouterr().out.strip() == text
    assert text._ipython_display_() is None  # a cell ending in show(...) shows it once
    assert "Exercise: the convolutional base" in labkit.show(augmentation.frozen_base,
                                                            docstring=True)


def test_show_refuses_what_has_no_source():
    with pytest.raises(TypeError, match="pass the function itself, not its result"):
        labkit.show(3)
