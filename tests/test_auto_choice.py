"""auto's rules, one by one (edge_runtime.mode_choice): each rule decides where it applies and
gives way to the rules before it; the policy wins over every signal."""

from __future__ import annotations

import dataclasses

import pytest

from edge_runtime.mode_choice import (
    CONSULTED,
    DRAGON_MIN_SHARE,
    NO_CONSENT,
    NOT_CONSULTED,
    SLOW_CLOUD,
    Choice,
    Policy,
    Speeds,
    choose,
    dragon_shares,
    public_can_matter,
)
from edge_runtime.mode_choice import Signals as _Signals

OPEN = Policy()
DEVICE_ONLY = Policy(questions_leave=False)
NO_PRIVATE_IN_CLOUD = Policy(private_in_cloud=False)


def Signals(private: float | None, public: float | None, **kw) -> _Signals:
    """The signals with one best passage a side (None: none passed the floor); the public
    corpus counts as consulted where a public passage is given, unless told."""
    kw.setdefault("consulted", public is not None)
    return _Signals(
        () if private is None else (private,), () if public is None else (public,), **kw
    )


def measured(cloud: float, device: float) -> Speeds:
    speeds = Speeds()
    speeds.observe("cloud", cloud)
    speeds.observe("local", device)
    return speeds


@pytest.mark.parametrize(
    "signals",
    [
        Signals(0.8, None),
        Signals(None, 0.8),
        Signals(0.8, 0.8),
        Signals(None, None),
        Signals(None, None, speeds=measured(cloud=50, device=1)),
    ],
)
def test_the_policy_keeps_every_question_on_the_device(signals):
    choice = choose(signals, DEVICE_ONLY)
    assert choice == Choice("local", "your policy keeps questions on this device")


NO_CLOUD = [
    ("off", "no cloud"),
    ("starting", "the cloud is still starting"),
    ("unreachable", "the cloud did not answer"),
]


@pytest.mark.parametrize(("reach", "reason"), NO_CLOUD)
def test_no_cloud_answers_locally(reach, reason):
    for private, public in ((0.8, None), (None, 0.8), (None, None)):
        assert choose(Signals(private, public, cloud=reach), OPEN) == Choice("local", reason)


def test_both_sides_relevant_is_dragon_unless_private_text_must_stay_out():
    assert choose(Signals(0.5, 0.6), OPEN).mode == "dragon"
    choice = choose(Signals(0.5, 0.6), NO_PRIVATE_IN_CLOUD)
    assert choice.mode == "local" and "policy" in choice.reason


def test_the_weights_are_dragons_own():
    """softmax of h = logsumexp(20 × cosine) a side: 0.1 of cosine apart is e² ≈ 7.4 : 1."""
    device, cloud = dragon_shares([0.6], [0.5])
    assert device / cloud == pytest.approx(2.718281828**2) and device + cloud == pytest.approx(1)
    two, one = dragon_shares([0.5, 0.5], [0.5])  # two passages as relevant weigh twice one
    assert two == pytest.approx(2 / 3) and one == pytest.approx(1 / 3)


def test_a_side_dragon_would_all_but_ignore_hands_the_answer_to_the_other():
    """Dragon would follow the stronger side alone: that side's mode answers (and says why)."""
    private_strong = _Signals((0.80,), (0.48,))  # a note, and a Wikipedia page on sailing
    assert min(dragon_shares((0.80,), (0.48,))) < DRAGON_MIN_SHARE
    choice = choose(private_strong, OPEN)
    assert choice.mode == "local" and choice.reason.startswith("your notes answer this")
    public_strong = _Signals((0.31,), (0.81,))
    choice = choose(public_strong, NO_PRIVATE_IN_CLOUD)  # the policy has nothing to keep out
    assert choice.mode == "cloud" and choice.reason.startswith("public sources answer this")
    # just inside the share: both sides count
    close = _Signals((0.70,), (0.48,))
    assert min(dragon_shares((0.70,), (0.48,))) >= DRAGON_MIN_SHARE
    assert choose(close, OPEN).mode == "dragon"


def test_private_only_is_local_whatever_the_speeds():
    for speeds in (Speeds(), measured(cloud=100, device=1)):
        choice = choose(Signals(0.31, None, speeds=speeds, split_gain=3.0), OPEN)
        assert choice == Choice("local", "your notes answer this" + NOT_CONSULTED)


def test_public_only_is_cloud_even_when_split_is_faster_or_the_cloud_slow():
    """Split verifies the bare question (no public passages) and the device holds none: only
    cloud mode can answer from the public corpus."""
    for speeds, gain in ((Speeds(), None), (measured(cloud=1, device=100), 3.0)):
        choice = choose(Signals(None, 0.4, speeds=speeds, split_gain=gain), OPEN)
        assert choice == Choice("cloud", "public sources answer this" + CONSULTED)


