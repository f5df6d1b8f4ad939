"""Continuous batching gives what the target gives one prompt at a time (fp32, greedy), while
rows join and leave the batch; sampled answers do not depend on their batch."""

import pytest
import torch

from specforge.config import RegenerateConfig
from specforge.data.conversations import Conversation
from specforge.distill.regenerate import regenerate_conversations
from specforge.engine.generation import (
    AUTO_MEMORY_SHARE,
    AUTO_ROWS,
    CPU_ROWS_PER_SPAN,
    PREFILL_PADDING,
    ContinuousBatcher,
    GenerationSettings,
    Request,
    auto_batch_size,
    default_rows_per_span,
    kv_bytes_per_token,
    prefill_groups,
)
from specforge.io import read_jsonl
from specforge.models.kv_cache import cache_kwargs, growing_cache
from specforge.models.target import use_grouped_sdpa
from tests.helpers import kernel_or_skip, make_tiny_llama

PROMPTS = [[5, 9, 2], [7] * 11, [3, 1, 4, 1, 5, 9, 2, 6], [8, 8], [1] * 20, [4, 4, 4, 4, 4], [6]]


def one_at_a_time(model, prompt, max_new_tokens, eos):
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    "rows_per_span, decode_kernel", [(None, "off"), (1, "off"), (2, "off"), (2, "on")]
)
def test_continuous_batching_equals_one_prompt_at_a_time(
    tiny_tokenizer, rows_per_span, decode_kernel
):
    """Also with the target's grouped attention reading each span of rows' real keys only
    (``rows_per_span``; None: HF's sdpa, which reads every column), and with decode steps
    through the CPU kernel (a target with head size 64, which it takes)."""
    tokenizer = tiny_tokenizer
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if decode_kernel == "on":
        kernel_or_skip()
    model = make_tiny_llama(
        len(tokenizer), hidden=256 if decode_kernel == "on" else 64, eos_token_id=eos_id
    )
    if rows_per_span:
        assert use_grouped_sdpa(model)
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>"), 33]  # 33 also ends (so rows end early)
    settings = GenerationSettings(
        max_new_tokens=12,
        eos_ids=eos,
        pad_id=0,
        max_batch_size=3,
        rows_per_span=rows_per_span or 3,
        decode_kernel=decode_kernel,
    )
    batcher = ContinuousBatcher(model, settings)
    # the first join (the 3 longest prompts) prefills in more than one forward
    assert len(prefill_groups(sorted(map(len, PROMPTS), reverse=True)[:3])) > 1
    pending = [Request(i, p) for i, p in enumerate(PROMPTS)]
    answers = {c.key: (c.tokens, c.stopped) for c in batcher.run(pending)}
    assert sorted(answers) == list(range(len(PROMPTS)))
    for i, prompt in enumerate(PROMPTS):
        reference = one_at_a_time(model, prompt, 12, eos)
        tokens, stopped = answers[i]
        if stopped:
            reference = reference[: reference.index(tokens[-1]) + 1]
        assert tokens == reference, i
        assert stopped == (tokens[-1] in eos)


@pytest.mark.parametrize(
    "lengths", [[89, 80, 70, 60, 50, 40, 35], [350, 60, 55, 50], [9, 9, 9], [1, 1, 100], [7], []]
)
def test_prefill_groups_bound_each_forwards_padding(lengths):
    """Consecutive groups covering every prompt; each pads by at most PREFILL_PADDING of its
    real tokens, and would pad by more with the next prompt."""
    groups = prefill_groups(lengths)
    assert [i for group in groups for i in group] == list(range(len(lengths)))
    for index, group in enumerate(groups):
        window = [lengths[i] for i in group]
        assert max(window) * len(window) <= (1 + PREFILL_PADDING) * sum(window)
        if index + 1 < len(groups):
            window.append(lengths[group.stop])
            assert max(window) * len(window) > (1 + PREFILL_PADDING) * sum(window)
    if lengths[:2] == [350, 60]:  # a follow-up turn carrying a long answer goes alone
        assert groups[0] == range(1)


