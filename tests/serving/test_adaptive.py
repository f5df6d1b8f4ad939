"""Cost-aware adaptive drafting (``num_steps: auto``): the depth picker, the running
acceptance estimate, and losslessness of the adaptive runtime."""

import pytest
import torch

from specforge.config import AUTO_MAX_DEPTH
from specforge.serving.adaptive import (
    AcceptanceEstimate,
    ConfidenceCalibration,
    CostModel,
    Dormancy,
    best_depth,
    calibrate,
    expected_tokens,
    first_acceptance,
    round_rate,
    tree_rate,
)
from specforge.serving.drafting import Drafting
from specforge.serving.policy import Fan, new_policy
from specforge.serving.proposers.lookup import PromptLookup
from specforge.serving.sampling import accept_sampling
from specforge.serving.speculative import SpeculativeDecoder
from specforge.serving.tree import DraftTree
from tests.helpers import StubDraft, greedy_reference
from tests.serving.test_sampling import VOCAB as SAMPLED_VOCAB
from tests.serving.test_sampling import models  # noqa: F401
from tests.serving.test_speculative import VOCAB, target  # noqa: F401

# this CPU's shape (benchmarks/verify_cost.py): 36 ms for one token, a jump at 4 rows
CPU_COSTS = CostModel(
    verify=[0.036, 0.040, 0.042, 0.056, 0.058, 0.060, 0.062, 0.064], draft_step=0.0015
)


GREEDY_AUTO = Drafting(num_steps="auto", max_siblings=3)
"""Greedy ``auto``'s settings."""


class FixedCosts(CostModel):
    """Costs that keep their figures: a tiny test model's real round times would otherwise
    replace the widths it verifies, beside the CPU figures of the widths it does not."""

    adapt = 0.0


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


def test_a_prompt_lookup_round_is_priced_without_the_draft_steps_it_never_runs():
    """Lookup proposes from the prompt: its round costs its verification and the round's other
    time, so where draft steps are dear a lookup chain the draft could not afford still pays
    (charged ``depth - 1`` draft steps, this chain was refused at 1 token)."""
    costly_steps = CostModel(verify=[0.036] * 8, draft_step=0.010, other=0.002)
    assert costly_steps.round_seconds(5, drafted=False) == costly_steps.verify[5] + 0.002
    assert costly_steps.round_seconds(5) == pytest.approx(0.036 + 4 * 0.010 + 0.002)
    assert best_depth([0.5] * 7, costly_steps) == 1
    assert best_depth([0.5] * 7, costly_steps, drafted=False) == 7
    assert round_rate([0.5] * 5, [], costly_steps, drafted=False) > round_rate(
        [0.5] * 5, [], costly_steps
    )


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
    # two warm-up passes over every width, then 3 timed passes, each over every width
    assert seen == [1, 2, 3, 4] * 2 + [1, 2, 3, 4] * 3
    assert costs.calibrated == costs.verify


def test_calibration_keeps_each_width_s_median_of_interleaved_passes():
    # a slow spell over the second of three timed passes (verify calls 10-12 after six
    # warm-up calls and a first pass; draft step 4 after two warm-ups and one): interleaved,
    # it costs every width one slow run, so each median keeps the steady figure (timed one
    # width after another, it would have taken all three runs of width 2)
    now, calls = [0.0], {"verify": 0, "draft": 0}

    def verify(n):
        calls["verify"] += 1
        now[0] += 100.0 if 9 < calls["verify"] <= 12 else float(n)

    def draft_step():
        calls["draft"] += 1
        now[0] += 100.0 if calls["draft"] == 4 else 0.5

    costs = calibrate(verify, draft_step, max_depth=2, repeats=3, clock=lambda: now[0])
    assert costs.verify == [1.0, 2.0, 3.0] and costs.draft_step == 0.5


