"""Every mode end to end over a real aiohttp server on loopback, with tiny models.

The cloud is the tiny model in float32 torch; drafters are its int8 ONNX export (close to it:
long accepted runs) and a second tiny model with other weights (far from it: many
rejections, so the residual paths run)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from scipy import stats as scipy_stats

from benchmarks.auto import counting_sockets
from benchmarks.tiny_models import TINY_CONTEXT
from collab.protocol import Ping, Pong, decode
from collab.sampling import SamplingParams, distribution
from collab.variants import variant_names
from edge_runtime.device import DeviceModel
from edge_runtime.events import Citation, Failure, Notice, Stats, TextDelta
from edge_runtime.modes import build_mode
from edge_runtime.modes.base import AnswerOptions, CloudSettings, ModeContext, Turn
from edge_runtime.split_costs import SplitCosts
from model_runtime.prompting import prompt_ids
from model_runtime.torch_runtime import TorchCausalLM
from tests.cloud import TOKEN
from tests.concurrent_answers import WORKERS, by_seed
from tests.sampled_law import stratified_chi_square_p

QUESTIONS = ["What is a tandem bicycle?", "Write a haiku about autumn rain."]


@pytest.fixture(scope="module")
def far_drafters(far_weights, tiny_tokenizer) -> list[DeviceModel]:
    """The far drafter once per concurrent session (`tests.concurrent_answers`)."""
    return [
        DeviceModel(TorchCausalLM(far_weights), tiny_tokenizer, f"tiny-far-{n}")
        for n in range(WORKERS)
    ]


async def ask(mode, question, options, history=()):
    events = [e async for e in mode.answer(question, list(history), options)]
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    stats = [e for e in events if isinstance(e, Stats)]
    assert len(stats) == 1 and events[-1] is stats[0]
    return text, stats[0], events


def context(device, url, variant="tk-slt", **kw) -> ModeContext:
    return ModeContext(device=device, cloud=CloudSettings(url, TOKEN), variant=variant, **kw)


# ---------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("variant", variant_names())
@pytest.mark.parametrize("drafter", ["near", "far"])
async def test_greedy_split_equals_cloud_only(variant, drafter, request, cloud_url):
    device = request.getfixturevalue({"near": "device", "far": "far_device"}[drafter])
    cloud = build_mode("cloud", context(device, cloud_url))
    split = build_mode("split", context(device, cloud_url, variant))
    options = AnswerOptions(max_new_tokens=40, temperature=0.0)
    for question in QUESTIONS:
        want_text, want, _ = await ask(cloud, question, options)
        split.costs = SplitCosts()  # unmeasured: speculate (a measured far drafter loses: AS²)
        got_text, got, _ = await ask(split, question, options)
        assert got.token_ids == want.token_ids and got_text == want_text
        assert got.finish == want.finish and got.rounds > 0
        assert got.drafted > 0 and got.accepted <= got.drafted
        assert got.bytes_up > 0 and got.bytes_down > 0
    if drafter == "far":
        assert got.accepted < got.drafted  # rejections happened, so the residual path ran
    await cloud.close()
    await split.close()


async def test_as2_falls_back_to_cloud_decoding_and_says_so(device, cloud_url):
    cloud = build_mode("cloud", context(device, cloud_url))
    split = build_mode("split", context(device, cloud_url))
    # A device that drafts far slower than the cloud decodes: no γ can win.
    split.costs.t_draft, split.costs.t_link = 10.0, 0.0
    split.costs.verify.append((5, 0.01))
    options = AnswerOptions(max_new_tokens=40, temperature=0.0)
    _, want, _ = await ask(cloud, QUESTIONS[0], options)
    _, got, events = await ask(split, QUESTIONS[0], options)
    assert got.token_ids == want.token_ids
    # all but the first token (which always comes from the cloud's prefill)
    assert got.cloud_only and got.cloud_tokens == len(got.token_ids) - 1 and got.rounds == 0
    assert any(isinstance(e, Notice) and "AS²" in e.text for e in events)


async def test_rapid_answers_always_speculate_even_where_as2_would_not(device, cloud_url):
    """RAPID's η acts only in speculative rounds: AS²'s cloud decoding would drop what the
    device knows, so an answer asked for with η > 0 speculates whatever the costs say."""
    split = build_mode("split", context(device, cloud_url))
    split.costs.t_draft, split.costs.t_link = 10.0, 0.0  # as above: AS² would win
    split.costs.verify.append((5, 0.01))
    options = AnswerOptions(max_new_tokens=16, temperature=1.0, seed=3, eta=1.0)
    _, got, events = await ask(split, QUESTIONS[0], options)
    assert not got.cloud_only and got.cloud_tokens == 0 and got.rounds > 0
    assert not any(isinstance(e, Notice) and "AS²" in e.text for e in events)
    await split.close()


async def test_as2_asks_for_its_tokens_before_the_first_one_arrives(device, cloud_url):
    """Once a session knows AS² wins, an answer's tokens after the first are asked for right
    behind Generate (one CloudDecode, sent before the first token arrives), so the cloud never
    waits a round trip for the device. The cloud keeps that frame while it samples the first
    token: the answer still equals cloud mode's, token for token."""
    cloud = build_mode("cloud", context(device, cloud_url))
    split = build_mode("split", context(device, cloud_url))
    split.costs.t_draft, split.costs.t_link, split.costs.t_cloud_step = 10.0, 0.0, 0.001
    split.costs.verify.append((5, 0.01))
    options = AnswerOptions(max_new_tokens=40, temperature=0.0)
    _, want, _ = await ask(cloud, QUESTIONS[0], options)
    client = await split.client()
    timeline: list[str] = []

    def sent(frame: bytes) -> None:
        if not isinstance(msg := decode(frame), Ping | Pong):
            timeline.append(f"sent {type(msg).__name__}")

    client.on_frame_sent = sent
    events = []
    async with asyncio.timeout(60):  # a cloud that dropped the early CloudDecode would hang
        async for event in split.answer(QUESTIONS[0], [], options):
            if isinstance(event, TextDelta) and "first token" not in timeline:
                timeline.append("first token")
            events.append(event)
    got = events[-1]
    assert got.token_ids == want.token_ids and got.rounds == 0 and got.cloud_only
    assert got.cloud_tokens == len(got.token_ids) - 1
    assert timeline == ["sent Generate", "sent CloudDecode", "first token"]
    assert any(isinstance(e, Notice) and "AS²" in e.text for e in events)
    await cloud.close()
    await split.close()