def test_a_follow_up_to_a_private_answer_stays_local_unless_public_sources_match():
    follow_up = Signals(None, None, private_turn=True, private_history=True)
    expected = Choice("local", "follows an answer only this device has seen" + NOT_CONSULTED)
    assert choose(follow_up, OPEN) == expected
    public = Signals(None, 0.5, private_turn=True, private_history=True)
    assert choose(public, OPEN).mode == "cloud"


def test_chat_goes_to_the_cloud_model_drafted_here_until_split_is_measured():
    """Split is exact (the cloud model's own answer): until its costs are measured it answers
    chat, and its first answer measures them."""
    choice = choose(Signals(None, None), OPEN)
    assert choice.mode == "split" and "larger model" in choice.reason
    # with private turns in the drafter's prompt and that kept out of the cloud: cloud mode
    shaped = Signals(None, None, private_history=True)
    assert choose(shaped, NO_PRIVATE_IN_CLOUD).mode == "cloud"


def test_chat_takes_split_once_measured_only_on_a_clear_gain():
    assert choose(Signals(None, None, split_gain=1.05), OPEN).mode == "cloud"  # inside the margin
    choice = choose(Signals(None, None, split_gain=1.4), OPEN)
    assert choice.mode == "split" and "1.4×" in choice.reason
    # earlier private turns are in the drafter's prompt: split counts as shaped by them
    shaped = Signals(None, None, split_gain=1.4, private_history=True)
    assert choose(shaped, NO_PRIVATE_IN_CLOUD).mode == "cloud"
    assert choose(shaped, OPEN).mode == "split"


def test_chat_goes_local_only_when_the_cloud_is_measured_far_slower():
    tokens = 100
    assert choose(Signals(None, None, tokens=tokens), OPEN).mode == "split"  # nothing measured
    slow = measured(cloud=SLOW_CLOUD * 20 * 0.9, device=20)  # just past the bound
    choice = choose(Signals(None, None, speeds=slow, tokens=tokens), OPEN)
    assert choice.mode == "local" and "slow" in choice.reason
    fine = measured(cloud=SLOW_CLOUD * 20 * 1.2, device=20)
    assert choose(Signals(None, None, speeds=fine, tokens=tokens), OPEN).mode == "split"
    # the round trip counts: a cloud fast enough on its own is not once each answer waits 10 s
    slow_link = Signals(None, None, speeds=fine, rtt_s=10.0, tokens=tokens)
    assert choose(slow_link, OPEN).mode == "local"


def test_speeds_are_a_moving_average_that_ignores_missing_figures():
    speeds = Speeds()
    speeds.observe("cloud", None)
    speeds.observe("cloud", 0.0)
    assert speeds.tokens_per_s == {}
    speeds.observe("cloud", 10.0)
    speeds.observe("cloud", 20.0)
    assert speeds.tokens_per_s["cloud"] == pytest.approx(13.0)


def test_dragon_needs_the_clouds_consent():
    """Both sides relevant, the policy open: without consent for this cloud the notes answer
    on the device, and the reason says why; consent or not, chat with private turns in the
    drafter's prompt does not go to split."""
    both = Signals(0.7, 0.6)
    assert choose(both, OPEN).mode == "dragon"
    assert choose(dataclasses.replace(both, consent=False), OPEN) == Choice(
        "local", NO_CONSENT + CONSULTED
    )
    shaped = Signals(None, None, split_gain=1.4, private_history=True, consent=False)
    assert choose(shaped, OPEN).mode == "cloud"


@pytest.mark.parametrize(
    ("private", "private_turn", "policy", "consent", "asked"),
    [
        ((), False, OPEN, True, True),  # nothing private: cloud or chat rules need it
        ((), False, OPEN, False, True),
        ((0.6,), False, OPEN, True, True),  # dragon may follow
        ((0.6,), False, OPEN, False, True),  # public passages could still outweigh 0.6
        ((0.9,), False, OPEN, False, False),  # nothing public could outweigh 0.9: not asked
        ((0.9,), False, NO_PRIVATE_IN_CLOUD, True, False),
        ((0.6,), False, NO_PRIVATE_IN_CLOUD, True, True),
        ((), True, OPEN, True, True),  # a follow-up to a device-only answer: as the policy says
        ((), True, NO_PRIVATE_IN_CLOUD, True, False),  # decided on the device, by the policy
    ],
)
def test_the_cloud_is_asked_only_where_its_answer_can_change_the_choice(
    private, private_turn, policy, consent, asked
):
    assert public_can_matter(private, private_turn, policy, consent, k=3) is asked
    if not asked and private:  # and indeed: whatever it would have said, the same choice
        chosen = {
            choose(_Signals(private, public, private_turn=private_turn, consent=consent), policy)
            for public in ((), (0.35,), (1.0, 1.0, 1.0))
        }
        assert len({c.mode for c in chosen}) == 1
