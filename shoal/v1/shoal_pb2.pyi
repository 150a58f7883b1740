from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    INT8: _ClassVar[DType]
    FLOAT64: _ClassVar[DType]
    UINT8: _ClassVar[DType]
    UINT32: _ClassVar[DType]

class SecAggPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SECAGG_PHASE_UNSPECIFIED: _ClassVar[SecAggPhase]
    SECAGG_SHARES: _ClassVar[SecAggPhase]
    SECAGG_REVEAL: _ClassVar[SecAggPhase]

class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PHASE_UNSPECIFIED: _ClassVar[Phase]
    REDUCE_SCATTER: _ClassVar[Phase]
    ALL_GATHER: _ClassVar[Phase]
    DISTANCES: _ClassVar[Phase]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT16: DType
BFLOAT16: DType
INT8: DType
FLOAT64: DType
UINT8: DType
UINT32: DType
SECAGG_PHASE_UNSPECIFIED: SecAggPhase
SECAGG_SHARES: SecAggPhase
SECAGG_REVEAL: SecAggPhase
PHASE_UNSPECIFIED: Phase
REDUCE_SCATTER: Phase
ALL_GATHER: Phase
DISTANCES: Phase

class JoinRequest(_message.Message):
    __slots__ = ("public_key", "data_address", "join_token", "num_samples", "version", "up_bytes_per_s", "down_bytes_per_s", "tls_csr", "outbound_only", "relay", "relay_bytes_per_s")
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    JOIN_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UP_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    DOWN_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    TLS_CSR_FIELD_NUMBER: _ClassVar[int]
    OUTBOUND_ONLY_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    RELAY_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    public_key: bytes
    data_address: str
    join_token: str
    num_samples: int
    version: str
    up_bytes_per_s: float
    down_bytes_per_s: float
    tls_csr: bytes
    outbound_only: bool
    relay: str
    relay_bytes_per_s: float
    def __init__(self, public_key: _Optional[bytes] = ..., data_address: _Optional[str] = ..., join_token: _Optional[str] = ..., num_samples: _Optional[int] = ..., version: _Optional[str] = ..., up_bytes_per_s: _Optional[float] = ..., down_bytes_per_s: _Optional[float] = ..., tls_csr: _Optional[bytes] = ..., outbound_only: _Optional[bool] = ..., relay: _Optional[str] = ..., relay_bytes_per_s: _Optional[float] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("peer_id", "lease_seconds", "heartbeat_interval_seconds", "epoch", "next_round", "run_config_json", "sync", "coordinator_public_key", "unreachable", "tls_certificate", "tls_ca", "tls_not_after", "finished", "relay_ticket")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NEXT_ROUND_FIELD_NUMBER: _ClassVar[int]
    RUN_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    TLS_CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    TLS_CA_FIELD_NUMBER: _ClassVar[int]
    TLS_NOT_AFTER_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    RELAY_TICKET_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    lease_seconds: float
    heartbeat_interval_seconds: float
    epoch: int
    next_round: int
    run_config_json: str
    sync: SyncOrder
    coordinator_public_key: bytes
    unreachable: str
    tls_certificate: bytes
    tls_ca: bytes
    tls_not_after: float
    finished: Finished
    relay_ticket: bytes
    def __init__(self, peer_id: _Optional[str] = ..., lease_seconds: _Optional[float] = ..., heartbeat_interval_seconds: _Optional[float] = ..., epoch: _Optional[int] = ..., next_round: _Optional[int] = ..., run_config_json: _Optional[str] = ..., sync: _Optional[_Union[SyncOrder, _Mapping]] = ..., coordinator_public_key: _Optional[bytes] = ..., unreachable: _Optional[str] = ..., tls_certificate: _Optional[bytes] = ..., tls_ca: _Optional[bytes] = ..., tls_not_after: _Optional[float] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ..., relay_ticket: _Optional[bytes] = ...) -> None: ...

class RenewCertificateRequest(_message.Message):
    __slots__ = ("peer_id", "tls_csr")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    TLS_CSR_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    tls_csr: bytes
    def __init__(self, peer_id: _Optional[str] = ..., tls_csr: _Optional[bytes] = ...) -> None: ...

class RenewCertificateResponse(_message.Message):
    __slots__ = ("tls_certificate", "tls_ca", "tls_not_after")
    TLS_CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    TLS_CA_FIELD_NUMBER: _ClassVar[int]
    TLS_NOT_AFTER_FIELD_NUMBER: _ClassVar[int]
    tls_certificate: bytes
    tls_ca: bytes
    tls_not_after: float
    def __init__(self, tls_certificate: _Optional[bytes] = ..., tls_ca: _Optional[bytes] = ..., tls_not_after: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("peer_id",)
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    def __init__(self, peer_id: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("lease_seconds", "epoch", "round", "ready", "pooled")
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    POOLED_FIELD_NUMBER: _ClassVar[int]
    lease_seconds: float
    epoch: int
    round: int
    ready: bool
    pooled: bool
    def __init__(self, lease_seconds: _Optional[float] = ..., epoch: _Optional[int] = ..., round: _Optional[int] = ..., ready: _Optional[bool] = ..., pooled: _Optional[bool] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("peer_id",)
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    def __init__(self, peer_id: _Optional[str] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReadyRequest(_message.Message):
    __slots__ = ("peer_id", "round", "num_elements", "dtype", "num_samples", "state_digest", "state_round", "state_bytes", "sync_bytes_per_s", "training", "local_steps", "local_seconds", "checkpoint_round", "checkpoint_digest", "secagg_mask_key", "secagg_box_key", "secagg_signature")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    NUM_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    STATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    STATE_ROUND_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SYNC_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    TRAINING_FIELD_NUMBER: _ClassVar[int]
    LOCAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ROUND_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SECAGG_MASK_KEY_FIELD_NUMBER: _ClassVar[int]
    SECAGG_BOX_KEY_FIELD_NUMBER: _ClassVar[int]
    SECAGG_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    round: int
    num_elements: int
    dtype: DType
    num_samples: int
    state_digest: bytes
    state_round: int
    state_bytes: int
    sync_bytes_per_s: float
    training: bool
    local_steps: int
    local_seconds: float
    checkpoint_round: int
    checkpoint_digest: bytes
    secagg_mask_key: bytes
    secagg_box_key: bytes
    secagg_signature: bytes
    def __init__(self, peer_id: _Optional[str] = ..., round: _Optional[int] = ..., num_elements: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., num_samples: _Optional[int] = ..., state_digest: _Optional[bytes] = ..., state_round: _Optional[int] = ..., state_bytes: _Optional[int] = ..., sync_bytes_per_s: _Optional[float] = ..., training: _Optional[bool] = ..., local_steps: _Optional[int] = ..., local_seconds: _Optional[float] = ..., checkpoint_round: _Optional[int] = ..., checkpoint_digest: _Optional[bytes] = ..., secagg_mask_key: _Optional[bytes] = ..., secagg_box_key: _Optional[bytes] = ..., secagg_signature: _Optional[bytes] = ...) -> None: ...

class ReadyResponse(_message.Message):
    __slots__ = ("round", "sync", "pooled")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    POOLED_FIELD_NUMBER: _ClassVar[int]
    round: int
    sync: SyncOrder
    pooled: bool
    def __init__(self, round: _Optional[int] = ..., sync: _Optional[_Union[SyncOrder, _Mapping]] = ..., pooled: _Optional[bool] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("peer_id",)
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    def __init__(self, peer_id: _Optional[str] = ...) -> None: ...

class Participant(_message.Message):
    __slots__ = ("peer_id", "address", "num_samples", "owner", "public_key", "outbound_only", "relay", "secagg_mask_key", "secagg_box_key", "secagg_signature")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    OUTBOUND_ONLY_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    SECAGG_MASK_KEY_FIELD_NUMBER: _ClassVar[int]
    SECAGG_BOX_KEY_FIELD_NUMBER: _ClassVar[int]
    SECAGG_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    address: str
    num_samples: int
    owner: bool
    public_key: bytes
    outbound_only: bool
    relay: str
    secagg_mask_key: bytes
    secagg_box_key: bytes
    secagg_signature: bytes
    def __init__(self, peer_id: _Optional[str] = ..., address: _Optional[str] = ..., num_samples: _Optional[int] = ..., owner: _Optional[bool] = ..., public_key: _Optional[bytes] = ..., outbound_only: _Optional[bool] = ..., relay: _Optional[str] = ..., secagg_mask_key: _Optional[bytes] = ..., secagg_box_key: _Optional[bytes] = ..., secagg_signature: _Optional[bytes] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("round", "attempt", "epoch", "participants", "collective", "shard_bounds", "shard_owner", "num_elements", "dtype", "deadline_seconds", "chunk_timeout_seconds", "chunk_bytes", "ticket", "aggregator", "compression", "predicted_seconds", "audit_owners", "fragment", "fragments", "secagg_seed", "predicted_round_seconds")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_FIELD_NUMBER: _ClassVar[int]
    SHARD_BOUNDS_FIELD_NUMBER: _ClassVar[int]
    SHARD_OWNER_FIELD_NUMBER: _ClassVar[int]
    NUM_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    AGGREGATOR_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    AUDIT_OWNERS_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    SECAGG_SEED_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_ROUND_SECONDS_FIELD_NUMBER: _ClassVar[int]
    round: int
    attempt: int
    epoch: int
    participants: _containers.RepeatedCompositeFieldContainer[Participant]
    collective: str
    shard_bounds: _containers.RepeatedScalarFieldContainer[int]
    shard_owner: _containers.RepeatedScalarFieldContainer[int]
    num_elements: int
    dtype: DType
    deadline_seconds: float
    chunk_timeout_seconds: float
    chunk_bytes: int
    ticket: bytes
    aggregator: str
    compression: str
    predicted_seconds: float
    audit_owners: bool
    fragment: int
    fragments: int
    secagg_seed: bytes
    predicted_round_seconds: float
    def __init__(self, round: _Optional[int] = ..., attempt: _Optional[int] = ..., epoch: _Optional[int] = ..., participants: _Optional[_Iterable[_Union[Participant, _Mapping]]] = ..., collective: _Optional[str] = ..., shard_bounds: _Optional[_Iterable[int]] = ..., shard_owner: _Optional[_Iterable[int]] = ..., num_elements: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., deadline_seconds: _Optional[float] = ..., chunk_timeout_seconds: _Optional[float] = ..., chunk_bytes: _Optional[int] = ..., ticket: _Optional[bytes] = ..., aggregator: _Optional[str] = ..., compression: _Optional[str] = ..., predicted_seconds: _Optional[float] = ..., audit_owners: _Optional[bool] = ..., fragment: _Optional[int] = ..., fragments: _Optional[int] = ..., secagg_seed: _Optional[bytes] = ..., predicted_round_seconds: _Optional[float] = ...) -> None: ...

class Commit(_message.Message):
    __slots__ = ("round", "attempt", "result_digest", "state_digest", "epoch", "participants", "flagged", "step_seconds", "epsilon", "checkpointers")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    RESULT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    STATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    FLAGGED_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTERS_FIELD_NUMBER: _ClassVar[int]
    round: int
    attempt: int
    result_digest: bytes
    state_digest: bytes
    epoch: int
    participants: _containers.RepeatedScalarFieldContainer[str]
    flagged: _containers.RepeatedScalarFieldContainer[str]
    step_seconds: float
    epsilon: float
    checkpointers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, round: _Optional[int] = ..., attempt: _Optional[int] = ..., result_digest: _Optional[bytes] = ..., state_digest: _Optional[bytes] = ..., epoch: _Optional[int] = ..., participants: _Optional[_Iterable[str]] = ..., flagged: _Optional[_Iterable[str]] = ..., step_seconds: _Optional[float] = ..., epsilon: _Optional[float] = ..., checkpointers: _Optional[_Iterable[str]] = ...) -> None: ...

class Abort(_message.Message):
    __slots__ = ("round", "attempt", "reason", "excluded", "will_retry")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_FIELD_NUMBER: _ClassVar[int]
    WILL_RETRY_FIELD_NUMBER: _ClassVar[int]
    round: int
    attempt: int
    reason: str
    excluded: _containers.RepeatedScalarFieldContainer[str]
    will_retry: bool
    def __init__(self, round: _Optional[int] = ..., attempt: _Optional[int] = ..., reason: _Optional[str] = ..., excluded: _Optional[_Iterable[str]] = ..., will_retry: _Optional[bool] = ...) -> None: ...

class SyncOrder(_message.Message):
    __slots__ = ("round", "state_digest", "donors", "state_bytes", "permit")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    DONORS_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PERMIT_FIELD_NUMBER: _ClassVar[int]
    round: int
    state_digest: bytes
    donors: _containers.RepeatedCompositeFieldContainer[Participant]
    state_bytes: int
    permit: bytes
    def __init__(self, round: _Optional[int] = ..., state_digest: _Optional[bytes] = ..., donors: _Optional[_Iterable[_Union[Participant, _Mapping]]] = ..., state_bytes: _Optional[int] = ..., permit: _Optional[bytes] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("rounds_committed", "reason")
    ROUNDS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    rounds_committed: int
    reason: str
    def __init__(self, rounds_committed: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class RoundEvent(_message.Message):
    __slots__ = ("plan", "commit", "abort", "sync", "finished")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    plan: Plan
    commit: Commit
    abort: Abort
    sync: SyncOrder
    finished: Finished
    def __init__(self, plan: _Optional[_Union[Plan, _Mapping]] = ..., commit: _Optional[_Union[Commit, _Mapping]] = ..., abort: _Optional[_Union[Abort, _Mapping]] = ..., sync: _Optional[_Union[SyncOrder, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ...) -> None: ...

class VoteRequest(_message.Message):
    __slots__ = ("peer_id", "round", "attempt", "ok", "result_digest", "state_digest", "error", "suspects", "flagged", "train_loss", "bytes_sent", "collective_seconds", "audit_failure", "relay_failure")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    RESULT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    STATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SUSPECTS_FIELD_NUMBER: _ClassVar[int]
    FLAGGED_FIELD_NUMBER: _ClassVar[int]
    TRAIN_LOSS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    AUDIT_FAILURE_FIELD_NUMBER: _ClassVar[int]
    RELAY_FAILURE_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    round: int
    attempt: int
    ok: bool
    result_digest: bytes
    state_digest: bytes
    error: str
    suspects: _containers.RepeatedScalarFieldContainer[str]
    flagged: _containers.RepeatedScalarFieldContainer[str]
    train_loss: float
    bytes_sent: int
    collective_seconds: float
    audit_failure: bool
    relay_failure: str
    def __init__(self, peer_id: _Optional[str] = ..., round: _Optional[int] = ..., attempt: _Optional[int] = ..., ok: _Optional[bool] = ..., result_digest: _Optional[bytes] = ..., state_digest: _Optional[bytes] = ..., error: _Optional[str] = ..., suspects: _Optional[_Iterable[str]] = ..., flagged: _Optional[_Iterable[str]] = ..., train_loss: _Optional[float] = ..., bytes_sent: _Optional[int] = ..., collective_seconds: _Optional[float] = ..., audit_failure: _Optional[bool] = ..., relay_failure: _Optional[str] = ...) -> None: ...

class VoteResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SecAggItem(_message.Message):
    __slots__ = ("from_peer", "to_peer", "data")
    FROM_PEER_FIELD_NUMBER: _ClassVar[int]
    TO_PEER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    from_peer: str
    to_peer: str
    data: bytes
    def __init__(self, from_peer: _Optional[str] = ..., to_peer: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class SecAggPost(_message.Message):
    __slots__ = ("peer_id", "round", "attempt", "phase", "items")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    round: int
    attempt: int
    phase: SecAggPhase
    items: _containers.RepeatedCompositeFieldContainer[SecAggItem]
    def __init__(self, peer_id: _Optional[str] = ..., round: _Optional[int] = ..., attempt: _Optional[int] = ..., phase: _Optional[_Union[SecAggPhase, str]] = ..., items: _Optional[_Iterable[_Union[SecAggItem, _Mapping]]] = ...) -> None: ...

class SecAggPostResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SecAggFetch(_message.Message):
    __slots__ = ("peer_id", "round", "attempt", "phase", "wait_seconds")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    round: int
    attempt: int
    phase: SecAggPhase
    wait_seconds: float
    def __init__(self, peer_id: _Optional[str] = ..., round: _Optional[int] = ..., attempt: _Optional[int] = ..., phase: _Optional[_Union[SecAggPhase, str]] = ..., wait_seconds: _Optional[float] = ...) -> None: ...

class SecAggFetchResponse(_message.Message):
    __slots__ = ("items", "posted")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    POSTED_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[SecAggItem]
    posted: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, items: _Optional[_Iterable[_Union[SecAggItem, _Mapping]]] = ..., posted: _Optional[_Iterable[str]] = ...) -> None: ...

class LinkEstimate(_message.Message):
    __slots__ = ("peer_id", "up_bytes_per_s", "down_bytes_per_s", "rtt_seconds", "samples")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    UP_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    DOWN_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    RTT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    up_bytes_per_s: float
    down_bytes_per_s: float
    rtt_seconds: float
    samples: int
    def __init__(self, peer_id: _Optional[str] = ..., up_bytes_per_s: _Optional[float] = ..., down_bytes_per_s: _Optional[float] = ..., rtt_seconds: _Optional[float] = ..., samples: _Optional[int] = ...) -> None: ...

class LinkReport(_message.Message):
    __slots__ = ("peer_id", "links", "up_bytes_per_s", "down_bytes_per_s", "shm_peers", "bulk_peers", "coordinator_rtt_seconds")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    UP_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    DOWN_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    SHM_PEERS_FIELD_NUMBER: _ClassVar[int]
    BULK_PEERS_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_RTT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    links: _containers.RepeatedCompositeFieldContainer[LinkEstimate]
    up_bytes_per_s: float
    down_bytes_per_s: float
    shm_peers: _containers.RepeatedScalarFieldContainer[str]
    bulk_peers: _containers.RepeatedScalarFieldContainer[str]
    coordinator_rtt_seconds: float
    def __init__(self, peer_id: _Optional[str] = ..., links: _Optional[_Iterable[_Union[LinkEstimate, _Mapping]]] = ..., up_bytes_per_s: _Optional[float] = ..., down_bytes_per_s: _Optional[float] = ..., shm_peers: _Optional[_Iterable[str]] = ..., bulk_peers: _Optional[_Iterable[str]] = ..., coordinator_rtt_seconds: _Optional[float] = ...) -> None: ...

class LinkReportResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("recent_rounds",)
    RECENT_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    recent_rounds: int
    def __init__(self, recent_rounds: _Optional[int] = ...) -> None: ...

class MemberInfo(_message.Message):
    __slots__ = ("peer_id", "address", "state", "lease_remaining_seconds", "num_samples", "up_bytes_per_s", "down_bytes_per_s", "rtt_seconds", "untrusted", "shm_peers", "reachability", "links_age_seconds", "outbound_only", "relay")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LEASE_REMAINING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    UP_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    DOWN_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    RTT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    UNTRUSTED_FIELD_NUMBER: _ClassVar[int]
    SHM_PEERS_FIELD_NUMBER: _ClassVar[int]
    REACHABILITY_FIELD_NUMBER: _ClassVar[int]
    LINKS_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    OUTBOUND_ONLY_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    address: str
    state: str
    lease_remaining_seconds: float
    num_samples: int
    up_bytes_per_s: float
    down_bytes_per_s: float
    rtt_seconds: float
    untrusted: bool
    shm_peers: int
    reachability: str
    links_age_seconds: float
    outbound_only: bool
    relay: str
    def __init__(self, peer_id: _Optional[str] = ..., address: _Optional[str] = ..., state: _Optional[str] = ..., lease_remaining_seconds: _Optional[float] = ..., num_samples: _Optional[int] = ..., up_bytes_per_s: _Optional[float] = ..., down_bytes_per_s: _Optional[float] = ..., rtt_seconds: _Optional[float] = ..., untrusted: _Optional[bool] = ..., shm_peers: _Optional[int] = ..., reachability: _Optional[str] = ..., links_age_seconds: _Optional[float] = ..., outbound_only: _Optional[bool] = ..., relay: _Optional[str] = ...) -> None: ...

class RoundInfo(_message.Message):
    __slots__ = ("round", "attempt", "status", "state_digest", "participants", "seconds", "reason", "train_loss", "collective")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    STATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TRAIN_LOSS_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_FIELD_NUMBER: _ClassVar[int]
    round: int
    attempt: int
    status: str
    state_digest: bytes
    participants: int
    seconds: float
    reason: str
    train_loss: float
    collective: str
    def __init__(self, round: _Optional[int] = ..., attempt: _Optional[int] = ..., status: _Optional[str] = ..., state_digest: _Optional[bytes] = ..., participants: _Optional[int] = ..., seconds: _Optional[float] = ..., reason: _Optional[str] = ..., train_loss: _Optional[float] = ..., collective: _Optional[str] = ...) -> None: ...

class Waiting(_message.Message):
    __slots__ = ("reason", "message", "peers", "seconds_left")
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_LEFT_FIELD_NUMBER: _ClassVar[int]
    reason: str
    message: str
    peers: _containers.RepeatedScalarFieldContainer[str]
    seconds_left: float
    def __init__(self, reason: _Optional[str] = ..., message: _Optional[str] = ..., peers: _Optional[_Iterable[str]] = ..., seconds_left: _Optional[float] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("epoch", "round", "members", "rounds", "rounds_committed", "rounds_aborted", "run_config_json", "waiting", "epsilon", "dp_delta", "durable_round", "durable_digest", "durable_peers", "rounds_lost")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_ABORTED_FIELD_NUMBER: _ClassVar[int]
    RUN_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    DP_DELTA_FIELD_NUMBER: _ClassVar[int]
    DURABLE_ROUND_FIELD_NUMBER: _ClassVar[int]
    DURABLE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    DURABLE_PEERS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_LOST_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    round: int
    members: _containers.RepeatedCompositeFieldContainer[MemberInfo]
    rounds: _containers.RepeatedCompositeFieldContainer[RoundInfo]
    rounds_committed: int
    rounds_aborted: int
    run_config_json: str
    waiting: Waiting
    epsilon: float
    dp_delta: float
    durable_round: int
    durable_digest: bytes
    durable_peers: _containers.RepeatedScalarFieldContainer[str]
    rounds_lost: int
    def __init__(self, epoch: _Optional[int] = ..., round: _Optional[int] = ..., members: _Optional[_Iterable[_Union[MemberInfo, _Mapping]]] = ..., rounds: _Optional[_Iterable[_Union[RoundInfo, _Mapping]]] = ..., rounds_committed: _Optional[int] = ..., rounds_aborted: _Optional[int] = ..., run_config_json: _Optional[str] = ..., waiting: _Optional[_Union[Waiting, _Mapping]] = ..., epsilon: _Optional[float] = ..., dp_delta: _Optional[float] = ..., durable_round: _Optional[int] = ..., durable_digest: _Optional[bytes] = ..., durable_peers: _Optional[_Iterable[str]] = ..., rounds_lost: _Optional[int] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("round", "attempt", "sender", "phase", "step", "shard", "offset", "dtype", "shape", "data", "ticket", "scale", "codec", "shm_name", "shm_offset", "chunk_signature")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFSET_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    round: int
    attempt: int
    sender: str
    phase: Phase
    step: int
    shard: int
    offset: int
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    ticket: bytes
    scale: bytes
    codec: int
    shm_name: str
    shm_offset: int
    chunk_signature: bytes
    def __init__(self, round: _Optional[int] = ..., attempt: _Optional[int] = ..., sender: _Optional[str] = ..., phase: _Optional[_Union[Phase, str]] = ..., step: _Optional[int] = ..., shard: _Optional[int] = ..., offset: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., ticket: _Optional[bytes] = ..., scale: _Optional[bytes] = ..., codec: _Optional[int] = ..., shm_name: _Optional[str] = ..., shm_offset: _Optional[int] = ..., chunk_signature: _Optional[bytes] = ...) -> None: ...

class PushAck(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: int
    def __init__(self, chunks: _Optional[int] = ...) -> None: ...

class StateRequest(_message.Message):
    __slots__ = ("peer_id", "round", "offset", "length")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    round: int
    offset: int
    length: int
    def __init__(self, peer_id: _Optional[str] = ..., round: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class StateChunk(_message.Message):
    __slots__ = ("round", "offset", "total_bytes", "data", "state_digest")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    STATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    round: int
    offset: int
    total_bytes: int
    data: bytes
    state_digest: bytes
    def __init__(self, round: _Optional[int] = ..., offset: _Optional[int] = ..., total_bytes: _Optional[int] = ..., data: _Optional[bytes] = ..., state_digest: _Optional[bytes] = ...) -> None: ...

class ProbeRequest(_message.Message):
    __slots__ = ("payload", "reply_bytes", "shm_name")
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    REPLY_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    reply_bytes: int
    shm_name: str
    def __init__(self, payload: _Optional[bytes] = ..., reply_bytes: _Optional[int] = ..., shm_name: _Optional[str] = ...) -> None: ...

class ProbeResponse(_message.Message):
    __slots__ = ("payload", "shm_nonce", "bulk_port")
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    SHM_NONCE_FIELD_NUMBER: _ClassVar[int]
    BULK_PORT_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    shm_nonce: bytes
    bulk_port: int
    def __init__(self, payload: _Optional[bytes] = ..., shm_nonce: _Optional[bytes] = ..., bulk_port: _Optional[int] = ...) -> None: ...

class ReachRequest(_message.Message):
    __slots__ = ("nonce",)
    NONCE_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    def __init__(self, nonce: _Optional[bytes] = ...) -> None: ...

class ReachResponse(_message.Message):
    __slots__ = ("public_key", "signature")
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    public_key: bytes
    signature: bytes
    def __init__(self, public_key: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class RoundTicket(_message.Message):
    __slots__ = ("round", "attempt", "participants", "plan_digest", "expires_unix")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    PLAN_DIGEST_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_FIELD_NUMBER: _ClassVar[int]
    round: int
    attempt: int
    participants: _containers.RepeatedScalarFieldContainer[str]
    plan_digest: bytes
    expires_unix: float
    def __init__(self, round: _Optional[int] = ..., attempt: _Optional[int] = ..., participants: _Optional[_Iterable[str]] = ..., plan_digest: _Optional[bytes] = ..., expires_unix: _Optional[float] = ...) -> None: ...

class ListMembersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MembershipInfo(_message.Message):
    __slots__ = ("member", "label", "admitted_at", "last_seen", "revoked_at", "status", "live", "address")
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_FIELD_NUMBER: _ClassVar[int]
    REVOKED_AT_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    member: str
    label: str
    admitted_at: float
    last_seen: float
    revoked_at: float
    status: str
    live: bool
    address: str
    def __init__(self, member: _Optional[str] = ..., label: _Optional[str] = ..., admitted_at: _Optional[float] = ..., last_seen: _Optional[float] = ..., revoked_at: _Optional[float] = ..., status: _Optional[str] = ..., live: _Optional[bool] = ..., address: _Optional[str] = ...) -> None: ...

class ListMembersResponse(_message.Message):
    __slots__ = ("members", "retention_seconds")
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    RETENTION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    members: _containers.RepeatedCompositeFieldContainer[MembershipInfo]
    retention_seconds: float
    def __init__(self, members: _Optional[_Iterable[_Union[MembershipInfo, _Mapping]]] = ..., retention_seconds: _Optional[float] = ...) -> None: ...

class RevokeMemberRequest(_message.Message):
    __slots__ = ("member",)
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    member: str
    def __init__(self, member: _Optional[str] = ...) -> None: ...

class RevokeMemberResponse(_message.Message):
    __slots__ = ("member",)
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    member: MembershipInfo
    def __init__(self, member: _Optional[_Union[MembershipInfo, _Mapping]] = ...) -> None: ...
