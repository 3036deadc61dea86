"""`mmserve.checkpoint.load_weights`: safetensors files streamed into a module, one tensor at a time;
`write_safetensors`: one written the same way."""

import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from mmserve.checkpoint import load_weights, stored_tensors, write_safetensors


class Small(nn.Module):
    def __init__(self, dtype=torch.float32, tied=False):
        super().__init__()
        self.embed = nn.Embedding(10, 4, dtype=dtype)
        self.proj = nn.Linear(4, 6, dtype=dtype)  # the checkpoint stores it as two halves
        self.head = nn.Linear(4, 10, bias=False, dtype=dtype, device="meta" if tied else None)
        if tied:
            self.head.weight = self.embed.weight


def _tensors(seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed.weight": torch.randn(10, 4, generator=g),
        "model.proj.top": torch.randn(3, 4, generator=g),
        "model.proj.bottom": torch.randn(3, 4, generator=g),
        "model.proj.bias": torch.randn(6, generator=g),
        "model.head.weight": torch.randn(10, 4, generator=g),
        "vision.never_read": torch.randn(1000, generator=g),
    }


def _write(path, tensors: dict[str, torch.Tensor], shards: int = 1, dtype=torch.float32):
    path.mkdir(exist_ok=True)
    keys = list(tensors)
    if shards == 1:
        save_file({k: v.to(dtype) for k, v in tensors.items()}, str(path / "model.safetensors"))
        return path
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = keys[i::shards]
        save_file({k: tensors[k].to(dtype) for k in part}, str(path / name))
        weight_map.update(dict.fromkeys(part, name))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


def rename(key: str) -> str | None:
    return key[len("model."):] if key.startswith("model.") else None


def join_halves(waiting: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if "proj.top" in waiting and "proj.bottom" in waiting:
        return {"proj.weight": torch.cat([waiting.pop("proj.top"), waiting.pop("proj.bottom")])}
    return {}


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("stored,wanted", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                           (torch.float32, torch.float64)])
def test_every_tensor_lands_in_its_parameter(tmp_path, shards, stored, wanted):
    tensors = _tensors()
    path = _write(tmp_path / "ckpt", tensors, shards, stored)
    module = Small(wanted)
    report = load_weights(module, path, rename, convert=join_halves)
    expect = {k: v.to(stored).to(wanted) for k, v in tensors.items()}
    torch.testing.assert_close(module.embed.weight, expect["model.embed.weight"], rtol=0, atol=0)
    torch.testing.assert_close(module.proj.weight, torch.cat([expect["model.proj.top"], expect["model.proj.bottom"]]),
                               rtol=0, atol=0)
    torch.testing.assert_close(module.head.weight, expect["model.head.weight"], rtol=0, atol=0)
    assert module.proj.weight.dtype == wanted
    assert "vision.never_read" not in report.keys_read and len(report.keys_read) == 5
    assert report.bytes_read == sum(t.numel() * stored.itemsize for k, t in tensors.items() if k != "vision.never_read")


def test_another_dtype_is_read_in_chunks_exactly(tmp_path, monkeypatch):
    """bf16 on disk into float32 parameters, 12 bytes (6 values) of the file at a time: each tensor
    (40 values: a partial last chunk) lands whole, through no buffer of its size."""
    import mmserve.checkpoint

    monkeypatch.setattr(mmserve.checkpoint, "_CONVERT_CHUNK", 12)
    chunks = []
    read_into = mmserve.checkpoint._read_into
    monkeypatch.setattr(mmserve.checkpoint, "_read_into", lambda f, stored, out: chunks.append(out.numel()) or
                        read_into(f, stored, out))
    tensors = _tensors()
    module = Small(torch.float32)
    load_weights(module, _write(tmp_path / "ckpt", tensors, dtype=torch.bfloat16), rename, convert=join_halves)
    for name in ("embed", "head"):
        expected = tensors[f"model.{name}.weight"].to(torch.bfloat16).float()
        torch.testing.assert_close(getattr(module, name).weight, expected, rtol=0, atol=0)
    assert 40 not in chunks and chunks.count(4) == 2  # embed and head: 40 values = 6 x 6 + 4 each


