"""The binary wire protocol shared by device and cloud (docs/protocol.md#design), one module per
family:

- `codec`: header, limits, `ProtocolError`, the message base and registry, encode/decode;
- `session`: handshake, requests, streamed tokens, pings, errors, Done, citations;
- `split`: split speculation's drafts, Verdict and CloudDecode;
- `dragon`: DRAGON's setup, drafts and targets;
- `modes`: what each mode declares of the wire (its messages, those sent inside a request),
  from which the cloud session's routing table is assembled.

Importing the package imports every family, so `decode` knows every message type.
"""

from collab.protocol.codec import (
    DEFAULT_LIMITS,
    EXTENSION_CODES,
    FLAG_F32,
    HEADER_SIZE,
    MAGIC,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Header,
    Limits,
    Message,
    MsgType,
    ProtocolError,
    RawHeader,
    decode,
    decode_header,
    encode,
    message,
    peek_header,
    peek_version,
)
from collab.protocol.dragon import (
    AggregatorPolicy,
    DragonDraft,
    DragonScore,
    DragonSequence,
    DragonSetup,
    DragonTarget,
    Side,
)
from collab.protocol.modes import ModeMessages, declare, request_frames, withdraw
from collab.protocol.session import (
    SESSION_PATH,
    Cancel,
    Citations,
    Done,
    Error,
    ErrorCode,
    FinishReason,
    Generate,
    Hello,
    HelloAck,
    Mode,
    Ping,
    Pong,
    TokenChunk,
)
from collab.protocol.split import (
    FLAG_AHEAD,
    CloudDecode,
    Draft,
    DsdDraft,
    DssdDraft,
    TopKDraft,
    Verdict,
)
from collab.sources import Source

__all__ = [
    "DEFAULT_LIMITS",
    "EXTENSION_CODES",
    "FLAG_AHEAD",
    "FLAG_F32",
    "HEADER_SIZE",
    "MAGIC",
    "MESSAGE_TYPES",
    "PROTOCOL_VERSION",
    "SESSION_PATH",
    "AggregatorPolicy",
    "Cancel",
    "Citations",
    "CloudDecode",
    "Done",
    "Draft",
    "DragonDraft",
    "DragonScore",
    "DragonSequence",
    "DragonSetup",
    "DragonTarget",
    "DsdDraft",
    "DssdDraft",
    "Error",
    "ErrorCode",
    "FinishReason",
    "Generate",
    "Header",
    "Hello",
    "HelloAck",
    "Limits",
    "Message",
    "Mode",
    "ModeMessages",
    "MsgType",
    "Ping",
    "Pong",
    "ProtocolError",
    "RawHeader",
    "Side",
    "Source",
    "TokenChunk",
    "TopKDraft",
    "Verdict",
    "declare",
    "decode",
    "decode_header",
    "encode",
    "message",
    "peek_header",
    "peek_version",
    "request_frames",
    "withdraw",
]
