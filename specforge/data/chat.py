"""Chat-template tokenization with a loss mask over assistant tokens.

The loss mask holds exactly the tokens of each assistant message's content plus the token(s)
that end the assistant turn (SmolLM2/ChatML: ``<|im_end|>``; Llama 3: ``<|eot_id|>``). It does
not hold the role header (``<|im_start|>assistant\\n``) nor whitespace the template writes after
the end-of-turn token: the draft never has to predict those at serving time.

How the spans are found, for any template: for assistant message ``i`` the template is rendered
for ``messages[:i]`` with the generation prompt (the text before the answer) and for
``messages[: i + 1]`` (the text through the answer). The answer span is the difference, with
trailing whitespace dropped. Both renders must be prefixes of the full conversation's render; a
template that rewrites earlier turns (e.g. one that strips past reasoning) is reported as an
error instead of producing a wrong mask. Tokens are assigned to spans by their character offsets
in the full render, which is tokenized once exactly as ``apply_chat_template`` would.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specforge.data.conversations import Conversation
from specforge.errors import UserError

logger = logging.getLogger(__name__)


@dataclass
class TokenizedSample:
    """One conversation as training input."""

    id: str
    input_ids: torch.Tensor
    """(T,) int64 token ids of the rendered conversation."""
    loss_mask: torch.Tensor
    """(T,) bool, True on assistant content and end-of-turn tokens."""
    truncated: bool = False
    recorded_ids: bool = False
    """The assistant tokens are the ids the target generated (not the text re-encoded)."""


@dataclass
class TokenizeStats:
    """Counts over a tokenized dataset (printed by ``specforge prepare``)."""

    conversations: int = 0
    samples: int = 0
    tokens: int = 0
    assistant_tokens: int = 0
    truncated: int = 0
    skipped_no_assistant: int = 0
    skipped_control_text: int = 0
    """Conversations whose message text holds a special token's text (``<|im_start|>``...):
    tokenized, it would act as a real control token (a planted turn, a wrong loss mask)."""
    max_tokens: int = 0
    recorded_ids: int = 0
    """Samples whose assistant tokens are the target's recorded ids (self-distilled data)."""
    skipped_ids: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, float | int]:
        return {
            "conversations": self.conversations,
            "samples": self.samples,
            "tokens": self.tokens,
            "assistant_tokens": self.assistant_tokens,
            "mean_tokens": round(self.tokens / max(self.samples, 1), 1),
            "max_tokens": self.max_tokens,
            "truncated": self.truncated,
            "skipped_no_assistant": self.skipped_no_assistant,
            "skipped_control_text": self.skipped_control_text,
            "recorded_ids": self.recorded_ids,
        }