def test_row_spans_cover_each_rows_real_columns(tiny_target):
    model, _ = tiny_target
    settings = GenerationSettings(max_new_tokens=4, eos_ids=[1], pad_id=0, rows_per_span=2)
    mask = torch.tensor(
        [[0, 0, 1, 1, 1], [0, 0, 0, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1], [0, 1, 1, 1, 1]]
    )
    # rows 0-1 need their last 3 columns, rows 2-3 all 5, row 4 its last 4
    spans = ContinuousBatcher(model, settings).rows._row_spans(mask)
    assert spans == [(0, 2, 3), (2, 4, 5), (4, 5, 4)]


def test_auto_row_spans_are_the_cpus_16_and_one_span_on_a_gpu(tiny_target):
    """``regenerate.rows_per_span: auto``: 16-row spans on a CPU; the whole batch on a GPU,
    where each span costs its own kernel launches."""
    model, _ = tiny_target
    settings = GenerationSettings(max_new_tokens=4, eos_ids=[1], pad_id=0, max_batch_size=256)
    assert ContinuousBatcher(model, settings).rows.rows_per_span == CPU_ROWS_PER_SPAN == 16
    assert default_rows_per_span(torch.device("cuda", 0), 256) == 256
    explicit = GenerationSettings(max_new_tokens=4, eos_ids=[1], pad_id=0, rows_per_span=4)
    assert ContinuousBatcher(model, explicit).rows.rows_per_span == 4
    assert RegenerateConfig().rows_per_span == "auto"


def test_follow_up_requests_join_the_running_batch(tiny_target):
    model, _ = tiny_target
    settings = GenerationSettings(max_new_tokens=6, eos_ids=[], pad_id=0, max_batch_size=2)
    first_prompts = {0: [5, 9, 2], 1: [7, 7]}
    pending = [Request(("first", i), p) for i, p in first_prompts.items()]
    asked, seen = {}, []
    for completion in ContinuousBatcher(model, settings).run(pending):
        turn, i = completion.key
        seen.append(completion.key)
        if turn == "first":  # a second turn built on the answer joins the running batch
            asked[i] = first_prompts[i] + completion.tokens
            assert completion.tokens == one_at_a_time(model, first_prompts[i], 6, [])
            pending.append(Request(("second", i), asked[i]))
        else:
            assert completion.tokens == one_at_a_time(model, asked[i], 6, [])
    assert sorted(seen) == [("first", 0), ("first", 1), ("second", 0), ("second", 1)]


CONVERSATIONS = [
    Conversation(f"c{i}", [{"role": "user", "content": text} for text in turns])
    for i, turns in enumerate(
        [["the cat"], ["hello there", "and then"], ["a much longer question in the end"], ["x"]]
        + [["thin"], ["in the thin end", "more"], ["he"]]
    )
]


def test_continuous_backend_writes_what_the_static_backend_writes(tmp_path, tiny_target):
    model, tokenizer = tiny_target
    outputs = {}
    for backend, batch_size in (("static", 4), ("continuous", 3), ("continuous", 16)):
        cfg = RegenerateConfig(
            enabled=True, backend=backend, max_new_tokens=10, batch_size=batch_size
        )
        out = tmp_path / f"{backend}-{batch_size}.jsonl"
        report = regenerate_conversations(model, tokenizer, CONVERSATIONS, out, cfg)
        outputs[(backend, batch_size)] = read_jsonl(out)
        assert report.turns == 9 and report.written == 7
    reference = outputs[("static", 4)]
    assert [r["id"] for r in reference] == [c.id for c in CONVERSATIONS]  # input order
    for records in outputs.values():
        assert records == reference