async def test_a_conversation_longer_than_the_context_still_gets_answers(
    device, cloud_url, tiny_tokenizer
):
    """Both sides leave the oldest exchanges out rather than refuse the prompt; the device
    says so. Greedy split still equals cloud mode (the cloud trims the same way in both).
    (Every turn a follow-up of the one before: a question that stands alone gets no history,
    edge_runtime.turns.)"""
    history = [
        Turn(
            "What are tandem bicycles?" if i == 0 else f"And what else about them, part {i}?",
            "They are " + "bicycles for two, " * 8,
            "cloud",
        )
        for i in range(8)
    ]
    question = "And who rides them?"
    whole = prompt_ids(
        tiny_tokenizer, question, [t for u in history for t in (u.question, u.answer)]
    )
    assert len(whole) > TINY_CONTEXT  # would not even fit the context
    # the user agreed: split's drafter reads the whole conversation (edge_runtime.consent)
    options = AnswerOptions(max_new_tokens=24, temperature=0.0, allow_private_in_cloud=True)
    answers = {}
    for name in ("local", "cloud", "split"):
        mode = build_mode(name, context(device, cloud_url))
        if name == "split":
            mode.costs = SplitCosts()  # unmeasured: speculate
        text, stats, events = await ask(mode, question, options, history)
        assert not any(isinstance(e, Failure) for e in events), name
        assert stats.tokens > 0 and text, name
        if name != "cloud":
            notices = [e.text for e in events if isinstance(e, Notice)]
            assert any("oldest exchanges left out" in n for n in notices), (name, notices)
        answers[name] = stats.token_ids
        await mode.close()
    assert answers["split"] == answers["cloud"]


# ---------------------------------------------------------------------------- sampling


# answers per variant, each second token tested given its own first (as on vLLM): P fitted
# with p 0.23-0.54 and the control (the drafter's Q) was refused at p = 0 in every variant
ANSWERS = 300


