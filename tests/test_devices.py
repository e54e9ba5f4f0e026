"""The quick tier's check that an edit of model.py still shards: one train step of a tiny model on
1 device and on 2 (FSDP, every large parameter split in two) gives the same loss, gradients and
updated parameters. test_train.py's test_fsdp_matches_one_device does the same on 8 devices."""
import numpy as np

from conftest import ROOT, assert_same_step, run_each


def test_one_step_on_two_devices_equals_one_device(tmp_path):
    saved = [tmp_path / f"d{n}.npz" for n in (1, 2)]
    for r in run_each([[str(ROOT / "tests/fsdp_probe.py"), str(n), str(saved[n - 1])] for n in (1, 2)]):
        assert r.returncode == 0, r.stderr[-2000:]
    one, two = map(np.load, saved)
    assert_same_step(two, one)
