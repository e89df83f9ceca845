"""An expbuf storage backend for TransferQueue: each (sample, field) TransferQueue stores is kept
in an expbuf table as a keyed value (PutValues / GetValues / ClearValues), durable when the put
returns, so a crash of a TransferQueue storage process, or of the expbuf server, loses no field
TransferQueue was told was stored.

TransferQueue picks a backend by name (`backend.storage_backend`); this module registers
"Expbuf": a storage manager (TransferQueue's KVStorageManager, which maps its batches to keys
"{global_index}@{field}") and its client, `ExpbufStorageClient`, configured under
`backend.Expbuf`: `target` (the server) or `shards` (a sharded expbuf's servers: a list of
host:port, or a {name: host:port} map; each key is kept on one of them, as the sharded client
places keyed values), `table` (created if absent; "transfer_queue" by default), `token` where
the server asks for one, and `max_message_bytes` (the client's; a value of more than half of it
is stored in parts).

    tq.init(OmegaConf.create({"backend": {"storage_backend": "Expbuf",
                                          "Expbuf": {"target": "expbuf:50051", "table": "tq"}}}))

A tensor is stored as its dtype, shape and bytes (on the CPU: a value on a device is copied
there); anything else TransferQueue stores (strings, lists, dicts, numbers, numpy arrays: a
NonTensorStack's items) is pickled, as TransferQueue's own transports do, and loaded back with
only the names pickles.py allows: a value another writer made to run code is refused, never run.
Puts and gets are cut to stay under the client's message size. TransferQueue's controller
(which indexes and fields exist, what was consumed) is kept in the same table by controller.py.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import re
import struct
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import grpc
import torch
import xxhash
from transfer_queue.metadata import BatchMeta
from transfer_queue.storage.bootstrap.provider import StorageBootstrapProvider
from transfer_queue.storage.clients.base import StorageClientFactory, StorageKVClient
from transfer_queue.storage.managers.base import KVStorageManager, StorageManagerFactory
from transfer_queue.utils.zmq_utils import ZMQMessage, ZMQRequestType

from ..client import BufferClient
from ..errors import ExpbufError, PermissionDeniedError, UnavailableError
from ..rpc.connection import DEFAULT_MAX_MESSAGE_BYTES
from ..shards.blocking import ShardedBufferClient
from . import pickles

BACKEND = "Expbuf"
CLIENT = "ExpbufStorageClient"
TENSOR, OBJECT, PARTS = b"T", b"P", b"M"
BATCH = 8 << 20  # bytes a put or a get of the backend carries, about
# How long a call waits for the expbuf server (a restart), by default: backend.Expbuf.wait_s.
WAIT_SECONDS = 120.0
IN_FLIGHT = 4  # puts or gets of one call under way at once: encoding, sending and storing overlap
# On every shard of a sharded backend: the shards its keys are placed over, and this one's name.
PLACEMENT = "expbuf/placement"
PARTS_META = "expbuf_parts"  # what a value stored in parts reports to TransferQueue: its parts' count
PROBE_SECONDS = 5.0  # the start's first look at each server, before any call waits for one
ASK_SECONDS = 60.0  # how long a clear waits for the controller's answer on the fields its samples hold
_LEN = struct.Struct("<I")


def encode(value: Any) -> bytes:
    """A value as stored: a tensor as b"T", its header's length, a JSON header (dtype, shape) and
    its bytes; anything else as b"P" and its pickle (a TypeError naming a type pickles.py does not
    load back)."""
    if isinstance(value, torch.Tensor):
        tensor = value
        if tensor.requires_grad or tensor.device.type != "cpu" or not tensor.is_contiguous():
            tensor = tensor.detach().to("cpu").contiguous()
        head = _head(tensor.dtype, tuple(tensor.shape))
        if not tensor.numel():
            return head
        try:
            data = tensor.numpy().data
        except TypeError:  # a dtype numpy lacks (bfloat16): its bytes
            data = tensor.reshape(-1).view(torch.uint8).numpy().data
        return b"".join([head, data])  # the tensor's bytes copied once
    return OBJECT + pickles.dumps(value)


@functools.lru_cache(maxsize=4096)
def _head(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    """What a tensor's bytes follow: b"T", its header's length and the header (one a dtype and
    shape, made once: a batch's samples share a few)."""
    header = json.dumps({"dtype": str(dtype).removeprefix("torch."), "shape": list(shape)}).encode()
    return TENSOR + _LEN.pack(len(header)) + header


def decode(blob: bytes, what: str = "a stored value") -> Any:
    """A stored value back (encode's); pickles.UnsafePickle naming `what` for a pickle that names
    what this backend never stores, none of it run."""
    if blob[:1] == TENSOR:
        (size,) = _LEN.unpack_from(blob, 1)
        dtype, shape = _layout(blob[5 : 5 + size])
        data = bytearray(memoryview(blob)[5 + size :])  # one copy, writable as TransferQueue's tensors are
        if not data:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(data, dtype=dtype).reshape(shape)
    if blob[:1] == OBJECT:
        return pickles.loads(memoryview(blob)[1:], what)
    raise ValueError(f"a stored value of {len(blob)} bytes that this backend did not write")


@functools.lru_cache(maxsize=4096)
def _layout(header: bytes) -> tuple[torch.dtype, tuple[int, ...]]:
    """A tensor header's dtype and shape (read once a header: a batch's samples share a few)."""
    fields = json.loads(header)
    return getattr(torch, fields["dtype"]), tuple(fields["shape"])


@dataclass(frozen=True)
class Server:
    """The expbuf server a config names, or a sharded expbuf's servers, and how to reach them."""

    target: str | None
    shards: list[str] | dict[str, str] | None
    token: str | None
    max_message_bytes: int


def server_of(config: Mapping[str, Any], where: str) -> Server:
    """The expbuf server a config names (`target`, host:port), or a sharded expbuf's servers
    (`shards`, a list of host:port or a {name: host:port} map), with its `token` and
    `max_message_bytes`; ValueError naming `where` for any other."""
    target, shards = config.get("target"), config.get("shards")
    if bool(target) == bool(shards):
        raise ValueError(
            f"{where}: name the expbuf server as target (host:port), or a sharded expbuf's servers as shards "
            f"(a list of host:port or a {{name: host:port}} map): one of them, got target={target!r} and "
            f"shards={shards!r}"
        )
    if shards is not None:
        if isinstance(shards, str) or not isinstance(shards, (Mapping, Sequence)):
            raise ValueError(
                f"{where}: shards must be a list of host:port or a {{name: host:port}} map, got {shards!r}"
            )
        given = list(shards.values() if isinstance(shards, Mapping) else shards)
        if not all(isinstance(shard, str) and shard for shard in given):
            raise ValueError(f"{where}: a shard without its host:port in {shards!r}")
        if isinstance(shards, Mapping):
            shards = {str(name): str(shard) for name, shard in shards.items()}
        else:
            shards = [str(shard) for shard in shards]
    return Server(
        target=None if target is None else str(target),
        shards=shards,
        token=config.get("token"),
        max_message_bytes=int(config.get("max_message_bytes") or DEFAULT_MAX_MESSAGE_BYTES),
    )


def connect(server: Server, timeout: float) -> BufferClient | ShardedBufferClient:
    """The client of `server`: a call waits out a restart for up to `timeout`."""
    size, token = server.max_message_bytes, server.token
    if server.shards is not None:
        return ShardedBufferClient(
            server.shards, token=token, max_message_bytes=size, timeout=timeout, wait_for_ready=True
        )
    assert server.target is not None  # server_of names one or the other
    return BufferClient(server.target, token=token, max_message_bytes=size, timeout=timeout, wait_for_ready=True)


def open_table(client: BufferClient | ShardedBufferClient, table: str, where: str) -> None:
    """Reach the server, or each shard in turn, and the table there, before anything is put or
    sought; an error names `where` (the config's section), and a shard.

    A server whose name does not resolve here fails at once (`reach`); one that does not answer
    is waited for as a restart is, up to the client's timeout. The table is used as it is where it
    exists, which the push and sample scopes can see; one that does not is made, which takes the
    admin scope (`ensure_table`). A sharded backend finds a key on the shard it put it on only over
    the same shards, each under the same name (a list's shards are named by their place in it):
    the first start writes on every shard the names the keys are placed over and the shard's own;
    a start over other shards, or over the same ones in another order, is refused by name, before
    anything is sought where it is not."""
    if not isinstance(client, ShardedBufferClient):
        try:
            reach(client)
            ensure_table(client, table)
        except ExpbufError as exc:
            raise ExpbufError(exc.code, f"{where}: {exc.details}", exc.reason) from None
        return
    names = sorted(client.shard_map.epochs[0].shards)
    for shard, one in client.clients.items():
        mine = json.dumps({"shards": names, "this": shard}).encode()
        try:
            reach(one)
            ensure_table(one, table)
            (found,) = one.get_values([PLACEMENT], table, only_own=True)
            if found is None:
                one.put_values([PLACEMENT], [mine], table)
        except ExpbufError as exc:
            named = f"{where}: shard {shard!r} ({client.shard_map.targets[shard]}) of expbuf table {table!r}"
            raise ExpbufError(exc.code, f"{named}: {exc.details}", exc.reason) from None
        if found is not None and found != mine:
            was = json.loads(found)
            raise ValueError(
                f"expbuf table {table!r}: the server named here as shard {shard!r} "
                f"({client.shard_map.targets[shard]}) holds the keys of shard {was.get('this')!r} of "
                f"{was.get('shards')}, and this config places keys over {names}: each key would be sought on "
                "another shard than it was put on. Name the shards as the table was made with them (a "
                "{name: host:port} map keeps each shard's name as its address changes)"
            )


def reach(one: BufferClient) -> None:
    """Fail at once, in one line, where the server's name does not resolve here: no restart makes
    it answer (a wait for it would only end at the deadline, naming none of this). Any other
    failure is left to the calls after, which wait for a server that restarts."""
    probe = one.clone(wait_for_ready=False, retries=0, timeout=PROBE_SECONDS)
    try:
        probe.server_info()
    except UnavailableError as exc:
        if "resolv" in exc.details:  # gRPC's "errors resolving HOST:PORT", "DNS resolution failed"
            raise UnavailableError(
                exc.code,
                f"the expbuf server's address {one.target} does not resolve here ({exc.details}): name the server "
                "by an address this process can resolve (its host's name or IP, and its port)",
                exc.reason,
            ) from None
    except ExpbufError:
        pass  # a token without the sample scope, a server still starting: the calls after say
    finally:
        probe.close()


def ensure_table(one: BufferClient, table: str) -> None:
    """The table there as it is, seen with the sample scope; made (with default settings) where it
    does not exist, which takes the admin scope: a PermissionDeniedError saying so otherwise."""
    try:
        if any(info.name == table for info in one.list_tables()):
            return
    except PermissionDeniedError:
        pass  # a token without the sample scope: making the table tells whether it may
    try:
        one.create_table(table, exist_ok=True)
    except PermissionDeniedError as exc:
        raise PermissionDeniedError(
            exc.code,
            f"expbuf table {table!r} does not exist at {one.target}, and this token may not make it ({exc.details}): "
            f"make it once with a token of the admin scope (`expbuf table create {table}`, or create_table), then "
            "start with a token of the push and sample scopes",
            exc.reason,
        ) from None


def get_in_halves(client: BufferClient | ShardedBufferClient, keys: Sequence[str], table: str) -> list[bytes | None]:
    """The keys' values, asked for in halves where a server finds them more than a message; each
    the job's own token's (another token's is refused, never read as the job's)."""
    try:
        return client.get_values(keys, table, only_own=True)
    except ExpbufError as exc:
        if exc.code != grpc.StatusCode.RESOURCE_EXHAUSTED or len(keys) == 1:
            raise
        half = len(keys) // 2
        return get_in_halves(client, keys[:half], table) + get_in_halves(client, keys[half:], table)


@StorageClientFactory.register(CLIENT)
class ExpbufStorageClient(StorageKVClient):
    """TransferQueue's storage client over an expbuf table's keyed values."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.table = str(config.get("table") or "transfer_queue")
        wait = config.get("wait_s", WAIT_SECONDS)
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not wait > 0:
            raise ValueError(f"backend.{BACKEND}.wait_s must be a number of seconds above 0, got {wait!r}")
        # A call waits out a restart of the server for up to wait_s, as the controller's journal does.
        self.client = connect(server_of(config, f"backend.{BACKEND}"), float(wait))
        open_table(self.client, self.table, f"backend.{BACKEND}")
        self.limit = self.client.max_message_bytes // 2  # bytes a put or a get carries at most
        self.batch = min(self.limit, BATCH)
        self._pool = ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="expbuf-tq")

    def put(self, keys: list[str], values: list[Any]) -> list[Any] | None:
        """Store each value under its key. A value of more than half a message is stored in parts
        (`{key}#{n}`), then its key names how many; TransferQueue keeps that count as the field's
        custom_backend_meta and hands it back to `clear`; a key put again keeps no part of its
        earlier value. The values go in puts of about `BATCH` bytes, `IN_FLIGHT` at once, each
        encoded while the ones before it are sent."""
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys for {len(values)} values")
        named = next((key for key in keys if _PART_NAME.search(key)), None)
        if named is not None:  # its value and another field's parts would overwrite each other
            raise ValueError(
                f"field {named.partition('@')[2]!r} ends in '#' and a number, as the parts of a large value of field"
                f" {_PART_NAME.sub('', named.partition('@')[2])!r} are named in expbuf's TransferQueue backend: name it"
                " otherwise"
            )
        metas: list[dict[str, int] | None] = [None] * len(keys)
        sent: list[Future[int]] = []
        names: list[str] = []
        blobs: list[bytes] = []
        size = 0
        try:
            for at, (key, value) in enumerate(zip(keys, values, strict=True)):
                blob = encode(value)
                if len(blob) > self.limit:
                    metas[at] = {PARTS_META: (len(blob) + self.limit - 1) // self.limit}
                    blob = self._put_parts(key, blob)
                if names and size + len(blob) > self.batch:
                    sent.append(self._pool.submit(self.client.put_values, names, blobs, self.table))
                    names, blobs, size = [], [], 0
                names.append(key)
                blobs.append(blob)
                size += len(blob)
            if names:
                sent.append(self._pool.submit(self.client.put_values, names, blobs, self.table))
        finally:
            wait(sent)  # every piece ended before the call does, failed or not: none lands after a retry
        for future in sent:
            future.result()
        self._clear_earlier_parts(keys, [meta[PARTS_META] if meta else 0 for meta in metas])
        return metas if any(metas) else None

    def _clear_earlier_parts(self, keys: Sequence[str], counts: Sequence[int]) -> None:
        """Clear the parts an earlier value of each key left past its new value's `count` (all of
        them for a value stored whole), once the keys hold their new values: nothing else clears
        them (TransferQueue hands `clear` the latest put's count) and they count against the
        table's capacity. A value's parts are stored from #0 up, and cleared from the last down,
        so those left are a run from the new count up: each round clears the next names of every
        key, twice as many as the round before, until one clears none (most puts: one round of
        one name a key)."""
        start, width = 0, 1
        while True:
            ahead = range(start, start + width)
            names = [f"{key}#{count + n}" for key, count in zip(keys, counts, strict=True) for n in ahead]
            if not self.client.clear_values(names, self.table):
                return
            start, width = start + width, 2 * width

    def _put_parts(self, key: str, blob: bytes) -> bytes:
        """Store a value too large for one put in parts, durable before the key names them; what
        the key then holds: their count, the value's size and its digest, which a get checks (a put
        of the key again that dies part way leaves its first parts under the earlier value's name)."""
        count = (len(blob) + self.limit - 1) // self.limit
        for part, name in enumerate(part_keys(key, count)):
            self.client.put_values([name], [blob[part * self.limit : (part + 1) * self.limit]], self.table)
        return (
            PARTS + json.dumps({"parts": count, "bytes": len(blob), "xxh3": xxhash.xxh3_128_hexdigest(blob)}).encode()
        )

    def get(
        self, keys: list[str], shapes: Any = None, dtypes: Any = None, custom_backend_meta: Any = None
    ) -> list[Any]:
        """The values of the keys, asked for in gets of about `BATCH` bytes by the sizes
        TransferQueue expects (its shapes and dtypes), `IN_FLIGHT` at once, each decoded while
        the ones after it are read; a get the server finds too large is asked for in halves."""
        sizes = [expected_bytes(shape, dtype) for shape, dtype in zip(shapes or [], dtypes or [], strict=False)]
        sizes += [0] * (len(keys) - len(sizes))
        asked = [keys[start:end] for start, end in cuts(sizes, self.batch)]
        values: list[Any] = []
        for part, blobs in zip(
            asked, self._pool.map(lambda p: get_in_halves(self.client, p, self.table), asked), strict=True
        ):
            missing = [key for key, blob in zip(part, blobs, strict=True) if blob is None]
            if missing:
                raise KeyError(f"expbuf table {self.table!r} holds no value for {len(missing)} key(s): {missing[:5]}")
            values += [
                decode(self._whole(key, blob), f"the value of {key} in expbuf table {self.table!r}")
                for key, blob in zip(part, blobs, strict=True)
                if blob is not None
            ]
        return values

    def _whole(self, key: str, blob: bytes) -> bytes:
        """A value as stored; one stored in parts, read part by part and joined."""
        if blob[:1] != PARTS:
            return blob
        manifest = json.loads(blob[1:])
        parts = []
        for name in part_keys(key, manifest["parts"]):
            (part,) = self.client.get_values([name], self.table, only_own=True)
            if part is None:
                raise KeyError(f"expbuf table {self.table!r} lacks {name}, a part of the value of {key}")
            parts.append(part)
        whole = b"".join(parts)
        digest = manifest.get("xxh3")  # a value stored before the digest has none
        if len(whole) != manifest["bytes"] or (digest is not None and xxhash.xxh3_128_hexdigest(whole) != digest):
            raise ValueError(
                f"the value of {key} in expbuf table {self.table!r} is not the one its key names ({len(whole)} bytes of"
                f" {manifest['bytes']}, its digest checked): a put of it was cut short part way, its parts left from"
                " two puts; put it again"
            )
        return whole

    def clear(self, keys: list[str], custom_backend_meta: Any = None) -> None:
        """Clear the keys, and the parts of those whose custom_backend_meta counts parts."""
        names = list(keys)
        for key, meta in zip(keys, custom_backend_meta or [], strict=False):
            if isinstance(meta, dict) and meta.get(PARTS_META):
                names += reversed(part_keys(key, int(meta[PARTS_META])))  # a clear cut short leaves a run from #0
        for start in range(0, len(names), 4096):
            self.client.clear_values(names[start : start + 4096], self.table)

    def close(self) -> None:
        """Stop the puts' and gets' threads and close the connection."""
        self._pool.shutdown(wait=True)
        self.client.close()


def cuts(sizes: Sequence[int], bound: int) -> list[tuple[int, int]]:
    """Consecutive spans of `sizes` of at most `bound` in total (a size larger alone, alone)."""
    spans, start, total = [], 0, 0
    for at, size in enumerate(sizes):
        if at > start and total + size > bound:
            spans.append((start, at))
            start, total = at, 0
        total += size
    return [*spans, (start, len(sizes))] if sizes else []


def expected_bytes(shape: Any, dtype: Any) -> int:
    """A tensor value's bytes as stored, from its shape and dtype; 0 where either is unknown."""
    if not isinstance(dtype, torch.dtype) or shape is None:
        return 0
    try:
        count = math.prod(int(n) for n in shape)
    except (TypeError, ValueError):
        return 0
    return count * dtype.itemsize + 64


# The end of a part's key (`part_keys`), which no field's key may have.
_PART_NAME = re.compile(r"#[0-9]+$")


def part_keys(key: str, count: int) -> list[str]:
    """The keys of a value's parts."""
    return [f"{key}#{part}" for part in range(count)]


@StorageManagerFactory.register(BACKEND)
class ExpbufStorageManager(KVStorageManager):
    """TransferQueue's key-value storage manager over `ExpbufStorageClient`."""

    def __init__(self, controller_info: Any, config: dict[str, Any], zmq_context: Any = None) -> None:
        config = dict(config or {})
        if config.get("client_name") not in (None, CLIENT):
            raise ValueError(f"the {BACKEND} backend's client is {CLIENT}, not {config.get('client_name')}")
        super().__init__(controller_info, {**config, "client_name": CLIENT}, zmq_context=zmq_context)

    async def clear_data(self, metadata: BatchMeta) -> None:
        """Clear every field the samples hold. TransferQueue's kv_clear names only the fields all
        of a batch's samples hold; a field some of them hold alone would stay stored (and count
        against the table's capacity) for ever, so the partition's fields are asked for, with
        their parts' counts, and each sample's key of each is cleared (clearing a key not stored
        clears nothing). Samples of no field (keys that hold tags alone) have nothing stored here:
        TransferQueue's own key-value manager refused to clear them, and their partition stayed."""
        names: set[str] = set(metadata.field_names)
        metas: dict[int, dict[str, Any]] = {}
        for partition_id in dict.fromkeys(metadata.partition_ids):
            whole = await self._partition_meta(partition_id)
            if whole is None:
                continue
            names.update(whole.field_names)
            metas.update(zip(whole.global_indexes, whole._custom_backend_meta, strict=True))
        if not names:  # keys of tags alone (kv_batch_put without fields): nothing stored, the controller clears them
            return
        for at, index in enumerate(metadata.global_indexes):
            metas.setdefault(index, metadata._custom_backend_meta[at])
        fields = sorted(names)
        keys = self._generate_keys(fields, metadata.global_indexes)
        backend = [metas[index].get(name) for name in fields for index in metadata.global_indexes]
        self.storage_client.clear(keys=keys, custom_backend_meta=backend)

    async def _partition_meta(self, partition_id: str) -> BatchMeta | None:
        """The controller's metadata of a whole partition (every field, every sample's parts'
        counts), asked on the manager's own connection to it; None for a partition it lacks."""
        request = ZMQMessage.create(
            request_type=ZMQRequestType.GET_PARTITION_META,
            sender_id=self.storage_manager_id,
            body={"partition_id": partition_id},
        ).serialize()

        async def ask() -> BatchMeta | None:
            async with self.notify_pool.alease(self.controller_info) as sock:
                await sock.send_multipart(request)
                reply = ZMQMessage.deserialize(await asyncio.wait_for(sock.recv_multipart(copy=False), ASK_SECONDS))
            if reply.request_type != ZMQRequestType.GET_PARTITION_META_RESPONSE:
                raise RuntimeError(
                    f"the controller did not say which fields partition {partition_id!r} holds: {reply.body}"
                )
            return reply.body["metadata"]

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(ask(), self._notify_loop))

    def close(self) -> None:
        super().close()
        client = getattr(self, "storage_client", None)
        if isinstance(client, ExpbufStorageClient):
            client.close()


@StorageBootstrapProvider.register_provider(BACKEND)
def _nothing_to_start(conf: Any) -> dict[str, Any]:
    """TransferQueue starts a backend's storage processes at init: expbuf's server runs on its own."""
    return {}
