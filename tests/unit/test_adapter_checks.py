"""Adapter tensors of every dtype and corrupt values (issue #28 item 7): integer/boolean tensors are refused from the
header as the checkpoint loader refuses them; NaN/Inf/huge entries and a NaN VSA gate are refused naming the adapter
and the tensor, up front (`check_adapter`) and by the loader itself (`AdapterFusion`); a corrupt header is one line."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from h3render.checkpoint.adapter import TINY_BASE_MODEL, AdapterFusion, check_adapter, native_shapes, read_adapter
from h3render.checkpoint.adapter_checks import MAX_ABS
from h3render.checkpoint.errors import AdapterError
from h3render.make_checkpoint.synthetic_adapter import write_synthetic_adapter
from h3render.models.dit_config import DIT_TINY



def _tensors(path):
    with safe_open(path, framework="pt", device="cpu") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def _rewrite(tmp_path, change, gates=False):
    """A synthetic tiny adapter with `change(tensors)` applied; returns (path, the key changed)."""
    src = write_synthetic_adapter(tmp_path / "src.safetensors", DIT_TINY, 0, with_set_weight=gates)
    tensors, meta = _tensors(src)
    key = change(tensors)
    out = tmp_path / "bad.safetensors"
    save_file(tensors, out, metadata=meta)
    return out, key


def _first(tensors, suffix):
    return next(k for k in sorted(tensors) if k.endswith(suffix))


def _fuse_all(path):
    adapter = read_adapter(path, base_model=TINY_BASE_MODEL)
    fusion = AdapterFusion(adapter, DIT_TINY)
    for name, shape in native_shapes(DIT_TINY).items():
        fusion(name, torch.zeros(shape))


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool])
def test_integer_and_boolean_adapter_tensors_are_refused_from_the_header(tmp_path, dtype):
    def to_int(t):
        key = _first(t, "lora_A.weight")
        t[key] = (t[key] * 10).to(dtype)
        return key

    path, key = _rewrite(tmp_path, to_int)
    with pytest.raises(AdapterError) as info:
        read_adapter(path, base_model=TINY_BASE_MODEL)
    message = str(info.value)
    assert message.startswith(f"{path}: tensor {key!r} is stored as ") and "floating point" in message
    assert "\n" not in message


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_every_floating_dtype_is_accepted_and_fused(tmp_path, dtype):
    def to_float(t):
        for k in t:
            t[k] = t[k].to(dtype)
        return None

    path, _ = _rewrite(tmp_path, to_float)
    check_adapter(path, base_model=TINY_BASE_MODEL)
    _fuse_all(path)


@pytest.mark.parametrize("bad, word", [(float("nan"), "NaN"), (float("inf"), "inf"), (-float("inf"), "-inf"),
                                       (MAX_ABS * 4, "magnitude")])
@pytest.mark.parametrize("suffix", ["lora_B.weight", ".diff", ".diff_b"])
def test_non_finite_or_huge_entries_are_refused_naming_the_adapter_and_tensor(tmp_path, bad, word, suffix):
    def poison(t):
        key = _first(t, suffix)
        t[key] = t[key].clone()
        t[key].view(-1)[t[key].numel() // 2] = bad
        return key

    path, key = _rewrite(tmp_path, poison)
    read_adapter(path, base_model=TINY_BASE_MODEL)  # the header is fine
    for check in (lambda: check_adapter(path, base_model=TINY_BASE_MODEL), lambda: _fuse_all(path)):
        with pytest.raises(AdapterError) as info:
            check()
        assert str(info.value).startswith(f"{path}: tensor {key!r}") and word in str(info.value)


def test_a_nan_vsa_gate_is_refused_as_a_gate(tmp_path):
    def poison(t):
        key = _first(t, "to_gate_compress.set_weight")
        t[key] = torch.full_like(t[key], float("nan"))
        return key

    path, key = _rewrite(tmp_path, poison, gates=True)
    for check in (lambda: check_adapter(path, base_model=TINY_BASE_MODEL), lambda: _fuse_all(path)):
        with pytest.raises(AdapterError, match="a VSA gate") as info:
            check()
        assert str(info.value).startswith(f"{path}: tensor {key!r} (a VSA gate) holds NaN")


def test_factors_within_bounds_whose_product_overflows_are_refused(tmp_path):
    def overflow(t):
        a, b = _first(t, "lora_A.weight"), None
        b = a.replace("lora_A", "lora_B")
        t[a] = torch.full_like(t[a], MAX_ABS)
        t[b] = torch.full_like(t[b], MAX_ABS)
        return b

    path, _ = _rewrite(tmp_path, overflow)
    with pytest.raises(AdapterError, match="gives non-finite weights"):
        _fuse_all(path)


@pytest.mark.parametrize("garble", ["truncate", "header"])
def test_a_corrupt_adapter_header_is_one_line_up_front(tmp_path, garble):
    path = write_synthetic_adapter(tmp_path / "a.safetensors", DIT_TINY, 0)
    data = bytearray(path.read_bytes())
    if garble == "truncate":
        data = data[: len(data) // 3]
    else:
        data[8:20] = b"not json!!!!"
    path.write_bytes(bytes(data))
    with pytest.raises(AdapterError) as info:
        check_adapter(path, base_model=TINY_BASE_MODEL)
    assert str(info.value).startswith(f"{path}: not a readable safetensors file") and "\n" not in str(info.value)


def test_the_value_scan_hashes_the_file_in_the_same_pass_and_the_load_reuses_it(tmp_path, monkeypatch):
    """The one check reads every value in the pass that computes the sidecar's sha256 (`scan_file`), and the load
    in the same process takes that digest instead of reading the file again; a file changed since is hashed again."""
    import hashlib
    import os

    from h3render.checkpoint import adapter as adapter_mod
    from h3render.checkpoint.adapter_checks import known_digest, scan_file

    path = write_synthetic_adapter(tmp_path / "a.safetensors", DIT_TINY, 0, with_set_weight=True)
    want = hashlib.sha256(path.read_bytes()).hexdigest()
    assert known_digest(path) is None
    adapter = check_adapter(path, base_model=TINY_BASE_MODEL)
    assert adapter.sha256 == want and known_digest(path) == want
    opened = []
    real_open = type(path).open
    monkeypatch.setattr(type(path), "open", lambda self, *a, **k: opened.append(self) or real_open(self, *a, **k))
    assert read_adapter(path, base_model=TINY_BASE_MODEL).sha256 == want and opened == []  # no second read
    monkeypatch.undo()
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert known_digest(path) is None
    assert adapter_mod._file_sha256(path) == want  # hashed again: the same bytes
    assert scan_file(path) == want