def test_costs_follow_what_rounds_of_a_width_really_cost():
    costs = CostModel(verify=[0.05, 0.06, 0.04], draft_step=0.002)
    for _ in range(100):
        costs.observe_verify(2, 0.09)  # depth 1 verifies 2 tokens; they cost 1.5x the timing
        costs.observe_other(0.004)
    assert costs.verify[1] == pytest.approx(0.09, rel=1e-3)
    # widths not verified are pulled towards their start-up figure at the speed seen (1.5x)
    # more slowly: part of the way after 100 rounds, in the calibration's shape
    assert 0.05 < costs.verify[0] < 0.075 and 0.04 < costs.verify[2] < 0.06
    assert costs.verify[0] / costs.verify[2] == pytest.approx(0.05 / 0.04)
    for _ in range(400):
        costs.observe_verify(2, 0.09)
    assert costs.verify[0] == pytest.approx(0.075, rel=1e-3)
    assert costs.verify[2] == pytest.approx(0.06, rel=1e-3)
    assert costs.calibrated == [0.05, 0.06, 0.04]  # the start-up figures stay reported
    assert costs.other == pytest.approx(0.004, rel=1e-3)
    assert costs.as_dict()["calibrated_verify_ms"] == [50.0, 60.0, 40.0]


def test_a_stall_moves_a_width_s_cost_a_little_and_not_for_long():
    costs = CostModel(verify=[0.05, 0.05, 0.05], draft_step=0.002)
    costs.observe_verify(1, 5.0)  # the machine paused for 5 s during a 1-token verification
    assert costs.verify[0] == pytest.approx(0.05 * (1 + CostModel.adapt), rel=1e-6)  # as 2x
    for _ in range(200):  # then only 2-token rounds, at the calibrated speed
        costs.observe_verify(2, 0.05)
    assert costs.verify[0] == pytest.approx(0.05, rel=1e-2)  # back to the calibration's shape


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
    decoder.policy.costs = FixedCosts(
        verify=list(CPU_COSTS.verify), draft_step=CPU_COSTS.draft_step
    )
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


def test_a_plain_round_for_one_unsure_token_does_not_put_a_paying_draft_to_sleep(target):  # noqa: F811
    # the draft is right and sure except at every 4th position, where it is wrong and unsure:
    # auto decodes those plainly (its confidence says the token fails) but, drafting paying in
    # general, never sleeps through the rounds after them
    torch.manual_seed(0)
    prompt = torch.randint(0, VOCAB, (1, 6))
    reference = greedy_reference(target, prompt, 120)
    draft = StubDraft(reference, lambda t: t % 4 == 0, VOCAB, sure=12.0)
    decoder = SpeculativeDecoder(target, draft, aux_layer_ids=[1, 1, 0], num_steps="auto")
    decoder.policy.costs = FixedCosts(
        verify=list(CPU_COSTS.verify), draft_step=CPU_COSTS.draft_step
    )
    tokens, stats = decoder.generate(prompt, max_new_tokens=120)
    assert tokens == reference[prompt.shape[1] :]
    assert stats.depth_histogram.get(0, 0) > 5
    assert stats.dormant_rounds == 0


def test_auto_rounds_feed_their_verify_times_into_the_costs(target):  # noqa: F811
    torch.manual_seed(0)
    prompt = torch.randint(0, VOCAB, (1, 6))
    reference = greedy_reference(target, prompt, 40)
    decoder = SpeculativeDecoder(
        target,
        StubDraft(reference, lambda t: t % 3 == 0, VOCAB),
        aux_layer_ids=[1, 1, 0],
        num_steps="auto",
    )
    decoder.policy.costs = CostModel(
        verify=[1.0] * (AUTO_MAX_DEPTH + 1), draft_step=0.0015
    )  # far off
    decoder.policy.max_siblings = (
        0  # chains: each round verifies its depth + 1 (flat costs pay siblings)
    )
    tokens, stats = decoder.generate(prompt, max_new_tokens=40)
    assert tokens == reference[prompt.shape[1] :]
    verified = {depth + 1 for depth in stats.depth_per_round}
    # the tiny model verifies in milliseconds: each verified width learnt it; a stall counts
    # as twice the estimate at most, and the other widths follow more slowly
    estimates = decoder.policy.costs.verify
    assert all(estimates[width - 1] < 0.95 for width in verified)
    others = [
        estimates[width - 1] for width in range(1, AUTO_MAX_DEPTH + 2) if width not in verified
    ]
    assert others and len(set(others)) == 1  # one shape: the start-up figures were all 1.0
    assert min(estimates[w - 1] for w in verified) < others[0] < 1.0
    assert decoder.policy.costs.calibrated == [1.0] * (AUTO_MAX_DEPTH + 1)


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
        path, _ = accept_sampling(DraftTree.chain(token, q[None]), target_probs, generator)
        accepted += len(path)
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
    assert (
        decoder.policy.costs is not None and len(decoder.policy.costs.verify) == AUTO_MAX_DEPTH + 1
    )
    assert all(s > 0 for s in decoder.policy.costs.verify) and decoder.policy.costs.draft_step > 0
    assert tokens == greedy_reference(target, prompt, 40)[prompt.shape[1] :]


