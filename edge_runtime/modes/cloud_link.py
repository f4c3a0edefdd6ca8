"""What the modes that talk to the cloud share: one session (websocket) per mode and variant,
opened on first use and reopened after a drop; one request per answer, with its own link
(`edge_runtime.modes.link.RequestLink`: the mode's loop gets that, never the mode), cancelled
if the answer stops early; and, if the link breaks mid-answer, the device finishing the answer.
What a cloud may hold the device to per answer (the stall bound, the sources shown) is the
link's."""

from __future__ import annotations

import itertools
import logging
import time
from abc import abstractmethod
from collections.abc import AsyncIterator, Sequence

from collab.protocol import Done, Generate, Mode
from edge_runtime.client import (
    CloudClient,
    CloudError,
    CloudUnavailable,
    ConnectionLost,
    session_url,
)
from edge_runtime.events import Event, Failure, Notice, Provenance
from edge_runtime.modes.base import (
    Answer,
    AnswerOptions,
    ModeContext,
    Orchestrator,
    Turn,
    cloud_history,
    device_generate,
    device_prompt,
    need_device,
    private_history,
    searched_by,
    shared_history,
)
from edge_runtime.modes.link import RequestLink

log = logging.getLogger("tandem.edge.modes")


class CloudBacked(Orchestrator):
    """A mode with a cloud side. Subclasses implement `converse` (the frames of one request)
    and may override `prepare` (device work before the request goes out)."""

    needs_cloud = True
    protocol_mode: Mode = Mode.CLOUD
    _request_ids = itertools.count(1)

    def __init__(self, ctx: ModeContext) -> None:
        super().__init__(ctx)
        self._cancelled: int | None = None  # a request we cancelled whose Done is pending

    @property
    def retrieve_public(self) -> bool:
        """Whether the cloud grounds this mode's requests in its public corpus."""
        return self.ctx.retrieve_public

    async def generate(
        self, question: str, history: Sequence[Turn], options: AnswerOptions, answer: Answer
    ) -> AsyncIterator[Event]:
        device = self.ctx.device
        link: RequestLink | None = None
        rid = next(self._request_ids)
        try:
            async for event in self.prepare(question, history, options, answer):
                yield event
            if answer.device_only:  # no consent for what the cloud would be sent: nothing is
                async for event in device_generate(
                    need_device(self.ctx), answer.prompt, answer, options
                ):
                    yield event
                return
            for last_try in (False, True):
                reused = self._open_client() is not None
                link = self.link(await self.client(), rid, answer)
                self._live_bytes = (link.client, link.up0, link.down0)
                try:
                    await link.send(self.generate_message(rid, question, history, options))
                    cloud = self.cloud_identity()
                    yield Provenance(True, len(answer.transcript.tokens), cloud)
                    async for event in self.converse(link, options, answer):
                        yield event
                    for event in link.take_events():
                        yield event
                    break
                except ConnectionLost as exc:
                    # A session kept from the last answer may have died since (the cloud's
                    # heartbeat, a NAT forgetting it) without this side noticing: open a new
                    # one and ask again, once, if nothing of this answer has come yet.
                    if last_try or not reused or answer.transcript.tokens:
                        raise
                    log.info("the cloud session had dropped (%s); reconnecting", exc)
        except CloudError as exc:
            answer.broken = True
            for event in link.take_events() if link is not None else []:
                yield event  # what came before the break (the cloud's sources)
            yield Provenance(False, len(answer.transcript.tokens))  # the rest the cloud never sees
            can_finish = self.ctx.finish_locally and device is not None
            yield Failure(
                f"{exc} (after {len(answer.transcript.tokens)} tokens)", recoverable=can_finish
            )
            if can_finish:
                async for event in self.finish_on_device(question, history, options, answer):
                    yield event
        finally:
            live = link is not None and not (answer.finished or answer.broken)
            if live and link is not None and link.client.connected:
                self._cancelled = rid if await link.cancel() else None
        if link is not None:
            answer.stats.bytes_up, answer.stats.bytes_down = link.bytes_up, link.bytes_down

    def link(self, client: CloudClient, rid: int, answer: Answer) -> RequestLink:
        """The link of request `rid` (one per request sent): per-request bounds start here."""
        stall = self.ctx.cloud.stall_timeout_s if self.ctx.cloud is not None else None
        return RequestLink(client, rid, answer, stall)

    async def prepare(
        self, question: str, history: Sequence[Turn], options: AnswerOptions, answer: Answer
    ) -> AsyncIterator[Event]:
        """Device work before the request goes out (none by default)."""
        return
        yield

    @abstractmethod
    def converse(
        self, link: RequestLink, options: AnswerOptions, answer: Answer
    ) -> AsyncIterator[Event]:
        """Exchange the request's frames over `link` until its Done (`link.ended`); the
        link's events are yielded after each frame or, at the latest, when this returns."""

    # ---- the session ---------------------------------------------------------------------

    def _open_client(self) -> CloudClient | None:
        """This mode's session, if one is open (as far as this side knows)."""
        client = self.ctx.clients.get((self.protocol_mode, self.variant))
        return client if client is not None and client.connected else None

    def cloud_identity(self) -> str | None:
        """The identity of the cloud this mode's open session reaches (its URL and the name
        it gave at handshake; never the token): what a turn's provenance names, and the only
        cloud its history goes back to. None without a session, or when the session is not
        to the configured cloud (it was changed under it): then no history is sent."""
        client, cloud = self._open_client(), self.ctx.cloud
        if client is None or cloud is None or client.url != session_url(cloud.url):
            return None
        return cloud.identity(client.cloud_model_name)

    async def shaped_by_private(self, passages: Sequence[object], history: Sequence[Turn]) -> bool:
        """Whether a device prompt of these passages and this conversation holds anything
        private to this cloud (a passage; a turn it did not see itself): what the device then
        drafts is shaped by it. Opens the session first, to know which cloud it is."""
        if passages:
            return True
        if not history:
            return False
        await self.client()
        return private_history(history, self.cloud_identity())

    async def private_allowed(self, options: AnswerOptions) -> bool:
        """Whether this answer may send the cloud content shaped by private passages or turns
        (edge_runtime.consent): opens the session to learn which cloud it is, and asks the
        user if they have not decided for that cloud."""
        await self.client()
        identity = self.cloud_identity()
        if identity is None:
            return False
        return await self.ctx.consent.grant(identity, options.allow_private_in_cloud)

    async def client(self) -> CloudClient:
        """This mode's session, opened if need be. From here on what it sends is written in
        the ledger of the answer in progress (`ModeContext.sent`), its Hello with the first
        answer that takes it: every request, retrieval query and handshake of an answer takes
        its session here first."""
        if self.ctx.cloud is None:
            raise CloudUnavailable("no cloud is configured")
        key = (self.protocol_mode, self.variant)
        client = self._open_client()
        if client is not None:
            client.serve(self.ctx.sent)
            await self._drain(client)
            return client
        dropped = self.ctx.clients.pop(key, None)
        if dropped is not None:
            await dropped.close()  # its HTTP session, after the websocket went away
        device = need_device(self.ctx)
        client = CloudClient(
            self.ctx.cloud.url,
            self.ctx.cloud.token,
            self.protocol_mode,
            self.variant,
            device.tokenizer_hash,
            device.name,
            connect_timeout=self.ctx.cloud.connect_timeout_s,
            heartbeat_s=self.ctx.cloud.heartbeat_s,
            ca_file=self.ctx.cloud.ca_file,
            allow_insecure=self.ctx.cloud.allow_insecure,
        )
        client.serve(self.ctx.sent)
        await client.connect(retries=self.ctx.cloud.retries)
        self.ctx.clients[key] = client
        self._cancelled = None
        return client

    async def _drain(self, client: CloudClient) -> None:
        """Wait (briefly) for the Done of a request we cancelled, so the cloud is free."""
        rid, self._cancelled = self._cancelled, None
        if rid is None:
            return
        deadline = time.perf_counter() + 5.0
        while (left := deadline - time.perf_counter()) > 0:
            msg = await client.recv(timeout=left)
            if isinstance(msg, Done) and msg.request_id == rid:
                return

    def generate_message(
        self, rid: int, question: str, history: Sequence[Turn], options: AnswerOptions
    ) -> Generate:
        identity = self.cloud_identity()
        return Generate(
            question,
            max_new_tokens=options.max_new_tokens,
            temperature=options.temperature,
            top_k=options.top_k,
            top_p=options.top_p,
            seed=options.seed,
            history=tuple(cloud_history(history, identity)),
            retrieve=self.retrieve_public,
            request_id=rid,
            search=public_search(question, history, identity),
        )

    async def close(self) -> None:
        key = (self.protocol_mode, self.variant)
        client = self.ctx.clients.pop(key, None)
        if client is not None:
            await client.close()

    async def finish_on_device(
        self, question: str, history: Sequence[Turn], options: AnswerOptions, answer: Answer
    ) -> AsyncIterator[Event]:
        """After the cloud dropped: the device continues the same answer from its tokens."""
        device = need_device(self.ctx)
        yield Notice(f"finishing the answer on the device ({device.name})")
        ids, _ = device_prompt(device, question, history, (), options)
        ids += answer.transcript.tokens
        async for event in device_generate(device, ids, answer, options):
            yield event


def public_search(question: str, history: Sequence[Turn], identity: str | None) -> str:
    """What the cloud searches its public corpus by for `question` besides the question itself
    ("": nothing else), keeping the better of the two (`retrieval.search.best_of`): the question
    with its topic's (edge_runtime.turns), built only from the turns that cloud saw itself, so
    a search shaped by a private turn never leaves."""
    search = searched_by(question, shared_history(history, identity))[0]
    return "" if search == question.strip() else search
