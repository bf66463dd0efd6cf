from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_p", "max_tokens", "stop", "has_seed", "seed", "ignore_eos")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    has_seed: bool
    seed: int
    ignore_eos: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., has_seed: _Optional[bool] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class KVPlan(_message.Message):
    __slots__ = ("block_keys", "namespace", "local_blocks", "fetch_blocks", "write_segment", "planned", "bootstrap_addr", "bootstrap_room", "home_segment", "keep_fetched")
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FETCH_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WRITE_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    PLANNED_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_ADDR_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_ROOM_FIELD_NUMBER: _ClassVar[int]
    HOME_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    KEEP_FETCHED_FIELD_NUMBER: _ClassVar[int]
    block_keys: _containers.RepeatedScalarFieldContainer[str]
    namespace: str
    local_blocks: int
    fetch_blocks: int
    write_segment: str
    planned: bool
    bootstrap_addr: str
    bootstrap_room: int
    home_segment: str
    keep_fetched: bool
    def __init__(self, block_keys: _Optional[_Iterable[str]] = ..., namespace: _Optional[str] = ..., local_blocks: _Optional[int] = ..., fetch_blocks: _Optional[int] = ..., write_segment: _Optional[str] = ..., planned: _Optional[bool] = ..., bootstrap_addr: _Optional[str] = ..., bootstrap_room: _Optional[int] = ..., home_segment: _Optional[str] = ..., keep_fetched: _Optional[bool] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "tenant", "sampling", "use_prefix_cache", "trace_context", "plan")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    USE_PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    tenant: str
    sampling: Sampling
    use_prefix_cache: bool
    trace_context: _containers.ScalarMap[str, str]
    plan: KVPlan
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., tenant: _Optional[str] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., use_prefix_cache: _Optional[bool] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., plan: _Optional[_Union[KVPlan, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "text", "finished", "finish_reason", "prompt_tokens", "cached_tokens", "computed_tokens", "tail_key", "stored_blocks", "rejected_blocks", "queue_ms", "load_ms", "compute_ms", "store_ms", "stages")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TAIL_KEY_FIELD_NUMBER: _ClassVar[int]
    STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    LOAD_MS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    STORE_MS_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    text: str
    finished: bool
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    tail_key: str
    stored_blocks: int
    rejected_blocks: int
    queue_ms: float
    load_ms: float
    compute_ms: float
    store_ms: float
    stages: _containers.RepeatedCompositeFieldContainer[StageStats]
    def __init__(self, first_token: _Optional[int] = ..., text: _Optional[str] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., tail_key: _Optional[str] = ..., stored_blocks: _Optional[int] = ..., rejected_blocks: _Optional[int] = ..., queue_ms: _Optional[float] = ..., load_ms: _Optional[float] = ..., compute_ms: _Optional[float] = ..., store_ms: _Optional[float] = ..., stages: _Optional[_Iterable[_Union[StageStats, _Mapping]]] = ...) -> None: ...

class StageStats(_message.Message):
    __slots__ = ("stage", "layer_lo", "layer_hi", "busy_s", "idle_s", "bytes_in", "bytes_out", "kv_bytes")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    LAYER_LO_FIELD_NUMBER: _ClassVar[int]
    LAYER_HI_FIELD_NUMBER: _ClassVar[int]
    BUSY_S_FIELD_NUMBER: _ClassVar[int]
    IDLE_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    stage: int
    layer_lo: int
    layer_hi: int
    busy_s: float
    idle_s: float
    bytes_in: int
    bytes_out: int
    kv_bytes: int
    def __init__(self, stage: _Optional[int] = ..., layer_lo: _Optional[int] = ..., layer_hi: _Optional[int] = ..., busy_s: _Optional[float] = ..., idle_s: _Optional[float] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., kv_bytes: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "tenant", "first_token", "sampling", "tail_key", "trace_context", "plan")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TAIL_KEY_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    tenant: str
    first_token: int
    sampling: Sampling
    tail_key: str
    trace_context: _containers.ScalarMap[str, str]
    plan: KVPlan
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., tenant: _Optional[str] = ..., first_token: _Optional[int] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., tail_key: _Optional[str] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., plan: _Optional[_Union[KVPlan, _Mapping]] = ...) -> None: ...

