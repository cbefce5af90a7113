"""profile_model_file: every user-fixable problem is one ModelFileError line naming file, problem, fix."""

from __future__ import annotations

import tempfile

import pytest

from optplan.estimators.errors import OptplanError
from optplan.probes.loader import ModelFileError, parse_child_output, profile_model_file


def expect_error(path, *fragments: str, **kwargs) -> ModelFileError:
    with pytest.raises(ModelFileError) as info:
        profile_model_file(path, **kwargs)
    err = info.value
    msg = str(err)
    assert isinstance(err, OptplanError)
    assert "\n" not in msg and "\r" not in msg, msg
    assert msg.startswith(f"{path}: "), msg
    assert " — " in msg and err.fix and err.problem, msg
    for frag in fragments:
        assert frag in msg, f"{frag!r} not in {msg!r}"
    return err


def test_file_missing(tmp_path):
    expect_error(tmp_path / "nope.py", "file not found", "check the path")


def test_not_a_python_file(tmp_path):
    path = tmp_path / "model.txt"
    path.write_text("build_model = 1\n")
    expect_error(path, "not a Python file", ".py")
    expect_error(tmp_path, "is a directory")


def test_syntax_error_names_the_line(write_model):
    path = write_model("""
        import torch

        def build_model(:
            pass
        """)
    expect_error(path, "syntax error at line 4", "fix the syntax")


def test_missing_package_says_pip_install(write_model):
    path = write_model("""
        import torch
        import optplan_no_such_package_xyz.sub
        """)
    expect_error(path, "missing package 'optplan_no_such_package_xyz'", "pip install optplan_no_such_package_xyz")


def test_import_raises(write_model):
    path = write_model("""
        raise RuntimeError("config file missing")
        """)
    expect_error(path, "importing the file raised RuntimeError: config file missing", "__main__")


def test_no_builder_found(write_model):
    path = write_model("""
        import torch.nn as nn

        class NeedsArgs(nn.Module):
            def __init__(self, width):
                super().__init__()
                self.fc = nn.Linear(width, width)

        def helper():
            return 1
        """)
    expect_error(path, "no model found", "build_model()")


def test_builder_raises_names_exception(write_model):
    path = write_model("""
        def build_model():
            raise ValueError("no checkpoint at /data/ckpt.pt")
        """)
    expect_error(path, "build_model() raised ValueError: no checkpoint at /data/ckpt.pt", "meta")


def test_builder_returns_non_module(write_model):
    path = write_model("""
        def build_model():
            return {"layers": 12}
        """)
    expect_error(path, "build_model() returned dict, not a torch.nn.Module", "return the model")


def test_example_batch_rejected_by_forward(write_model):
    path = write_model("""
        import torch, torch.nn as nn

        def build_model():
            return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))

        def example_batch(batch_size, seq_len):
            return torch.randn(batch_size, 10)
        """)
    expect_error(path, "the model rejected example_batch(1, 1024): forward raised RuntimeError",
                 "make example_batch(batch_size, seq_len) return what forward takes")


def test_forward_raising_in_the_model_file_is_named_as_the_model_s_bug(write_model):
    """An exception raised by the model file's own forward (not a torch layer refusing the batch) names its line,
    and does not blame example_batch."""
    path = write_model("""
        import torch, torch.nn as nn

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.l = nn.Linear(8, 8)

            def forward(self, x):
                raise ValueError("my bug in forward")

        def build_model():
            return M()

        def example_batch(batch_size, seq_len):
            return torch.randn(batch_size, 8)
        """)
    err = expect_error(path, "forward raised ValueError: my bug in forward at line 10 of the model file",
                       "fix forward at that line")
    assert "rejected" not in err.problem


def test_example_batch_raises(write_model):
    path = write_model("""
        import torch.nn as nn

        def build_model():
            return nn.Linear(4, 4)

        def example_batch(batch_size, seq_len):
            raise KeyError("dataset")
        """)
    expect_error(path, "example_batch(1, 1024) raised KeyError", "example_batch(batch_size, seq_len)")


def test_no_example_batch_for_non_token_model(write_model):
    path = write_model("""
        import torch.nn as nn

        def build_model():
            return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        """)
    expect_error(path, "no example_batch", "add example_batch(batch_size, seq_len)")


def test_optplan_not_a_dict(write_model):
    path = write_model("""
        import torch.nn as nn
        OPTPLAN = [("seq_len", 128)]

        def build_model():
            return nn.Linear(4, 4)
        """)
    expect_error(path, "OPTPLAN must be a dict, got list", "OPTPLAN = {")


def test_optplan_bad_value(write_model):
    path = write_model("""
        import torch.nn as nn
        OPTPLAN = {"seq_len": "2k"}

        def build_model():
            return nn.Linear(4, 4)
        """)
    expect_error(path, "OPTPLAN['seq_len'] must be a positive integer", "2048")


