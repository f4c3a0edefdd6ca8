"""PicoSpec's pipeline in split mode (docs/math.md#picospec), end to end over a real aiohttp server
on
loopback with tiny models: the device drafts on while the cloud verifies, a rejection
interrupts it, a batch goes out short when drafting falls behind. The pipeline may change when
things happen, never what is sampled: greedy answers equal cloud-only token for token, and a
token drafted after a rejection that threw drafting away follows the cloud's distribution."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from scipy import stats as scipy_stats

from collab.sampling import SamplingParams, distribution
from collab.scheduling import GammaChoice, choose_draft_length, picospec_expected_round_time
from collab.variants import variant_names
from edge_runtime.device import DeviceModel
from edge_runtime.modes import build_mode
from edge_runtime.modes.base import AnswerOptions
from edge_runtime.split_costs import SplitCosts
from model_runtime.prompting import prompt_ids
from tests import test_modes
from tests.concurrent_answers import by_seed
from tests.test_modes import QUESTIONS, ask, context

far_drafters = test_modes.far_drafters  # the far drafter once per concurrent session


class Frozen(SplitCosts):
    """Costs that measurements do not move: the regime a test puts the cost model in."""

    def observe_round(self, *args, **kwargs):
        pass

    def observe_cloud_tokens(self, *args, **kwargs):
        pass


def long_batches(gamma_max: int = 12) -> SplitCosts:
    """Costs, held, that make the cost model pick long pipelined batches and never hand over
    to the cloud: a long link, drafting cheaper than the round trip, a verification that
    costs the same at any length, high acceptance."""
    costs = Frozen(gamma_max=gamma_max, as2=False)
    costs.t_draft, costs.t_link = 0.02, 0.5
    costs.accepted, costs.rejected = 9.0, 1.0
    costs.verify.extend([(2, 0.05), (13, 0.05)])
    assert costs.choose(48, pipelined=True).tokens_per_second > costs.choose(48).tokens_per_second
    return costs


@pytest.mark.parametrize("variant", variant_names())
@pytest.mark.parametrize("drafter", ["near", "far"])
async def test_pipelined_greedy_split_equals_cloud_only(variant, drafter, request, cloud_url):
    device = request.getfixturevalue({"near": "device", "far": "far_device"}[drafter])
    cloud = build_mode("cloud", context(device, cloud_url))
    split = build_mode("split", context(device, cloud_url, variant))
    options = AnswerOptions(max_new_tokens=48, temperature=0.0, pipeline=True)
    depth = rollbacks = rejected = 0
    for question in QUESTIONS:
        _, want, _ = await ask(cloud, question, options)
        split.costs = long_batches()
        _, got, _ = await ask(split, question, options)
        assert got.token_ids == want.token_ids and got.finish == want.finish
        assert got.pipeline and got.rounds > 0 and got.cloud_tokens == 0
        depth = max(depth, got.pipeline_depth)
        rollbacks += got.rollbacks
        rejected += sum(n < d for d, n in got.per_round)
    assert depth >= 2  # a second batch went out while the first was being verified
    if drafter == "far":
        assert rejected > 0 and rollbacks > 0  # rejections threw drafting away
    await cloud.close()
    await split.close()


class FixedGamma(SplitCosts):
    """γ held at 3 whatever is measured (the cost model, which would drop γ to 1 for a slow
    drafter and a fast cloud, is tested on its own): batches long enough to be cut short."""

    def choose(self, remaining: int, pipelined: bool = False) -> GammaChoice:
        return GammaChoice(max(1, min(3, remaining)), 2.0, 1.0, use_cloud_only=False)


class SlowPhone(DeviceModel):
    """The same tiny model, with every model step `delay` seconds slower: a device that drafts
    slower than this loopback cloud verifies, so drafting falls behind."""

    delay = 0.1

    async def step(self, kind, n, fn):
        await asyncio.sleep(self.delay)
        return await super().step(kind, n, fn)


def slow(device: DeviceModel, delay: float = 0.1) -> DeviceModel:
    return type("SlowPhone", (SlowPhone,), {"delay": delay})(device.lm, device.tokenizer, "slow")


async def test_a_batch_goes_out_short_when_drafting_falls_behind(device, cloud_url):
    phone = slow(device)
    cloud = build_mode("cloud", context(phone, cloud_url))
    split = build_mode("split", context(phone, cloud_url))
    options = AnswerOptions(max_new_tokens=48, temperature=0.0, pipeline=True)
    truncations, seen = 0, []
    for question in QUESTIONS:
        _, want, _ = await ask(cloud, question, options)
        split.costs = FixedGamma(as2=False)  # accepted whole often enough
        _, got, _ = await ask(split, question, options)
        assert got.token_ids == want.token_ids
        truncations += got.truncations
        seen.append(got.per_round)
    assert truncations > 0, seen
    await cloud.close()
    await split.close()


@pytest.mark.parametrize("drafter", ["near", "far"])
async def test_the_cloud_verifies_a_batch_before_it_is_whole_when_drafting_is_slow(
    drafter, request, cloud_url
):
    """Fast verification (PicoSpec §3.2): each draft goes out as it is made, and a cloud that
    verifies faster than the device drafts does not wait for the batch's end. A rejection
    there reaches the device while it is still drafting that batch. Greedy answers stay
    cloud-only's token for token."""
    phone = slow(request.getfixturevalue({"near": "device", "far": "far_device"}[drafter]))
    cloud = build_mode("cloud", context(phone, cloud_url))
    split = build_mode("split", context(phone, cloud_url, "tk-slt"))
    options = AnswerOptions(max_new_tokens=24, temperature=0.0, pipeline=True)
    early = rounds = 0
    for question in QUESTIONS:
        _, want, _ = await ask(cloud, question, options)
        split.costs = FixedGamma(as2=False)
        _, got, _ = await ask(split, question, options)
        assert got.token_ids == want.token_ids and got.finish == want.finish
        early += got.fast_verified
        rounds += got.rounds
    assert early > rounds // 3, (early, rounds)
    await cloud.close()
    await split.close()