def scored_positions(
    loss_mask: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """(B, T) bool: the positions whose target distribution some TTT step scores against,
    ``p`` with ``loss_mask[p + 1]`` (step ``k`` at ``t`` reads ``t + 1 + k`` and counts where
    the mask holds on ``t + 2 + k``). Capture stores the last hidden state only there."""
    masked = loss_mask.bool()
    if attention_mask is not None:
        masked = masked & attention_mask.bool()
    # (B, T) -> (B, T): out[:, p] = masked[:, p + 1], False at the end
    scored = torch.zeros_like(masked)
    scored[:, :-1] = masked[:, 1:]
    return scored


def end_of_turn_ids(tokenizer, generation_config=None) -> list[int]:
    """The ids that end an assistant turn: the tokenizer's EOS plus the generation config's."""
    ids = set()
    for source in (tokenizer, generation_config):
        eos = getattr(source, "eos_token_id", None)
        if eos is None:
            continue
        ids.update(eos if isinstance(eos, list) else [eos])
    return sorted(int(i) for i in ids)


def control_tokens(tokenizer) -> list[str]:
    """The text of every token a tokenizer treats as special: its named special tokens and
    every added token marked special (SmolLM2 adds 14 beyond the three it names, such as
    ``<file_sep>``), since each of them tokenizes as one control id wherever it appears."""
    added = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
    return sorted({t for t in [*tokenizer.all_special_tokens, *added] if t})


def control_text_in(tokenizer, messages: list[dict[str, str]]) -> str | None:
    """The first special token text (``<|im_start|>``, ``<|eot_id|>``, ``<file_sep>``...) that
    a message's content holds, else ``None`` (:func:`control_tokens`). Content is text; such a
    string would tokenize as a control token, so the conversation is skipped and counted
    instead."""
    specials = control_tokens(tokenizer)
    for message in messages:
        found = next((t for t in specials if t in message["content"]), None)
        if found is not None:
            return found
    return None


def pad_id_of(tokenizer, generation_config=None) -> int:
    """The id every stage pads with: the tokenizer's pad token, else the first id that ends a
    turn, else 0. Padding is masked out everywhere (training, capture, generation), so the
    choice never changes a result; generation only needs a real token id."""
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    end_ids = end_of_turn_ids(tokenizer, generation_config)
    return end_ids[0] if end_ids else 0


def set_chat_template(tokenizer, chat_template: str | None) -> None:
    """Install a user-supplied template (a file path or the template text), or check that the
    tokenizer has one.

    Raises:
        UserError: no template anywhere.
    """
    if chat_template:
        path = Path(chat_template)
        looks_like_path = "{" not in chat_template and len(chat_template) < 4096
        if looks_like_path and path.is_file():
            chat_template = path.read_text(encoding="utf-8")
        elif looks_like_path:
            raise UserError(f"chat template file not found: {chat_template}")
        tokenizer.chat_template = chat_template
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template; "
            "set data.chat_template to a Jinja template (file path or text)"
        )


def with_system_prompt(messages: list[dict[str, str]], system_prompt: str | None):
    """Prepend ``system_prompt`` when given and the conversation has no system message."""
    if system_prompt is None or (messages and messages[0]["role"] == "system"):
        return messages
    return [{"role": "system", "content": system_prompt}, *messages]


def render(tokenizer, messages: list[dict[str, str]], *, add_generation_prompt: bool) -> str:
    """The chat template's text for ``messages``."""
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def prompt_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The token ids of ``messages`` rendered with the generation prompt (what the target
    answers), tokenized as ``apply_chat_template`` does (no extra special tokens)."""
    text = render(tokenizer, messages, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def left_padded(rows: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Token id rows left-padded to one length, for generation: ``input_ids`` (B, T) and
    ``attention_mask`` (B, T), 0 on padding."""
    length = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(len(rows), length, dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            input_ids[i, -len(row) :] = torch.tensor(row, dtype=torch.long)
            attention_mask[i, -len(row) :] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def assistant_char_spans(tokenizer, messages: list[dict[str, str]]) -> tuple[str, list[tuple]]:
    """The full rendered text and the ``[start, end)`` character span of every assistant answer
    (content + end-of-turn marker).

    Raises:
        UserError: the template does not render turns as stable prefixes.
    """
    full = render(tokenizer, messages, add_generation_prompt=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], add_generation_prompt=True)
        through = render(tokenizer, messages[: i + 1], add_generation_prompt=False).rstrip()
        if not (full.startswith(through) and through.startswith(before)):
            raise UserError(
                f"the chat template does not render assistant turn {i} as a prefix of the whole "
                "conversation, so its loss mask cannot be located; supply data.chat_template"
            )
        spans.append((len(before), len(through)))
    return full, spans


