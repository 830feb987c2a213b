from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Durability(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DURABILITY_UNSPECIFIED: _ClassVar[Durability]
    DURABILITY_LOG: _ClassVar[Durability]
    DURABILITY_SNAPSHOT: _ClassVar[Durability]
    DURABILITY_NONE: _ClassVar[Durability]
DURABILITY_UNSPECIFIED: Durability
DURABILITY_LOG: Durability
DURABILITY_SNAPSHOT: Durability
DURABILITY_NONE: Durability

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty", "penalty_last_n", "logit_bias")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PENALTY_LAST_N_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    penalty_last_n: int
    logit_bias: _containers.ScalarMap[int, float]
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., penalty_last_n: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("session_id", "at_step", "prompt_ids", "prompt_text", "max_tokens", "sampling", "stop_token_ids", "generated_before", "stop", "ignore_eos", "logprobs", "top_logprobs", "constraint", "monitor", "monitor_retries", "generated_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    AT_STEP_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_BEFORE_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    MONITOR_FIELD_NUMBER: _ClassVar[int]
    MONITOR_RETRIES_FIELD_NUMBER: _ClassVar[int]
    GENERATED_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    at_step: int
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_text: str
    max_tokens: int
    sampling: SamplingParams
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    generated_before: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    logprobs: bool
    top_logprobs: int
    constraint: Constraint
    monitor: TextMonitor
    monitor_retries: int
    generated_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., at_step: _Optional[int] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., prompt_text: _Optional[str] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., generated_before: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ..., monitor: _Optional[_Union[TextMonitor, _Mapping]] = ..., monitor_retries: _Optional[int] = ..., generated_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("json_schema", "regex", "lark_grammar", "json_object")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    LARK_GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    regex: str
    lark_grammar: str
    json_object: bool
    def __init__(self, json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., lark_grammar: _Optional[str] = ..., json_object: _Optional[bool] = ...) -> None: ...

class TextMonitor(_message.Message):
    __slots__ = ("regex", "json_schema", "rollback_tokens", "max_retries")
    REGEX_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_RETRIES_FIELD_NUMBER: _ClassVar[int]
    regex: str
    json_schema: str
    rollback_tokens: int
    max_retries: int
    def __init__(self, regex: _Optional[str] = ..., json_schema: _Optional[str] = ..., rollback_tokens: _Optional[int] = ..., max_retries: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "text")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    text: str
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., text: _Optional[str] = ...) -> None: ...

class GeneratedToken(_message.Message):
    __slots__ = ("step", "token_id", "logprob", "text", "guard_events", "unfiltered_logprob", "top_logprobs")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    GUARD_EVENTS_FIELD_NUMBER: _ClassVar[int]
    UNFILTERED_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    step: int
    token_id: int
    logprob: float
    text: str
    guard_events: _containers.RepeatedCompositeFieldContainer[GuardEvent]
    unfiltered_logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, step: _Optional[int] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., text: _Optional[str] = ..., guard_events: _Optional[_Iterable[_Union[GuardEvent, _Mapping]]] = ..., unfiltered_logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("tokens", "finish_reason", "stopped", "session_step", "stop_string", "text", "prompt_fed_step", "prompt_ids_left", "retracted_after_step", "monitor_retries")
    class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        FINISH_UNSPECIFIED: _ClassVar[GenerateResponse.FinishReason]
        FINISH_LENGTH: _ClassVar[GenerateResponse.FinishReason]
        FINISH_STOP: _ClassVar[GenerateResponse.FinishReason]
        FINISH_GUARD: _ClassVar[GenerateResponse.FinishReason]
        FINISH_EOS: _ClassVar[GenerateResponse.FinishReason]
        FINISH_CANCELLED: _ClassVar[GenerateResponse.FinishReason]
        FINISH_MONITOR: _ClassVar[GenerateResponse.FinishReason]
    FINISH_UNSPECIFIED: GenerateResponse.FinishReason
    FINISH_LENGTH: GenerateResponse.FinishReason
    FINISH_STOP: GenerateResponse.FinishReason
    FINISH_GUARD: GenerateResponse.FinishReason
    FINISH_EOS: GenerateResponse.FinishReason
    FINISH_CANCELLED: GenerateResponse.FinishReason
    FINISH_MONITOR: GenerateResponse.FinishReason
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    SESSION_STEP_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FED_STEP_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_LEFT_FIELD_NUMBER: _ClassVar[int]
    RETRACTED_AFTER_STEP_FIELD_NUMBER: _ClassVar[int]
    MONITOR_RETRIES_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[GeneratedToken]
    finish_reason: GenerateResponse.FinishReason
    stopped: StepError
    session_step: int
    stop_string: str
    text: str
    prompt_fed_step: int
    prompt_ids_left: _containers.RepeatedScalarFieldContainer[int]
    retracted_after_step: int
    monitor_retries: int
    def __init__(self, tokens: _Optional[_Iterable[_Union[GeneratedToken, _Mapping]]] = ..., finish_reason: _Optional[_Union[GenerateResponse.FinishReason, str]] = ..., stopped: _Optional[_Union[StepError, _Mapping]] = ..., session_step: _Optional[int] = ..., stop_string: _Optional[str] = ..., text: _Optional[str] = ..., prompt_fed_step: _Optional[int] = ..., prompt_ids_left: _Optional[_Iterable[int]] = ..., retracted_after_step: _Optional[int] = ..., monitor_retries: _Optional[int] = ...) -> None: ...

class UpgradeRequest(_message.Message):
    __slots__ = ("session_id", "model")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    model: str
    def __init__(self, session_id: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class UpgradeResponse(_message.Message):
    __slots__ = ("session", "from_model", "replayed_from_step", "replayed_steps")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    FROM_MODEL_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FROM_STEP_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_STEPS_FIELD_NUMBER: _ClassVar[int]
    session: SessionInfo
    from_model: str
    replayed_from_step: int
    replayed_steps: int
    def __init__(self, session: _Optional[_Union[SessionInfo, _Mapping]] = ..., from_model: _Optional[str] = ..., replayed_from_step: _Optional[int] = ..., replayed_steps: _Optional[int] = ...) -> None: ...

class GuardRule(_message.Message):
    __slots__ = ("name", "check", "min", "max", "dims", "action", "side", "max_rate", "tolerance", "decay", "scale_floor", "sustained")
    class Check(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        CHECK_UNSPECIFIED: _ClassVar[GuardRule.Check]
        CHECK_FINITE: _ClassVar[GuardRule.Check]
        CHECK_RANGE: _ClassVar[GuardRule.Check]
        CHECK_RATE: _ClassVar[GuardRule.Check]
        CHECK_PREDICTION_ERROR: _ClassVar[GuardRule.Check]
    CHECK_UNSPECIFIED: GuardRule.Check
    CHECK_FINITE: GuardRule.Check
    CHECK_RANGE: GuardRule.Check
    CHECK_RATE: GuardRule.Check
    CHECK_PREDICTION_ERROR: GuardRule.Check
    class Action(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        ACTION_UNSPECIFIED: _ClassVar[GuardRule.Action]
        ACTION_REPORT: _ClassVar[GuardRule.Action]
        ACTION_CLAMP: _ClassVar[GuardRule.Action]
        ACTION_REJECT: _ClassVar[GuardRule.Action]
        ACTION_ROLLBACK: _ClassVar[GuardRule.Action]
        ACTION_IMPUTE: _ClassVar[GuardRule.Action]
    ACTION_UNSPECIFIED: GuardRule.Action
    ACTION_REPORT: GuardRule.Action
    ACTION_CLAMP: GuardRule.Action
    ACTION_REJECT: GuardRule.Action
    ACTION_ROLLBACK: GuardRule.Action
    ACTION_IMPUTE: GuardRule.Action
    class Side(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        SIDE_UNSPECIFIED: _ClassVar[GuardRule.Side]
        SIDE_OUTPUT: _ClassVar[GuardRule.Side]
        SIDE_INPUT: _ClassVar[GuardRule.Side]
    SIDE_UNSPECIFIED: GuardRule.Side
    SIDE_OUTPUT: GuardRule.Side
    SIDE_INPUT: GuardRule.Side
    NAME_FIELD_NUMBER: _ClassVar[int]
    CHECK_FIELD_NUMBER: _ClassVar[int]
    MIN_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    DIMS_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    SIDE_FIELD_NUMBER: _ClassVar[int]
    MAX_RATE_FIELD_NUMBER: _ClassVar[int]
    TOLERANCE_FIELD_NUMBER: _ClassVar[int]
    DECAY_FIELD_NUMBER: _ClassVar[int]
    SCALE_FLOOR_FIELD_NUMBER: _ClassVar[int]
    SUSTAINED_FIELD_NUMBER: _ClassVar[int]
    name: str
    check: GuardRule.Check
    min: float
    max: float
    dims: _containers.RepeatedScalarFieldContainer[int]
    action: GuardRule.Action
    side: GuardRule.Side
    max_rate: float
    tolerance: float
    decay: float
    scale_floor: float
    sustained: int
    def __init__(self, name: _Optional[str] = ..., check: _Optional[_Union[GuardRule.Check, str]] = ..., min: _Optional[float] = ..., max: _Optional[float] = ..., dims: _Optional[_Iterable[int]] = ..., action: _Optional[_Union[GuardRule.Action, str]] = ..., side: _Optional[_Union[GuardRule.Side, str]] = ..., max_rate: _Optional[float] = ..., tolerance: _Optional[float] = ..., decay: _Optional[float] = ..., scale_floor: _Optional[float] = ..., sustained: _Optional[int] = ...) -> None: ...

class SessionConfig(_message.Message):
    __slots__ = ("snapshot_every", "max_snapshots", "history_window", "guards", "durability", "idle_ttl_s", "labels", "snapshot_phase")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SNAPSHOT_EVERY_FIELD_NUMBER: _ClassVar[int]
    MAX_SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_WINDOW_FIELD_NUMBER: _ClassVar[int]
    GUARDS_FIELD_NUMBER: _ClassVar[int]
    DURABILITY_FIELD_NUMBER: _ClassVar[int]
    IDLE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_PHASE_FIELD_NUMBER: _ClassVar[int]
    snapshot_every: int
    max_snapshots: int
    history_window: int
    guards: _containers.RepeatedCompositeFieldContainer[GuardRule]
    durability: Durability
    idle_ttl_s: float
    labels: _containers.ScalarMap[str, str]
    snapshot_phase: int
    def __init__(self, snapshot_every: _Optional[int] = ..., max_snapshots: _Optional[int] = ..., history_window: _Optional[int] = ..., guards: _Optional[_Iterable[_Union[GuardRule, _Mapping]]] = ..., durability: _Optional[_Union[Durability, str]] = ..., idle_ttl_s: _Optional[float] = ..., labels: _Optional[_Mapping[str, str]] = ..., snapshot_phase: _Optional[int] = ...) -> None: ...

class CreateSessionRequest(_message.Message):
    __slots__ = ("model", "session_id", "config")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    model: str
    session_id: str
    config: SessionConfig
    def __init__(self, model: _Optional[str] = ..., session_id: _Optional[str] = ..., config: _Optional[_Union[SessionConfig, _Mapping]] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session_id", "model", "model_fingerprint", "step", "config", "created_at", "updated_at", "snapshot_count", "oldest_rollback_step", "owner", "resident", "input_dim", "output_dim", "token_input", "closed", "tenant")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_COUNT_FIELD_NUMBER: _ClassVar[int]
    OLDEST_ROLLBACK_STEP_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    INPUT_DIM_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DIM_FIELD_NUMBER: _ClassVar[int]
    TOKEN_INPUT_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    model: str
    model_fingerprint: str
    step: int
    config: SessionConfig
    created_at: float
    updated_at: float
    snapshot_count: int
    oldest_rollback_step: int
    owner: str
    resident: bool
    input_dim: int
    output_dim: int
    token_input: bool
    closed: bool
    tenant: str
    def __init__(self, session_id: _Optional[str] = ..., model: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., step: _Optional[int] = ..., config: _Optional[_Union[SessionConfig, _Mapping]] = ..., created_at: _Optional[float] = ..., updated_at: _Optional[float] = ..., snapshot_count: _Optional[int] = ..., oldest_rollback_step: _Optional[int] = ..., owner: _Optional[str] = ..., resident: _Optional[bool] = ..., input_dim: _Optional[int] = ..., output_dim: _Optional[int] = ..., token_input: _Optional[bool] = ..., closed: _Optional[bool] = ..., tenant: _Optional[str] = ...) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ("page_size", "page_token", "model")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    model: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions", "next_page_token")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionInfo]
    next_page_token: str
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionInfo, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id", "final_snapshot")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    FINAL_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    final_snapshot: bool
    def __init__(self, session_id: _Optional[str] = ..., final_snapshot: _Optional[bool] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("step", "snapshot_id")
    STEP_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    step: int
    snapshot_id: str
    def __init__(self, step: _Optional[int] = ..., snapshot_id: _Optional[str] = ...) -> None: ...

class Vector(_message.Message):
    __slots__ = ("values", "packed")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    packed: bytes
    def __init__(self, values: _Optional[_Iterable[float]] = ..., packed: _Optional[bytes] = ...) -> None: ...

class StepInput(_message.Message):
    __slots__ = ("session_id", "step", "token", "vector")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    VECTOR_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    step: int
    token: int
    vector: Vector
    def __init__(self, session_id: _Optional[str] = ..., step: _Optional[int] = ..., token: _Optional[int] = ..., vector: _Optional[_Union[Vector, _Mapping]] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("steps", "packed_outputs", "last_outputs_only")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    PACKED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    LAST_OUTPUTS_ONLY_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedCompositeFieldContainer[StepInput]
    packed_outputs: bool
    last_outputs_only: bool
    def __init__(self, steps: _Optional[_Iterable[_Union[StepInput, _Mapping]]] = ..., packed_outputs: _Optional[bool] = ..., last_outputs_only: _Optional[bool] = ...) -> None: ...

class GuardEvent(_message.Message):
    __slots__ = ("guard", "action", "step", "dims", "detail", "rolled_back_to", "imputed")
    GUARD_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DIMS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    ROLLED_BACK_TO_FIELD_NUMBER: _ClassVar[int]
    IMPUTED_FIELD_NUMBER: _ClassVar[int]
    guard: str
    action: GuardRule.Action
    step: int
    dims: _containers.RepeatedScalarFieldContainer[int]
    detail: str
    rolled_back_to: int
    imputed: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, guard: _Optional[str] = ..., action: _Optional[_Union[GuardRule.Action, str]] = ..., step: _Optional[int] = ..., dims: _Optional[_Iterable[int]] = ..., detail: _Optional[str] = ..., rolled_back_to: _Optional[int] = ..., imputed: _Optional[_Iterable[float]] = ...) -> None: ...

class SnapshotEvent(_message.Message):
    __slots__ = ("snapshot_id", "step", "reason")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    step: int
    reason: str
    def __init__(self, snapshot_id: _Optional[str] = ..., step: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class StepError(_message.Message):
    __slots__ = ("code", "reason", "message", "owner", "retry_after_ms", "session_step")
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    SESSION_STEP_FIELD_NUMBER: _ClassVar[int]
    code: int
    reason: str
    message: str
    owner: str
    retry_after_ms: int
    session_step: int
    def __init__(self, code: _Optional[int] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ..., owner: _Optional[str] = ..., retry_after_ms: _Optional[int] = ..., session_step: _Optional[int] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("session_id", "step", "output", "replayed", "guard_events", "snapshot_events", "error")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    GUARD_EVENTS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_EVENTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    step: int
    output: Vector
    replayed: bool
    guard_events: _containers.RepeatedCompositeFieldContainer[GuardEvent]
    snapshot_events: _containers.RepeatedCompositeFieldContainer[SnapshotEvent]
    error: StepError
    def __init__(self, session_id: _Optional[str] = ..., step: _Optional[int] = ..., output: _Optional[_Union[Vector, _Mapping]] = ..., replayed: _Optional[bool] = ..., guard_events: _Optional[_Iterable[_Union[GuardEvent, _Mapping]]] = ..., snapshot_events: _Optional[_Iterable[_Union[SnapshotEvent, _Mapping]]] = ..., error: _Optional[_Union[StepError, _Mapping]] = ...) -> None: ...

class StreamResponse(_message.Message):
    __slots__ = ("results", "continued")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    CONTINUED_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[StepResult]
    continued: bool
    def __init__(self, results: _Optional[_Iterable[_Union[StepResult, _Mapping]]] = ..., continued: _Optional[bool] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ("session_id", "label")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    label: str
    def __init__(self, session_id: _Optional[str] = ..., label: _Optional[str] = ...) -> None: ...

class SnapshotInfo(_message.Message):
    __slots__ = ("snapshot_id", "session_id", "step", "label", "reason", "created_at", "size_bytes")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    session_id: str
    step: int
    label: str
    reason: str
    created_at: float
    size_bytes: int
    def __init__(self, snapshot_id: _Optional[str] = ..., session_id: _Optional[str] = ..., step: _Optional[int] = ..., label: _Optional[str] = ..., reason: _Optional[str] = ..., created_at: _Optional[float] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class GetHistoryRequest(_message.Message):
    __slots__ = ("session_id", "from_step", "to_step")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_STEP_FIELD_NUMBER: _ClassVar[int]
    TO_STEP_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    from_step: int
    to_step: int
    def __init__(self, session_id: _Optional[str] = ..., from_step: _Optional[int] = ..., to_step: _Optional[int] = ...) -> None: ...

class HistoryChunk(_message.Message):
    __slots__ = ("first_step", "count", "inputs", "outputs", "input_dim", "output_dim", "snapshots", "events")
    FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    INPUT_DIM_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DIM_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    first_step: int
    count: int
    inputs: bytes
    outputs: bytes
    input_dim: int
    output_dim: int
    snapshots: _containers.RepeatedCompositeFieldContainer[SnapshotInfo]
    events: _containers.RepeatedCompositeFieldContainer[SessionEvent]
    def __init__(self, first_step: _Optional[int] = ..., count: _Optional[int] = ..., inputs: _Optional[bytes] = ..., outputs: _Optional[bytes] = ..., input_dim: _Optional[int] = ..., output_dim: _Optional[int] = ..., snapshots: _Optional[_Iterable[_Union[SnapshotInfo, _Mapping]]] = ..., events: _Optional[_Iterable[_Union[SessionEvent, _Mapping]]] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("kind", "step", "at", "to_step", "cause", "guard", "action", "detail")
    KIND_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    TO_STEP_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    GUARD_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    kind: str
    step: int
    at: float
    to_step: int
    cause: str
    guard: str
    action: str
    detail: str
    def __init__(self, kind: _Optional[str] = ..., step: _Optional[int] = ..., at: _Optional[float] = ..., to_step: _Optional[int] = ..., cause: _Optional[str] = ..., guard: _Optional[str] = ..., action: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("key", "name", "version", "fingerprint", "input_dim", "output_dim", "token_input", "resident_sessions", "newest", "tokenizer_fingerprint", "eos_token_ids", "has_tokenizer")
    KEY_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    INPUT_DIM_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DIM_FIELD_NUMBER: _ClassVar[int]
    TOKEN_INPUT_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    NEWEST_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HAS_TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    key: str
    name: str
    version: str
    fingerprint: str
    input_dim: int
    output_dim: int
    token_input: bool
    resident_sessions: int
    newest: bool
    tokenizer_fingerprint: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    has_tokenizer: bool
    def __init__(self, key: _Optional[str] = ..., name: _Optional[str] = ..., version: _Optional[str] = ..., fingerprint: _Optional[str] = ..., input_dim: _Optional[int] = ..., output_dim: _Optional[int] = ..., token_input: _Optional[bool] = ..., resident_sessions: _Optional[int] = ..., newest: _Optional[bool] = ..., tokenizer_fingerprint: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., has_tokenizer: _Optional[bool] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("worker", "models")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    worker: str
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, worker: _Optional[str] = ..., models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class ListSnapshotsRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ListSnapshotsResponse(_message.Message):
    __slots__ = ("snapshots",)
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    snapshots: _containers.RepeatedCompositeFieldContainer[SnapshotInfo]
    def __init__(self, snapshots: _Optional[_Iterable[_Union[SnapshotInfo, _Mapping]]] = ...) -> None: ...

class RollbackRequest(_message.Message):
    __slots__ = ("session_id", "snapshot_id", "label", "step", "steps_back")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_BACK_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    snapshot_id: str
    label: str
    step: int
    steps_back: int
    def __init__(self, session_id: _Optional[str] = ..., snapshot_id: _Optional[str] = ..., label: _Optional[str] = ..., step: _Optional[int] = ..., steps_back: _Optional[int] = ...) -> None: ...

class RollbackResponse(_message.Message):
    __slots__ = ("step", "from_snapshot_id", "replayed_steps")
    STEP_FIELD_NUMBER: _ClassVar[int]
    FROM_SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_STEPS_FIELD_NUMBER: _ClassVar[int]
    step: int
    from_snapshot_id: str
    replayed_steps: int
    def __init__(self, step: _Optional[int] = ..., from_snapshot_id: _Optional[str] = ..., replayed_steps: _Optional[int] = ...) -> None: ...

class ExportCheckpointRequest(_message.Message):
    __slots__ = ("session_id", "snapshot_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    snapshot_id: str
    def __init__(self, session_id: _Optional[str] = ..., snapshot_id: _Optional[str] = ...) -> None: ...

class CheckpointChunk(_message.Message):
    __slots__ = ("index", "data", "total_size", "last")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    index: int
    data: bytes
    total_size: int
    last: bool
    def __init__(self, index: _Optional[int] = ..., data: _Optional[bytes] = ..., total_size: _Optional[int] = ..., last: _Optional[bool] = ...) -> None: ...

class ImportHeader(_message.Message):
    __slots__ = ("session_id", "model", "config", "replace")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    model: str
    config: SessionConfig
    replace: bool
    def __init__(self, session_id: _Optional[str] = ..., model: _Optional[str] = ..., config: _Optional[_Union[SessionConfig, _Mapping]] = ..., replace: _Optional[bool] = ...) -> None: ...

class ImportCheckpointRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: ImportHeader
    chunk: CheckpointChunk
    def __init__(self, header: _Optional[_Union[ImportHeader, _Mapping]] = ..., chunk: _Optional[_Union[CheckpointChunk, _Mapping]] = ...) -> None: ...

class ForecastRequest(_message.Message):
    __slots__ = ("session_id", "horizon", "at_step", "packed_outputs")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    HORIZON_FIELD_NUMBER: _ClassVar[int]
    AT_STEP_FIELD_NUMBER: _ClassVar[int]
    PACKED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    horizon: int
    at_step: int
    packed_outputs: bool
    def __init__(self, session_id: _Optional[str] = ..., horizon: _Optional[int] = ..., at_step: _Optional[int] = ..., packed_outputs: _Optional[bool] = ...) -> None: ...

class ForecastStep(_message.Message):
    __slots__ = ("step", "output", "token", "guard_events")
    STEP_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    GUARD_EVENTS_FIELD_NUMBER: _ClassVar[int]
    step: int
    output: Vector
    token: int
    guard_events: _containers.RepeatedCompositeFieldContainer[GuardEvent]
    def __init__(self, step: _Optional[int] = ..., output: _Optional[_Union[Vector, _Mapping]] = ..., token: _Optional[int] = ..., guard_events: _Optional[_Iterable[_Union[GuardEvent, _Mapping]]] = ...) -> None: ...

class ForecastResponse(_message.Message):
    __slots__ = ("from_step", "steps", "stopped")
    FROM_STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    from_step: int
    steps: _containers.RepeatedCompositeFieldContainer[ForecastStep]
    stopped: StepError
    def __init__(self, from_step: _Optional[int] = ..., steps: _Optional[_Iterable[_Union[ForecastStep, _Mapping]]] = ..., stopped: _Optional[_Union[StepError, _Mapping]] = ...) -> None: ...

class ForkRequest(_message.Message):
    __slots__ = ("session_id", "step", "snapshot_id", "label", "new_session_id", "target")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    NEW_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    step: int
    snapshot_id: str
    label: str
    new_session_id: str
    target: str
    def __init__(self, session_id: _Optional[str] = ..., step: _Optional[int] = ..., snapshot_id: _Optional[str] = ..., label: _Optional[str] = ..., new_session_id: _Optional[str] = ..., target: _Optional[str] = ...) -> None: ...

class ForkResponse(_message.Message):
    __slots__ = ("session", "source_session_id", "step", "from_snapshot_id", "replayed_steps")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    FROM_SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_STEPS_FIELD_NUMBER: _ClassVar[int]
    session: SessionInfo
    source_session_id: str
    step: int
    from_snapshot_id: str
    replayed_steps: int
    def __init__(self, session: _Optional[_Union[SessionInfo, _Mapping]] = ..., source_session_id: _Optional[str] = ..., step: _Optional[int] = ..., from_snapshot_id: _Optional[str] = ..., replayed_steps: _Optional[int] = ...) -> None: ...

class LoadModelRequest(_message.Message):
    __slots__ = ("key", "directory")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    key: str
    directory: str
    def __init__(self, key: _Optional[str] = ..., directory: _Optional[str] = ...) -> None: ...

class UnloadModelRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "address", "models", "load", "started_at", "heartbeat_at", "draining", "numerics", "stats")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AT_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    NUMERICS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    models: _containers.RepeatedScalarFieldContainer[str]
    load: int
    started_at: float
    heartbeat_at: float
    draining: bool
    numerics: str
    stats: WorkerStats
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., models: _Optional[_Iterable[str]] = ..., load: _Optional[int] = ..., started_at: _Optional[float] = ..., heartbeat_at: _Optional[float] = ..., draining: _Optional[bool] = ..., numerics: _Optional[str] = ..., stats: _Optional[_Union[WorkerStats, _Mapping]] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("steps", "snapshots", "open_streams", "step_p50_ms", "step_p99_ms", "memory_held_bytes", "memory_budget_bytes")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    OPEN_STREAMS_FIELD_NUMBER: _ClassVar[int]
    STEP_P50_MS_FIELD_NUMBER: _ClassVar[int]
    STEP_P99_MS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_HELD_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    steps: int
    snapshots: int
    open_streams: int
    step_p50_ms: float
    step_p99_ms: float
    memory_held_bytes: int
    memory_budget_bytes: int
    def __init__(self, steps: _Optional[int] = ..., snapshots: _Optional[int] = ..., open_streams: _Optional[int] = ..., step_p50_ms: _Optional[float] = ..., step_p99_ms: _Optional[float] = ..., memory_held_bytes: _Optional[int] = ..., memory_budget_bytes: _Optional[int] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ...) -> None: ...

class MigrateRequest(_message.Message):
    __slots__ = ("session_id", "target")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    target: str
    def __init__(self, session_id: _Optional[str] = ..., target: _Optional[str] = ...) -> None: ...

class MigrateResponse(_message.Message):
    __slots__ = ("session_id", "source", "target", "step", "snapshot_id", "elapsed_ms")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_MS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    source: str
    target: str
    step: int
    snapshot_id: str
    elapsed_ms: float
    def __init__(self, session_id: _Optional[str] = ..., source: _Optional[str] = ..., target: _Optional[str] = ..., step: _Optional[int] = ..., snapshot_id: _Optional[str] = ..., elapsed_ms: _Optional[float] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("worker",)
    WORKER_FIELD_NUMBER: _ClassVar[int]
    worker: str
    def __init__(self, worker: _Optional[str] = ...) -> None: ...

class DrainProgress(_message.Message):
    __slots__ = ("session_id", "target", "done", "total", "error", "heartbeat")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    target: str
    done: int
    total: int
    error: str
    heartbeat: bool
    def __init__(self, session_id: _Optional[str] = ..., target: _Optional[str] = ..., done: _Optional[int] = ..., total: _Optional[int] = ..., error: _Optional[str] = ..., heartbeat: _Optional[bool] = ...) -> None: ...

class UndrainRequest(_message.Message):
    __slots__ = ("worker",)
    WORKER_FIELD_NUMBER: _ClassVar[int]
    worker: str
    def __init__(self, worker: _Optional[str] = ...) -> None: ...

class AdoptSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class AdoptSessionResponse(_message.Message):
    __slots__ = ("step", "epoch")
    STEP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    step: int
    epoch: int
    def __init__(self, step: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...
