from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    DRAM: _ClassVar[Tier]
    SSD: _ClassVar[Tier]

class ErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_NONE: _ClassVar[ErrorCode]
    ERROR_EXISTS: _ClassVar[ErrorCode]
    ERROR_NOT_FOUND: _ClassVar[ErrorCode]
    ERROR_TOO_LARGE: _ClassVar[ErrorCode]
    ERROR_NO_SPACE: _ClassVar[ErrorCode]
    ERROR_INVALID: _ClassVar[ErrorCode]
    ERROR_UNAVAILABLE: _ClassVar[ErrorCode]
    ERROR_INTERNAL: _ClassVar[ErrorCode]
    ERROR_QUOTA_EXCEEDED: _ClassVar[ErrorCode]

class Placement(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PLACEMENT_UNSPECIFIED: _ClassVar[Placement]
    LOCAL_FIRST: _ClassVar[Placement]
    PREFERRED: _ClassVar[Placement]
    MOST_FREE: _ClassVar[Placement]
TIER_UNSPECIFIED: Tier
DRAM: Tier
SSD: Tier
ERROR_NONE: ErrorCode
ERROR_EXISTS: ErrorCode
ERROR_NOT_FOUND: ErrorCode
ERROR_TOO_LARGE: ErrorCode
ERROR_NO_SPACE: ErrorCode
ERROR_INVALID: ErrorCode
ERROR_UNAVAILABLE: ErrorCode
ERROR_INTERNAL: ErrorCode
ERROR_QUOTA_EXCEEDED: ErrorCode
PLACEMENT_UNSPECIFIED: Placement
LOCAL_FIRST: Placement
PREFERRED: Placement
MOST_FREE: Placement

class SegmentInfo(_message.Message):
    __slots__ = ("name", "tier", "size", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    tier: Tier
    size: int
    path: str
    def __init__(self, name: _Optional[str] = ..., tier: _Optional[_Union[Tier, str]] = ..., size: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...

class Replica(_message.Message):
    __slots__ = ("node_id", "address", "host_id", "segment", "tier", "offset", "segment_path", "segment_size")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_PATH_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_SIZE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    host_id: str
    segment: str
    tier: Tier
    offset: int
    segment_path: str
    segment_size: int
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., host_id: _Optional[str] = ..., segment: _Optional[str] = ..., tier: _Optional[_Union[Tier, str]] = ..., offset: _Optional[int] = ..., segment_path: _Optional[str] = ..., segment_size: _Optional[int] = ...) -> None: ...

class InventoryItem(_message.Message):
    __slots__ = ("key", "segment", "offset", "size", "checksum")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    key: str
    segment: str
    offset: int
    size: int
    checksum: int
    def __init__(self, key: _Optional[str] = ..., segment: _Optional[str] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ..., checksum: _Optional[int] = ...) -> None: ...

class RegisterNodeRequest(_message.Message):
    __slots__ = ("node_id", "address", "host_id", "segments", "inventory", "incarnation")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    host_id: str
    segments: _containers.RepeatedCompositeFieldContainer[SegmentInfo]
    inventory: _containers.RepeatedCompositeFieldContainer[InventoryItem]
    incarnation: str
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., host_id: _Optional[str] = ..., segments: _Optional[_Iterable[_Union[SegmentInfo, _Mapping]]] = ..., inventory: _Optional[_Iterable[_Union[InventoryItem, _Mapping]]] = ..., incarnation: _Optional[str] = ...) -> None: ...

class RegisterNodeResponse(_message.Message):
    __slots__ = ("master_id", "heartbeat_interval_ms", "restored_objects", "dropped_replicas")
    MASTER_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    RESTORED_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    master_id: str
    heartbeat_interval_ms: int
    restored_objects: int
    dropped_replicas: int
    def __init__(self, master_id: _Optional[str] = ..., heartbeat_interval_ms: _Optional[int] = ..., restored_objects: _Optional[int] = ..., dropped_replicas: _Optional[int] = ...) -> None: ...

class SegmentUsage(_message.Message):
    __slots__ = ("name", "used")
    NAME_FIELD_NUMBER: _ClassVar[int]
    USED_FIELD_NUMBER: _ClassVar[int]
    name: str
    used: int
    def __init__(self, name: _Optional[str] = ..., used: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "usage")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    usage: _containers.RepeatedCompositeFieldContainer[SegmentUsage]
    def __init__(self, node_id: _Optional[str] = ..., usage: _Optional[_Iterable[_Union[SegmentUsage, _Mapping]]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("reregister", "master_id")
    REREGISTER_FIELD_NUMBER: _ClassVar[int]
    MASTER_ID_FIELD_NUMBER: _ClassVar[int]
    reregister: bool
    master_id: str
    def __init__(self, reregister: _Optional[bool] = ..., master_id: _Optional[str] = ...) -> None: ...

class NodeCommand(_message.Message):
    __slots__ = ("id", "kind", "key", "segment", "offset", "size", "checksum", "src_segment", "src_offset", "src_replica")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[NodeCommand.Kind]
        COMMITTED: _ClassVar[NodeCommand.Kind]
        FREED: _ClassVar[NodeCommand.Kind]
        COPY: _ClassVar[NodeCommand.Kind]
    KIND_UNSPECIFIED: NodeCommand.Kind
    COMMITTED: NodeCommand.Kind
    FREED: NodeCommand.Kind
    COPY: NodeCommand.Kind
    ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    SRC_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    SRC_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SRC_REPLICA_FIELD_NUMBER: _ClassVar[int]
    id: int
    kind: NodeCommand.Kind
    key: str
    segment: str
    offset: int
    size: int
    checksum: int
    src_segment: str
    src_offset: int
    src_replica: Replica
    def __init__(self, id: _Optional[int] = ..., kind: _Optional[_Union[NodeCommand.Kind, str]] = ..., key: _Optional[str] = ..., segment: _Optional[str] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ..., checksum: _Optional[int] = ..., src_segment: _Optional[str] = ..., src_offset: _Optional[int] = ..., src_replica: _Optional[_Union[Replica, _Mapping]] = ...) -> None: ...

class NodeCommandBatch(_message.Message):
    __slots__ = ("commands",)
    COMMANDS_FIELD_NUMBER: _ClassVar[int]
    commands: _containers.RepeatedCompositeFieldContainer[NodeCommand]
    def __init__(self, commands: _Optional[_Iterable[_Union[NodeCommand, _Mapping]]] = ...) -> None: ...

class NodeCommandsRequest(_message.Message):
    __slots__ = ("node_id", "master_id")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    MASTER_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    master_id: str
    def __init__(self, node_id: _Optional[str] = ..., master_id: _Optional[str] = ...) -> None: ...

class CommandDoneRequest(_message.Message):
    __slots__ = ("node_id", "id", "ok", "error")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    id: int
    ok: bool
    error: str
    def __init__(self, node_id: _Optional[str] = ..., id: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class CommandDoneResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PutStartRequest(_message.Message):
    __slots__ = ("key", "size", "replicas", "placement", "preferred_segment", "client_host_id", "segments", "tenant")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    PREFERRED_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    CLIENT_HOST_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    key: str
    size: int
    replicas: int
    placement: Placement
    preferred_segment: str
    client_host_id: str
    segments: _containers.RepeatedScalarFieldContainer[str]
    tenant: str
    def __init__(self, key: _Optional[str] = ..., size: _Optional[int] = ..., replicas: _Optional[int] = ..., placement: _Optional[_Union[Placement, str]] = ..., preferred_segment: _Optional[str] = ..., client_host_id: _Optional[str] = ..., segments: _Optional[_Iterable[str]] = ..., tenant: _Optional[str] = ...) -> None: ...

class PutStartResponse(_message.Message):
    __slots__ = ("put_id", "replicas", "exists", "in_progress")
    PUT_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    IN_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    put_id: int
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    exists: bool
    in_progress: bool
    def __init__(self, put_id: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ..., exists: _Optional[bool] = ..., in_progress: _Optional[bool] = ...) -> None: ...

class PutEndRequest(_message.Message):
    __slots__ = ("key", "put_id", "checksum")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PUT_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    key: str
    put_id: int
    checksum: int
    def __init__(self, key: _Optional[str] = ..., put_id: _Optional[int] = ..., checksum: _Optional[int] = ...) -> None: ...

class PutEndResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PutRevokeRequest(_message.Message):
    __slots__ = ("key", "put_id")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PUT_ID_FIELD_NUMBER: _ClassVar[int]
    key: str
    put_id: int
    def __init__(self, key: _Optional[str] = ..., put_id: _Optional[int] = ...) -> None: ...

class PutRevokeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BatchPutStartRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[PutStartRequest]
    def __init__(self, items: _Optional[_Iterable[_Union[PutStartRequest, _Mapping]]] = ...) -> None: ...

class PutStartResult(_message.Message):
    __slots__ = ("ok", "error", "code")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    ok: PutStartResponse
    error: str
    code: ErrorCode
    def __init__(self, ok: _Optional[_Union[PutStartResponse, _Mapping]] = ..., error: _Optional[str] = ..., code: _Optional[_Union[ErrorCode, str]] = ...) -> None: ...

class BatchPutStartResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[PutStartResult]
    def __init__(self, results: _Optional[_Iterable[_Union[PutStartResult, _Mapping]]] = ...) -> None: ...

class BatchPutEndRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[PutEndRequest]
    def __init__(self, items: _Optional[_Iterable[_Union[PutEndRequest, _Mapping]]] = ...) -> None: ...

class BatchPutEndResponse(_message.Message):
    __slots__ = ("errors", "codes")
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    CODES_FIELD_NUMBER: _ClassVar[int]
    errors: _containers.RepeatedScalarFieldContainer[str]
    codes: _containers.RepeatedScalarFieldContainer[ErrorCode]
    def __init__(self, errors: _Optional[_Iterable[str]] = ..., codes: _Optional[_Iterable[_Union[ErrorCode, str]]] = ...) -> None: ...

class SpaceLeaseRequest(_message.Message):
    __slots__ = ("size", "min_size", "replicas", "placement", "preferred_segment", "client_host_id", "segments", "tenant")
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MIN_SIZE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    PREFERRED_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    CLIENT_HOST_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    size: int
    min_size: int
    replicas: int
    placement: Placement
    preferred_segment: str
    client_host_id: str
    segments: _containers.RepeatedScalarFieldContainer[str]
    tenant: str
    def __init__(self, size: _Optional[int] = ..., min_size: _Optional[int] = ..., replicas: _Optional[int] = ..., placement: _Optional[_Union[Placement, str]] = ..., preferred_segment: _Optional[str] = ..., client_host_id: _Optional[str] = ..., segments: _Optional[_Iterable[str]] = ..., tenant: _Optional[str] = ...) -> None: ...

class SpaceLeaseResponse(_message.Message):
    __slots__ = ("lease_id", "size", "replicas", "ttl_ms", "align")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    ALIGN_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    size: int
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    ttl_ms: int
    align: int
    def __init__(self, lease_id: _Optional[int] = ..., size: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ..., ttl_ms: _Optional[int] = ..., align: _Optional[int] = ...) -> None: ...

class CommitItem(_message.Message):
    __slots__ = ("key", "offset", "size", "checksum")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    key: str
    offset: int
    size: int
    checksum: int
    def __init__(self, key: _Optional[str] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ..., checksum: _Optional[int] = ...) -> None: ...

class PutCommitRequest(_message.Message):
    __slots__ = ("lease_id", "items", "release")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    items: _containers.RepeatedCompositeFieldContainer[CommitItem]
    release: bool
    def __init__(self, lease_id: _Optional[int] = ..., items: _Optional[_Iterable[_Union[CommitItem, _Mapping]]] = ..., release: _Optional[bool] = ...) -> None: ...

class PutCommitResponse(_message.Message):
    __slots__ = ("errors", "codes")
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    CODES_FIELD_NUMBER: _ClassVar[int]
    errors: _containers.RepeatedScalarFieldContainer[str]
    codes: _containers.RepeatedScalarFieldContainer[ErrorCode]
    def __init__(self, errors: _Optional[_Iterable[str]] = ..., codes: _Optional[_Iterable[_Union[ErrorCode, str]]] = ...) -> None: ...

class SpaceReleaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    def __init__(self, lease_id: _Optional[int] = ...) -> None: ...

class SpaceReleaseResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class ReplicaStartRequest(_message.Message):
    __slots__ = ("keys", "segment")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    segment: str
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., segment: _Optional[str] = ...) -> None: ...

class ReplicaStartResult(_message.Message):
    __slots__ = ("replica_id", "replica", "size", "checksum", "code", "error")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    replica_id: int
    replica: Replica
    size: int
    checksum: int
    code: ErrorCode
    error: str
    def __init__(self, replica_id: _Optional[int] = ..., replica: _Optional[_Union[Replica, _Mapping]] = ..., size: _Optional[int] = ..., checksum: _Optional[int] = ..., code: _Optional[_Union[ErrorCode, str]] = ..., error: _Optional[str] = ...) -> None: ...

class ReplicaStartResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ReplicaStartResult]
    def __init__(self, results: _Optional[_Iterable[_Union[ReplicaStartResult, _Mapping]]] = ...) -> None: ...

class ReplicaEndItem(_message.Message):
    __slots__ = ("key", "replica_id", "checksum", "revoke")
    KEY_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    REVOKE_FIELD_NUMBER: _ClassVar[int]
    key: str
    replica_id: int
    checksum: int
    revoke: bool
    def __init__(self, key: _Optional[str] = ..., replica_id: _Optional[int] = ..., checksum: _Optional[int] = ..., revoke: _Optional[bool] = ...) -> None: ...

class ReplicaEndRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ReplicaEndItem]
    def __init__(self, items: _Optional[_Iterable[_Union[ReplicaEndItem, _Mapping]]] = ...) -> None: ...

class ReplicaEndResponse(_message.Message):
    __slots__ = ("errors", "codes")
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    CODES_FIELD_NUMBER: _ClassVar[int]
    errors: _containers.RepeatedScalarFieldContainer[str]
    codes: _containers.RepeatedScalarFieldContainer[ErrorCode]
    def __init__(self, errors: _Optional[_Iterable[str]] = ..., codes: _Optional[_Iterable[_Union[ErrorCode, str]]] = ...) -> None: ...

class GetReplicasRequest(_message.Message):
    __slots__ = ("keys", "lease_ms", "client_host_id")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_HOST_ID_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    lease_ms: int
    client_host_id: str
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., lease_ms: _Optional[int] = ..., client_host_id: _Optional[str] = ...) -> None: ...

