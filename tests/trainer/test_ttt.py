import pytest
import torch

from specforge.data.chat import scored_positions
from specforge.trainer.ttt import (
    first_needed_position,
    sharpened,
    shift_left,
    target_distribution,
    ttt_loss,
    ttt_unroll,
)
from tests.helpers import tiny_draft


def inputs(seed=0, length=14):
    torch.manual_seed(seed)
    target, draft = tiny_draft(seed=seed)
    ids = torch.randint(0, 96, (2, length))
    attention_mask = torch.ones(2, length, dtype=torch.long)
    attention_mask[1, 10:] = 0
    loss_mask = torch.zeros(2, length, dtype=torch.bool)
    loss_mask[:, 5:] = True
    loss_mask &= attention_mask.bool()
    with torch.no_grad():
        out = target(ids, attention_mask=attention_mask, output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i + 1] for i in (1, 2, 3)], dim=-1)
    return target, draft, ids, attention_mask, loss_mask, aux, out


def draft_distribution(target, draft, out):
    """The tiny target's distribution on the tiny draft's 32-token vocabulary."""
    return target_distribution(
        out.hidden_states[-1],
        target.lm_head.weight,
        hot_ids=torch.arange(32) + draft.d2t,
        t2d=draft.t2d,
    )


def run_ttt(draft, ids, attention_mask, loss_mask, aux, dist, ttt_length):
    return ttt_loss(
        draft,
        input_ids=ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        aux_hidden_states=aux,
        target_dist=dist,
        ttt_length=ttt_length,
    )