def test_auto_refuses_trees(target):  # noqa: F811
    from specforge.errors import UserError

    with pytest.raises(UserError, match="chains only"):
        SpeculativeDecoder(target, None, aux_layer_ids=[1, 1, 0], num_steps="auto", topk=2)
    with pytest.raises(UserError, match="max_siblings must be in 0..7, got 8"):
        SpeculativeDecoder(target, None, aux_layer_ids=[1, 1, 0], num_steps="auto", max_siblings=8)


def test_the_runtime_its_policy_and_its_proposer_read_one_settings_record(target):  # noqa: F811
    decoder = SpeculativeDecoder(
        target, StubDraft([0] * 8, lambda t: True, VOCAB), aux_layer_ids=[1, 1, 0], num_steps="auto"
    )
    assert decoder.proposer.drafting is decoder.policy.drafting is decoder.drafting
    assert decoder.drafting.depth == decoder.num_steps == AUTO_MAX_DEPTH
    # a misspelt setting is refused by name, not ignored
    with pytest.raises(TypeError, match="num_step"):
        SpeculativeDecoder(target, None, aux_layer_ids=[1, 1, 0], num_step=3)


def test_siblings_are_verified_where_a_wider_verification_costs_little_and_not_where_it_costs():
    flat = CostModel(verify=[0.036] * 8, draft_step=0.0015)
    steep = CostModel(verify=[0.016 + 0.02 * n for n in range(1, 9)], draft_step=0.0015)
    policy = new_policy(GREEDY_AUTO, trees=True, device=torch.device("cpu"))
    # siblings whose calibrated acceptance is their q (the prior, nothing learnt yet)
    ranked = [(11, 0.2), (12, 0.1), (13, 0.05)]

    def siblings(costs: CostModel, depth: int) -> int:
        policy.costs = costs
        fan = Fan(list(range(1, depth + 1)), [0.9] * depth, ranked)
        _, chosen = policy.best_round(fan, [0.9] * depth, [])
        assert chosen.depth == depth  # the chain is verified: it pays
        return chosen.siblings

    assert siblings(flat, 1) == 3
    assert siblings(steep, 1) == 0
    assert siblings(flat, 7) == 0  # no wider width calibrated
    assert siblings(flat, 6) == 1
    # the first position's candidates are exclusive: each adds its own acceptance
    assert round_rate([0.4], [0.2, 0.1], flat) == pytest.approx((1 + 0.4 + 0.3) / (0.036 + 0.0))
    assert round_rate([], [], steep) == pytest.approx(1 / 0.036)


def test_a_tree_s_rate_counts_each_node_s_chance_once():
    flat = CostModel(verify=[0.036] * 8, draft_step=0.0015)
    chain_and_sibling = tree_rate([([1, 2], [0.5, 0.5]), ([3], [0.2])], 2, flat)
    assert chain_and_sibling == pytest.approx(round_rate([0.5, 0.5], [0.2], flat))
    # a proposal that shares the chain's first token: that node once, at the larger chance
    shared = tree_rate([([1, 2], [0.5, 0.5]), ([1, 4], [0.6, 0.5])], 2, flat)
    assert shared == pytest.approx((1 + 0.6 + 0.25 + 0.3) / flat.round_seconds(2, 1))
    assert tree_rate([(list(range(8)), [0.9] * 8)], 0, flat) == 0.0  # wider than calibrated


class OracleLookup(PromptLookup):
    """Prompt lookup that proposes the target's continuation ``reference`` at the sequence
    indices ``right`` accepts and another token (``reference + wrong``) at the others."""

    def __init__(self, tokens: int, reference: list[int], right, wrong: int = 1):
        super().__init__(tokens)
        self.reference, self.right, self.wrong = reference, right, wrong

    def propose(self, prompt, output, *, room):
        start = prompt.shape[0] + len(output)
        indices = range(start, min(start + self.tokens, start + room, len(self.reference)))
        proposal = [
            self.reference[j] if self.right(j) else (self.reference[j] + self.wrong) % VOCAB
            for j in indices
        ]
        self.proposal = torch.tensor(proposal) if proposal else None