def test_several_candidates_ask_for_model_name(write_model):
    path = write_model("""
        import torch, torch.nn as nn

        class Small(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(8, 2)
            def forward(self, x):
                return self.fc(x)

        class Big(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(8, 4)
            def forward(self, x):
                return self.fc(x)

        def example_batch(batch_size, seq_len):
            return torch.randn(batch_size, 8)
        """)
    expect_error(path, "several models found", "Big, Small", "--model-name Big")


def test_loss_fn_raises(write_model):
    path = write_model("""
        import torch, torch.nn as nn

        def build_model():
            return nn.Linear(4, 4)

        def example_batch(batch_size, seq_len):
            return torch.randn(batch_size, 4)

        def loss_fn(output, batch):
            return output["loss"]
        """)
    expect_error(path, "loss_fn(output, batch) raised", "scalar tensor")


def test_child_crash_reports_last_stderr_line(write_model):
    path = write_model("""
        import os, sys

        def build_model():
            print("allocating the world", file=sys.stderr, flush=True)
            os._exit(7)
        """)
    expect_error(path, "crashed (exit code 7)", "allocating the world", "to see the full error")


def test_child_timeout(write_model):
    path = write_model("""
        import sys, time
        print("waiting for the cluster", file=sys.stderr, flush=True)
        time.sleep(120)
        """)
    expect_error(path, "did not finish within 3 s", "raise the timeout", timeout_s=3)


def test_garbage_output_is_a_model_file_error():
    with pytest.raises(ModelFileError, match="printed no JSON profile"):
        parse_child_output("m.py", 0, "hello\n", "")
    with pytest.raises(ModelFileError, match="killed by signal 9.*oom"):
        parse_child_output("m.py", -9, "", "oom\n")
    with pytest.raises(ModelFileError, match="invalid profile"):
        parse_child_output("m.py", 0, '{"name": "x"}', "")


def test_user_prints_do_not_break_the_json(write_model):
    path = write_model("""
        import os, torch, torch.nn as nn
        print("hello from import")
        os.write(1, b"raw fd write\\n")

        def build_model():
            print("building")
            return nn.Linear(4, 2)

        def example_batch(batch_size, seq_len):
            return torch.randn(batch_size, 4)
        """)
    profile = profile_model_file(path)
    assert profile.params == 10


def test_missing_package_names_the_pypi_distribution_when_it_differs(write_model):
    path = write_model("""
        import torch
        import sklearn.linear_model
        """)
    expect_error(path, "missing package 'sklearn'", "scikit-learn on PyPI")


@pytest.mark.parametrize("how", ["cancel", "timeout", "ok"])
def test_the_profiler_leaves_nothing_in_tmpdir(write_model, tmp_path, monkeypatch, how):
    """torch's compile cache folder is made and removed by the parent, so a child killed by a cancel
    or a timeout (no clean-up code runs in it) leaves nothing behind either."""
    from optplan.estimators.errors import Cancelled
    from optplan.probes.loader import profile_model_file

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    marker = tmp_path / "started"
    hang = "" if how == "ok" else f"open({str(marker)!r}, 'w').close()\n            time.sleep(120)"
    path = write_model(f"""
        import time, torch, torch.nn as nn
        def build_model():
            {hang}
            return nn.Linear(4, 4)
        def example_batch(batch_size, seq_len):
            return torch.zeros(batch_size, 4)
        """)
    if how == "cancel":
        with pytest.raises(Cancelled):
            profile_model_file(path, cancelled=marker.exists)
    elif how == "timeout":  # killed once build_model() runs (8 s, else once more with 20 s on a loaded machine)
        for timeout in (8, 20):
            with pytest.raises(ModelFileError, match=f"did not finish within {timeout} s"):
                profile_model_file(path, timeout_s=timeout)
            if marker.exists():
                break
        assert marker.exists()
    else:
        assert profile_model_file(path).params == 20
    assert sorted(p.name for p in tmp.iterdir()) == []


def test_a_torch_operator_failing_on_a_model_file_line_is_the_models_bug_not_the_batch(write_model):
    """A ``.view`` of the wrong shape raises inside torch (the fake-tensor dispatch below the file's frame): the line
    that called it is named; a layer (``nn.Linear``) refusing the batch's shape still asks for example_batch."""
    path = write_model("""
        import torch, torch.nn as nn

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.l = nn.Linear(8, 8)

            def forward(self, x):
                h = self.l(x)
                return h.view(3, -1, 7)

        def build_model():
            return M()

        def example_batch(batch_size, seq_len):
            return torch.randn(batch_size, 8)
        """)
    err = expect_error(path, "forward raised RuntimeError: shape '[3, -1, 7]' is invalid", "fix forward at that line")
    assert "at line 11 of the model file" in err.problem and "rejected" not in err.problem