def test_target_distribution_chunking_and_restriction():
    target, draft, ids, attention_mask, _, _, out = inputs()
    hot = torch.arange(32) + draft.d2t
    whole = target_distribution(
        out.hidden_states[-1], target.lm_head.weight, hot_ids=hot, t2d=draft.t2d, chunk_size=10_000
    )
    chunked = target_distribution(
        out.hidden_states[-1], target.lm_head.weight, hot_ids=hot, t2d=draft.t2d, chunk_size=3
    )
    torch.testing.assert_close(whole.probs, chunked.probs)
    assert torch.equal(whole.argmax, out.logits.argmax(-1))
    expected = out.logits[..., hot].float().softmax(-1)
    torch.testing.assert_close(whole.probs, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(whole.in_draft, draft.t2d[whole.argmax])
    # an earlier pass's argmax (train.state_cache_gb) gives the same distribution
    again = target_distribution(
        out.hidden_states[-1],
        target.lm_head.weight,
        hot_ids=hot,
        t2d=draft.t2d,
        argmax=whole.argmax,
    )
    for field in ("probs", "argmax", "in_draft"):
        assert torch.equal(getattr(again, field), getattr(whole, field))


def test_every_id_in_order_gives_the_full_softmax_and_argmax_from_one_product():
    """A distribution over every id (a DFlash draft's soft labels) equals the full softmax and
    argmax, as a shuffled full vocabulary (two products) does, reordered."""
    target, _, _, _, _, _, out = inputs()
    every = torch.ones(96, dtype=torch.bool)
    dist = target_distribution(
        out.hidden_states[-1], target.lm_head.weight, hot_ids=torch.arange(96), t2d=every
    )
    assert torch.equal(dist.argmax, out.logits.argmax(-1))
    torch.testing.assert_close(dist.probs, out.logits.float().softmax(-1), rtol=1e-5, atol=1e-6)
    shuffled = torch.randperm(96, generator=torch.Generator().manual_seed(0))
    apart = target_distribution(
        out.hidden_states[-1], target.lm_head.weight, hot_ids=shuffled, t2d=every
    )
    assert torch.equal(apart.argmax, dist.argmax)
    torch.testing.assert_close(apart.probs, dist.probs[..., shuffled])


def test_counted_positions_are_the_loss_mask_shifted_by_two_plus_k():
    target, draft, ids, attention_mask, loss_mask, aux, out = inputs()
    hot = torch.arange(32) + draft.d2t
    dist = target_distribution(
        out.hidden_states[-1], target.lm_head.weight, hot_ids=hot, t2d=draft.t2d
    )
    result = run_ttt(draft, ids, attention_mask, loss_mask, aux, dist, ttt_length=4)
    for k in range(4):
        assert int(result.step_counted[k]) == int(loss_mask[:, 2 + k :].sum())
        assert int(result.step_chain_correct[k]) <= int(result.step_prev_correct[k])
    assert result.loss.requires_grad and len(result.step_losses) == 4


def test_perfect_draft_scores_full_accuracy_and_zero_excess_loss():
    """If the draft's logits equal the target's restricted logits, acc_k is 1 wherever the
    target's argmax is in the draft vocabulary and the loss equals the target's entropy."""
    target, draft, ids, attention_mask, loss_mask, aux, out = inputs()
    full_vocab = torch.arange(96)
    dist = target_distribution(
        out.hidden_states[-1],
        target.lm_head.weight,
        hot_ids=full_vocab,
        t2d=torch.ones(96, dtype=torch.bool),
    )

    # logits at step k, position t must be the target's at t+1+k: emulate with a stub draft
    class Oracle(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("d2t", torch.zeros(96, dtype=torch.long))
            self.step = 0

        def ttt_step(self, input_ids, hidden, positions, *, cache, key_padding_mask, start):
            # the "hidden state" of this stub is the target's logits, from position start on
            logits = shift_left(out.logits, 1 + self.step)[:, start:]
            self.step += 1
            return logits

        def logits(self, hidden):
            return hidden

        def fuse(self, aux_hidden_states):
            return aux_hidden_states  # ignored by this stub

        def unrolled_inputs(self, input_ids, hidden):
            return input_ids, hidden

        def to_target_ids(self, ids):
            return ids + self.d2t[ids]

    result = ttt_loss(
        Oracle(),
        input_ids=ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        aux_hidden_states=aux,
        target_dist=dist,
        ttt_length=3,
    )
    assert result.accuracies == [1.0, 1.0, 1.0]
    for k in range(3):
        p = shift_left(dist.probs, 1 + k)
        counted = shift_left(loss_mask, 2 + k, fill=False)
        entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)
        expected = (entropy * counted).sum() / counted.sum()
        torch.testing.assert_close(result.step_losses[k], expected, rtol=1e-4, atol=1e-5)


def test_sharpened_is_the_target_at_a_lower_temperature():
    """``softmax(log p / T)`` is the target's distribution with its logits divided by ``T``;
    ``T = 0`` is its argmax alone, ``T = 1`` the distribution itself."""
    torch.manual_seed(0)
    logits = torch.randn(5, 32) * 3
    probs = logits.softmax(-1)
    assert sharpened(probs, 1.0) is probs
    torch.testing.assert_close(sharpened(probs, 0.5), (logits / 0.5).softmax(-1))
    torch.testing.assert_close(sharpened(probs, 2.0), (logits / 2.0).softmax(-1))
    hard = sharpened(probs, 0.0)
    assert torch.equal(hard.argmax(-1), logits.argmax(-1)) and torch.equal(
        hard.sum(-1), torch.ones(5)
    )
    assert int((hard > 0).sum()) == 5


def test_temperature_zero_trains_on_the_greedy_token_alone():
    """At ``target_temperature=0`` the loss is the cross-entropy of the target's argmax on the
    draft vocabulary (the loss of a one-hot target distribution); accuracies are unchanged."""
    target, draft, ids, attention_mask, loss_mask, aux, out = inputs()
    dist = draft_distribution(target, draft, out)
    kwargs = dict(
        input_ids=ids, attention_mask=attention_mask, loss_mask=loss_mask, aux_hidden_states=aux
    )
    hard = ttt_loss(draft, **kwargs, target_dist=dist, ttt_length=3, target_temperature=0.0)
    one_hot = torch.zeros_like(dist.probs).scatter_(-1, dist.probs.argmax(-1, keepdim=True), 1.0)
    dist_one_hot = type(dist)(probs=one_hot, argmax=dist.argmax, in_draft=dist.in_draft)
    expected = ttt_loss(draft, **kwargs, target_dist=dist_one_hot, ttt_length=3)
    soft = ttt_loss(draft, **kwargs, target_dist=dist, ttt_length=3)
    torch.testing.assert_close(hard.loss, expected.loss)
    assert not torch.isclose(hard.loss, soft.loss)
    assert hard.accuracies == soft.accuracies


def test_ttt_length_must_be_positive():
    target, draft, ids, attention_mask, loss_mask, aux, out = inputs()
    dist = draft_distribution(target, draft, out)
    with pytest.raises(ValueError, match="ttt_length must be >= 1, got 0"):
        run_ttt(draft, ids, attention_mask, loss_mask, aux, dist, ttt_length=0)


def reference_ttt_loss(draft, ids, attention_mask, loss_mask, aux, dist, ttt_length):
    """The TTT loss computed everywhere (every position, every step, full logits), as the
    module docstring defines it: what the pruned :func:`ttt_loss` must equal."""
    loss_mask = loss_mask & attention_mask.bool()
    total, step_losses, correct_counts, chain_counts = 0.0, [], [], []
    chain = torch.ones_like(loss_mask)
    steps = ttt_unroll(
        draft,
        input_ids=ids,
        attention_mask=attention_mask,
        aux_hidden_states=aux,
        ttt_length=ttt_length,
    )
    for k, hidden in enumerate(steps):
        logits = draft.logits(hidden)
        counted = shift_left(loss_mask, 2 + k, fill=False)
        scored = counted & shift_left(dist.in_draft, 1 + k, fill=False)
        per_position = -(shift_left(dist.probs, 1 + k) * logits.log_softmax(-1)).sum(-1)
        step_loss = (per_position * scored).sum() / scored.sum().clamp(min=1)
        total = total + 0.8**k * step_loss
        correct = draft.to_target_ids(logits.argmax(-1)) == shift_left(dist.argmax, 1 + k)
        correct &= counted
        chain = chain & correct
        step_losses.append(step_loss.detach())
        correct_counts.append(int(correct.sum()))
        chain_counts.append(int(chain.sum()))
    return total, step_losses, correct_counts, chain_counts


def test_pruned_ttt_loss_equals_the_loss_computed_everywhere():
    """ttt_loss skips positions no step scores (a prompt prefix, after step 0's keys), draft
    logits at uncounted positions and the target distribution where no step reads it: the loss,
    per-step losses, accuracy counts and gradients are those of the full computation."""
    target, draft, ids, attention_mask, _, aux, out = inputs(length=24)
    loss_mask = torch.zeros(2, 24, dtype=torch.bool)
    loss_mask[0, 13:20] = True  # a second turn's prompt (20..21) in between
    loss_mask[0, 22:] = True
    loss_mask[1, 15:] = True
    loss_mask &= attention_mask.bool()
    assert first_needed_position(loss_mask, 3) == 9
    hot = torch.arange(32) + draft.d2t
    everywhere = target_distribution(
        out.hidden_states[-1], target.lm_head.weight, hot_ids=hot, t2d=draft.t2d
    )
    rows = scored_positions(loss_mask, attention_mask)
    pruned = target_distribution(
        out.hidden_states[-1], target.lm_head.weight, hot_ids=hot, t2d=draft.t2d, rows=rows
    )
    torch.testing.assert_close(pruned.probs[rows], everywhere.probs[rows])
    assert torch.equal(pruned.in_draft[rows], everywhere.in_draft[rows])
    # score every counted position, whatever the tiny target's argmax (a stricter comparison)
    everywhere.in_draft = torch.ones_like(everywhere.in_draft)
    pruned.in_draft = rows
    result = run_ttt(draft, ids, attention_mask, loss_mask, aux, pruned, ttt_length=3)
    result.loss.backward()
    grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
    draft.zero_grad()
    loss, step_losses, correct, chain = reference_ttt_loss(
        draft, ids, attention_mask, loss_mask, aux, everywhere, ttt_length=3
    )
    loss.backward()
    torch.testing.assert_close(result.loss, loss.detach())
    torch.testing.assert_close(torch.stack(result.step_losses), torch.stack(step_losses))
    assert [int(c) for c in result.step_correct] == correct
    assert [int(c) for c in result.step_chain_correct] == chain
    assert grads.keys() == {n for n, p in draft.named_parameters() if p.grad is not None}
    for name, grad in grads.items():
        torch.testing.assert_close(grad, dict(draft.named_parameters())[name].grad, msg=name)
