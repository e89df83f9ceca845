from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GroupBy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GROUP_BY_UNSPECIFIED: _ClassVar[GroupBy]
    GROUP_BY_TASK: _ClassVar[GroupBy]
    GROUP_BY_RUN: _ClassVar[GroupBy]
    GROUP_BY_STEP: _ClassVar[GroupBy]
    GROUP_BY_NONE: _ClassVar[GroupBy]

class WhenFull(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WHEN_FULL_UNSPECIFIED: _ClassVar[WhenFull]
    WHEN_FULL_BLOCK: _ClassVar[WhenFull]
    WHEN_FULL_EVICT: _ClassVar[WhenFull]

class OnGroupTimeout(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ON_GROUP_TIMEOUT_UNSPECIFIED: _ClassVar[OnGroupTimeout]
    ON_GROUP_TIMEOUT_RELEASE: _ClassVar[OnGroupTimeout]
    ON_GROUP_TIMEOUT_DROP: _ClassVar[OnGroupTimeout]

class Compression(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMPRESSION_UNSPECIFIED: _ClassVar[Compression]
    COMPRESSION_NONE: _ClassVar[Compression]
    COMPRESSION_ZSTD: _ClassVar[Compression]

class OnTokenStale(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ON_TOKEN_STALE_UNSPECIFIED: _ClassVar[OnTokenStale]
    ON_TOKEN_STALE_MASK: _ClassVar[OnTokenStale]
    ON_TOKEN_STALE_DROP: _ClassVar[OnTokenStale]

class OnStale(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ON_STALE_UNSPECIFIED: _ClassVar[OnStale]
    ON_STALE_DROP: _ClassVar[OnStale]
    ON_STALE_REFUSE: _ClassVar[OnStale]

class Order(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ORDER_UNSPECIFIED: _ClassVar[Order]
    ORDER_FIFO: _ClassVar[Order]
    ORDER_LIFO: _ClassVar[Order]
    ORDER_UNIFORM: _ClassVar[Order]
    ORDER_PRIORITY: _ClassVar[Order]

class Delivery(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DELIVERY_UNSPECIFIED: _ClassVar[Delivery]
    DELIVERY_CONSUME: _ClassVar[Delivery]
    DELIVERY_LEASE: _ClassVar[Delivery]
    DELIVERY_REPLAY: _ClassVar[Delivery]
GROUP_BY_UNSPECIFIED: GroupBy
GROUP_BY_TASK: GroupBy
GROUP_BY_RUN: GroupBy
GROUP_BY_STEP: GroupBy
GROUP_BY_NONE: GroupBy
WHEN_FULL_UNSPECIFIED: WhenFull
WHEN_FULL_BLOCK: WhenFull
WHEN_FULL_EVICT: WhenFull
ON_GROUP_TIMEOUT_UNSPECIFIED: OnGroupTimeout
ON_GROUP_TIMEOUT_RELEASE: OnGroupTimeout
ON_GROUP_TIMEOUT_DROP: OnGroupTimeout
COMPRESSION_UNSPECIFIED: Compression
COMPRESSION_NONE: Compression
COMPRESSION_ZSTD: Compression
ON_TOKEN_STALE_UNSPECIFIED: OnTokenStale
ON_TOKEN_STALE_MASK: OnTokenStale
ON_TOKEN_STALE_DROP: OnTokenStale
ON_STALE_UNSPECIFIED: OnStale
ON_STALE_DROP: OnStale
ON_STALE_REFUSE: OnStale
ORDER_UNSPECIFIED: Order
ORDER_FIFO: Order
ORDER_LIFO: Order
ORDER_UNIFORM: Order
ORDER_PRIORITY: Order
DELIVERY_UNSPECIFIED: Delivery
DELIVERY_CONSUME: Delivery
DELIVERY_LEASE: Delivery
DELIVERY_REPLAY: Delivery

class Estimator(_message.Message):
    __slots__ = ("name", "params", "device")
    class ParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    name: str
    params: _containers.ScalarMap[str, float]
    device: str
    def __init__(self, name: _Optional[str] = ..., params: _Optional[_Mapping[str, float]] = ..., device: _Optional[str] = ...) -> None: ...

class Shaping(_message.Message):
    __slots__ = ("reward_clip", "overlong_buffer", "overlong_buffer_len", "overlong_buffer_penalty_factor", "max_new_tokens", "reward_running_norm", "reward_running_norm_minus_mean", "advantage_clip", "advantages_norm")
    REWARD_CLIP_FIELD_NUMBER: _ClassVar[int]
    OVERLONG_BUFFER_FIELD_NUMBER: _ClassVar[int]
    OVERLONG_BUFFER_LEN_FIELD_NUMBER: _ClassVar[int]
    OVERLONG_BUFFER_PENALTY_FACTOR_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REWARD_RUNNING_NORM_FIELD_NUMBER: _ClassVar[int]
    REWARD_RUNNING_NORM_MINUS_MEAN_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGE_CLIP_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGES_NORM_FIELD_NUMBER: _ClassVar[int]
    reward_clip: float
    overlong_buffer: bool
    overlong_buffer_len: int
    overlong_buffer_penalty_factor: float
    max_new_tokens: int
    reward_running_norm: bool
    reward_running_norm_minus_mean: bool
    advantage_clip: float
    advantages_norm: bool
    def __init__(self, reward_clip: _Optional[float] = ..., overlong_buffer: _Optional[bool] = ..., overlong_buffer_len: _Optional[int] = ..., overlong_buffer_penalty_factor: _Optional[float] = ..., max_new_tokens: _Optional[int] = ..., reward_running_norm: _Optional[bool] = ..., reward_running_norm_minus_mean: _Optional[bool] = ..., advantage_clip: _Optional[float] = ..., advantages_norm: _Optional[bool] = ...) -> None: ...

class TableConfig(_message.Message):
    __slots__ = ("name", "group_by", "group_size", "group_timeout_seconds", "on_group_timeout", "estimator", "capacity_experiences", "capacity_bytes", "when_full", "max_times_sampled", "drop_zero_variance", "tombstone_seconds", "keep_failed", "shaping", "max_staleness", "batch_size", "on_stale", "min_size_to_sample", "samples_per_insert", "samples_per_insert_error", "evict_stale", "priority_decay", "reuse_cooldown_seconds", "priority_noise", "extensions", "min_group_size", "max_token_staleness", "on_token_stale", "compression", "compression_level")
    NAME_FIELD_NUMBER: _ClassVar[int]
    GROUP_BY_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    GROUP_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ON_GROUP_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    ESTIMATOR_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_EXPERIENCES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    WHEN_FULL_FIELD_NUMBER: _ClassVar[int]
    MAX_TIMES_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    DROP_ZERO_VARIANCE_FIELD_NUMBER: _ClassVar[int]
    TOMBSTONE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KEEP_FAILED_FIELD_NUMBER: _ClassVar[int]
    SHAPING_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    ON_STALE_FIELD_NUMBER: _ClassVar[int]
    MIN_SIZE_TO_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_INSERT_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_INSERT_ERROR_FIELD_NUMBER: _ClassVar[int]
    EVICT_STALE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_DECAY_FIELD_NUMBER: _ClassVar[int]
    REUSE_COOLDOWN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_NOISE_FIELD_NUMBER: _ClassVar[int]
    EXTENSIONS_FIELD_NUMBER: _ClassVar[int]
    MIN_GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKEN_STALENESS_FIELD_NUMBER: _ClassVar[int]
    ON_TOKEN_STALE_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_LEVEL_FIELD_NUMBER: _ClassVar[int]
    name: str
    group_by: GroupBy
    group_size: int
    group_timeout_seconds: float
    on_group_timeout: OnGroupTimeout
    estimator: Estimator
    capacity_experiences: int
    capacity_bytes: int
    when_full: WhenFull
    max_times_sampled: int
    drop_zero_variance: bool
    tombstone_seconds: float
    keep_failed: bool
    shaping: Shaping
    max_staleness: int
    batch_size: int
    on_stale: OnStale
    min_size_to_sample: int
    samples_per_insert: float
    samples_per_insert_error: float
    evict_stale: bool
    priority_decay: float
    reuse_cooldown_seconds: float
    priority_noise: float
    extensions: _containers.RepeatedScalarFieldContainer[str]
    min_group_size: int
    max_token_staleness: int
    on_token_stale: OnTokenStale
    compression: Compression
    compression_level: int
    def __init__(self, name: _Optional[str] = ..., group_by: _Optional[_Union[GroupBy, str]] = ..., group_size: _Optional[int] = ..., group_timeout_seconds: _Optional[float] = ..., on_group_timeout: _Optional[_Union[OnGroupTimeout, str]] = ..., estimator: _Optional[_Union[Estimator, _Mapping]] = ..., capacity_experiences: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., when_full: _Optional[_Union[WhenFull, str]] = ..., max_times_sampled: _Optional[int] = ..., drop_zero_variance: _Optional[bool] = ..., tombstone_seconds: _Optional[float] = ..., keep_failed: _Optional[bool] = ..., shaping: _Optional[_Union[Shaping, _Mapping]] = ..., max_staleness: _Optional[int] = ..., batch_size: _Optional[int] = ..., on_stale: _Optional[_Union[OnStale, str]] = ..., min_size_to_sample: _Optional[int] = ..., samples_per_insert: _Optional[float] = ..., samples_per_insert_error: _Optional[float] = ..., evict_stale: _Optional[bool] = ..., priority_decay: _Optional[float] = ..., reuse_cooldown_seconds: _Optional[float] = ..., priority_noise: _Optional[float] = ..., extensions: _Optional[_Iterable[str]] = ..., min_group_size: _Optional[int] = ..., max_token_staleness: _Optional[int] = ..., on_token_stale: _Optional[_Union[OnTokenStale, str]] = ..., compression: _Optional[_Union[Compression, str]] = ..., compression_level: _Optional[int] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("table", "payload", "seq", "total_bytes", "offset")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    table: str
    payload: bytes
    seq: int
    total_bytes: int
    offset: int
    def __init__(self, table: _Optional[str] = ..., payload: _Optional[bytes] = ..., seq: _Optional[int] = ..., total_bytes: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class ColumnBatch(_message.Message):
    __slots__ = ("batches", "tasks", "runs", "steps", "suffixes", "int_batches", "int_tasks", "columns", "multi_modal_keys")
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    SUFFIXES_FIELD_NUMBER: _ClassVar[int]
    INT_BATCHES_FIELD_NUMBER: _ClassVar[int]
    INT_TASKS_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    MULTI_MODAL_KEYS_FIELD_NUMBER: _ClassVar[int]
    batches: _containers.RepeatedScalarFieldContainer[str]
    tasks: _containers.RepeatedScalarFieldContainer[str]
    runs: _containers.RepeatedScalarFieldContainer[int]
    steps: _containers.RepeatedScalarFieldContainer[int]
    suffixes: _containers.RepeatedScalarFieldContainer[str]
    int_batches: bool
    int_tasks: bool
    columns: _containers.RepeatedCompositeFieldContainer[Column]
    multi_modal_keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, batches: _Optional[_Iterable[str]] = ..., tasks: _Optional[_Iterable[str]] = ..., runs: _Optional[_Iterable[int]] = ..., steps: _Optional[_Iterable[int]] = ..., suffixes: _Optional[_Iterable[str]] = ..., int_batches: _Optional[bool] = ..., int_tasks: _Optional[bool] = ..., columns: _Optional[_Iterable[_Union[Column, _Mapping]]] = ..., multi_modal_keys: _Optional[_Iterable[str]] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("seq", "stored_uids", "duplicate_uids", "completed_groups", "stale_uids", "partial_uids")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STORED_UIDS_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_UIDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    STALE_UIDS_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_UIDS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    stored_uids: _containers.RepeatedScalarFieldContainer[str]
    duplicate_uids: _containers.RepeatedScalarFieldContainer[str]
    completed_groups: _containers.RepeatedScalarFieldContainer[str]
    stale_uids: _containers.RepeatedScalarFieldContainer[str]
    partial_uids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, seq: _Optional[int] = ..., stored_uids: _Optional[_Iterable[str]] = ..., duplicate_uids: _Optional[_Iterable[str]] = ..., completed_groups: _Optional[_Iterable[str]] = ..., stale_uids: _Optional[_Iterable[str]] = ..., partial_uids: _Optional[_Iterable[str]] = ...) -> None: ...

class SampleRequest(_message.Message):
    __slots__ = ("table", "batch_size", "num_groups", "order", "delivery", "lease_seconds", "wait_seconds", "allow_partial", "max_batches", "min_model_version", "has_min_model_version", "received", "stop", "trainer_version", "has_trainer_version", "window", "compact_advantages", "order_name", "fields", "max_reply_bytes", "answers_stopping", "awaits_delivery")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ALLOW_PARTIAL_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCHES_FIELD_NUMBER: _ClassVar[int]
    MIN_MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    HAS_MIN_MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    TRAINER_VERSION_FIELD_NUMBER: _ClassVar[int]
    HAS_TRAINER_VERSION_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    COMPACT_ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    ORDER_NAME_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    MAX_REPLY_BYTES_FIELD_NUMBER: _ClassVar[int]
    ANSWERS_STOPPING_FIELD_NUMBER: _ClassVar[int]
    AWAITS_DELIVERY_FIELD_NUMBER: _ClassVar[int]
    table: str
    batch_size: int
    num_groups: int
    order: Order
    delivery: Delivery
    lease_seconds: float
    wait_seconds: float
    allow_partial: bool
    max_batches: int
    min_model_version: int
    has_min_model_version: bool
    received: int
    stop: bool
    trainer_version: int
    has_trainer_version: bool
    window: int
    compact_advantages: bool
    order_name: str
    fields: _containers.RepeatedScalarFieldContainer[str]
    max_reply_bytes: int
    answers_stopping: bool
    awaits_delivery: bool
    def __init__(self, table: _Optional[str] = ..., batch_size: _Optional[int] = ..., num_groups: _Optional[int] = ..., order: _Optional[_Union[Order, str]] = ..., delivery: _Optional[_Union[Delivery, str]] = ..., lease_seconds: _Optional[float] = ..., wait_seconds: _Optional[float] = ..., allow_partial: _Optional[bool] = ..., max_batches: _Optional[int] = ..., min_model_version: _Optional[int] = ..., has_min_model_version: _Optional[bool] = ..., received: _Optional[int] = ..., stop: _Optional[bool] = ..., trainer_version: _Optional[int] = ..., has_trainer_version: _Optional[bool] = ..., window: _Optional[int] = ..., compact_advantages: _Optional[bool] = ..., order_name: _Optional[str] = ..., fields: _Optional[_Iterable[str]] = ..., max_reply_bytes: _Optional[int] = ..., answers_stopping: _Optional[bool] = ..., awaits_delivery: _Optional[bool] = ...) -> None: ...

class Column(_message.Message):
    __slots__ = ("name", "dtype", "items", "ndim", "shapes", "values", "align")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    NDIM_FIELD_NUMBER: _ClassVar[int]
    SHAPES_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    ALIGN_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    items: _containers.RepeatedScalarFieldContainer[int]
    ndim: int
    shapes: _containers.RepeatedScalarFieldContainer[int]
    values: bytes
    align: bytes
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., items: _Optional[_Iterable[int]] = ..., ndim: _Optional[int] = ..., shapes: _Optional[_Iterable[int]] = ..., values: _Optional[bytes] = ..., align: _Optional[bytes] = ...) -> None: ...

class SampleReply(_message.Message):
    __slots__ = ("payload", "uids", "group_ids", "lease_id", "lease_expires_unix", "partial", "times_sampled", "advantages", "response_lengths", "confirm_seconds", "lease_seconds", "columns", "part", "whole_bytes", "missing_uids", "missing_fields", "stopping", "delivered")
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    UIDS_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    TIMES_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    CONFIRM_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    WHOLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MISSING_UIDS_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELDS_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    uids: _containers.RepeatedScalarFieldContainer[str]
    group_ids: _containers.RepeatedScalarFieldContainer[str]
    lease_id: str
    lease_expires_unix: float
    partial: bool
    times_sampled: _containers.RepeatedScalarFieldContainer[int]
    advantages: _containers.RepeatedScalarFieldContainer[float]
    response_lengths: _containers.RepeatedScalarFieldContainer[int]
    confirm_seconds: float
    lease_seconds: float
    columns: _containers.RepeatedCompositeFieldContainer[Column]
    part: bytes
    whole_bytes: int
    missing_uids: _containers.RepeatedScalarFieldContainer[str]
    missing_fields: _containers.RepeatedScalarFieldContainer[str]
    stopping: bool
    delivered: int
    def __init__(self, payload: _Optional[bytes] = ..., uids: _Optional[_Iterable[str]] = ..., group_ids: _Optional[_Iterable[str]] = ..., lease_id: _Optional[str] = ..., lease_expires_unix: _Optional[float] = ..., partial: _Optional[bool] = ..., times_sampled: _Optional[_Iterable[int]] = ..., advantages: _Optional[_Iterable[float]] = ..., response_lengths: _Optional[_Iterable[int]] = ..., confirm_seconds: _Optional[float] = ..., lease_seconds: _Optional[float] = ..., columns: _Optional[_Iterable[_Union[Column, _Mapping]]] = ..., part: _Optional[bytes] = ..., whole_bytes: _Optional[int] = ..., missing_uids: _Optional[_Iterable[str]] = ..., missing_fields: _Optional[_Iterable[str]] = ..., stopping: _Optional[bool] = ..., delivered: _Optional[int] = ...) -> None: ...

class AckRequest(_message.Message):
    __slots__ = ("table", "lease_id")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    table: str
    lease_id: str
    def __init__(self, table: _Optional[str] = ..., lease_id: _Optional[str] = ...) -> None: ...

class AckReply(_message.Message):
    __slots__ = ("acked",)
    ACKED_FIELD_NUMBER: _ClassVar[int]
    acked: int
    def __init__(self, acked: _Optional[int] = ...) -> None: ...

class NackRequest(_message.Message):
    __slots__ = ("table", "lease_id")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    table: str
    lease_id: str
    def __init__(self, table: _Optional[str] = ..., lease_id: _Optional[str] = ...) -> None: ...

class NackReply(_message.Message):
    __slots__ = ("requeued",)
    REQUEUED_FIELD_NUMBER: _ClassVar[int]
    requeued: int
    def __init__(self, requeued: _Optional[int] = ...) -> None: ...

class RenewRequest(_message.Message):
    __slots__ = ("table", "lease_id", "lease_seconds")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    table: str
    lease_id: str
    lease_seconds: float
    def __init__(self, table: _Optional[str] = ..., lease_id: _Optional[str] = ..., lease_seconds: _Optional[float] = ...) -> None: ...

class RenewReply(_message.Message):
    __slots__ = ("lease_expires_unix", "leased")
    LEASE_EXPIRES_UNIX_FIELD_NUMBER: _ClassVar[int]
    LEASED_FIELD_NUMBER: _ClassVar[int]
    lease_expires_unix: float
    leased: int
    def __init__(self, lease_expires_unix: _Optional[float] = ..., leased: _Optional[int] = ...) -> None: ...

class RetireRequest(_message.Message):
    __slots__ = ("table", "group_ids")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    table: str
    group_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, table: _Optional[str] = ..., group_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RetireReply(_message.Message):
    __slots__ = ("retired",)
    RETIRED_FIELD_NUMBER: _ClassVar[int]
    retired: int
    def __init__(self, retired: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("table", "uids")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    UIDS_FIELD_NUMBER: _ClassVar[int]
    table: str
    uids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, table: _Optional[str] = ..., uids: _Optional[_Iterable[str]] = ...) -> None: ...

class GetReply(_message.Message):
    __slots__ = ("payload", "missing_uids")
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    MISSING_UIDS_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    missing_uids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, payload: _Optional[bytes] = ..., missing_uids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReadFieldsRequest(_message.Message):
    __slots__ = ("table", "uids", "fields", "shares", "take", "max_reply_bytes", "lease_id", "rank", "ranks", "balance", "model", "equal")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    UIDS_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    SHARES_FIELD_NUMBER: _ClassVar[int]
    TAKE_FIELD_NUMBER: _ClassVar[int]
    MAX_REPLY_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    BALANCE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    EQUAL_FIELD_NUMBER: _ClassVar[int]
    table: str
    uids: _containers.RepeatedScalarFieldContainer[str]
    fields: _containers.RepeatedScalarFieldContainer[str]
    shares: int
    take: _containers.RepeatedScalarFieldContainer[int]
    max_reply_bytes: int
    lease_id: str
    rank: int
    ranks: int
    balance: str
    model: ModelShape
    equal: bool
    def __init__(self, table: _Optional[str] = ..., uids: _Optional[_Iterable[str]] = ..., fields: _Optional[_Iterable[str]] = ..., shares: _Optional[int] = ..., take: _Optional[_Iterable[int]] = ..., max_reply_bytes: _Optional[int] = ..., lease_id: _Optional[str] = ..., rank: _Optional[int] = ..., ranks: _Optional[int] = ..., balance: _Optional[str] = ..., model: _Optional[_Union[ModelShape, _Mapping]] = ..., equal: _Optional[bool] = ...) -> None: ...

class ModelShape(_message.Message):
    __slots__ = ("params", "layers", "hidden")
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    params: int
    layers: int
    hidden: int
    def __init__(self, params: _Optional[int] = ..., layers: _Optional[int] = ..., hidden: _Optional[int] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("table", "uids", "group_ids")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    UIDS_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    table: str
    uids: _containers.RepeatedScalarFieldContainer[str]
    group_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, table: _Optional[str] = ..., uids: _Optional[_Iterable[str]] = ..., group_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class DeleteReply(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class PutValuesRequest(_message.Message):
    __slots__ = ("table", "keys", "values")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    table: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    values: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, table: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ..., values: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PutValuesReply(_message.Message):
    __slots__ = ("stored",)
    STORED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    def __init__(self, stored: _Optional[int] = ...) -> None: ...

class GetValuesRequest(_message.Message):
    __slots__ = ("table", "keys", "only_own")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    ONLY_OWN_FIELD_NUMBER: _ClassVar[int]
    table: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    only_own: bool
    def __init__(self, table: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ..., only_own: _Optional[bool] = ...) -> None: ...

class GetValuesReply(_message.Message):
    __slots__ = ("values", "missing_keys")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    MISSING_KEYS_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[bytes]
    missing_keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, values: _Optional[_Iterable[bytes]] = ..., missing_keys: _Optional[_Iterable[str]] = ...) -> None: ...

class ClearValuesRequest(_message.Message):
    __slots__ = ("table", "keys")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    table: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, table: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ...) -> None: ...

class ClearValuesReply(_message.Message):
    __slots__ = ("cleared",)
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    cleared: int
    def __init__(self, cleared: _Optional[int] = ...) -> None: ...

class SealRequest(_message.Message):
    __slots__ = ("table", "group_id")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    table: str
    group_id: str
    def __init__(self, table: _Optional[str] = ..., group_id: _Optional[str] = ...) -> None: ...

class SealReply(_message.Message):
    __slots__ = ("size",)
    SIZE_FIELD_NUMBER: _ClassVar[int]
    size: int
    def __init__(self, size: _Optional[int] = ...) -> None: ...

class FailRunsRequest(_message.Message):
    __slots__ = ("table", "uids", "reasons")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    UIDS_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    table: str
    uids: _containers.RepeatedScalarFieldContainer[str]
    reasons: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, table: _Optional[str] = ..., uids: _Optional[_Iterable[str]] = ..., reasons: _Optional[_Iterable[str]] = ...) -> None: ...

class GetPartialsRequest(_message.Message):
    __slots__ = ("table", "task_ids", "uids", "max_reply_bytes")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    UIDS_FIELD_NUMBER: _ClassVar[int]
    MAX_REPLY_BYTES_FIELD_NUMBER: _ClassVar[int]
    table: str
    task_ids: _containers.RepeatedScalarFieldContainer[str]
    uids: _containers.RepeatedScalarFieldContainer[str]
    max_reply_bytes: int
    def __init__(self, table: _Optional[str] = ..., task_ids: _Optional[_Iterable[str]] = ..., uids: _Optional[_Iterable[str]] = ..., max_reply_bytes: _Optional[int] = ...) -> None: ...

class FailRunsReply(_message.Message):
    __slots__ = ("recorded_uids", "completed_groups", "dropped_groups")
    RECORDED_UIDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    recorded_uids: _containers.RepeatedScalarFieldContainer[str]
    completed_groups: _containers.RepeatedScalarFieldContainer[str]
    dropped_groups: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, recorded_uids: _Optional[_Iterable[str]] = ..., completed_groups: _Optional[_Iterable[str]] = ..., dropped_groups: _Optional[_Iterable[str]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("table",)
    TABLE_FIELD_NUMBER: _ClassVar[int]
    table: str
    def __init__(self, table: _Optional[str] = ...) -> None: ...

class TableStats(_message.Message):
    __slots__ = ("name", "pending", "ready", "leased", "consumed", "bytes", "groups_pending", "groups_ready", "groups_leased", "groups_failed", "groups_dropped", "oldest_age_seconds", "min_model_version", "max_model_version", "evicted", "pushed", "duplicates", "sampled", "leases_expired", "computing", "groups_computing", "last_failure", "overlong_penalised", "rewards_seen", "rewards_clipped", "advantages_seen", "advantages_clipped", "reward_running_mean", "reward_running_std", "trainer_version", "submitted", "admitted", "grants_expired", "stale_dropped", "damaged", "quarantined", "values", "value_bytes", "staged_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    LEASED_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    GROUPS_PENDING_FIELD_NUMBER: _ClassVar[int]
    GROUPS_READY_FIELD_NUMBER: _ClassVar[int]
    GROUPS_LEASED_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FAILED_FIELD_NUMBER: _ClassVar[int]
    GROUPS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    OLDEST_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MIN_MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    PUSHED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    LEASES_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    COMPUTING_FIELD_NUMBER: _ClassVar[int]
    GROUPS_COMPUTING_FIELD_NUMBER: _ClassVar[int]
    LAST_FAILURE_FIELD_NUMBER: _ClassVar[int]
    OVERLONG_PENALISED_FIELD_NUMBER: _ClassVar[int]
    REWARDS_SEEN_FIELD_NUMBER: _ClassVar[int]
    REWARDS_CLIPPED_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGES_SEEN_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGES_CLIPPED_FIELD_NUMBER: _ClassVar[int]
    REWARD_RUNNING_MEAN_FIELD_NUMBER: _ClassVar[int]
    REWARD_RUNNING_STD_FIELD_NUMBER: _ClassVar[int]
    TRAINER_VERSION_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    GRANTS_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    STALE_DROPPED_FIELD_NUMBER: _ClassVar[int]
    DAMAGED_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    VALUE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STAGED_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    pending: int
    ready: int
    leased: int
    consumed: int
    bytes: int
    groups_pending: int
    groups_ready: int
    groups_leased: int
    groups_failed: int
    groups_dropped: int
    oldest_age_seconds: float
    min_model_version: int
    max_model_version: int
    evicted: int
    pushed: int
    duplicates: int
    sampled: int
    leases_expired: int
    computing: int
    groups_computing: int
    last_failure: str
    overlong_penalised: int
    rewards_seen: int
    rewards_clipped: int
    advantages_seen: int
    advantages_clipped: int
    reward_running_mean: float
    reward_running_std: float
    trainer_version: int
    submitted: int
    admitted: int
    grants_expired: int
    stale_dropped: int
    damaged: int
    quarantined: int
    values: int
    value_bytes: int
    staged_bytes: int
    def __init__(self, name: _Optional[str] = ..., pending: _Optional[int] = ..., ready: _Optional[int] = ..., leased: _Optional[int] = ..., consumed: _Optional[int] = ..., bytes: _Optional[int] = ..., groups_pending: _Optional[int] = ..., groups_ready: _Optional[int] = ..., groups_leased: _Optional[int] = ..., groups_failed: _Optional[int] = ..., groups_dropped: _Optional[int] = ..., oldest_age_seconds: _Optional[float] = ..., min_model_version: _Optional[int] = ..., max_model_version: _Optional[int] = ..., evicted: _Optional[int] = ..., pushed: _Optional[int] = ..., duplicates: _Optional[int] = ..., sampled: _Optional[int] = ..., leases_expired: _Optional[int] = ..., computing: _Optional[int] = ..., groups_computing: _Optional[int] = ..., last_failure: _Optional[str] = ..., overlong_penalised: _Optional[int] = ..., rewards_seen: _Optional[int] = ..., rewards_clipped: _Optional[int] = ..., advantages_seen: _Optional[int] = ..., advantages_clipped: _Optional[int] = ..., reward_running_mean: _Optional[float] = ..., reward_running_std: _Optional[float] = ..., trainer_version: _Optional[int] = ..., submitted: _Optional[int] = ..., admitted: _Optional[int] = ..., grants_expired: _Optional[int] = ..., stale_dropped: _Optional[int] = ..., damaged: _Optional[int] = ..., quarantined: _Optional[int] = ..., values: _Optional[int] = ..., value_bytes: _Optional[int] = ..., staged_bytes: _Optional[int] = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("tables",)
    TABLES_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableStats]
    def __init__(self, tables: _Optional[_Iterable[_Union[TableStats, _Mapping]]] = ...) -> None: ...

class ServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfoReply(_message.Message):
    __slots__ = ("version", "trxp_version", "advantage_device", "max_message_bytes", "uptime_seconds", "storage_bytes", "lmdb_map_used_ratio", "scrub", "orders", "advantage_worker_failure", "advantage_worker_state", "repeats_answered")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TRXP_VERSION_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGE_DEVICE_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STORAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LMDB_MAP_USED_RATIO_FIELD_NUMBER: _ClassVar[int]
    SCRUB_FIELD_NUMBER: _ClassVar[int]
    ORDERS_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGE_WORKER_FAILURE_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGE_WORKER_STATE_FIELD_NUMBER: _ClassVar[int]
    REPEATS_ANSWERED_FIELD_NUMBER: _ClassVar[int]
    version: str
    trxp_version: str
    advantage_device: str
    max_message_bytes: int
    uptime_seconds: float
    storage_bytes: int
    lmdb_map_used_ratio: float
    scrub: ScrubInfo
    orders: _containers.RepeatedScalarFieldContainer[str]
    advantage_worker_failure: str
    advantage_worker_state: str
    repeats_answered: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, version: _Optional[str] = ..., trxp_version: _Optional[str] = ..., advantage_device: _Optional[str] = ..., max_message_bytes: _Optional[int] = ..., uptime_seconds: _Optional[float] = ..., storage_bytes: _Optional[int] = ..., lmdb_map_used_ratio: _Optional[float] = ..., scrub: _Optional[_Union[ScrubInfo, _Mapping]] = ..., orders: _Optional[_Iterable[str]] = ..., advantage_worker_failure: _Optional[str] = ..., advantage_worker_state: _Optional[str] = ..., repeats_answered: _Optional[_Iterable[str]] = ...) -> None: ...

class ScrubInfo(_message.Message):
    __slots__ = ("mb_per_second", "interval_seconds", "running", "pass_checked_bytes", "pass_total_bytes", "passes", "checked_bytes", "checked", "found", "last_pass_end_unix", "last_pass_seconds", "last_pass_bytes", "last_pass_found")
    MB_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    PASS_CHECKED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PASS_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    PASSES_FIELD_NUMBER: _ClassVar[int]
    CHECKED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKED_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    LAST_PASS_END_UNIX_FIELD_NUMBER: _ClassVar[int]
    LAST_PASS_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAST_PASS_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAST_PASS_FOUND_FIELD_NUMBER: _ClassVar[int]
    mb_per_second: float
    interval_seconds: float
    running: bool
    pass_checked_bytes: int
    pass_total_bytes: int
    passes: int
    checked_bytes: int
    checked: int
    found: int
    last_pass_end_unix: float
    last_pass_seconds: float
    last_pass_bytes: int
    last_pass_found: int
    def __init__(self, mb_per_second: _Optional[float] = ..., interval_seconds: _Optional[float] = ..., running: _Optional[bool] = ..., pass_checked_bytes: _Optional[int] = ..., pass_total_bytes: _Optional[int] = ..., passes: _Optional[int] = ..., checked_bytes: _Optional[int] = ..., checked: _Optional[int] = ..., found: _Optional[int] = ..., last_pass_end_unix: _Optional[float] = ..., last_pass_seconds: _Optional[float] = ..., last_pass_bytes: _Optional[int] = ..., last_pass_found: _Optional[int] = ...) -> None: ...

class CreateTableRequest(_message.Message):
    __slots__ = ("config", "exist_ok")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    EXIST_OK_FIELD_NUMBER: _ClassVar[int]
    config: TableConfig
    exist_ok: bool
    def __init__(self, config: _Optional[_Union[TableConfig, _Mapping]] = ..., exist_ok: _Optional[bool] = ...) -> None: ...

class CreateTableReply(_message.Message):
    __slots__ = ("config", "created")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    config: TableConfig
    created: bool
    def __init__(self, config: _Optional[_Union[TableConfig, _Mapping]] = ..., created: _Optional[bool] = ...) -> None: ...

class ListTablesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTablesReply(_message.Message):
    __slots__ = ("tables",)
    TABLES_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableConfig]
    def __init__(self, tables: _Optional[_Iterable[_Union[TableConfig, _Mapping]]] = ...) -> None: ...

class DropTableRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DropTableReply(_message.Message):
    __slots__ = ("dropped_experiences",)
    DROPPED_EXPERIENCES_FIELD_NUMBER: _ClassVar[int]
    dropped_experiences: int
    def __init__(self, dropped_experiences: _Optional[int] = ...) -> None: ...

class SetTrainerVersionRequest(_message.Message):
    __slots__ = ("table", "version")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    table: str
    version: int
    def __init__(self, table: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class SetTrainerVersionReply(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class AdmitRequest(_message.Message):
    __slots__ = ("table", "count", "wait_seconds", "grant_seconds", "grant_id")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GRANT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GRANT_ID_FIELD_NUMBER: _ClassVar[int]
    table: str
    count: int
    wait_seconds: float
    grant_seconds: float
    grant_id: str
    def __init__(self, table: _Optional[str] = ..., count: _Optional[int] = ..., wait_seconds: _Optional[float] = ..., grant_seconds: _Optional[float] = ..., grant_id: _Optional[str] = ...) -> None: ...

class AdmitReply(_message.Message):
    __slots__ = ("granted", "grant_id", "expires_unix")
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    GRANT_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_FIELD_NUMBER: _ClassVar[int]
    granted: int
    grant_id: str
    expires_unix: float
    def __init__(self, granted: _Optional[int] = ..., grant_id: _Optional[str] = ..., expires_unix: _Optional[float] = ...) -> None: ...

class FinishGrantRequest(_message.Message):
    __slots__ = ("table", "grant_id", "accepted")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    GRANT_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    table: str
    grant_id: str
    accepted: int
    def __init__(self, table: _Optional[str] = ..., grant_id: _Optional[str] = ..., accepted: _Optional[int] = ...) -> None: ...

class FinishGrantReply(_message.Message):
    __slots__ = ("returned",)
    RETURNED_FIELD_NUMBER: _ClassVar[int]
    returned: int
    def __init__(self, returned: _Optional[int] = ...) -> None: ...

class ListExperiencesRequest(_message.Message):
    __slots__ = ("table", "states", "min_model_version", "max_model_version", "after", "limit")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    MIN_MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    table: str
    states: _containers.RepeatedScalarFieldContainer[str]
    min_model_version: int
    max_model_version: int
    after: int
    limit: int
    def __init__(self, table: _Optional[str] = ..., states: _Optional[_Iterable[str]] = ..., min_model_version: _Optional[int] = ..., max_model_version: _Optional[int] = ..., after: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class ListedExperience(_message.Message):
    __slots__ = ("uid", "group_id", "state", "model_version", "reward", "times_sampled")
    UID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    TIMES_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    uid: str
    group_id: str
    state: str
    model_version: int
    reward: float
    times_sampled: int
    def __init__(self, uid: _Optional[str] = ..., group_id: _Optional[str] = ..., state: _Optional[str] = ..., model_version: _Optional[int] = ..., reward: _Optional[float] = ..., times_sampled: _Optional[int] = ...) -> None: ...

class ListExperiencesReply(_message.Message):
    __slots__ = ("experiences", "next", "done")
    EXPERIENCES_FIELD_NUMBER: _ClassVar[int]
    NEXT_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    experiences: _containers.RepeatedCompositeFieldContainer[ListedExperience]
    next: int
    done: bool
    def __init__(self, experiences: _Optional[_Iterable[_Union[ListedExperience, _Mapping]]] = ..., next: _Optional[int] = ..., done: _Optional[bool] = ...) -> None: ...

class ResetOffPolicyRequest(_message.Message):
    __slots__ = ("table", "trainer_version", "has_trainer_version")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    TRAINER_VERSION_FIELD_NUMBER: _ClassVar[int]
    HAS_TRAINER_VERSION_FIELD_NUMBER: _ClassVar[int]
    table: str
    trainer_version: int
    has_trainer_version: bool
    def __init__(self, table: _Optional[str] = ..., trainer_version: _Optional[int] = ..., has_trainer_version: _Optional[bool] = ...) -> None: ...

class ResetOffPolicyReply(_message.Message):
    __slots__ = ("trainer_version", "submitted")
    TRAINER_VERSION_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_FIELD_NUMBER: _ClassVar[int]
    trainer_version: int
    submitted: int
    def __init__(self, trainer_version: _Optional[int] = ..., submitted: _Optional[int] = ...) -> None: ...

class WritersRequest(_message.Message):
    __slots__ = ("table", "change", "writer_id")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    CHANGE_FIELD_NUMBER: _ClassVar[int]
    WRITER_ID_FIELD_NUMBER: _ClassVar[int]
    table: str
    change: int
    writer_id: str
    def __init__(self, table: _Optional[str] = ..., change: _Optional[int] = ..., writer_id: _Optional[str] = ...) -> None: ...

class WritersReply(_message.Message):
    __slots__ = ("open", "done")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    open: int
    done: bool
    def __init__(self, open: _Optional[int] = ..., done: _Optional[bool] = ...) -> None: ...

class DatasetConfig(_message.Message):
    __slots__ = ("name", "size", "epochs", "seed", "max_in_flight", "on_drop", "max_attempts", "shards", "shard", "pass_threshold", "order", "order_options", "zero_variance", "skip_epochs")
    class OrderOptionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    ON_DROP_FIELD_NUMBER: _ClassVar[int]
    MAX_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    PASS_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    ORDER_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    ZERO_VARIANCE_FIELD_NUMBER: _ClassVar[int]
    SKIP_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    epochs: int
    seed: int
    max_in_flight: int
    on_drop: str
    max_attempts: int
    shards: _containers.RepeatedScalarFieldContainer[str]
    shard: str
    pass_threshold: float
    order: str
    order_options: _containers.ScalarMap[str, float]
    zero_variance: str
    skip_epochs: int
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., epochs: _Optional[int] = ..., seed: _Optional[int] = ..., max_in_flight: _Optional[int] = ..., on_drop: _Optional[str] = ..., max_attempts: _Optional[int] = ..., shards: _Optional[_Iterable[str]] = ..., shard: _Optional[str] = ..., pass_threshold: _Optional[float] = ..., order: _Optional[str] = ..., order_options: _Optional[_Mapping[str, float]] = ..., zero_variance: _Optional[str] = ..., skip_epochs: _Optional[int] = ...) -> None: ...

class EpochCounts(_message.Message):
    __slots__ = ("pending", "claimed", "generated", "trained", "dropped")
    PENDING_FIELD_NUMBER: _ClassVar[int]
    CLAIMED_FIELD_NUMBER: _ClassVar[int]
    GENERATED_FIELD_NUMBER: _ClassVar[int]
    TRAINED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    pending: int
    claimed: int
    generated: int
    trained: int
    dropped: int
    def __init__(self, pending: _Optional[int] = ..., claimed: _Optional[int] = ..., generated: _Optional[int] = ..., trained: _Optional[int] = ..., dropped: _Optional[int] = ...) -> None: ...

class DatasetInfo(_message.Message):
    __slots__ = ("config", "created_unix", "cursor_epoch", "cursor_position", "counts", "reissued", "attempts_dropped", "done", "owned", "totals", "skipped")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    CURSOR_EPOCH_FIELD_NUMBER: _ClassVar[int]
    CURSOR_POSITION_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    REISSUED_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    OWNED_FIELD_NUMBER: _ClassVar[int]
    TOTALS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    config: DatasetConfig
    created_unix: float
    cursor_epoch: int
    cursor_position: int
    counts: _containers.RepeatedCompositeFieldContainer[EpochCounts]
    reissued: int
    attempts_dropped: int
    done: bool
    owned: int
    totals: EpochCounts
    skipped: int
    def __init__(self, config: _Optional[_Union[DatasetConfig, _Mapping]] = ..., created_unix: _Optional[float] = ..., cursor_epoch: _Optional[int] = ..., cursor_position: _Optional[int] = ..., counts: _Optional[_Iterable[_Union[EpochCounts, _Mapping]]] = ..., reissued: _Optional[int] = ..., attempts_dropped: _Optional[int] = ..., done: _Optional[bool] = ..., owned: _Optional[int] = ..., totals: _Optional[_Union[EpochCounts, _Mapping]] = ..., skipped: _Optional[int] = ...) -> None: ...

class CreateDatasetRequest(_message.Message):
    __slots__ = ("table", "config", "exist_ok")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    EXIST_OK_FIELD_NUMBER: _ClassVar[int]
    table: str
    config: DatasetConfig
    exist_ok: bool
    def __init__(self, table: _Optional[str] = ..., config: _Optional[_Union[DatasetConfig, _Mapping]] = ..., exist_ok: _Optional[bool] = ...) -> None: ...

class CreateDatasetReply(_message.Message):
    __slots__ = ("dataset", "created")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    dataset: DatasetInfo
    created: bool
    def __init__(self, dataset: _Optional[_Union[DatasetInfo, _Mapping]] = ..., created: _Optional[bool] = ...) -> None: ...

class ListDatasetsRequest(_message.Message):
    __slots__ = ("table", "name")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    table: str
    name: str
    def __init__(self, table: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class ListDatasetsReply(_message.Message):
    __slots__ = ("datasets",)
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    datasets: _containers.RepeatedCompositeFieldContainer[DatasetInfo]
    def __init__(self, datasets: _Optional[_Iterable[_Union[DatasetInfo, _Mapping]]] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("dataset", "epoch", "index", "attempt", "batch", "task", "expires_unix", "state", "owner", "stats")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    epoch: int
    index: int
    attempt: int
    batch: str
    task: str
    expires_unix: float
    state: str
    owner: str
    stats: PromptStats
    def __init__(self, dataset: _Optional[str] = ..., epoch: _Optional[int] = ..., index: _Optional[int] = ..., attempt: _Optional[int] = ..., batch: _Optional[str] = ..., task: _Optional[str] = ..., expires_unix: _Optional[float] = ..., state: _Optional[str] = ..., owner: _Optional[str] = ..., stats: _Optional[_Union[PromptStats, _Mapping]] = ...) -> None: ...

class PromptStats(_message.Message):
    __slots__ = ("attempts", "generated", "runs", "passes", "last_runs", "last_mean", "last_var", "trained", "last_epoch", "last_step")
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    PASSES_FIELD_NUMBER: _ClassVar[int]
    LAST_RUNS_FIELD_NUMBER: _ClassVar[int]
    LAST_MEAN_FIELD_NUMBER: _ClassVar[int]
    LAST_VAR_FIELD_NUMBER: _ClassVar[int]
    TRAINED_FIELD_NUMBER: _ClassVar[int]
    LAST_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    attempts: int
    generated: int
    runs: int
    passes: int
    last_runs: int
    last_mean: float
    last_var: float
    trained: int
    last_epoch: int
    last_step: int
    def __init__(self, attempts: _Optional[int] = ..., generated: _Optional[int] = ..., runs: _Optional[int] = ..., passes: _Optional[int] = ..., last_runs: _Optional[int] = ..., last_mean: _Optional[float] = ..., last_var: _Optional[float] = ..., trained: _Optional[int] = ..., last_epoch: _Optional[int] = ..., last_step: _Optional[int] = ...) -> None: ...

class ClaimRequest(_message.Message):
    __slots__ = ("table", "dataset", "count", "lease_seconds", "owner", "wait_seconds", "max_reply_bytes", "claim_id")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_REPLY_BYTES_FIELD_NUMBER: _ClassVar[int]
    CLAIM_ID_FIELD_NUMBER: _ClassVar[int]
    table: str
    dataset: str
    count: int
    lease_seconds: float
    owner: str
    wait_seconds: float
    max_reply_bytes: int
    claim_id: str
    def __init__(self, table: _Optional[str] = ..., dataset: _Optional[str] = ..., count: _Optional[int] = ..., lease_seconds: _Optional[float] = ..., owner: _Optional[str] = ..., wait_seconds: _Optional[float] = ..., max_reply_bytes: _Optional[int] = ..., claim_id: _Optional[str] = ...) -> None: ...

class ClaimReply(_message.Message):
    __slots__ = ("prompts", "done")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    done: bool
    def __init__(self, prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., done: _Optional[bool] = ...) -> None: ...

class PromptRef(_message.Message):
    __slots__ = ("epoch", "index", "attempt")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    index: int
    attempt: int
    def __init__(self, epoch: _Optional[int] = ..., index: _Optional[int] = ..., attempt: _Optional[int] = ...) -> None: ...

class RenewClaimsRequest(_message.Message):
    __slots__ = ("table", "dataset", "prompts", "lease_seconds")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    table: str
    dataset: str
    prompts: _containers.RepeatedCompositeFieldContainer[PromptRef]
    lease_seconds: float
    def __init__(self, table: _Optional[str] = ..., dataset: _Optional[str] = ..., prompts: _Optional[_Iterable[_Union[PromptRef, _Mapping]]] = ..., lease_seconds: _Optional[float] = ...) -> None: ...

class RenewClaimsReply(_message.Message):
    __slots__ = ("expires_unix", "ended")
    EXPIRES_UNIX_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    expires_unix: float
    ended: _containers.RepeatedCompositeFieldContainer[PromptRef]
    def __init__(self, expires_unix: _Optional[float] = ..., ended: _Optional[_Iterable[_Union[PromptRef, _Mapping]]] = ...) -> None: ...

class ReleaseClaimsRequest(_message.Message):
    __slots__ = ("table", "dataset", "prompts")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    table: str
    dataset: str
    prompts: _containers.RepeatedCompositeFieldContainer[PromptRef]
    def __init__(self, table: _Optional[str] = ..., dataset: _Optional[str] = ..., prompts: _Optional[_Iterable[_Union[PromptRef, _Mapping]]] = ...) -> None: ...

class ReleaseClaimsReply(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class PromptOutcome(_message.Message):
    __slots__ = ("prompt", "rewards")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    prompt: PromptRef
    rewards: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, prompt: _Optional[_Union[PromptRef, _Mapping]] = ..., rewards: _Optional[_Iterable[float]] = ...) -> None: ...

class ReportPromptsRequest(_message.Message):
    __slots__ = ("table", "dataset", "outcomes")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    table: str
    dataset: str
    outcomes: _containers.RepeatedCompositeFieldContainer[PromptOutcome]
    def __init__(self, table: _Optional[str] = ..., dataset: _Optional[str] = ..., outcomes: _Optional[_Iterable[_Union[PromptOutcome, _Mapping]]] = ...) -> None: ...

class ReportPromptsReply(_message.Message):
    __slots__ = ("reported",)
    REPORTED_FIELD_NUMBER: _ClassVar[int]
    reported: int
    def __init__(self, reported: _Optional[int] = ...) -> None: ...

class ListPromptsRequest(_message.Message):
    __slots__ = ("table", "dataset", "states", "has_after", "after_epoch", "after_index", "limit")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    HAS_AFTER_FIELD_NUMBER: _ClassVar[int]
    AFTER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    AFTER_INDEX_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    table: str
    dataset: str
    states: _containers.RepeatedScalarFieldContainer[str]
    has_after: bool
    after_epoch: int
    after_index: int
    limit: int
    def __init__(self, table: _Optional[str] = ..., dataset: _Optional[str] = ..., states: _Optional[_Iterable[str]] = ..., has_after: _Optional[bool] = ..., after_epoch: _Optional[int] = ..., after_index: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class ListPromptsReply(_message.Message):
    __slots__ = ("prompts", "after_epoch", "after_index", "done")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    AFTER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    AFTER_INDEX_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    after_epoch: int
    after_index: int
    done: bool
    def __init__(self, prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., after_epoch: _Optional[int] = ..., after_index: _Optional[int] = ..., done: _Optional[bool] = ...) -> None: ...
