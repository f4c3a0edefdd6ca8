"""Extensions written the way a new mode or split variant is written: one module per side
(and, for a mode with its own message, one for the wire both sides share), registered with
one line each (tests/test_extending.py, tests/tui/test_mode_registry.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def registered() -> Iterator[None]:
    """The registry lines a new mode and a new variant add, one per side; removed after."""
    from cloud_backend import modes as cloud_modes
    from collab import protocol, variants
    from collab.protocol import Mode
    from edge_runtime import modes as device_modes
    from tests.toy_extensions.argmax_variant import ArgmaxDraft
    from tests.toy_extensions.shout_cloud import ShoutRequest
    from tests.toy_extensions.shout_device import ShoutMode
    from tests.toy_extensions.shout_wire import SHOUT_MESSAGES

    protocol.declare(SHOUT_MESSAGES)  # the mode's messages, the wire (both sides)
    device_modes.register_mode(ShoutMode)  # the mode with its figures and setting, device side
    cloud_modes.register_request(Mode.EXPERIMENTAL, ShoutRequest)  # the mode, cloud side
    variants.register(ArgmaxDraft())  # the variant, both sides (collab is shared)
    try:
        yield
    finally:
        device_modes.unregister_mode(ShoutMode.name)
        cloud_modes.REQUESTS.pop(Mode.EXPERIMENTAL, None)
        protocol.withdraw(Mode.EXPERIMENTAL)
        variants.unregister(ArgmaxDraft.name)
