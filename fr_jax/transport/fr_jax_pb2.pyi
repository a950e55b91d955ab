from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Trajectory(_message.Message):
    __slots__ = ("prompt_id", "traj_id", "prompt_tokens", "completion_tokens", "action_mask", "behavior_logp", "policy_version", "reward", "finish_reason", "num_tool_calls", "num_turns", "env", "worker_id", "routed_experts")
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    TRAJ_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACTION_MASK_FIELD_NUMBER: _ClassVar[int]
    BEHAVIOR_LOGP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    NUM_TURNS_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    prompt_id: str
    traj_id: str
    prompt_tokens: Tensor
    completion_tokens: Tensor
    action_mask: Tensor
    behavior_logp: Tensor
    policy_version: Tensor
    reward: float
    finish_reason: str
    num_tool_calls: int
    num_turns: int
    env: str
    worker_id: str
    routed_experts: Tensor
    def __init__(self, prompt_id: _Optional[str] = ..., traj_id: _Optional[str] = ..., prompt_tokens: _Optional[_Union[Tensor, _Mapping]] = ..., completion_tokens: _Optional[_Union[Tensor, _Mapping]] = ..., action_mask: _Optional[_Union[Tensor, _Mapping]] = ..., behavior_logp: _Optional[_Union[Tensor, _Mapping]] = ..., policy_version: _Optional[_Union[Tensor, _Mapping]] = ..., reward: _Optional[float] = ..., finish_reason: _Optional[str] = ..., num_tool_calls: _Optional[int] = ..., num_turns: _Optional[int] = ..., env: _Optional[str] = ..., worker_id: _Optional[str] = ..., routed_experts: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class PushAck(_message.Message):
    __slots__ = ("traj_id", "admitted", "reason", "learner_version", "queue_depth")
    TRAJ_ID_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LEARNER_VERSION_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    traj_id: str
    admitted: bool
    reason: str
    learner_version: int
    queue_depth: int
    def __init__(self, traj_id: _Optional[str] = ..., admitted: _Optional[bool] = ..., reason: _Optional[str] = ..., learner_version: _Optional[int] = ..., queue_depth: _Optional[int] = ...) -> None: ...

class WeightsRequest(_message.Message):
    __slots__ = ("min_version", "worker_id", "form")
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    FORM_FIELD_NUMBER: _ClassVar[int]
    min_version: int
    worker_id: str
    form: str
    def __init__(self, min_version: _Optional[int] = ..., worker_id: _Optional[str] = ..., form: _Optional[str] = ...) -> None: ...

class WeightsChunk(_message.Message):
    __slots__ = ("version", "num_tensors", "name", "dtype", "shape", "offset", "total_bytes", "data", "hf_dir", "crc32", "piece", "base_version")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    HF_DIR_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    PIECE_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    num_tensors: int
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    total_bytes: int
    data: bytes
    hf_dir: str
    crc32: int
    piece: int
    base_version: int
    def __init__(self, version: _Optional[int] = ..., num_tensors: _Optional[int] = ..., name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., total_bytes: _Optional[int] = ..., data: _Optional[bytes] = ..., hf_dir: _Optional[str] = ..., crc32: _Optional[int] = ..., piece: _Optional[int] = ..., base_version: _Optional[int] = ...) -> None: ...

class ManifestRequest(_message.Message):
    __slots__ = ("min_version", "worker_id", "serve_address")
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SERVE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    min_version: int
    worker_id: str
    serve_address: str
    def __init__(self, min_version: _Optional[int] = ..., worker_id: _Optional[str] = ..., serve_address: _Optional[str] = ...) -> None: ...

class ManifestReply(_message.Message):
    __slots__ = ("version", "manifest", "hosts", "parent")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    version: int
    manifest: str
    hosts: _containers.RepeatedScalarFieldContainer[str]
    parent: str
    def __init__(self, version: _Optional[int] = ..., manifest: _Optional[str] = ..., hosts: _Optional[_Iterable[str]] = ..., parent: _Optional[str] = ...) -> None: ...

class ShardsRequest(_message.Message):
    __slots__ = ("version", "pieces", "base_version", "worker_id")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    version: int
    pieces: _containers.RepeatedScalarFieldContainer[int]
    base_version: int
    worker_id: str
    def __init__(self, version: _Optional[int] = ..., pieces: _Optional[_Iterable[int]] = ..., base_version: _Optional[int] = ..., worker_id: _Optional[str] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker_id", "engine_version", "trajectories", "tokens", "uptime_s", "inflight")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    engine_version: int
    trajectories: int
    tokens: int
    uptime_s: float
    inflight: int
    def __init__(self, worker_id: _Optional[str] = ..., engine_version: _Optional[int] = ..., trajectories: _Optional[int] = ..., tokens: _Optional[int] = ..., uptime_s: _Optional[float] = ..., inflight: _Optional[int] = ...) -> None: ...

class LearnerStats(_message.Message):
    __slots__ = ("version", "queue_depth", "queue_capacity", "inflight_target", "shutdown", "hf_dir", "stats_json")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    QUEUE_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_TARGET_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    HF_DIR_FIELD_NUMBER: _ClassVar[int]
    STATS_JSON_FIELD_NUMBER: _ClassVar[int]
    version: int
    queue_depth: int
    queue_capacity: int
    inflight_target: int
    shutdown: bool
    hf_dir: str
    stats_json: str
    def __init__(self, version: _Optional[int] = ..., queue_depth: _Optional[int] = ..., queue_capacity: _Optional[int] = ..., inflight_target: _Optional[int] = ..., shutdown: _Optional[bool] = ..., hf_dir: _Optional[str] = ..., stats_json: _Optional[str] = ...) -> None: ...