def test_prompt_lookup_learns_apart_where_the_draft_s_first_choice_agrees_with_it():
    lookup = PromptLookup(3)
    prompt = torch.tensor([5, 6, 7, 8, 5, 6])  # after the last "5 6": 7 8 5
    for agree in [True, False] * 100:
        lookup.propose(prompt, [], room=10)
        lookup.compare(7 if agree else 9)
        lookup.learn([7, 8, 5] if agree else [1, 2, 3])
    differing, agreeing = lookup.estimates[False, 1], lookup.estimates[True, 1]  # a 2-token match
    assert agreeing.rates()[0] > 0.95 and differing.rates()[0] < 0.05
    lookup.propose(prompt, [], room=0)  # asleep, or the turn's last token
    assert lookup.proposal is None and not lookup.agrees
    lookup.propose(prompt, [], room=2)
    assert lookup.proposal.tolist() == [7, 8]


def test_prompt_lookup_learns_apart_by_how_far_back_its_match_reaches():
    """The same proposal after a 4-token match and after a 1-token one: where only the longer
    match's continuation is the target's, each match length's estimate learns its own."""
    lookup = PromptLookup(2)
    far = torch.tensor([1, 2, 3, 4, 9, 1, 2, 3, 4])  # "1 2 3 4" again: 9 1 follows it
    near = torch.tensor([8, 4, 9, 1, 2, 3, 4])  # "4" again, after 3 this time: 9 1
    for matched, prompt in [(4, far), (1, near)] * 100:
        lookup.propose(prompt, [], room=10)
        assert lookup.proposal.tolist() == [9, 1]
        lookup.learn([9, 1] if matched == 4 else [5, 5])
    assert lookup.estimates[False, 2].rates()[0] > 0.95  # matches of 3-4 tokens
    assert lookup.estimates[False, 0].rates()[0] < 0.05  # of 1 token


def test_prompt_lookup_verifies_more_tokens_than_the_draft_s_deepest_chain(target):  # noqa: F811
    """Lookup's proposals cost no draft step, so they may be longer than the draft's chains
    (7): a lookup that is always right (beside a draft that never is) is verified 12 tokens
    at a time, and the output stays the target's."""
    torch.manual_seed(0)
    prompt = torch.randint(0, VOCAB, (1, 6))
    reference = greedy_reference(target, prompt, 60)
    draft = StubDraft(reference, lambda t: False, VOCAB)
    decoder = SpeculativeDecoder(
        target, draft, aux_layer_ids=[1, 1, 0], num_steps="auto", lookup_tokens=12
    )
    decoder.policy.costs = FixedCosts(verify=[0.036] * 13, draft_step=0.0015)
    decoder.policy.lookup = OracleLookup(12, reference, lambda index: True)
    tokens, stats = decoder.generate(prompt, max_new_tokens=60)
    assert tokens == reference[prompt.shape[1] :]
    assert max(stats.accepted_per_round) == 12 > AUTO_MAX_DEPTH


def test_auto_plans_no_round_past_the_turns_budget(target):  # noqa: F811
    """Greedy ``auto``'s rounds (prompt lookup's 12 tokens, the draft's chain and its siblings
    in one tree) are planned within what the turn can still use: no round verifies more tokens
    than are left after it, and the output is the target's."""
    torch.manual_seed(0)
    prompt = torch.randint(0, VOCAB, (1, 6))
    reference = greedy_reference(target, prompt, 40)
    for budget in (3, 9, 17):
        decoder = SpeculativeDecoder(
            target,
            StubDraft(reference, lambda t: t % 2 == 0, VOCAB, sure=30.0),
            aux_layer_ids=[1, 1, 0],
            num_steps="auto",
            lookup_tokens=12,
        )
        decoder.policy.costs = FixedCosts(verify=[0.036] * 17, draft_step=0.0015)
        decoder.policy.lookup = OracleLookup(12, reference, lambda index: index % 3 > 0)
        tokens, stats = decoder.generate(prompt, max_new_tokens=budget)
        assert tokens == reference[prompt.shape[1] :][:budget]
        left = budget - 1  # after the prefill's token
        for depth, accepted in zip(stats.depth_per_round, stats.accepted_per_round, strict=True):
            assert depth <= left - 1  # the round's bonus token needs a place too
            left -= accepted + 1
        assert max(stats.depth_per_round) > 0


