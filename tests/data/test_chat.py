import pytest
import torch

from specforge.data.chat import set_chat_template, tokenize_conversation, tokenize_conversations
from specforge.data.conversations import Conversation
from tests.helpers import make_tiny_tokenizer

MULTI_TURN = Conversation(
    "m",
    [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "the thin man"},
        {"role": "assistant", "content": "hi there"},
        {"role": "user", "content": "and then?"},
        {"role": "assistant", "content": "in the end\nit ends"},
    ],
)


def expected_mask(tokens: list[str]) -> list[bool]:
    """Independent reference: walk the ChatML tokens; after `<|im_start|>assistant\\n`, mask
    everything up to and including the next `<|im_end|>`."""
    mask, inside, header = [], False, ""
    for token in tokens:
        if inside:
            mask.append(True)
            inside = token != "<|im_end|>"
            continue
        mask.append(False)
        if token == "<|im_start|>":
            header = token
        elif header:
            header += token
            if header == "<|im_start|>assistantĊ":
                inside, header = True, ""
            elif not "<|im_start|>assistantĊ".startswith(header):
                header = ""
    return mask


def test_multi_turn_mask_token_by_token(tiny_tokenizer):
    sample = tokenize_conversation(tiny_tokenizer, MULTI_TURN, max_length=1000)
    tokens = tiny_tokenizer.convert_ids_to_tokens(sample.input_ids.tolist())
    assert sample.loss_mask.tolist() == expected_mask(tokens)
    masked = tiny_tokenizer.decode(sample.input_ids[sample.loss_mask])
    assert masked == "hi there<|im_end|>in the end\nit ends<|im_end|>"
    # The ids are exactly what apply_chat_template produces (what serving sees).
    reference = tiny_tokenizer.apply_chat_template(MULTI_TURN.messages, tokenize=True)
    reference = reference["input_ids"] if hasattr(reference, "keys") else reference
    assert sample.input_ids.tolist() == list(reference)


def test_mask_excludes_headers_and_trailing_newline(tiny_tokenizer):
    sample = tokenize_conversation(tiny_tokenizer, MULTI_TURN, max_length=1000)
    tokens = tiny_tokenizer.convert_ids_to_tokens(sample.input_ids.tolist())
    for i, token in enumerate(tokens):
        if token == "<|im_end|>" and sample.loss_mask[i]:
            assert tokens[i + 1] == "Ċ" and not sample.loss_mask[i + 1]
    assert not sample.loss_mask[0]


def test_system_prompt_is_prepended_only_when_missing(tiny_tokenizer):
    no_system = Conversation("s", MULTI_TURN.messages[1:])
    added = tokenize_conversation(tiny_tokenizer, no_system, max_length=1000, system_prompt="X")
    kept = tokenize_conversation(tiny_tokenizer, MULTI_TURN, max_length=1000, system_prompt="X")
    assert tiny_tokenizer.decode(added.input_ids).startswith("<|im_start|>system\nX<|im_end|>")
    assert tiny_tokenizer.decode(kept.input_ids).startswith("<|im_start|>system\nBe kind.")


def test_truncation_is_counted_and_empty_masks_skipped(tiny_tokenizer, caplog):
    full = tokenize_conversation(tiny_tokenizer, MULTI_TURN, max_length=1000)
    first_answer = int(full.loss_mask.nonzero()[0])
    prompt_only = Conversation("p", [{"role": "user", "content": "hello"}])
    samples, stats = tokenize_conversations(
        tiny_tokenizer, [MULTI_TURN, prompt_only], max_length=first_answer + 3
    )
    assert stats.truncated == 1 and stats.skipped_no_assistant == 1
    assert [s.id for s in samples] == ["m"]
    assert len(samples[0].input_ids) == first_answer + 3
    assert int(samples[0].loss_mask.sum()) == 3
    assert stats.assistant_tokens == 3 and "truncated to max_length" in caplog.text


def test_missing_chat_template_is_a_clear_error(tmp_path):
    tokenizer = make_tiny_tokenizer(chat_template=None)
    with pytest.raises(ValueError, match="has no chat template"):
        set_chat_template(tokenizer, None)
    template_file = tmp_path / "chat.jinja"
    template_file.write_text(
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '<|im_end|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    set_chat_template(tokenizer, str(template_file))
    sample = tokenize_conversation(tokenizer, MULTI_TURN, max_length=1000)
    assert tokenizer.decode(sample.input_ids[sample.loss_mask]) == (
        "hi there<|im_end|>in the end\nit ends<|im_end|>"
    )
    with pytest.raises(ValueError, match="chat template file not found"):
        set_chat_template(tokenizer, str(tmp_path / "missing.jinja"))


def test_template_that_rewrites_history_is_rejected():
    # Drops all but the last assistant message: earlier turns are not stable prefixes.
    template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
        "{{ m['role'] + ': ' + m['content'] + '<|im_end|>' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    tokenizer = make_tiny_tokenizer(chat_template=template)
    with pytest.raises(ValueError, match="assistant turn 2"):
        tokenize_conversation(tokenizer, MULTI_TURN, max_length=1000)


def test_mask_dtype_and_shapes(tiny_tokenizer):
    sample = tokenize_conversation(tiny_tokenizer, MULTI_TURN, max_length=1000)
    assert sample.input_ids.dtype == torch.long and sample.loss_mask.dtype == torch.bool
    assert sample.input_ids.shape == sample.loss_mask.shape
