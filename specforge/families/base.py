"""What the rest of the package asks of a draft family, in one record: a family is a folder
(``specforge/families/<name>/``: model, objective, proposer, exporter) whose ``__init__`` builds
one :class:`DraftFamily`, and a line of :data:`specforge.families.REGISTRY`.

Recipes, checkpoints, exports and benches dispatch on the record; none of them branches on a
family's name or class. The family is recorded once in a checkpoint (``trainer_state.json``'s
``draft_type``) and found again in an export by :attr:`DraftFamily.recognizes` (its
``config.json``, as the engines read it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specforge.data.chat import end_of_turn_ids
from specforge.data.vocab import vocab_map_from_samples
from specforge.errors import UserError


@dataclass(frozen=True)
class Capabilities:
    """What a family's proposer can do, which the runtime and the bench ask before a round."""

    auto_depth: bool
    """It drafts step by step, so ``num_steps: auto`` may stop a chain at any token."""
    trees: bool
    """It drafts trees (``topk > 1``)."""
    graphs: bool
    """Its draft forwards may be captured as CUDA graphs (a :class:`DraftEngine`)."""
    max_depth: Callable[[Any], int | None]
    """The deepest chain a round may draft for a draft config (``None``: no bound)."""
    default_depth: Callable[[Any], int | None]
    """The depth the bench and the engine check use where ``num_steps`` is ``auto`` and the
    family has no ``auto`` (``None``: the family has ``auto``)."""

    @classmethod
    def one_forward(cls, depth: Callable[[Any], int]) -> Capabilities:
        """A family that drafts a round's chain in one forward: at most ``depth(config)``
        tokens (its depth under ``auto`` too), no ``auto``, no trees, no draft graphs."""
        return cls(
            auto_depth=False, trees=False, graphs=False, max_depth=depth, default_depth=depth
        )


@dataclass(frozen=True)
class EngineMethods:
    """How the serving engines name the family."""

    vllm: dict[str, Any] | None
    """vLLM's ``--speculative-config`` entries besides the model and depth (``None``: vLLM
    does not serve it)."""
    sglang: str | None
    """SGLang's ``--speculative-algorithm`` (``None``: SGLang does not serve it)."""


@dataclass(frozen=True)
class DraftFamily:
    """One draft family: every question the package asks of it (see the module docstring).

    Callables take the recipe's objects as arguments; their signatures are the family's
    contract with the recipes (``cfg`` a :class:`~specforge.config.SpecForgeConfig`).
    """

    name: str
    """``draft.type``."""
    summary: str
    """One line for ``--help`` and the docs."""
    offline: bool
    """It trains from a capture on disk (``data.mode: offline``)."""
    options: tuple[str, ...]
    """The ``draft.*`` / ``train.*`` keys it reads beyond every family's; a key of another
    family's is refused at config load (:func:`specforge.families.dispatch.check_options`)."""
    build: Callable[..., tuple[Any, Any, Any]]
    """``build(cfg, source, samples, device) -> (draft, draft_config, vocab_map or None)``:
    a new draft initialised from the target (``source.head``); it may set
    ``source.aux_layer_ids`` to the target layers it reads."""
    objective: Callable[..., Any]
    """``objective(cfg, draft) -> nn.Module``: the draft and its loss, called on
    ``(batch, aux_hidden_states, target_dist)``."""
    vocabulary: Callable[..., Any]
    """``vocabulary(cfg, draft, draft_config, device)``: what the hidden-state source reads of
    the draft's vocabulary (``hot_ids``, ``t2d``)."""
    metrics: Callable[[list], dict[str, float]]
    """Loss, per-position accuracy and ``tau_pred`` over several steps' results."""
    new_model: Callable[[dict[str, Any], str], Any]
    """``new_model(saved_config_values, where)``: an empty draft of a saved geometry (a
    checkpoint's ``draft_config.json``), its weights loaded by the caller."""
    write_export: Callable[..., Path]
    """``write_export(out_dir, *, model, target_config, aux_layer_ids, dtype, tokenizer,
    advice)``: the directory the engines load, checked first."""
    recognizes: Callable[[dict[str, Any]], bool]
    """Whether an export's ``config.json`` is this family's."""
    load_export: Callable[..., Any]
    """``load_export(export_dir, *, target, dtype)``: the exported draft the built-in runtime
    serves, checked against the contract, sharing the target's tensors."""
    export_checks: Callable[..., list[tuple[str, Callable[[], None]]]]
    """``export_checks(export_dir, exported_config, tensors, target_config)``: the contract,
    check by check ``(what, check)``; a check raises a UserError or ValueError naming the
    problem."""
    aux_layer_ids: Callable[[Path, Any], list[int]]
    """``aux_layer_ids(export_dir, target_text_config)``: the target layers the export reads."""
    draft_config: Callable[[Path], Any]
    """``draft_config(export_dir)``: the export's draft config (its depth bounds)."""
    proposer: Callable[..., Any]
    """``proposer(draft_model, drafting, *, engine, draft_engine)``: a proposer for the
    runtime (:mod:`specforge.serving.proposers`) under its settings
    (:class:`~specforge.serving.drafting.Drafting`), or a UserError naming the setting the
    family cannot run."""
    capabilities: Capabilities
    engines: EngineMethods
    load_trainable: Callable[..., tuple[Any, Any]] | None = None
    """``load_trainable(export_dir, head) -> (draft, draft_config)``: an export of this family
    as a draft to train further (``train.from_pretrained``), float32 on the CPU, checked
    against the target (``head``: :class:`~specforge.models.target.TargetHead`); ``None``:
    the family cannot start from an export."""
    extends: str | None = None
    """The family whose export layout this one's extends (its exports are recognised first)."""


def check_one_forward(what: str, deepest: int, drafting) -> None:
    """Refuse ``drafting`` settings (:class:`~specforge.serving.drafting.Drafting`) a
    one-forward proposer cannot run (:meth:`Capabilities.one_forward`): ``what`` says what the
    draft proposes a round.

    Raises:
        UserError: ``auto``, a tree, or a chain deeper than ``deepest``.
    """
    if drafting.auto or drafting.topk != 1 or drafting.num_steps > deepest:
        raise UserError(
            f"{what}: num_steps 1..{deepest} and topk 1 (got num_steps {drafting.num_steps}, "
            f"topk {drafting.topk})"
        )


def draft_vocabulary(cfg, source, samples):
    """The vocabulary map of ``samples``' assistant tokens (``vocab.draft_vocab_size`` ids):
    what a new draft, or one given a new map (``train.rebuild_vocab``), drafts over."""
    vocab_map, _ = vocab_map_from_samples(
        samples,
        vocab_size=source.head.config.vocab_size,
        draft_vocab_size=cfg.vocab.draft_vocab_size,
        end_of_turn=end_of_turn_ids(source.tokenizer, source.generation_config),
    )
    return vocab_map
