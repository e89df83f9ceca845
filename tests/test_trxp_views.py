"""Zero-copy decode: a sampled batch's tensors are views over buffers the batch owns, one per
dtype, byte for byte what Trinity-RFT's own Experience.deserialize_many reads from the payload."""

from __future__ import annotations

import itertools
import warnings
from pathlib import Path

import pytest
import torch

from expbuf.client import BufferClient, trxp
from expbuf.client.schema.experience import TENSOR_FIELDS

from conftest import payload


def import_frameworks() -> None:
    """Run by tests/conftest.py before this module's tests: not at its import, which every pytest worker does."""
    global trinity
    trinity = pytest.importorskip("trinity.common.experience")


FIXTURES = sorted(p.name for p in (Path(__file__).parent / "fixtures" / "trxp").glob("*.trxp"))


def tensors(exp: object) -> dict[str, torch.Tensor]:
    """Every tensor of an experience (expbuf's or Trinity-RFT's), by field."""
    found = {name: t for name in TENSOR_FIELDS if isinstance(t := getattr(exp, name, None), torch.Tensor)}
    found |= {f"mm:{key}": t for key, t in (getattr(exp, "multi_modal_inputs", None) or {}).items()}
    return found


def assert_same_as_trinity(ours: list, data: bytes) -> None:
    theirs = trinity.Experience.deserialize_many(data)
    assert len(ours) == len(theirs)
    for mine, ref in zip(ours, theirs, strict=True):
        got, want = tensors(mine), tensors(ref)
        assert got.keys() == want.keys()
        for name, tensor in want.items():
            assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
            assert bytes(got[name].contiguous().view(torch.uint8).reshape(-1).numpy()) == bytes(
                tensor.contiguous().view(torch.uint8).reshape(-1).numpy()
            ), name


def inside(tensor: torch.Tensor, buffer: memoryview) -> bool:
    base = torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()
    return base <= tensor.data_ptr() and tensor.data_ptr() + tensor.nbytes <= base + len(buffer)


def one_arena(exps: list) -> bool:
    """Whether the tensors of each dtype lie back to back, each aligned to its element size,
    in one span of memory: views over one gathered buffer per dtype, not a copy
    each."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for e in exps:
        for t in tensors(e).values():
            if t.numel():
                by_dtype.setdefault(t.dtype, []).append(t)
    for dtype, made in by_dtype.items():
        made.sort(key=torch.Tensor.data_ptr)
        if any(t.data_ptr() % dtype.itemsize for t in made):
            return False
        if any(b.data_ptr() != a.data_ptr() + a.nbytes for a, b in itertools.pairwise(made)):
            return False
    return True


@pytest.mark.parametrize("name", FIXTURES)
def test_views_hold_trinitys_values_and_share_the_buffer(name: str) -> None:
    data = payload(name)
    assert_same_as_trinity(trxp.decode(data), data)
    assert one_arena(trxp.decode(data))
    items = trxp.parse(data)
    buffers, made = trxp.gather(items)
    exps = [trxp.to_experience(item, tensors) for item, tensors in zip(items, made, strict=True)]
    assert_same_as_trinity(exps, data)
    assert len(buffers) == len({raw.dtype for item in items for raw in item.tensors.values()})
    made_tensors = [t for e in exps for t in tensors(e).values() if t.numel()]
    assert all(sum(inside(t, memoryview(buffer)) for buffer in buffers) == 1 for t in made_tensors)


def test_writing_a_tensor_changes_only_the_owned_copy() -> None:
    """Views over immutable bytes would let a write change a `bytes` object: decode of bytes
    copies them once, so a tensor is writable, without torch's non-writable warning."""
    data = payload("grpo_group.trxp")
    before = bytes(data)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exp = trxp.decode(data)[0]
        exp.tokens[0] = 12345
    assert data == before
    assert exp.tokens[0] == 12345


def address(buffer: memoryview | bytearray) -> int:
    return torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()


def test_a_writable_buffer_is_shared_and_a_misaligned_tensor_is_copied() -> None:
    """A writable buffer is handed over: its tensors are views of it where aligned. Placed one
    byte off, every tensor wider than a byte lies misaligned and is copied, with the same
    values; the one-byte masks are still views."""
    data = payload("grpo_group.trxp")
    owner = bytearray(len(data) + 16)

    def placed(shift: int) -> memoryview:
        owner[shift : shift + len(data)] = data
        return memoryview(owner)[shift : shift + len(data)]

    def wide(exps: list) -> list[torch.Tensor]:
        return [t for e in exps for t in tensors(e).values() if t.dtype.itemsize > 1 and t.numel()]

    shifts = [shift for shift in range(8) if all(inside(t, placed(shift)) for t in wide(trxp.decode(placed(shift))))]
    assert shifts and shifts[0] + 1 not in shifts
    view = placed(shifts[0] + 1)
    exps = trxp.decode(view)
    assert_same_as_trinity(exps, data)
    narrow = [t for e in exps for t in tensors(e).values() if t.dtype.itemsize == 1 and t.numel()]
    assert wide(exps) and not any(inside(t, view) for t in wide(exps))
    assert narrow and all(inside(t, view) for t in narrow)


def test_a_sampled_batch_decodes_to_views_over_its_own_buffer(client: BufferClient) -> None:
    """The server packs a batch's tensors back to back, so after a 6-byte mask the next
    tensors lie off their alignment in the payload: gathered, every one is a view."""
    client.push(payload("mixed_batch.trxp"))
    batch = next(client.sample(num_groups=2, delivery="consume"))
    assert_same_as_trinity(batch.experiences, batch.payload)
    copy = bytearray(batch.payload)
    offsets = [address(raw.data) - address(copy) for item in trxp.parse(copy) for raw in item.tensors.values()]
    assert len(offsets) == 40 and len({offset % 4 for offset in offsets}) > 1  # the payload's layout is not
    assert sum(len(tensors(e)) for e in batch.experiences) == 40 and one_arena(batch.experiences)
    batch.experiences[0].advantages.zero_()  # the caller writes: the payload stays as sent
    assert batch.experiences[0].advantages.abs().sum() == 0
    assert_same_as_trinity(trxp.decode(batch.payload), batch.payload)
    assert trinity.Experience.deserialize_many(batch.payload)[0].advantages.abs().sum() > 0