def test_generated_ids_are_recorded_as_the_target_produced_them(tmp_path, tiny_target):
    model, tokenizer = tiny_target
    cfg = RegenerateConfig(enabled=True, max_new_tokens=10, batch_size=4)
    out = tmp_path / "out.jsonl"
    report = regenerate_conversations(model, tokenizer, CONVERSATIONS, out, cfg)
    mismatches = 0
    for record in read_jsonl(out):
        answers = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
        meta = record["meta"]
        assert len(meta["token_ids"]) == len(answers) == len(meta["finish_reasons"])
        for ids, text, reason in zip(
            meta["token_ids"], answers, meta["finish_reasons"], strict=True
        ):
            content = ids[:-1] if reason == "stop" else ids
            assert tokenizer.decode(content, skip_special_tokens=True).strip() == text
            mismatches += tokenizer(text, add_special_tokens=False)["input_ids"] != content
    assert report.reencode_mismatch_turns == mismatches
    assert report.generated_tokens == sum(
        len(ids) for r in read_jsonl(out) for ids in r["meta"]["token_ids"]
    )


def test_sampled_answers_do_not_depend_on_the_batch(tmp_path, tiny_target):
    model, tokenizer = tiny_target
    runs = []
    for batch_size in (1, 3):
        cfg = RegenerateConfig(
            enabled=True, max_new_tokens=10, batch_size=batch_size, temperature=1.0, seed=7
        )
        out = tmp_path / f"sampled-{batch_size}.jsonl"
        regenerate_conversations(model, tokenizer, CONVERSATIONS, out, cfg)
        runs.append(read_jsonl(out))
    assert runs[0] == runs[1]
    greedy = tmp_path / "greedy.jsonl"
    regenerate_conversations(
        model, tokenizer, CONVERSATIONS, greedy, RegenerateConfig(enabled=True, max_new_tokens=10)
    )
    assert read_jsonl(greedy) != runs[0]


def test_training_tokens_are_the_recorded_ids(tmp_path, tiny_target):
    """A self-distilled record tokenizes to the prompt as serving renders it followed by the ids
    the target generated, with the loss mask on exactly those (plus the end marker)."""
    from specforge.data.chat import prompt_ids, tokenize_conversations

    model, tokenizer = tiny_target
    cfg = RegenerateConfig(enabled=True, max_new_tokens=10, batch_size=4)
    out = tmp_path / "out.jsonl"
    regenerate_conversations(model, tokenizer, CONVERSATIONS, out, cfg)
    records = read_jsonl(out)
    conversations = [Conversation.from_record(r) for r in records]
    samples, stats = tokenize_conversations(tokenizer, conversations, max_length=4096)
    assert stats.recorded_ids == len(samples) == len(records)
    end_marker = tokenizer("<|im_end|>", add_special_tokens=False)["input_ids"]
    for record, sample in zip(records, samples, strict=True):
        first = record["messages"][:1]
        generated = record["meta"]["token_ids"][0]
        if record["meta"]["finish_reasons"][0] == "length":
            generated = generated + end_marker
        prompt = prompt_ids(tokenizer, first)
        ids = sample.input_ids.tolist()
        assert ids[: len(prompt) + len(generated)] == prompt + generated
        assert not sample.loss_mask[: len(prompt)].any()
        assert sample.loss_mask[len(prompt) : len(prompt) + len(generated)].all()
    # without the recorded ids the same text is re-encoded (and can differ)
    plain, plain_stats = tokenize_conversations(
        tokenizer, [Conversation(c.id, c.messages) for c in conversations], max_length=4096
    )
    assert plain_stats.recorded_ids == 0 and len(plain) == len(samples)