def test_auto_verifies_prompt_lookup_and_the_draft_in_one_tree(target):  # noqa: F811
    """Where prompt lookup and the draft are each right at every other position (the draft
    wherever lookup is wrong), a tree of both accepts a token in every round, where choosing
    one of them misses about every other round."""
    torch.manual_seed(0)
    prompt = torch.randint(0, VOCAB, (1, 6))
    reference = greedy_reference(target, prompt, 120)

    def lookup_right(index: int) -> bool:
        return (index * 37) % 7 < 3

    accepted = {}
    for trees in (True, False):
        # the stub draft's position t proposes sequence index t + 2
        draft = StubDraft(reference, lambda t: lookup_right(t + 2), VOCAB)
        decoder = SpeculativeDecoder(
            target, draft, aux_layer_ids=[1, 1, 0], num_steps="auto", lookup_tokens=4
        )
        decoder.policy.costs = FixedCosts(verify=[0.036] * (AUTO_MAX_DEPTH + 1), draft_step=0.0015)
        decoder.policy.lookup = OracleLookup(4, reference, lookup_right)
        decoder.policy.trees = trees
        tokens, stats = decoder.generate(prompt, max_new_tokens=120)
        assert tokens == reference[prompt.shape[1] :]
        accepted[trees] = stats.accepted_per_round
    assert accepted[True].count(0) <= 1  # the last round may have no proposal left
    assert accepted[False].count(0) > 0.3 * len(accepted[False])
    assert len(accepted[True]) < 0.8 * len(accepted[False])


def test_auto_calibrates_the_draft_s_first_token_apart_by_prompt_lookup_s_agreement(target):  # noqa: F811
    """Where the draft is right exactly where prompt lookup is (and each wrong token is
    another), agreeing with lookup means right and differing means wrong: the first token's
    calibrations learn that apart, whatever the draft's own probability says."""
    torch.manual_seed(0)
    prompt = torch.randint(0, VOCAB, (1, 6))
    reference = greedy_reference(target, prompt, 120)

    def right(index: int) -> bool:
        return (index * 37) % 7 < 4

    draft = StubDraft(reference, lambda t: not right(t + 2), VOCAB)  # position t: index t + 2
    decoder = SpeculativeDecoder(
        target, draft, aux_layer_ids=[1, 1, 0], num_steps="auto", lookup_tokens=4
    )
    decoder.policy.costs = FixedCosts(verify=[0.036] * (AUTO_MAX_DEPTH + 1), draft_step=0.0015)
    decoder.policy.lookup = OracleLookup(4, reference, right, wrong=2)
    tokens, _ = decoder.generate(prompt, max_new_tokens=120)
    assert tokens == reference[prompt.shape[1] :]
    q = 1.0 / (1.0 + (VOCAB - 1) / torch.e)  # the stub's probability of its proposal
    differs, agrees = decoder.policy.lookup_confidence
    assert agrees.acceptance(q) > 0.9 and differs.acceptance(q) < 0.1
    assert sum(differs.counts.trials) > 5 and sum(agrees.counts.trials) > 5


def test_a_tree_s_verification_cost_is_learnt_apart_from_the_chain_widths():
    costs = CostModel(verify=[0.04, 0.042, 0.044, 0.046], draft_step=0.002)
    for _ in range(200):
        costs.observe_verify(3, 0.050, tree=True)  # 6 ms over the chain of its width
    assert costs.verify == [0.04, 0.042, 0.044, 0.046]  # the chain widths keep their figures
    assert costs.tree_extra == pytest.approx(0.006, rel=1e-3)
    assert costs.round_seconds(1, 1, tree=True) == pytest.approx(0.044 + 0.006)
    assert costs.round_seconds(1, 1) == pytest.approx(0.044)
    # a sibling or a second chain is verified as a tree and pays it; one chain does not
    assert round_rate([0.5], [0.2], costs) == pytest.approx(1.7 / 0.050)
    assert tree_rate([([1, 2], [0.5, 0.5])], 2, costs) == pytest.approx(
        round_rate([0.5, 0.5], [], costs)
    )
    two = tree_rate([([1], [0.5]), ([1], [0.6])], 1, costs)  # the same token: still a tree
    assert two == pytest.approx(1.6 / 0.048)
    costs.observe_verify(3, 5.0, tree=True)  # a stall counts as twice the tree's estimate
    assert costs.tree_extra == pytest.approx(0.006 + CostModel.adapt * 0.050, rel=1e-3)
    assert costs.as_dict()["tree_extra_ms"] == pytest.approx(1000 * costs.tree_extra, abs=1e-3)