@pytest.mark.parametrize("variant", ["tk-slt", "dssd", "dsd"])
async def test_sampled_split_tokens_follow_the_cloud_model(
    variant, far_device, far_drafters, cloud_engine, cloud_url, tiny_tokenizer
):
    """χ² over many short generations. The first token comes from the cloud's prefill; the
    second is the first one decided by a speculative round (the far drafter's draft, accepted
    or resampled). Given its own first token, each answer's second must follow the cloud's P,
    not the drafter's Q (the negative control shows the test tells them apart)."""
    params = SamplingParams(temperature=1.0, top_k=12)
    question = QUESTIONS[0]
    ids = prompt_ids(tiny_tokenizer, question)

    def target(lm):
        return lambda first: distribution(lm.prefill([[*ids, first]])[0], params)

    p_first = distribution(cloud_engine.lm.prefill([ids])[0], params)
    first = int(np.argmax(p_first))
    p, q = target(cloud_engine.lm)(first), target(far_device.lm)(first)
    assert 0.5 * np.abs(p - q).sum() > 0.3  # far apart: a biased sampler would show
    splits = [build_mode("split", context(d, cloud_url, variant)) for d in far_drafters]

    async def answer(split, seed: int) -> tuple[int, int]:
        options = AnswerOptions(max_new_tokens=2, temperature=1.0, top_k=12, seed=seed)
        split.costs = SplitCosts()  # always one speculative round, never AS²'s cloud decoding
        _, stats, _ = await ask(split, question, options)
        assert stats.rounds == 1 and not stats.cloud_only and len(stats.token_ids) == 2
        return stats.token_ids[0], stats.token_ids[1]

    pairs = await by_seed(splits, range(ANSWERS), answer)
    for split in splits:
        await split.close()
    fits, control = (
        stratified_chi_square_p(pairs, target(lm)) for lm in (cloud_engine.lm, far_device.lm)
    )
    print(f"{variant}: {len(pairs)} answers, chi2 p under P {fits:.3g}, Q {control:.3g}")
    assert stratified_chi_square_p([(0, f) for f, _ in pairs], lambda _: p_first) > 1e-3
    assert fits > 1e-3 and control < 1e-6


async def test_rapid_pulls_the_cloud_toward_a_drafter_reading_private_passages(
    device, cloud_url, private_index
):
    """η travels with Generate and the cloud verifies against p̂: with the device model
    reading a private passage the cloud never sees, the same seeds get far more drafts
    accepted at η = 100 than at η = 0. (The tiny random models spread p over the whole
    vocabulary, so only a large η shows at this size; the exact law of a RAPID round, through
    the variant, the codec and the verdict, is tested in tests/test_math_edges.py.)"""
    ctx = ModeContext(device, private_index, CloudSettings(cloud_url, TOKEN, embedded=True))
    split = build_mode("split", ctx)
    counts = {}
    for eta in (0.0, 100.0):
        drafted = accepted = 0
        for seed in range(20):
            options = AnswerOptions(max_new_tokens=5, temperature=1.0, seed=seed, eta=eta, k=1)
            split.costs = SplitCosts()  # speculate from the first round
            _, stats, _ = await ask(split, "What is my locker code?", options)
            assert stats.rapid_eta == eta and stats.rounds >= 1
            drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
        counts[eta] = (accepted, drafted)
    await split.close()
    (a0, n0), (a1, n1) = counts[0.0], counts[100.0]
    assert a1 / n1 > a0 / n0, counts
    assert scipy_stats.fisher_exact([[a0, n0 - a0], [a1, n1 - a1]]).pvalue < 1e-4, counts


async def test_rapid_refuses_dssd_and_leaves_a_greedy_answer_alone(device, cloud_url):
    """DSSD's cloud never sees Q: RAPID is refused before anything is sent. Greedy: the T → 0
    limit of p̂ is p, so the answer is cloud-only's, and the device says why."""
    options = AnswerOptions(max_new_tokens=8, temperature=1.0, eta=1.0)
    dssd = build_mode("split", context(device, cloud_url, "dssd"))
    _, stats, events = await ask(dssd, QUESTIONS[0], options)
    failures = [e for e in events if isinstance(e, Failure)]
    assert failures and "tk-slt" in failures[0].message and stats.tokens == 0
    greedy = AnswerOptions(max_new_tokens=8, temperature=0.0, eta=1.0)
    split = build_mode("split", context(device, cloud_url, "tk-slt"))
    _, got, events = await ask(split, QUESTIONS[0], greedy)
    assert any(isinstance(e, Notice) and "greedy" in e.text for e in events)
    cloud = build_mode("cloud", context(device, cloud_url))
    _, want, _ = await ask(cloud, QUESTIONS[0], AnswerOptions(max_new_tokens=8, temperature=0.0))
    assert got.token_ids == want.token_ids and got.rapid_eta == 1.0
    for mode in (dssd, split, cloud):
        await mode.close()