def regime(verify: tuple[float, float], link_s: float, alpha: float) -> SplitCosts:
    """Held costs: verification of 1 and of 6 drafts, the link, 60 ms of drafting per token
    and acceptance α."""
    costs = Frozen(gamma_max=6, as2=False)
    costs.t_draft, costs.t_link = 0.06, link_s
    costs.accepted, costs.rejected = alpha / (1 - alpha), 1.0
    costs.verify.extend([(2, verify[0]), (7, verify[1])])
    return costs


@pytest.mark.parametrize("variant", ["tk-slt", "dssd"])
async def test_each_batch_is_pipelined_or_waits_as_the_costs_say(variant, far_device, cloud_url):
    """Where verification dominates the round (this CPU: 0.65-1.3 s against 60 ms of drafting),
    a stop-and-wait round gets the bonus token for about the same time, and every batch waits;
    where the link and drafting dominate (a fast cloud far away), batches are pipelined.
    Either way the answer is cloud-only's."""
    cloud = build_mode("cloud", context(far_device, cloud_url))
    split = build_mode("split", context(far_device, cloud_url, variant))
    options = AnswerOptions(max_new_tokens=24, temperature=0.0, pipeline=True)
    _, want, _ = await ask(cloud, QUESTIONS[1], options)
    waits = {}
    # this machine's bf16 1.5B on one core; a GPU cloud 150 ms away
    for name, costs in (
        ("verify-bound", regime((0.65, 1.3), 0.05, 0.5)),
        ("link-bound", regime((0.02, 0.03), 0.3, 0.8)),
    ):
        assert (
            costs.choose(24).tokens_per_second > costs.choose(24, pipelined=True).tokens_per_second
        ) == (name == "verify-bound")
        split.costs = costs
        _, got, _ = await ask(split, QUESTIONS[1], options)
        assert got.token_ids == want.token_ids
        waits[name] = (got.waits, got.rounds, got.pipeline_depth)
    assert waits["verify-bound"][0] == waits["verify-bound"][1] > 0, waits
    assert waits["verify-bound"][2] == 1, waits  # never a batch drafted past a waiting one
    # link-bound: pipelined but for the last tokens (γ capped by what is left: a bonus pays)
    assert waits["link-bound"][0] <= waits["link-bound"][1] // 4, waits
    await cloud.close()
    await split.close()


