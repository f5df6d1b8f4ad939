"""The P-EAGLE family's record (:data:`FAMILY`): EAGLE-3's, with the mask inputs (the package
docstring says what it adds)."""

from __future__ import annotations

import dataclasses
from functools import partial
from pathlib import Path

from specforge.data.vocab import mask_token_for
from specforge.families.base import Capabilities, EngineMethods, check_one_forward
from specforge.families.eagle3 import record as eagle3
from specforge.families.peagle.model import PEagleConfig, PEagleDraftModel
from specforge.families.peagle.proposer import PEagleProposer
from specforge.io import read_json
from specforge.models.eagle3 import AUX_STATES
from specforge.serving.export import load_exported_draft, write_export

MASK_HIDDEN = "mask_hidden"
"""The export's tensor vLLM loads into its parallel-drafting buffer."""


def mask_tensors(config: PEagleConfig) -> dict[str, tuple[int, ...]]:
    """What the export holds beside EAGLE-3's contract: ``mask_hidden`` (1, 3 * Ht)."""
    return {MASK_HIDDEN: (1, AUX_STATES * config.target_hidden_size)}


def build(cfg, source, samples, device):
    """EAGLE-3's draft and vocabulary map, with the mask token chosen
    (:func:`~specforge.data.vocab.mask_token_for`) and the depth ``train.ttt_length``."""
    mask = mask_token_for(cfg.draft.mask_token_id, source.tokenizer, samples, source.head.config)
    return eagle3.build(
        cfg,
        source,
        samples,
        device,
        model_class=PEagleDraftModel,
        extra_config={"mask_token_id": mask, "parallel_draft_tokens": cfg.train.ttt_length},
    )


def recognizes(exported: dict) -> bool:
    return eagle3.recognizes(exported) and exported.get("parallel_drafting") is True


def export_config(exported: dict, where: str) -> PEagleConfig:
    return eagle3.exported_config(exported, where, PEagleConfig)


def write_peagle_export(out_dir, *, model, target_config, aux_layer_ids, dtype, tokenizer, advice):
    """EAGLE-3's export with the mask inputs (module docstring); SGLang's depth advice is for
    step-by-step chains, so none is written."""
    config = model.config
    return write_export(
        out_dir,
        model=model,
        target_config=target_config,
        aux_layer_ids=aux_layer_ids,
        dtype=dtype,
        tokenizer=tokenizer,
        extra_config={
            "parallel_drafting": True,
            "mask_token_id": config.mask_token_id,
            "parallel_draft_tokens": config.parallel_draft_tokens,
        },
        extra_tensors=(MASK_HIDDEN,),
    )


def export_checks(export_dir: Path, exported: dict, tensors: dict, target_config):
    where = str(Path(export_dir) / "config.json")

    def mask_settings() -> None:
        export_config(exported, where)  # mask_token_id in range, a depth >= 1

    extra = {MASK_HIDDEN: (1, AUX_STATES * target_config.hidden_size)}
    checks = eagle3.export_checks(export_dir, exported, tensors, target_config, extra=extra)
    return [
        *checks,
        ("mask_token_id within the vocabulary, parallel_draft_tokens >= 1", mask_settings),
    ]


def proposer(draft_model, drafting, *, engine, draft_engine):
    """A chain in one forward, at most ``parallel_draft_tokens`` deep (the depth it was
    trained to), at a fixed depth."""
    deepest = FAMILY.capabilities.max_depth(draft_model.config)
    what = "a P-EAGLE draft proposes a chain in one forward, as deep as it was trained to"
    check_one_forward(what, deepest, drafting)
    return PEagleProposer(draft_model, drafting)


def export_draft_config(export_dir: Path) -> PEagleConfig:
    path = Path(export_dir) / "config.json"
    return export_config(read_json(path), str(path))


FAMILY = dataclasses.replace(
    eagle3.FAMILY,
    name="peagle",
    summary="P-EAGLE: an EAGLE-3 draft that drafts a chain in one forward from a mask token "
    "and a learned mask hidden state (vLLM's parallel drafting)",
    options=(*eagle3.FAMILY.options, "draft.mask_token_id"),
    build=build,
    new_model=lambda values, where: PEagleDraftModel(PEagleConfig.from_dict(values, where)),
    write_export=write_peagle_export,
    recognizes=recognizes,
    load_export=partial(
        eagle3.load_export,
        loader=partial(load_exported_draft, model_class=PEagleDraftModel, extra=mask_tensors),
    ),
    load_trainable=partial(
        eagle3.load_trainable,
        loader=partial(load_exported_draft, model_class=PEagleDraftModel, extra=mask_tensors),
    ),
    export_checks=export_checks,
    draft_config=export_draft_config,
    proposer=proposer,
    capabilities=Capabilities.one_forward(lambda config: config.parallel_draft_tokens),
    engines=EngineMethods(vllm={"method": "eagle3", "parallel_drafting": True}, sglang=None),
    extends="eagle3",
)