def test_several_sampled_answers_per_conversation_resume_by_id(tmp_path, tiny_target):
    model, tokenizer = tiny_target
    cfg = RegenerateConfig(enabled=True, max_new_tokens=8, temperature=1.0, num_samples=3)
    out = tmp_path / "samples.jsonl"
    regenerate_conversations(model, tokenizer, CONVERSATIONS[:2], out, cfg)
    records = read_jsonl(out)
    assert [r["id"] for r in records] == ["c0#s0", "c0#s1", "c0#s2", "c1#s0", "c1#s1", "c1#s2"]
    answers = {r["messages"][1]["content"] for r in records[:3]}
    assert len(answers) > 1  # different seeds, different answers
    report = regenerate_conversations(model, tokenizer, CONVERSATIONS[:3], out, cfg)
    assert report.already_done == 6 and report.turns == 3  # only c2's three answers are new
    assert read_jsonl(out)[:6] == records


def test_requests_join_by_priority_then_longest_prompt(tiny_target):
    model, _ = tiny_target
    settings = GenerationSettings(max_new_tokens=2, eos_ids=[], pad_id=0, max_batch_size=1)
    pending = [Request("short", [5]), Request("long", [5, 9, 2]), Request("first", [7], priority=1)]
    order = [completion.key for completion in ContinuousBatcher(model, settings).run(pending)]
    assert order == ["first", "long", "short"]


def test_auto_batch_size_fits_the_cache_in_its_share_of_free_memory(tiny_target):
    """``regenerate.batch_size: auto``: rows whose caches, each ``tokens`` long, fill at most
    AUTO_MEMORY_SHARE of the free memory; at least 1, at most AUTO_ROWS on a CPU."""
    model, _ = tiny_target
    tokens = 40
    cache = growing_cache()
    with torch.no_grad():
        model(input_ids=torch.ones(1, tokens, dtype=torch.long), **cache_kwargs(model, cache))
    per_row = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    assert per_row == tokens * kv_bytes_per_token(model)  # what a real cache holds
    room_for_3 = int((3 * per_row + per_row // 2) / AUTO_MEMORY_SHARE)
    assert auto_batch_size(model, tokens, free_bytes=room_for_3) == 3
    assert auto_batch_size(model, tokens, free_bytes=per_row) == 1
    assert auto_batch_size(model, tokens, free_bytes=1 << 50) == AUTO_ROWS["cpu"]


@pytest.mark.parametrize("name", ["mistral_window", "gemma2", "gpt_oss"])
def test_continuous_batching_of_a_windowed_target_equals_one_prompt_at_a_time(
    tiny_tokenizer, name, tmp_path
):
    """Sliding-window targets through the continuous batcher: prompts and answers longer than
    the window, rows joining and leaving, token for token what ``generate`` gives each prompt
    alone (whose cache applies the window itself)."""
    from transformers import AutoModelForCausalLM

    from tests.architectures import WINDOW, save_tiny_target

    folder = save_tiny_target(name, tiny_tokenizer, tmp_path / name)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    use_grouped_sdpa(model)
    eos = [tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")]
    prompts = [
        [3 + (i * 7 + j) % 60 for j in range(length)]
        for i, length in enumerate([WINDOW + 5, 3, WINDOW - 1, 2 * WINDOW, 9])
    ]
    new_tokens = 2 * WINDOW
    settings = GenerationSettings(
        max_new_tokens=new_tokens, eos_ids=eos, pad_id=0, max_batch_size=3, rows_per_span=3
    )
    pending = [Request(i, p) for i, p in enumerate(prompts)]
    answers = {c.key: c.tokens for c in ContinuousBatcher(model, settings).run(pending)}
    for i, prompt in enumerate(prompts):
        assert answers[i] == one_at_a_time(model, prompt, new_tokens, eos), i
    # the window shapes these answers: without it the same weights answer otherwise
    no_window = None if name == "mistral_window" else 4096
    unwindowed = AutoModelForCausalLM.from_pretrained(folder, sliding_window=no_window).eval()
    assert any(
        answers[i] != one_at_a_time(unwindowed, p, new_tokens, eos) for i, p in enumerate(prompts)
    )
