"""Extensions written the way a new mode or split variant is written: one module per side,
registered with one line each (tests/test_extending.py, tests/tui/test_mode_registry.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def registered() -> Iterator[None]:
    """The registry lines a new mode and a new variant add, one per side; removed after."""
    from cloud_backend import modes as cloud_modes
    from collab import variants
    from collab.protocol import Mode
    from edge_runtime import modes as device_modes
    from tests.toy_extensions.argmax_variant import ArgmaxDraft
    from tests.toy_extensions.shout_cloud import ShoutRequest
    from tests.toy_extensions.shout_device import ShoutMode

    device_modes.register_mode(ShoutMode)  # the mode, device side
    cloud_modes.register_request(Mode.EXPERIMENTAL, ShoutRequest)  # the mode, cloud side
    variants.register(ArgmaxDraft())  # the variant, both sides (collab is shared)
    try:
        yield
    finally:
        device_modes.unregister_mode(ShoutMode.name)
        cloud_modes.REQUESTS.pop(Mode.EXPERIMENTAL, None)
        variants.unregister(ArgmaxDraft.name)
