"""The DFlash family's record (:data:`FAMILY`): what the registry's callers ask of a block draft,
answered from this folder; its config section is :mod:`.options`."""

from __future__ import annotations

import logging
from pathlib import Path

from specforge.config.resolve import torch_dtype
from specforge.data.vocab import mask_token_for
from specforge.errors import UserError
from specforge.families.base import (
    Capabilities,
    DraftFamily,
    EngineMethods,
    check_one_forward,
)
from specforge.families.dflash.export import (
    ARCHITECTURE,
    check_dflash_config,
    dflash_contract,
    draft_config_of,
    load_exported_dflash,
    write_dflash_export,
)
from specforge.families.dflash.model import (
    DFlashConfig,
    DFlashDraftModel,
    build_dflash_model,
    default_target_layer_ids,
)
from specforge.families.dflash.objective import BlockVocabulary, DFlashObjective, block_metrics
from specforge.families.dflash.proposer import DFlashProposer
from specforge.io import read_json
from specforge.models.adapter import logit_transform
from specforge.serving.export import contract_problems

logger = logging.getLogger(__name__)


def build(cfg, source, samples, device):
    """A DFlash draft from the target and ``draft.*``: the target's embedding and ``lm_head``
    (frozen, the logit transform's scale on the head), its norm from the target's final norm,
    the rest seeded; the source then captures the layers it reads. No vocabulary map."""
    head = source.head
    layers = head.config.num_hidden_layers
    count = min(cfg.draft.dflash.target_layers, max(layers - 3, 1))
    if count < cfg.draft.dflash.target_layers:
        logger.warning(
            "draft.dflash.target_layers %d: the target has %d layers, so the draft reads %d "
            "(layers 1 .. L - 3)",
            cfg.draft.dflash.target_layers,
            layers,
            count,
        )
    config = DFlashConfig.from_target(
        head.config,
        mask_token_id=mask_token_for(
            cfg.draft.mask_token_id, source.tokenizer, samples, head.config
        ),
        num_hidden_layers=cfg.draft.dflash.draft_layers,
        block_size=cfg.draft.dflash.block_size,
        target_layer_ids=default_target_layer_ids(layers, count=count),
    )
    source.aux_layer_ids = list(config.target_layer_ids)
    draft = build_dflash_model(
        config,
        target_embedding=head.embed_tokens.float().cpu(),
        target_lm_head=head.lm_head.float().cpu() * head.transform.scale,
        target_norm=head.norm.float().cpu(),
        seed=cfg.train.seed,
    )
    return draft.to(device), config, None


def objective(cfg, draft) -> DFlashObjective:
    return DFlashObjective(
        draft,
        anchors=cfg.draft.dflash.anchors,
        block_decay=cfg.draft.dflash.block_decay,
        labels=cfg.draft.dflash.block_labels,
    )


def vocabulary(cfg, draft, config: DFlashConfig, device) -> BlockVocabulary:
    return BlockVocabulary.of(config.vocab_size, device, cfg.draft.dflash.block_labels)


def recognizes(exported: dict) -> bool:
    return exported.get("architectures") == [ARCHITECTURE]


def load_export(export_dir, *, target, dtype, quantize="none", prepack=False):
    """The exported block draft on the target's device, with the target's embedding and
    ``lm_head`` (its logit transform's scale folded into the head, as in training). Its
    layers run a whole block per forward, so the one-row drafting step's int8 weights and
    prepacking (``quantize``, ``prepack``) are not applied."""
    scale = logit_transform(target.config).scale
    return load_exported_dflash(
        export_dir,
        target_config=target.config,
        target_embedding=target.get_input_embeddings().weight.detach().float(),
        target_lm_head=target.get_output_embeddings().weight.detach().float() * scale,
        dtype=torch_dtype(dtype),
    ).to(target.device)


def export_checks(export_dir: Path, exported: dict, tensors: dict, target_config):
    def weights() -> None:
        config = draft_config_of(exported, "config.json")
        dtype = tensors["fc.weight"].dtype if "fc.weight" in tensors else None
        expected = {name: (shape, dtype) for name, shape in dflash_contract(config).items()}
        problems = contract_problems(tensors, expected)
        if problems:
            raise UserError("; ".join(problems))

    return [
        (
            "config.json against the target (architecture, tying, vocabulary, hidden size, "
            "positions, activation, target layers, RoPE)",
            lambda: check_dflash_config(exported, target_config),
        ),
        ("weights: names, shapes, dtypes, finite values", weights),
    ]


def write_export(out_dir, *, model, target_config, aux_layer_ids, dtype, tokenizer, advice=None):
    """The export directory (the layers read are the draft's own ``target_layer_ids``; SGLang's
    depth advice is EAGLE's, not written for a block draft)."""
    return write_dflash_export(
        out_dir, model=model, target_config=target_config, dtype=dtype, tokenizer=tokenizer
    )


def proposer(draft_model, drafting, *, engine, draft_engine):
    """A block a round: a chain of at most ``block_size - 1`` tokens at a fixed depth."""
    deepest = FAMILY.capabilities.max_depth(draft_model.config)
    check_one_forward("a DFlash draft proposes one block a round", deepest, drafting)
    return DFlashProposer(draft_model, drafting)


def export_draft_config(export_dir: Path) -> DFlashConfig:
    return draft_config_of(read_json(Path(export_dir) / "config.json"), str(export_dir))


FAMILY = DraftFamily(
    name="dflash",
    summary="DFlash block draft: target layers as keys and values, a block predicted in one "
    "forward, trained online",
    offline=False,
    options=("draft.dflash", "draft.mask_token_id"),
    build=build,
    objective=objective,
    vocabulary=vocabulary,
    metrics=block_metrics,
    new_model=lambda values, where: DFlashDraftModel(DFlashConfig.from_dict(values, where)),
    write_export=write_export,
    recognizes=recognizes,
    load_export=load_export,
    export_checks=export_checks,
    aux_layer_ids=lambda export_dir, target: list(export_draft_config(export_dir).target_layer_ids),
    draft_config=export_draft_config,
    proposer=proposer,
    capabilities=Capabilities.one_forward(lambda config: config.block_size - 1),
    engines=EngineMethods(vllm={"method": "dflash"}, sglang="DFLASH"),
)
