"""ref2va's DiT partition (`transformer_ref`): make-checkpoint writes it in the official (`Ref2VA/transformer/`) and
diffusers (`transformer_ref/`) layouts, the loader reads it back as the built-in model's own, its weights differ
from the base DiT's, and a checkpoint without it says so by name."""

import shutil

import pytest
import torch

from h3render.checkpoint.errors import CheckpointError
from h3render.checkpoint.info import read_checkpoint_info
from h3render.checkpoint.load import load_partition_dit
from h3render.make_checkpoint.writer import make_checkpoint
from tests._cli import invoke, one_error_line
from tests._media import png


def test_partition_in_every_folder_layout(tmp_path):
    builtin = load_partition_dit(read_checkpoint_info("tiny"), "transformer_ref").state_dict()
    base = load_partition_dit(read_checkpoint_info("tiny"), "transformer").state_dict()
    assert all(not torch.equal(builtin[k], base[k]) for k in base if base[k].numel() > 1)
    for layout, folder in (("official", "Ref2VA/transformer"), ("diffusers", "transformer_ref")):
        root = make_checkpoint(tmp_path / layout, "tiny", layout, shards=2)
        info = read_checkpoint_info(root)
        assert info.transformer_ref == str(root / folder)
        loaded = load_partition_dit(info, "transformer_ref").state_dict()
        assert all(torch.equal(loaded[k], builtin[k]) for k in builtin), layout
        shutil.rmtree(root / folder)
        if layout == "official":  # a ref2va job on a checkpoint without the partition: one line, exit 2, nothing run
            png(tmp_path / "r.png")
            result = invoke("prompt", "a fox", "--reference", str(tmp_path / "r.png"), "--checkpoint", str(root),
                            "-o", str(tmp_path / "o.mp4"), "--device", "cpu")
            assert "no ref2va DiT partition" in one_error_line(result) and not (tmp_path / "o.mp4").exists()
        info = read_checkpoint_info(root)
        assert info.transformer_ref is None
        with pytest.raises(CheckpointError, match=f"no ref2va DiT partition \\({folder}/ missing\\)"):
            load_partition_dit(info, "transformer_ref")
    with pytest.raises(CheckpointError, match="unknown DiT partition"):
        load_partition_dit(read_checkpoint_info("tiny"), "transformer_x")
