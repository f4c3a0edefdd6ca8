"""The user's consent to let a cloud take part in answers shaped by private passages.

DRAGON's drafts, weights and tokens, and split's drafts from a prompt holding private
passages or private turns, are shaped by what the user's documents say even though their text
never leaves. No mode sends such content to a cloud the user has not agreed to: the cloud
Tandem starts on this device counts as on-device; for any other, the answer is "always" or
"never" (remembered per cloud identity, `edge_runtime.cloud_identity`, in the settings), or
"this time" (one answer). A front end that can ask (the TUI) is asked once per cloud; one that
cannot (`tandem ask`) is given consent for one answer by a flag, or gets none."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

from edge_runtime.cloud_identity import on_device

log = logging.getLogger("tandem.edge.consent")

Answer = Literal["always", "once", "never"]
REMEMBERED = ("always", "never")


def refused(identity: str) -> str:
    """Why an answer went on without private context, in the user's words."""
    return (
        f"you have not agreed to let {identity} take part in answers shaped by your documents "
        "(settings, or --allow-private-in-cloud for one answer)"
    )


@dataclass
class Consent:
    """What the user said, per cloud identity, and how to ask them (None: nobody to ask)."""

    remembered: dict[str, str] = field(default_factory=dict)  # identity → "always" | "never"
    ask: Callable[[str], Awaitable[Answer | None]] | None = None
    remember: Callable[[str, str], None] | None = None  # persist an "always" or "never"

    def known(self, identity: str, once: bool = False) -> bool | None:
        """Whether private-shaped content may go to that cloud, without asking: True, False,
        or None (not decided yet: `grant` would ask)."""
        if on_device(identity) or once:
            return True
        said = self.remembered.get(identity)
        if said == "always":
            return True
        if said == "never" or self.ask is None:
            return False
        return None

    async def grant(self, identity: str, once: bool = False) -> bool:
        """Whether this answer may send private-shaped content to that cloud; asks the user
        if they have not decided (an "always" or "never" is remembered)."""
        known = self.known(identity, once)
        if known is not None:
            return known
        assert self.ask is not None  # known() says None only when there is someone to ask
        said = await self.ask(identity)
        if said in REMEMBERED:
            self.remembered[identity] = said
            if self.remember is not None:
                try:
                    self.remember(identity, said)
                except OSError as exc:  # kept for this run; the file could not be written
                    log.warning("could not save the consent for %s: %s", identity, exc)
        return said in ("always", "once")
