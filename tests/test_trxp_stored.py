"""The stored form of an experience is part of the data directory format: the same pushed
item packs to the same bytes, and so the same digest, in every release and whichever encoder
sent it."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from expbuf.client import EID, Experience, trxp
from expbuf.server.store import Entry

from conftest import MANIFEST, payload

# sha256 of the packed items of each payload, concatenated: what the store keeps today. A change
# here changes the digests that recognise a retried push as a duplicate of what is stored.
PINNED = {
    "dpo.trxp": "eb6aa2ab52dbb24dc6a3d83710d83f2323d68dd810ea29732d7cb5cb1c9aced7",
    "empty_batch.trxp": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "grpo_group.trxp": "a1747d667a2a46a15700170fa407c4f532cf6223ef1eba2faeba128745c92818",
    "mixed_batch.trxp": "90c2d3f236b0ce275805d7e91993f49bcfa278d34b2b57c2e1ff4c764fdc52a1",
    "multi_turn.trxp": "6ef9df8010b987647d9d94dc16fc0d96912c0b7865628335de395365df86273f",
    "rich_fields.trxp": "5470463ae09a34b1f17d6733f91bcf7eb3bcef0be2932fa4fdab7814c409bb13",
    "single_turn.trxp": "60375a1efc8a08ba5d35dcdee353b84733e610e035135d35551480e27ee8a58b",
    "tricky": "e09bcc7b4815993869f14de5c38f5aca9968f66b745c730b3b6ddcbc6e7a3a4b",
    "large values": "224f57b5f9c0266f47a0d0ee0d5583f247f99b2f045d5ae0e88166e24089a9cc",
}


def tricky_payload() -> bytes:
    """Metadata the fast paths of packing must not get wrong: keys out of order, str and bytes
    keys together, tuples, a dict shared by two fields, non-ASCII text, ints of every width,
    and tensor names that JSON must escape."""
    shared = {"z": 1, "a": [1, 2, (3, "ü")]}
    info = {
        "model_version": 4,
        "priority": 0.5,
        b"raw": b"\x00\xff",
        "zeta": shared,
        "alpha": shared,
        "ints": [0, -1, 255, 256, 65535, -(2**31), 2**31, 2**63 - 1, -(2**63), 2**200],
        "flags": (True, False, None),
        "nested": {"b": {"d": [], "c": {}}, "a": ()},
        "text": "naïve — 東京 \U0001f600",
    }
    exps = [
        Experience(
            eid=EID(batch="b/ü", task="t", run=run, step=2, suffix="s"),
            tokens=torch.arange(6, dtype=torch.int64),
            prompt_length=2,
            logprobs=torch.full((4,), -0.25),
            action_mask=torch.tensor([True, False, True, True]),
            reward=-1.5,
            info=info,
            metrics={"m2": 2.0, "m1": 1},
            messages=[{"role": "user", "content": 'quote " and \\ and \n'}],
            multi_modal_inputs={
                'pix"el\\s': torch.ones(2, 2),
                "größe": torch.tensor([1, 2], dtype=torch.int16),
                "ctrl\x01": torch.zeros(1, dtype=torch.uint8),
            },
        )
        for run in range(2)
    ]
    return trxp.encode(exps)


def large_values_payload() -> bytes:
    """Metadata with str and bytes values of 64 KiB and more, which the pickler writes past its
    buffer: ASCII and non-ASCII text, bytes, a large key, a large value shared by two fields,
    large values first and last in their dict, and a response text of its own."""
    shared = bytes(range(256)) * 300
    info = {
        "a": "x" * 70_000,
        "model_version": 2,
        "m": {"one": shared, "two": shared, "tail": "東京" * 40_000},
        "k" * 66_000: b"v",
        "z": bytes(65_536),
    }
    exp = Experience(
        eid=EID(batch="big", task="t", run=0, suffix="s"),
        tokens=torch.arange(6, dtype=torch.int64),
        prompt_length=2,
        reward=0.5,
        info=info,
        response_text="y" * 100_000,
    )
    return trxp.encode([exp])


def payloads() -> dict[str, bytes]:
    return {
        **{name: payload(name) for name in sorted(MANIFEST["payloads"])},
        "tricky": tricky_payload(),
        "large values": large_values_payload(),
    }


@pytest.mark.parametrize("name", sorted(PINNED))
def test_stored_bytes_are_pinned(name: str) -> None:
    items = trxp.parse(payloads()[name])
    blobs = [trxp.pack_item(item) for item in items]
    assert hashlib.sha256(b"".join(blobs)).hexdigest() == PINNED[name]
    for item, blob in zip(items, blobs, strict=True):
        entry = Entry.of(item)
        assert entry.blob == blob
        assert entry.digest == xxhash.xxh3_128_digest(blob)
        assert trxp.parse(blob) == [item]


plain = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=False),
        st.text(max_size=6),
        st.binary(max_size=6),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.tuples(inner, inner), st.dictionaries(st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=12,
)


def reversed_keys(value: Any) -> Any:
    """The same plain data with every dict's keys in the opposite order, as another client may write them."""
    if isinstance(value, dict):
        return {key: reversed_keys(value[key]) for key in reversed(value)}
    if isinstance(value, (list, tuple)):
        return type(value)(reversed_keys(inner) for inner in value)
    return value


@given(st.lists(st.dictionaries(st.text(max_size=6), plain, max_size=5), min_size=1, max_size=3))
@settings(max_examples=60, deadline=None)
def test_an_experience_is_stored_as_the_same_bytes_and_digest_whichever_encoder_sent_it(infos: list[dict]) -> None:
    """Trinity-RFT's layout (expbuf's encoder writes its bytes), the stored form a sampled batch
    is sent in, and a client that writes every dict's keys in another order: the store keeps
    the same bytes and XXH3-128 digest of each, so a retry from any of them is a duplicate."""
    exps = [
        Experience(
            eid=EID(batch=0, task=index, run=0, suffix="s"),
            tokens=torch.arange(3 + index, dtype=torch.int32),
            prompt_length=1,
            reward=float(index),
            info=info,
        )
        for index, info in enumerate(infos)
    ]
    items = trxp.parse(trxp.encode(exps))
    shuffled = [trxp.RawItem(reversed_keys(item.meta), item.tensors) for item in items]
    sources = [
        trxp.encode(exps),
        trxp.join([trxp.pack_item(item) for item in items]),
        trxp.build(shuffled),
    ]
    stored = [[(e.uid, e.blob, e.digest) for e in map(Entry.of, trxp.parse(source))] for source in sources]
    assert stored[0] == stored[1] == stored[2]
    for _, blob, digest in stored[0]:
        assert digest == xxhash.xxh3_128_digest(blob)