@pytest.mark.parametrize("variant", ["tk-slt", "dssd"])
@pytest.mark.parametrize("pipeline", [True, False])
async def test_the_cloud_ending_the_answer_inside_a_batch_ends_it_cleanly(
    variant, pipeline, device, cloud_engine, cloud_url, tiny_tokenizer, monkeypatch
):
    """The cloud's own length limit (the room its context leaves, which the device does not
    know) can fall inside a batch, even inside a part verified before the batch was whole:
    the answer ends with LENGTH exactly where cloud-only's does, and nothing hangs (pipelined
    and stop-and-wait alike)."""
    phone = slow(device, 0.02)
    cloud = build_mode("cloud", context(phone, cloud_url))
    split = build_mode("split", context(phone, cloud_url, variant))
    options = AnswerOptions(max_new_tokens=48, temperature=0.0, pipeline=pipeline)
    for question in QUESTIONS:
        for room in (5, 9, 14):
            limit = len(prompt_ids(tiny_tokenizer, question)) + room
            monkeypatch.setattr(cloud_engine.lm, "max_context", limit)
            _, want, _ = await ask(cloud, question, options)
            split.costs = FixedGamma(as2=False)
            _, got, _ = await ask(split, question, options)
            assert want.finish == "length" and len(want.token_ids) == room
            assert got.token_ids == want.token_ids and got.finish == want.finish
    await cloud.close()
    await split.close()


async def test_stop_and_wait_when_the_pipeline_is_off(device, cloud_url):
    split = build_mode("split", context(device, cloud_url))
    split.costs = long_batches()
    options = AnswerOptions(max_new_tokens=24, temperature=0.0, pipeline=False)
    _, got, _ = await ask(split, QUESTIONS[0], options)
    assert not got.pipeline and got.pipeline_depth == 0 and got.rounds > 0
    await split.close()


# answers per case: the control (the drafter's Q) was refused with p < 1e-300 at 300
ANSWERS = 150


def randomised_pit(token: int, probs: np.ndarray, order: np.ndarray, u: float) -> float:
    """Uniform on [0, 1] when `token` was drawn from `probs`, for any fixed `order` of the
    vocabulary (here: by p/q, so that a sample from the wrong one lands at one end)."""
    rank = int(np.flatnonzero(order == token)[0])
    return float(probs[order[:rank]].sum() + u * probs[token])