@pytest.mark.parametrize("runner_up", [0.9, None])
def test_auto_siblings_are_lossless_and_catch_the_draft_s_second_choice(target, runner_up):  # noqa: F811
    # the draft's first choice is always wrong; with runner_up its second choice is the
    # target's token, which a sibling catches; without, its other tokens are a flat tail (a
    # verification of any width costs the same here, so siblings are tried, and rarely hit)
    torch.manual_seed(0)
    prompt = torch.randint(0, VOCAB, (1, 6))
    reference = greedy_reference(target, prompt, 120)
    draft = StubDraft(reference, lambda t: True, VOCAB, runner_up=runner_up)
    decoder = SpeculativeDecoder(target, draft, aux_layer_ids=[1, 1, 0], num_steps="auto")
    decoder.policy.costs = FixedCosts(verify=[0.036] * (AUTO_MAX_DEPTH + 1), draft_step=0.0015)
    tokens, stats = decoder.generate(prompt, max_new_tokens=120)
    assert tokens == reference[prompt.shape[1] :]
    hits = len(stats.sibling_hit_rounds)
    assert stats.acceptance_per_position[0] == 0  # the chain's own first token: never
    if runner_up is None:
        assert hits < 0.1 * stats.verifications and stats.tau < 1.1
    else:
        # the sibling's calibration learns from every round's first target token
        assert hits > 0.9 * stats.verifications and stats.tau > 1.9


def rounds_of_the_last(decoder: SpeculativeDecoder, asked: list[torch.Tensor]):
    """The last prompt's tokens and rounds after the runtime answered every prompt of
    ``asked`` in turn (each sampled from seed 3), the costs frozen (:class:`FixedCosts`): real
    round times, the machine's, would move the depths."""
    decoder.policy.use_costs(
        FixedCosts(verify=list(CPU_COSTS.verify), draft_step=CPU_COSTS.draft_step)
    )
    for prompt in asked:
        generator = torch.Generator().manual_seed(3)
        tokens, stats = decoder.generate(prompt, max_new_tokens=60, generator=generator)
    return tokens, stats.depth_per_round, stats.accepted_per_round, stats.dormant_rounds


def test_a_request_s_greedy_rounds_do_not_depend_on_the_requests_before_it(target):  # noqa: F811
    """``auto`` starts every request from its priors (the position estimates, the confidence
    calibrations, the sleep, prompt lookup's estimates): a question gets the same rounds asked
    first or after ten others."""
    torch.manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (1, 6)) for _ in range(11)]
    # right on the question's answer but every third token, wrong on the other prompts
    reference = greedy_reference(target, prompts[-1], 60)
    draft = StubDraft(reference, lambda t: t % 3 == 0, VOCAB)
    runs = [
        rounds_of_the_last(
            SpeculativeDecoder(
                target, draft, aux_layer_ids=[1, 1, 0], num_steps="auto", lookup_tokens=4
            ),
            asked,
        )
        for asked in (prompts[-1:], prompts)
    ]
    assert runs[0] == runs[1]
    assert runs[0][0] == reference[prompts[-1].shape[1] :]
    assert len(set(runs[0][1])) > 1  # auto chose more than one depth on its own


def test_a_request_s_sampled_rounds_do_not_depend_on_the_requests_before_it(models):  # noqa: F811
    """The same for sampling: the request's seed gives the same tokens and rounds."""
    sampled_target, draft = models
    torch.manual_seed(0)
    prompts = [torch.randint(0, SAMPLED_VOCAB, (1, 5)) for _ in range(11)]
    runs = [
        rounds_of_the_last(
            SpeculativeDecoder(
                sampled_target, draft, aux_layer_ids=[1, 1, 0], num_steps="auto", temperature=1.0
            ),
            asked,
        )
        for asked in (prompts[-1:], prompts)
    ]
    assert runs[0] == runs[1]
    assert len(set(runs[0][1])) > 1