class ObjectReplicas(_message.Message):
    __slots__ = ("found", "size", "checksum", "replicas")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    found: bool
    size: int
    checksum: int
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    def __init__(self, found: _Optional[bool] = ..., size: _Optional[int] = ..., checksum: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ...) -> None: ...

class GetReplicasResponse(_message.Message):
    __slots__ = ("objects", "lease_id", "lease_expires_unix_ms")
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    objects: _containers.RepeatedCompositeFieldContainer[ObjectReplicas]
    lease_id: int
    lease_expires_unix_ms: int
    def __init__(self, objects: _Optional[_Iterable[_Union[ObjectReplicas, _Mapping]]] = ..., lease_id: _Optional[int] = ..., lease_expires_unix_ms: _Optional[int] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    def __init__(self, lease_id: _Optional[int] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExistsRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class ExistsResponse(_message.Message):
    __slots__ = ("exists", "prefix_len")
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    exists: _containers.RepeatedScalarFieldContainer[bool]
    prefix_len: int
    def __init__(self, exists: _Optional[_Iterable[bool]] = ..., prefix_len: _Optional[int] = ...) -> None: ...

class RemoveRequest(_message.Message):
    __slots__ = ("keys", "force")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    force: bool
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., force: _Optional[bool] = ...) -> None: ...

class RemoveResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, removed: _Optional[_Iterable[bool]] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("keys", "pin")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    pin: bool
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., pin: _Optional[bool] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("ok",)
    OK_FIELD_NUMBER: _ClassVar[int]
    ok: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, ok: _Optional[_Iterable[bool]] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("node_id", "snapshot")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    snapshot: bool
    def __init__(self, node_id: _Optional[str] = ..., snapshot: _Optional[bool] = ...) -> None: ...

class BlockEvent(_message.Message):
    __slots__ = ("seq", "kind", "key", "node_id", "segment", "tier", "size", "unix_ms")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[BlockEvent.Kind]
        STORED: _ClassVar[BlockEvent.Kind]
        EVICTED: _ClassVar[BlockEvent.Kind]
        REMOVED: _ClassVar[BlockEvent.Kind]
        SPILLED: _ClassVar[BlockEvent.Kind]
        PROMOTED: _ClassVar[BlockEvent.Kind]
        SNAPSHOT_END: _ClassVar[BlockEvent.Kind]
    KIND_UNSPECIFIED: BlockEvent.Kind
    STORED: BlockEvent.Kind
    EVICTED: BlockEvent.Kind
    REMOVED: BlockEvent.Kind
    SPILLED: BlockEvent.Kind
    PROMOTED: BlockEvent.Kind
    SNAPSHOT_END: BlockEvent.Kind
    SEQ_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    kind: BlockEvent.Kind
    key: str
    node_id: str
    segment: str
    tier: Tier
    size: int
    unix_ms: int
    def __init__(self, seq: _Optional[int] = ..., kind: _Optional[_Union[BlockEvent.Kind, str]] = ..., key: _Optional[str] = ..., node_id: _Optional[str] = ..., segment: _Optional[str] = ..., tier: _Optional[_Union[Tier, str]] = ..., size: _Optional[int] = ..., unix_ms: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SegmentStats(_message.Message):
    __slots__ = ("name", "node_id", "tier", "size", "used", "objects", "host_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    USED_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    node_id: str
    tier: Tier
    size: int
    used: int
    objects: int
    host_id: str
    def __init__(self, name: _Optional[str] = ..., node_id: _Optional[str] = ..., tier: _Optional[_Union[Tier, str]] = ..., size: _Optional[int] = ..., used: _Optional[int] = ..., objects: _Optional[int] = ..., host_id: _Optional[str] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("master_id", "objects", "pending_puts", "nodes", "segments", "evictions", "spills", "promotions", "meta_bytes_estimate", "recovering", "tenants")
    MASTER_ID_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    PENDING_PUTS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    SPILLS_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    META_BYTES_ESTIMATE_FIELD_NUMBER: _ClassVar[int]
    RECOVERING_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    master_id: str
    objects: int
    pending_puts: int
    nodes: int
    segments: _containers.RepeatedCompositeFieldContainer[SegmentStats]
    evictions: int
    spills: int
    promotions: int
    meta_bytes_estimate: int
    recovering: bool
    tenants: _containers.RepeatedCompositeFieldContainer[TenantQuotaStats]
    def __init__(self, master_id: _Optional[str] = ..., objects: _Optional[int] = ..., pending_puts: _Optional[int] = ..., nodes: _Optional[int] = ..., segments: _Optional[_Iterable[_Union[SegmentStats, _Mapping]]] = ..., evictions: _Optional[int] = ..., spills: _Optional[int] = ..., promotions: _Optional[int] = ..., meta_bytes_estimate: _Optional[int] = ..., recovering: _Optional[bool] = ..., tenants: _Optional[_Iterable[_Union[TenantQuotaStats, _Mapping]]] = ...) -> None: ...

class TenantQuotaStats(_message.Message):
    __slots__ = ("tenant", "dram_used", "ssd_used", "objects", "dram_quota", "ssd_quota", "evictions", "refusals")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    DRAM_USED_FIELD_NUMBER: _ClassVar[int]
    SSD_USED_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    DRAM_QUOTA_FIELD_NUMBER: _ClassVar[int]
    SSD_QUOTA_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    REFUSALS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    dram_used: int
    ssd_used: int
    objects: int
    dram_quota: int
    ssd_quota: int
    evictions: int
    refusals: int
    def __init__(self, tenant: _Optional[str] = ..., dram_used: _Optional[int] = ..., ssd_used: _Optional[int] = ..., objects: _Optional[int] = ..., dram_quota: _Optional[int] = ..., ssd_quota: _Optional[int] = ..., evictions: _Optional[int] = ..., refusals: _Optional[int] = ...) -> None: ...

class StreamPlan(_message.Message):
    __slots__ = ("objects",)
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    objects: _containers.RepeatedCompositeFieldContainer[PlanObject]
    def __init__(self, objects: _Optional[_Iterable[_Union[PlanObject, _Mapping]]] = ...) -> None: ...

class PlanObject(_message.Message):
    __slots__ = ("size", "replicas")
    SIZE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    size: int
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    def __init__(self, size: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ...) -> None: ...