# ---------------------------------------------------------------------------- privacy


def client_frames(data: bytes, binary_only: bool = False) -> list[bytes]:
    """Unmask a client's websocket frames (RFC 6455 §5.2) after the HTTP upgrade (only the
    binary ones, the protocol's, if `binary_only`: no close, ping or pong)."""
    pos = data.index(b"\r\n\r\n") + 4
    out = []
    while pos < len(data):
        b0, b1 = data[pos], data[pos + 1]
        keep = not binary_only or b0 & 0x0F == 0x2
        assert not b0 & 0x70, "compressed or extended frames would hide text from this test"
        assert b1 & 0x80, "client frames must be masked"
        n, pos = b1 & 0x7F, pos + 2
        if n == 126:
            n, pos = int.from_bytes(data[pos : pos + 2], "big"), pos + 2
        elif n == 127:
            n, pos = int.from_bytes(data[pos : pos + 8], "big"), pos + 8
        mask, pos = data[pos : pos + 4], pos + 4
        body = bytes(c ^ mask[i % 4] for i, c in enumerate(data[pos : pos + n]))
        if keep:
            out.append(body)
        pos += n
    return out


class WireTap:
    """A TCP proxy that keeps every byte the device sends, to read the websocket frames (`up`:
    all of it; `connections`: per connection), and can cut every connection at once (to the
    device, the cloud has vanished)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.up = bytearray()
        self.connections: list[tuple[bytearray, list[asyncio.StreamWriter]]] = []
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _handle(self, reader, writer) -> None:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        sent = bytearray()
        self.connections.append((sent, [writer, up_w]))

        async def pipe(src, dst, keep: bool) -> None:
            try:
                while data := await src.read(65536):
                    if keep:
                        self.up += data
                        sent.extend(data)
                    dst.write(data)
                    await dst.drain()
            except ConnectionError:
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_w, True), pipe(up_r, writer, False))

    def cut(self) -> None:
        for _, writers in self.connections:
            for w in writers:
                w.transport.abort()

    def sent_since(self, n: int) -> bytes:
        """The websocket payloads the device sent on the connections opened after the n-th."""
        return b"".join(f for sent, _ in self.connections[n:] for f in client_frames(bytes(sent)))

    def payloads(self) -> list[bytes]:
        return client_frames(bytes(self.up))

    async def close(self) -> None:
        if self.server:
            self.server.close()


@pytest.mark.parametrize("variant", variant_names())
async def test_split_never_sends_private_text(variant, device, cloud_url, private_index):
    port = int(cloud_url.split(":")[2].split("/")[0])
    tap = WireTap(port)
    tap_port = await tap.start()
    url = f"ws://127.0.0.1:{tap_port}/v1/session"
    split = build_mode("split", context(device, url, variant, index=private_index))
    question = "And where is the spare key hidden?"  # a follow-up: it gets the history
    # the user agreed: the drafts come from a prompt holding the passages (what is tested)
    options = AnswerOptions(
        max_new_tokens=24, temperature=0.7, seed=3, k=2, allow_private_in_cloud=True
    )
    # an earlier turn answered locally may quote private text: it must not travel either
    this_cloud = CloudSettings(url, TOKEN).identity("tiny-cloud")  # the turn it saw goes back
    history = [
        Turn("What is my locker code?", "Your locker code is 4417.", "local"),
        Turn("Hi", "Hello there!", "cloud", shared="Hello there!", shared_with=this_cloud),
    ]
    _, stats, events = await ask(split, question, options, history)
    await split.close()
    await tap.close()
    cites = [e for e in events if isinstance(e, Citation)]
    assert cites and all(c.side == "device" for c in cites)
    frames = tap.payloads()
    wire = b"".join(frames)
    assert question.encode() in wire  # the tap does see text the device sends
    assert b"Hello there!" in wire and b"4417" not in wire
    assert stats.rounds > 0
    for hit in private_index.search(question, k=5):
        chunk = hit.text.encode()
        for i in range(max(1, len(chunk) - 31)):
            assert chunk[i : i + 32] not in wire, (
                f"private text left the device: {chunk[i : i + 32]}"
            )
        assert chunk not in bytes(tap.up)


async def test_local_mode_opens_no_socket(device, private_index):
    ctx = ModeContext(device, private_index, CloudSettings("ws://127.0.0.1:9/x", TOKEN))
    local = build_mode("local", ctx)
    with counting_sockets() as opened:  # every connect, blocking or the event loop's
        text, stats, events = await ask(local, "Where is the spare key?", AnswerOptions(24, k=2))
    assert text and stats.tokens > 0 and stats.bytes_up == stats.bytes_down == 0
    assert any(isinstance(e, Citation) and e.side == "device" for e in events)
    assert opened == []


async def test_an_off_topic_question_cites_nothing_and_says_so(device, private_index):
    """Nothing in the user's documents is relevant: no passage goes into the prompt or the
    citations, and the answer says so instead of citing noise (issue 29)."""
    from edge_runtime.device import NOTHING_PRIVATE

    ctx = ModeContext(device, private_index, CloudSettings("ws://127.0.0.1:9/x", TOKEN))
    local = build_mode("local", ctx)
    _, _, events = await ask(
        local, "Who won the football World Cup in 2010?", AnswerOptions(8, k=2)
    )
    assert not [e for e in events if isinstance(e, Citation)]
    assert Notice(NOTHING_PRIVATE) in events
    # the same question with no floor cites the user's unrelated notes: the floor did it
    _, _, events = await ask(
        local, "Who won the football World Cup in 2010?", AnswerOptions(8, k=2, min_score=None)
    )
    assert [e for e in events if isinstance(e, Citation)]
    assert Notice(NOTHING_PRIVATE) not in events


def test_an_empty_citations_frame_says_nothing_public_was_relevant():
    from collab.protocol import Citations
    from collab.sources import Source
    from edge_runtime.device import NOTHING_PUBLIC
    from edge_runtime.modes.link import CitationCount

    count = CitationCount()  # one request's (its link's)
    assert count.cite(Citations((), request_id=1)) == [Notice(NOTHING_PUBLIC)]
    (event,) = count.cite(Citations((Source("Lima", score=0.7, found_by="both"),), request_id=1))
    assert isinstance(event, Citation) and event.found_by == "both" and event.side == "cloud"


# ---------------------------------------------------------------------------- failures


async def test_wrong_token_is_a_plain_failure_and_the_device_answers(device, cloud_url):
    ctx = context(device, cloud_url)
    ctx.cloud = CloudSettings(cloud_url, "wrong-token", retries=0)
    cloud = build_mode("cloud", ctx)
    text, stats, events = await ask(cloud, QUESTIONS[0], AnswerOptions(max_new_tokens=8))
    failures = [e for e in events if isinstance(e, Failure)]
    assert failures and "token" in failures[0].message.lower()
    assert text and stats.tokens > 0  # finished on the device


async def test_server_killed_mid_answer_is_reported_and_finished_on_device(
    tiny, device, tmp_path, monkeypatch
):
    from app.embedded import EmbeddedCloud

    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path))
    serve = [
        "--engine",
        "torch",
        "--dtype",
        "float32",
        "--model-dir",
        str(tiny["hf"]),
        "--no-corpus",
    ]
    cloud = await EmbeddedCloud.start(serve, timeout_s=120)
    try:
        ctx = ModeContext(device, None, CloudSettings(cloud.url, cloud.token))
        split = build_mode("split", ctx)
        history = [Turn("Hi", "Hello!", "split")]
        events = []
        options = AnswerOptions(max_new_tokens=150, temperature=0.0)
        killed = False
        async for event in split.answer(QUESTIONS[1], history, options):
            events.append(event)
            if isinstance(event, TextDelta) and not killed and len(events) > 3:
                cloud.proc.kill()
                killed = True
        assert killed
        failure = next(e for e in events if isinstance(e, Failure))
        assert failure.recoverable and "after" in failure.message
        assert any(isinstance(e, Notice) and "device" in e.text for e in events)
        stats = events[-1]
        assert isinstance(stats, Stats) and stats.finish in ("stop", "length")
        # the next question still gets an answer (the link is down: finished on the device)
        text, _, more = await ask(split, "And then?", AnswerOptions(max_new_tokens=8))
        assert text and any(isinstance(e, Failure) for e in more)
        await split.close()
    finally:
        await cloud.stop()


def test_tiny_context_fits(tiny_tokenizer):
    """The tests above keep prompts + answers within the tiny model's 256-token context."""
    assert len(prompt_ids(tiny_tokenizer, QUESTIONS[1], ["Hi", "Hello!"])) + 150 < 256
