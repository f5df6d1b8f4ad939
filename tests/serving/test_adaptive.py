"""Cost-aware adaptive drafting (``num_steps: auto``): the depth picker, the running
acceptance estimate, and losslessness of the adaptive runtime."""

import pytest
import torch

from specforge.serving.adaptive import (
    AcceptanceEstimate,
    ConfidenceCalibration,
    CostModel,
    Dormancy,
    best_depth,
    calibrate,
    expected_tokens,
    first_acceptance,
)
from specforge.serving.sampling import accept_chain_sampling
from specforge.serving.speculative import AUTO_MAX_DEPTH, SpeculativeDecoder
from tests.helpers import StubDraft, greedy_reference
from tests.serving.test_speculative import VOCAB, target  # noqa: F401

# this CPU's shape (benchmarks/verify_cost.py): 36 ms for one token, a jump at 4 rows
CPU_COSTS = CostModel(
    verify=[0.036, 0.040, 0.042, 0.056, 0.058, 0.060, 0.062, 0.064], draft_step=0.0015
)


def test_expected_tokens_is_one_plus_the_chain_products():
    assert expected_tokens([0.5, 0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5, 0.5, 0.5], 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens([1.0] * 7, 7) == 8.0


def test_the_picker_chooses_no_drafting_when_the_draft_never_agrees_and_the_deepest_when_always():
    assert best_depth([0.0] * 7, CPU_COSTS) == 0
    assert best_depth([1.0] * 7, CPU_COSTS) == 7
    # the 4-token jump: with 0.6 per position, 2 draft tokens pay and the third does not
    assert best_depth([0.6] * 7, CPU_COSTS) == 2
    # free verification: any acceptance makes the deepest chain best
    flat = CostModel(verify=[0.036] * 8, draft_step=0.0)
    assert best_depth([0.1] * 7, flat) == 7
    # the first draft token comes with the draft's extension: depth 1 takes no draft step, so
    # it pays whenever verifying a second token costs nothing, however dear a step is
    assert CPU_COSTS.round_seconds(1) == CPU_COSTS.verify[1]
    costly_steps = CostModel(verify=[0.036] * 8, draft_step=0.010)
    assert best_depth([0.1] * 7, costly_steps) == 1


def test_the_estimate_follows_what_it_observes_and_learns_one_depth_ahead():
    estimate = AcceptanceEstimate(max_depth=4)
    assert estimate.rates() == [0.5] * 4  # the prior
    for _ in range(200):
        estimate.observe(depth=2, accepted=2, lookahead=True)
    rates = estimate.rates()
    assert rates[0] > 0.95 and rates[1] > 0.95 and rates[2] > 0.95  # depth 3 via the lookahead
    for _ in range(200):
        estimate.observe(depth=2, accepted=0, lookahead=None)
    assert estimate.rates()[0] < 0.05  # recent rounds weigh most (decay)


def test_confidence_calibration_starts_at_q_and_learns_each_bin():
    calibration = ConfidenceCalibration(bins=10)
    assert calibration.acceptance(0.25) == pytest.approx(0.25)  # the prior is q itself
    for _ in range(300):
        calibration.observe(0.05, True)  # low-confidence tokens that are accepted anyway
        calibration.observe(0.95, False)
    assert calibration.acceptance(0.05) > 0.9 and calibration.acceptance(0.95) < 0.1
    assert calibration.acceptance(0.55) == pytest.approx(0.55)  # an untouched bin keeps its prior


def test_calibration_times_every_verify_width_and_a_draft_step():
    seen = []
    ticks = iter(range(10_000))
    costs = calibrate(
        lambda n: seen.append(n), lambda: None, max_depth=3, repeats=3, clock=lambda: next(ticks)
    )
    assert len(costs.verify) == 4 and costs.max_depth == 3
    # two warm-up passes over every width, then 3 timed runs of each
    assert seen == [1, 2, 3, 4] * 2 + [1] * 3 + [2] * 3 + [3] * 3 + [4] * 3


@pytest.mark.parametrize("agree", ["always", "never", "sometimes"])
def test_auto_depth_is_lossless_and_settles_where_it_pays(target, agree):  # noqa: F811
    wrong_at = {
        "always": lambda t: False,
        "never": lambda t: True,
        "sometimes": lambda t: t % 3 == 0,
    }[agree]
    torch.manual_seed(0)
    prompt = torch.randint(0, VOCAB, (1, 6))
    reference = greedy_reference(target, prompt, 120)
    decoder = SpeculativeDecoder(
        target, StubDraft(reference, wrong_at, VOCAB), aux_layer_ids=[1, 1, 0], num_steps="auto"
    )
    decoder.costs = CostModel(verify=list(CPU_COSTS.verify), draft_step=CPU_COSTS.draft_step)
    tokens, stats = decoder.generate(prompt, max_new_tokens=120)
    assert tokens == reference[prompt.shape[1] :]
    assert len(stats.depth_per_round) == stats.verifications
    last = stats.depth_per_round[-5:]
    if agree == "always":
        assert last[:-1] == [AUTO_MAX_DEPTH] * 4  # (the last round may be cut by the budget)
    if agree == "never":
        assert last == [0] * 5 and stats.tau == 1.0
        # the draft sleeps through most plain rounds: one extension per round it is awake
        # for (the first round's comes with the prefill), never a draft step
        awake = stats.verifications - stats.dormant_rounds
        assert stats.dormant_rounds > stats.verifications * 3 // 4
        assert decoder.draft_model.forwards == 1 + (awake - 1)


def test_dormancy_doubles_its_sleep_while_plain_rounds_win_and_wakes_for_a_drafting_round():
    dormancy = Dormancy(max_span=4)
    pattern = []
    for depth in [0, 0, 0, 0, 3, 0]:  # what each round the draft is awake for verifies
        dormancy.woke(depth)
        slept = 0
        while dormancy.sleeping():
            slept += 1
        pattern.append(slept)
    assert pattern == [1, 2, 4, 4, 0, 1]


def test_first_acceptance_is_the_rate_sampling_verification_accepts_a_first_draft_token():
    generator = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(6, generator=generator) * 2, 0)
    q = torch.softmax(torch.randn(6, generator=generator) * 2, 0)
    trials, accepted = 4000, 0
    for _ in range(trials):
        token = torch.multinomial(q, 1, generator=generator)
        target_probs = torch.stack([p, p])  # the root and the bonus position
        accepted += accept_chain_sampling(token, q[None], target_probs, generator)[0]
    rate = first_acceptance(q, p)
    assert 0.2 < rate < 0.9  # a case where the draft is neither useless nor exact
    assert accepted / trials == pytest.approx(rate, abs=4 * (rate * (1 - rate) / trials) ** 0.5)


def test_auto_calibrates_on_first_use_and_stays_lossless_with_a_random_draft(target):  # noqa: F811
    from tests.helpers import tiny_draft

    _, draft = tiny_draft(seed=1)
    torch.manual_seed(1)
    prompt = torch.randint(0, VOCAB, (1, 7))
    decoder = SpeculativeDecoder(target, draft, aux_layer_ids=[1, 2, 3], num_steps="auto")
    tokens, stats = decoder.generate(prompt, max_new_tokens=40)
    assert decoder.costs is not None and len(decoder.costs.verify) == AUTO_MAX_DEPTH + 1
    assert all(s > 0 for s in decoder.costs.verify) and decoder.costs.draft_step > 0
    assert tokens == greedy_reference(target, prompt, 40)[prompt.shape[1] :]


def test_auto_refuses_trees(target):  # noqa: F811
    from specforge.errors import UserError

    with pytest.raises(UserError, match="chains only"):
        SpeculativeDecoder(target, None, aux_layer_ids=[1, 1, 0], num_steps="auto", topk=2)
