"""Safetensors folders (moe.hf.io) and the part of a checkpoint tensor one rank reads
(moe.hf.weights._read_part), on small tensors written here: no model is built."""

import json

import pytest
import torch

from moe.hf.io import INDEX, SafetensorsReader, write_safetensors
from moe.hf.weights import _read_part
from moe.model.sharding import Shard


def tensors(n: int = 4, shape=(2, 5)) -> dict[str, torch.Tensor]:
    """n float32 tensors t0.. with distinct values (40 bytes each at the default shape)."""
    numel = torch.Size(shape).numel()
    return {f"t{i}": torch.arange(numel, dtype=torch.float32).view(shape) + 100 * i
            for i in range(n)}


def test_shards_fill_up_to_the_limit_and_are_indexed(tmp_path):
    """Hugging Face's layout: 1-based `model-0000i-of-0000n` names, each shard filled up to
    max_shard_bytes (a tensor that just fits stays), an index with the size in bytes."""
    want = tensors()
    files = write_safetensors(want, str(tmp_path), max_shard_bytes=80)
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = json.load(open(tmp_path / INDEX))
    assert index["metadata"]["total_size"] == 160
    assert index["weight_map"] == {"t0": files[0], "t1": files[0], "t2": files[1],
                                   "t3": files[1]}
    reader = SafetensorsReader(str(tmp_path))
    assert all(torch.equal(reader.read(n), t) for n, t in want.items())


def test_a_tensor_over_the_limit_gets_a_shard_of_its_own(tmp_path):
    files = write_safetensors(tensors(2), str(tmp_path / "big"), max_shard_bytes=30)
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert write_safetensors(tensors(2), str(tmp_path / "one")) == ["model.safetensors"]
    assert not (tmp_path / "one" / INDEX).exists()
    with pytest.raises(ValueError, match="max_shard_bytes=0 must be > 0"):
        write_safetensors(tensors(1), str(tmp_path / "zero"), max_shard_bytes=0)


def test_reader_slices_and_records_what_it_read(tmp_path):
    want = tensors(1, shape=(4, 6))["t0"]
    write_safetensors({"w": want}, str(tmp_path))
    reader = SafetensorsReader(str(tmp_path))
    assert torch.equal(reader.read("w", 0, 1, 3), want[1:3])
    assert torch.equal(reader.read("w", 1, 2, 5), want[:, 2:5])
    assert reader.reads == [("w", 0, 1, 3, 12), ("w", 1, 2, 5, 12)]
    with pytest.raises(ValueError, match="dim 2 is not supported"):
        reader.read("w", 2, 0, 1)
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors files"):
        SafetensorsReader(str(tmp_path / "empty"))


def shard(rank: int, parts: int, dim: int | None = 0) -> Shard:
    return Shard(dim=dim, rank=rank, parts=parts)


def test_fused_parts_are_split_in_row_chunks(tmp_path):
    """Each part of a fused tensor (q, k, v; gate, up) is split like the whole: rank r reads
    row chunk r; rows that do not split evenly are an error."""
    want = tensors(1, shape=(6, 2))["t0"]
    write_safetensors({"w": want}, str(tmp_path))
    reader = SafetensorsReader(str(tmp_path))
    got = _read_part(reader, "w", shard(1, 3), torch.empty(0), fused=True, vocab=False)
    assert torch.equal(got, want[2:4])
    with pytest.raises(ValueError, match="6 rows cannot be split 4 ways"):
        _read_part(reader, "w", shard(0, 4), torch.empty(0), fused=True, vocab=False)


def test_tp_chunks_pad_only_the_vocabulary(tmp_path):
    """Rank r reads chunk r along the partition dim; vocabulary rows past the checkpoint's are
    zeros (all of them on a rank past its end); any other tensor too small is an error."""
    want = tensors(1, shape=(6, 5))["t0"]
    write_safetensors({"w": want}, str(tmp_path))
    reader = SafetensorsReader(str(tmp_path))
    param = torch.empty(4, 5)
    got = _read_part(reader, "w", shard(1, 3), param, fused=False, vocab=True)
    assert torch.equal(got, torch.cat([want[4:], torch.zeros(2, 5)]))
    got = _read_part(reader, "w", shard(2, 3), param, fused=False, vocab=True)
    assert torch.equal(got, torch.zeros(4, 5))
    got = _read_part(reader, "w", shard(1, 5, dim=1), torch.empty(6, 1), fused=False,
                     vocab=False)
    assert torch.equal(got, want[:, 1:2])
    with pytest.raises(ValueError, match=r"checkpoint shape \(6, 5\) is too small for the "
                                         r"model \(needs 6 along dim 1\)"):
        _read_part(reader, "w", shard(1, 2, dim=1), torch.empty(6, 3), fused=False,
                   vocab=False)


@pytest.mark.parametrize("param_shape, part, vocab, needs", [
    ((6, 2), shard(0, 2, dim=1), False, "4 along dim 1"),  # TP columns: the last one dropped
    ((4, 5), shard(0, 1, dim=None), False, "4 along dim 0"),  # read whole: its first rows only
    ((2, 5), shard(0, 2), True, "4 along dim 0"),  # rows past the model's padded vocabulary
])
def test_a_checkpoint_tensor_larger_than_the_model_is_refused(tmp_path, param_shape, part, vocab,
                                                              needs):
    """A checkpoint tensor with more rows or columns than the model's whole tensor is refused by
    name, not read in part (a config.json that disagrees with its weights)."""
    write_safetensors(tensors(1, shape=(6, 5)), str(tmp_path))
    reader = SafetensorsReader(str(tmp_path))
    with pytest.raises(ValueError, match=r"t0: checkpoint shape \(6, 5\) is too large for the "
                                         rf"model \(needs {needs}\)"):
        _read_part(reader, "t0", part, torch.empty(param_shape), fused=False, vocab=vocab)


@pytest.mark.parametrize("index", [False, True], ids=["one_file", "indexed"])
def test_a_truncated_file_is_a_value_error_naming_it(tmp_path, index):
    """An interrupted download (a shard cut short) is a ValueError naming the file, which the
    CLI turns into one line and exit status 2, not safetensors' own exception."""
    files = write_safetensors(tensors(), str(tmp_path), max_shard_bytes=80 if index else 1000)
    path = tmp_path / files[-1]
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(ValueError, match=f"{files[-1]}: not a readable safetensors file"):
        reader = SafetensorsReader(str(tmp_path))
        reader.read("t3")


def test_an_index_that_names_the_wrong_shard_is_a_value_error(tmp_path):
    """An index whose weight_map sends a tensor to a shard without it (a hand-merged folder):
    a ValueError naming the shard and the tensor, not safetensors' own exception."""
    files = write_safetensors(tensors(), str(tmp_path), max_shard_bytes=80)
    index = json.load(open(tmp_path / INDEX))
    index["weight_map"]["t3"] = files[0]
    (tmp_path / INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"{files[0]}: .*t3.*{INDEX} lists it there"):
        SafetensorsReader(str(tmp_path)).read("t3")


def test_a_shard_missing_from_an_indexed_folder_is_file_not_found_once(tmp_path):
    """A shard the index lists but the folder lacks: FileNotFoundError naming it once (it was
    re-wrapped as a ValueError repeating the path and the index)."""
    files = write_safetensors(tensors(), str(tmp_path), max_shard_bytes=80)
    (tmp_path / files[-1]).unlink()
    with pytest.raises(FileNotFoundError) as err:
        SafetensorsReader(str(tmp_path)).read("t3")
    assert str(err.value) == f"{tmp_path / files[-1]} (listed in {INDEX}) does not exist"
