"""A toy mode, device side: the cloud answers with the question in capitals. It rides on
the protocol's EXPERIMENTAL mode number, reserved for modes added outside Tandem."""

from __future__ import annotations

from collab.protocol import Mode
from edge_runtime.modes.cloud import CloudMode


class ShoutMode(CloudMode):
    """Streams what the cloud sends, as cloud mode does."""

    name = "shout"
    description = "the cloud repeats the question in capitals (a test of the mode registry)"
    protocol_mode = Mode.EXPERIMENTAL
