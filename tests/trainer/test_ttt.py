import pytest
import torch

from specforge.trainer.ttt import shift_left, target_distribution, ttt_loss
from tests.models.test_eagle3 import tiny_draft


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


def run_ttt(draft, ids, attention_mask, loss_mask, aux, dist, ttt_length):
    return ttt_loss(
        draft,
        input_ids=ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        aux_hidden_states=aux,
        target=dist,
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

        def ttt_step(self, input_ids, hidden, positions, *, cache, key_padding_mask):
            logits = shift_left(out.logits, 1 + self.step)
            self.step += 1
            return logits, hidden

        def to_target_ids(self, ids):
            return ids + self.d2t[ids]

    result = ttt_loss(
        Oracle(),
        input_ids=ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        aux_hidden_states=aux,
        target=dist,
        ttt_length=3,
    )
    assert result.accuracies == [1.0, 1.0, 1.0]
    for k in range(3):
        p = shift_left(dist.probs, 1 + k)
        counted = shift_left(loss_mask, 2 + k, fill=False)
        entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)
        expected = (entropy * counted).sum() / counted.sum()
        torch.testing.assert_close(result.step_losses[k], expected, rtol=1e-4, atol=1e-5)


def test_ttt_length_must_be_positive():
    target, draft, ids, attention_mask, loss_mask, aux, out = inputs()
    dist = target_distribution(
        out.hidden_states[-1],
        target.lm_head.weight,
        hot_ids=torch.arange(32) + draft.d2t,
        t2d=draft.t2d,
    )
    with pytest.raises(ValueError, match="ttt_length must be >= 1, got 0"):
        run_ttt(draft, ids, attention_mask, loss_mask, aux, dist, ttt_length=0)