class DecodeHandoff(_message.Message):
    __slots__ = ("context_tokens", "tail_key", "stored_blocks", "reason")
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TAIL_KEY_FIELD_NUMBER: _ClassVar[int]
    STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    context_tokens: int
    tail_key: str
    stored_blocks: int
    reason: str
    def __init__(self, context_tokens: _Optional[int] = ..., tail_key: _Optional[str] = ..., stored_blocks: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class DecodeChunk(_message.Message):
    __slots__ = ("token_id", "text", "finished", "finish_reason", "handoff")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    text: str
    finished: bool
    finish_reason: str
    handoff: DecodeHandoff
    def __init__(self, token_id: _Optional[int] = ..., text: _Optional[str] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., handoff: _Optional[_Union[DecodeHandoff, _Mapping]] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("instance_id", "role", "revision", "model", "model_fingerprint", "dtype", "block_tokens", "max_context", "ready", "draining", "queued_requests", "queued_tokens", "running", "kv_free_tokens", "kv_capacity_tokens", "local_segment", "engine", "kv_layout", "waiting", "bootstrap_addr", "tokenizer_fingerprint", "host_id", "pipeline_group", "pipeline_stage", "pipeline_group_size", "pipeline_whole", "accepted_streams")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    KV_FREE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_ADDR_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_GROUP_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_STAGE_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_WHOLE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_STREAMS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    role: str
    revision: str
    model: str
    model_fingerprint: str
    dtype: str
    block_tokens: int
    max_context: int
    ready: bool
    draining: bool
    queued_requests: int
    queued_tokens: int
    running: int
    kv_free_tokens: int
    kv_capacity_tokens: int
    local_segment: str
    engine: str
    kv_layout: str
    waiting: int
    bootstrap_addr: str
    tokenizer_fingerprint: str
    host_id: str
    pipeline_group: str
    pipeline_stage: int
    pipeline_group_size: int
    pipeline_whole: bool
    accepted_streams: int
    def __init__(self, instance_id: _Optional[str] = ..., role: _Optional[str] = ..., revision: _Optional[str] = ..., model: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., dtype: _Optional[str] = ..., block_tokens: _Optional[int] = ..., max_context: _Optional[int] = ..., ready: _Optional[bool] = ..., draining: _Optional[bool] = ..., queued_requests: _Optional[int] = ..., queued_tokens: _Optional[int] = ..., running: _Optional[int] = ..., kv_free_tokens: _Optional[int] = ..., kv_capacity_tokens: _Optional[int] = ..., local_segment: _Optional[str] = ..., engine: _Optional[str] = ..., kv_layout: _Optional[str] = ..., waiting: _Optional[int] = ..., bootstrap_addr: _Optional[str] = ..., tokenizer_fingerprint: _Optional[str] = ..., host_id: _Optional[str] = ..., pipeline_group: _Optional[str] = ..., pipeline_stage: _Optional[int] = ..., pipeline_group_size: _Optional[int] = ..., pipeline_whole: _Optional[bool] = ..., accepted_streams: _Optional[int] = ...) -> None: ...

class StageHello(_message.Message):
    __slots__ = ("group", "group_size", "stage", "model_fingerprint", "revision", "num_layers")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    group: str
    group_size: int
    stage: int
    model_fingerprint: str
    revision: str
    num_layers: int
    def __init__(self, group: _Optional[str] = ..., group_size: _Optional[int] = ..., stage: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., revision: _Optional[str] = ..., num_layers: _Optional[int] = ...) -> None: ...

class StageHelloReply(_message.Message):
    __slots__ = ("ok", "problem", "stage", "layer_lo", "layer_hi", "instance_id", "inbox_segment", "inbox_path", "inbox_size", "inbox_address", "host_id", "slots", "slot_bytes", "downstream")
    OK_FIELD_NUMBER: _ClassVar[int]
    PROBLEM_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    LAYER_LO_FIELD_NUMBER: _ClassVar[int]
    LAYER_HI_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    INBOX_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    INBOX_PATH_FIELD_NUMBER: _ClassVar[int]
    INBOX_SIZE_FIELD_NUMBER: _ClassVar[int]
    INBOX_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    DOWNSTREAM_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    problem: str
    stage: int
    layer_lo: int
    layer_hi: int
    instance_id: str
    inbox_segment: str
    inbox_path: str
    inbox_size: int
    inbox_address: str
    host_id: str
    slots: int
    slot_bytes: int
    downstream: _containers.RepeatedCompositeFieldContainer[StageHelloReply]
    def __init__(self, ok: _Optional[bool] = ..., problem: _Optional[str] = ..., stage: _Optional[int] = ..., layer_lo: _Optional[int] = ..., layer_hi: _Optional[int] = ..., instance_id: _Optional[str] = ..., inbox_segment: _Optional[str] = ..., inbox_path: _Optional[str] = ..., inbox_size: _Optional[int] = ..., inbox_address: _Optional[str] = ..., host_id: _Optional[str] = ..., slots: _Optional[int] = ..., slot_bytes: _Optional[int] = ..., downstream: _Optional[_Iterable[_Union[StageHelloReply, _Mapping]]] = ...) -> None: ...

class StageBegin(_message.Message):
    __slots__ = ("request_id", "token_ids", "reuse_keys", "keep_fetched", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REUSE_KEYS_FIELD_NUMBER: _ClassVar[int]
    KEEP_FETCHED_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    reuse_keys: _containers.RepeatedScalarFieldContainer[str]
    keep_fetched: bool
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., reuse_keys: _Optional[_Iterable[str]] = ..., keep_fetched: _Optional[bool] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class StageStart(_message.Message):
    __slots__ = ("start", "first_block", "put_plan")
    START_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    PUT_PLAN_FIELD_NUMBER: _ClassVar[int]
    start: int
    first_block: int
    put_plan: bytes
    def __init__(self, start: _Optional[int] = ..., first_block: _Optional[int] = ..., put_plan: _Optional[bytes] = ...) -> None: ...

class StageChunk(_message.Message):
    __slots__ = ("slot", "start", "end", "nbytes", "checksum", "last_token_pass")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    LAST_TOKEN_PASS_FIELD_NUMBER: _ClassVar[int]
    slot: int
    start: int
    end: int
    nbytes: int
    checksum: int
    last_token_pass: bool
    def __init__(self, slot: _Optional[int] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., nbytes: _Optional[int] = ..., checksum: _Optional[int] = ..., last_token_pass: _Optional[bool] = ...) -> None: ...

class StageEnd(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StageMessage(_message.Message):
    __slots__ = ("begin", "start", "chunk", "end")
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    begin: StageBegin
    start: StageStart
    chunk: StageChunk
    end: StageEnd
    def __init__(self, begin: _Optional[_Union[StageBegin, _Mapping]] = ..., start: _Optional[_Union[StageStart, _Mapping]] = ..., chunk: _Optional[_Union[StageChunk, _Mapping]] = ..., end: _Optional[_Union[StageEnd, _Mapping]] = ...) -> None: ...

class StageBegun(_message.Message):
    __slots__ = ("verified_blocks",)
    VERIFIED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    verified_blocks: int
    def __init__(self, verified_blocks: _Optional[int] = ...) -> None: ...

class StageCredit(_message.Message):
    __slots__ = ("slot",)
    SLOT_FIELD_NUMBER: _ClassVar[int]
    slot: int
    def __init__(self, slot: _Optional[int] = ...) -> None: ...

class StageResult(_message.Message):
    __slots__ = ("last_hidden", "dtype", "failed_objects", "stages", "layer_ranges")
    LAST_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    FAILED_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    LAYER_RANGES_FIELD_NUMBER: _ClassVar[int]
    last_hidden: bytes
    dtype: str
    failed_objects: _containers.RepeatedScalarFieldContainer[int]
    stages: _containers.RepeatedCompositeFieldContainer[StageStats]
    layer_ranges: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, last_hidden: _Optional[bytes] = ..., dtype: _Optional[str] = ..., failed_objects: _Optional[_Iterable[int]] = ..., stages: _Optional[_Iterable[_Union[StageStats, _Mapping]]] = ..., layer_ranges: _Optional[_Iterable[int]] = ...) -> None: ...

class StageEvent(_message.Message):
    __slots__ = ("begun", "credit", "result")
    BEGUN_FIELD_NUMBER: _ClassVar[int]
    CREDIT_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    begun: StageBegun
    credit: StageCredit
    result: StageResult
    def __init__(self, begun: _Optional[_Union[StageBegun, _Mapping]] = ..., credit: _Optional[_Union[StageCredit, _Mapping]] = ..., result: _Optional[_Union[StageResult, _Mapping]] = ...) -> None: ...