def tokenize_conversation(
    tokenizer,
    conversation: Conversation,
    *,
    max_length: int,
    system_prompt: str | None = None,
) -> TokenizedSample:
    """Render one conversation with the chat template and build its loss mask.

    Args:
        tokenizer: a fast (Rust-backed) HF tokenizer with a chat template.
        conversation: the conversation; assistant turns are what the loss covers.
        max_length: longer samples are truncated to this many tokens (``truncated`` is set).
        system_prompt: prepended when the conversation has no system message.

    Returns:
        The sample; its mask may be empty when no assistant token survives.
    """
    messages = with_system_prompt(conversation.messages, system_prompt)
    full, spans = assistant_char_spans(tokenizer, messages)
    spliced = None
    if conversation.token_ids is not None:
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        spliced = spliced_ids(tokenizer, full, spans, answers, conversation.token_ids)
    if spliced is not None:
        input_ids, loss_mask = spliced
    else:
        encoding = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        input_ids = torch.tensor(encoding["input_ids"], dtype=torch.long)
        starts = torch.tensor([start for start, _ in encoding["offset_mapping"]], dtype=torch.long)
        loss_mask = torch.zeros(len(input_ids), dtype=torch.bool)
        for span_start, span_end in spans:
            loss_mask |= (starts >= span_start) & (starts < span_end)
    truncated = len(input_ids) > max_length
    return TokenizedSample(
        id=conversation.id,
        input_ids=input_ids[:max_length],
        loss_mask=loss_mask[:max_length],
        truncated=truncated,
        recorded_ids=spliced is not None,
    )


def spliced_ids(
    tokenizer, full: str, spans: list[tuple[int, int]], answers: list[str], token_ids
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The conversation as serving sees it: the template's text between answers tokenized,
    each answer's span replaced by the ids the target generated (plus the template's
    end-of-turn marker when the answer hit the length limit). ``None`` when the template does
    not write an answer verbatim (then the text is tokenized as a whole)."""
    ids: list[int] = []
    mask: list[bool] = []
    cursor = 0
    for (start, end), text, generated in zip(spans, answers, token_ids, strict=True):
        if not full.startswith(text, start):
            return None
        between = tokenizer(full[cursor:start], add_special_tokens=False)["input_ids"]
        marker = tokenizer(full[start + len(text) : end], add_special_tokens=False)["input_ids"]
        stopped = bool(marker) and generated[-len(marker) :] == marker
        answer = list(generated) if stopped else list(generated) + marker
        ids += between + answer
        mask += [False] * len(between) + [True] * len(answer)
        cursor = end
    tail = tokenizer(full[cursor:], add_special_tokens=False)["input_ids"]
    ids += tail
    mask += [False] * len(tail)
    return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool)


def tokenize_conversations(
    tokenizer,
    conversations: Iterable[Conversation],
    *,
    max_length: int,
    system_prompt: str | None = None,
) -> tuple[list[TokenizedSample], TokenizeStats]:
    """Tokenize many conversations, dropping (and counting) those with no assistant token left.

    Truncations are counted and logged, never silent.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise UserError("loss masks need a fast tokenizer (character offsets); got a slow one")
    stats = TokenizeStats()
    samples = []
    for conversation in conversations:
        stats.conversations += 1
        if control_text_in(tokenizer, conversation.messages):
            stats.skipped_control_text += 1
            stats.skipped_ids.append(conversation.id)
            continue
        sample = tokenize_conversation(
            tokenizer, conversation, max_length=max_length, system_prompt=system_prompt
        )
        stats.truncated += sample.truncated
        stats.recorded_ids += sample.recorded_ids
        if not sample.loss_mask.any():
            stats.skipped_no_assistant += 1
            stats.skipped_ids.append(sample.id)
            continue
        samples.append(sample)
        stats.samples += 1
        stats.tokens += len(sample.input_ids)
        stats.assistant_tokens += int(sample.loss_mask.sum())
        stats.max_tokens = max(stats.max_tokens, len(sample.input_ids))
    if stats.truncated:
        logger.warning("%d samples were truncated to max_length=%d", stats.truncated, max_length)
    if stats.skipped_control_text:
        logger.warning(
            "%d conversations hold special-token text in a message and were skipped",
            stats.skipped_control_text,
        )
    if stats.skipped_no_assistant:
        logger.warning(
            "%d conversations had no assistant token (within max_length) and were skipped; "
            "first: %s",
            stats.skipped_no_assistant,
            ", ".join(stats.skipped_ids[:5]),
        )
    return samples, stats