# (TK-SLT without the delay drew the very same tokens, seed for seed: one case is enough)
@pytest.mark.parametrize(("variant", "delay"), [("dssd", 0.0), ("tk-slt", 0.02)])
async def test_the_token_after_an_interrupting_rejection_follows_the_cloud(
    variant, delay, far_device, far_drafters, cloud_engine, cloud_url, tiny_tokenizer
):
    """The far drafter is rejected almost every time, with a second batch in flight or being
    drafted: the rejection throws it away. The token the device drafts next, from the
    corrected prefix, must follow the cloud's P given that prefix (randomised PIT uniform),
    and not the drafter's Q (the control shows the test tells them apart). Every answer's
    first rejection counts, whether or not it interrupted drafting: choosing answers by what
    happened later would bias the sample (most of them did interrupt, which is asserted).
    Answers come from four sessions at once (`tests.concurrent_answers`), so the cloud
    verifies most batches before they are whole (fast verification), more so with a device
    20 ms slower per step; the law must not change."""
    params = SamplingParams(temperature=1.0, top_k=12)
    question = QUESTIONS[0]
    phones = [slow(d, delay) if delay else d for d in far_drafters]
    splits = [build_mode("split", context(phone, cloud_url, variant)) for phone in phones]

    async def answer(split, seed: int) -> tuple[list[int] | None, bool, int]:
        """The prefix and the token after the first rejection (None if none), whether a
        rejection interrupted drafting, the batches verified before they were whole."""
        options = AnswerOptions(
            max_new_tokens=7, temperature=1.0, top_k=12, seed=seed, pipeline=True
        )
        split.costs = SplitCosts(as2=False)  # unmeasured: γ = 4 per batch, never AS²
        _, stats, _ = await ask(split, question, options)
        assert stats.pipeline and stats.cloud_tokens == 0
        done = 1  # the first token comes from the cloud's prefill
        for drafted, n in stats.per_round:
            if n < drafted:
                at = done + n + 1  # the correction is token `done + n`; the next one is drafted
                after = stats.token_ids[: at + 1] if at < len(stats.token_ids) else None
                return after, stats.rollbacks > 0, stats.fast_verified
            done += n
        return None, stats.rollbacks > 0, stats.fast_verified

    answers = await by_seed(splits, range(ANSWERS), answer)
    for split in splits:
        await split.close()
    after = [a for a, _, _ in answers if a is not None]
    interrupted = sum(i for _, i, _ in answers)
    early = sum(e for _, _, e in answers)
    ids = prompt_ids(tiny_tokenizer, question)
    rng = np.random.default_rng(0)
    pit_p, pit_q = [], []
    for seq in after:
        prefix, token = seq[:-1], seq[-1]
        p = distribution(cloud_engine.lm.prefill([[*ids, *prefix]])[0], params)
        q = distribution(far_device.lm.prefill([[*ids, *prefix]])[0], params)
        with np.errstate(divide="ignore", invalid="ignore"):
            order = np.lexsort((np.arange(p.size), -(np.log(p) - np.log(q))))
        u = rng.random()
        pit_p.append(randomised_pit(token, p, order, u))
        pit_q.append(randomised_pit(token, q, order, u))
    fits, control = (scipy_stats.kstest(pits, "uniform").pvalue for pits in (pit_p, pit_q))
    print(
        f"{variant}: {len(after)} tokens ({interrupted} interrupted, {early} verified early), "
        f"KS p under P {fits:.3g}, under Q {control:.3g}"
    )
    assert fits > 1e-3 and control < 1e-6


def test_pipelined_rounds_are_chosen_with_picospec_round_cost():
    """γ maximises (1 − α^γ)/(1 − α) tokens per eq. (9) round: no bonus token, drafting
    hidden behind the round trip when a batch is accepted whole."""
    alpha, t_draft, rtt = 0.8, 0.02, 0.1

    def verify(g: int) -> float:
        return 0.06 + 0.004 * g

    got = choose_draft_length(
        alpha,
        t_draft=t_draft,
        t_rtt=rtt,
        t_verify=verify,
        t_cloud_step=0.07,
        gamma_max=12,
        pipelined=True,
    )
    rates = [
        (1 - alpha**g)
        / (1 - alpha)
        / picospec_expected_round_time(alpha, g, g * t_draft, rtt, verify(g))
        for g in range(1, 13)
    ]
    assert got.gamma == int(np.argmax(rates)) + 1
    assert got.tokens_per_second == pytest.approx(max(rates))
    stop_and_wait = choose_draft_length(
        alpha, t_draft=t_draft, t_rtt=rtt, t_verify=verify, t_cloud_step=0.07, gamma_max=12
    )
    assert got.tokens_per_second > stop_and_wait.tokens_per_second  # the link is hidden