def test_tied_weights_are_one_tensor_and_never_overwritten(tmp_path):
    tensors = _tensors()
    path = _write(tmp_path / "ckpt", tensors)
    module = Small(tied=True)
    report = load_weights(module, path, rename, convert=join_halves, optional=frozenset({"head.weight"}))
    assert module.head.weight is module.embed.weight
    torch.testing.assert_close(module.embed.weight, tensors["model.embed.weight"], rtol=0, atol=0)
    assert "model.head.weight" not in report.keys_read


def test_the_header_is_read_without_the_data(tmp_path):
    path = _write(tmp_path / "ckpt", _tensors(), dtype=torch.bfloat16)
    stored = {t.key: t for t in stored_tensors(path / "model.safetensors")}
    assert stored["vision.never_read"].shape == (1000,) and stored["vision.never_read"].nbytes == 2000
    assert stored["model.proj.top"].dtype == torch.bfloat16
    starts = [t.start for t in stored_tensors(path / "model.safetensors")]
    assert starts == sorted(starts)


def test_a_missing_tensor_is_named(tmp_path):
    tensors = _tensors()
    del tensors["model.proj.bias"]
    with pytest.raises(ValueError, match="checkpoint lacks tensors of the model: \\['proj.bias'\\]"):
        load_weights(Small(), _write(tmp_path / "ckpt", tensors), rename, convert=join_halves)


def test_a_tensor_of_the_wrong_shape_is_named(tmp_path):
    tensors = _tensors()
    tensors["model.embed.weight"] = torch.zeros(11, 4)
    with pytest.raises(ValueError, match=r"embed.weight has shape \(11, 4\), the model expects \(10, 4\)"):
        load_weights(Small(), _write(tmp_path / "ckpt", tensors), rename, convert=join_halves)


def test_a_tensor_with_no_place_is_named(tmp_path):
    with pytest.raises(ValueError, match="no place in the model: \\['proj.bottom', 'proj.top'\\]"):
        load_weights(Small(), _write(tmp_path / "ckpt", _tensors()), rename)


def test_the_fingerprint_hook_sees_each_tensor_as_stored(tmp_path):
    tensors = _tensors()
    path = _write(tmp_path / "ckpt", tensors, dtype=torch.bfloat16)
    seen = {}
    load_weights(Small(torch.float32), path, rename, convert=join_halves,
                 on_read=lambda key, t: seen.setdefault(key, (t.dtype, t.clone())))
    assert set(seen) == {k for k in tensors if k.startswith("model.")}
    dtype, tensor = seen["model.head.weight"]
    assert dtype == torch.bfloat16
    torch.testing.assert_close(tensor, tensors["model.head.weight"].to(torch.bfloat16), rtol=0, atol=0)


def test_a_file_written_tensor_by_tensor_reads_back_aligned(tmp_path):
    """Mixed element sizes, in any order: safetensors reads every tensor back bit for bit, each
    starting at a multiple of its element size; an existing file is replaced, no spool left."""
    from safetensors import safe_open

    tensors = {"b": torch.randn(3, 5).to(torch.bfloat16), "w8": torch.randn(7, 3).to(torch.float8_e4m3fn),
               "s": torch.rand(2, 1), "q": torch.randint(-2 ** 31, 2 ** 31 - 1, (3, 2), dtype=torch.int32),
               "h": torch.randn(5).half(), "one": torch.tensor(1.5, dtype=torch.float64)}
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"old")
    write_safetensors(path, iter(tensors.items()), metadata={"format": "pt"})
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        for key, tensor in tensors.items():
            assert f.get_tensor(key).dtype == tensor.dtype
            assert torch.equal(f.get_tensor(key).reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))
    assert all(t.start % torch.empty((), dtype=t.dtype).element_size() == 0 for t in stored_tensors(path))
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]
