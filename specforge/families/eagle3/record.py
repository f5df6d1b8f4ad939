"""The EAGLE-3 family's record (:data:`FAMILY`): the one place that binds its pieces as a
family (the package docstring says where they live); other families extend it."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from specforge.config.resolve import torch_dtype
from specforge.engine.cpu.int8_linear import quantize_linears
from specforge.engine.cpu.packed_linear import prepack_linears
from specforge.families.base import Capabilities, DraftFamily, EngineMethods, draft_vocabulary
from specforge.io import read_json
from specforge.models.adapter import config_value, text_config
from specforge.models.compiling import inductor_options
from specforge.models.eagle3 import (
    Eagle3Config,
    Eagle3DraftModel,
    build_draft_model,
    init_from_target_layer,
)
from specforge.serving.export import (
    ARCHITECTURE,
    check_export_config,
    check_export_tensors,
    engine_defaults,
    exported_aux_layer_ids,
    load_exported_draft,
    write_export,
)
from specforge.serving.proposers.eagle import EagleProposer
from specforge.trainer.metrics import ttt_metrics
from specforge.trainer.ttt import TTTObjective

logger = logging.getLogger(__name__)


def new_draft(cfg, config, head, vocab_map, model_class) -> Eagle3DraftModel:
    """A ``model_class`` draft filled from the target: its embedding, ``lm_head`` rows (the
    logit transform's scale folded in) and final norm, its last layer where
    ``train.init_from_target`` asks; the head frozen with ``train.freeze_lm_head``."""
    draft = build_draft_model(
        config,
        target_embedding=head.embed_tokens.float().cpu(),
        target_lm_head=head.lm_head.float().cpu() * head.transform.scale,
        d2t=vocab_map.d2t,
        t2d=vocab_map.t2d,
        target_norm=head.norm.float().cpu(),
        seed=cfg.train.seed,
        model_class=model_class,
    )
    if cfg.train.init_from_target:
        copied = init_from_target_layer(
            draft,
            {name: w.float().cpu() for name, w in head.last_layer.items()},
            target_act=config_value(head.config, "hidden_act", "hidden_activation", "activation"),
        )
        logger.info("initialised from the target's last layer: %s", ", ".join(copied))
    draft.lm_head.weight.requires_grad_(not cfg.train.freeze_lm_head)
    return draft


def compile_ttt_step(draft: Eagle3DraftModel) -> None:
    """Run ``draft``'s TTT step through ``torch.compile`` (``train.compile``): one graph per
    unrolled step (each reads one more step's keys), lengths and rows dynamic; the weights,
    their gradients and the checkpoints are the module's own."""
    device = next(draft.parameters()).device
    draft.ttt_step = torch.compile(draft.ttt_step, dynamic=True, options=inductor_options(device))


def build(cfg, source, samples, device, *, model_class=Eagle3DraftModel, extra_config=None):
    """A new draft over the vocabulary map of ``samples`` (returned too), initialised from the
    target; a family that extends EAGLE-3 passes its ``model_class`` and the values its config
    adds (``extra_config``)."""
    vocab_map = draft_vocabulary(cfg, source, samples)
    config = model_class.config_class.from_target(
        source.head.config,
        draft_vocab_size=vocab_map.draft_vocab_size,
        **cfg.draft.switches,
        **(extra_config or {}),
    )
    draft = new_draft(cfg, config, source.head, vocab_map, model_class).to(device)
    if cfg.train.compile == "true":
        compile_ttt_step(draft)
    return draft, config, vocab_map


def objective(cfg, draft) -> TTTObjective:
    tc = cfg.train
    return TTTObjective(
        draft,
        tc.ttt_length,
        tc.step_weight,
        tc.loss,
        tc.target_temperature,
        replay_depth=tc.on_policy.depth,
        replay=tc.on_policy.replay,
    )


def recognizes(exported: dict) -> bool:
    return exported.get("architectures") == [ARCHITECTURE]


def load_export(export_dir, *, target, dtype, quantize="none", prepack=False, loader=None):
    """The exported draft on the target's device, sharing its input embedding; its linear
    layers int8 for ``quantize`` ``int8``, else prepacked with ``prepack`` (its steps are
    one-row calls, like the target's decoding)."""
    draft = (loader or load_exported_draft)(
        export_dir,
        target_config=target.config,
        target_embedding=target.get_input_embeddings().weight.detach().float(),
        dtype=torch_dtype(dtype),
    ).to(target.device)
    if quantize == "int8":
        quantize_linears(draft)
    elif prepack:
        prepack_linears(draft)
    return draft


def load_trainable(export_dir, head, *, loader=None):
    """An export as a draft to train further (``train.from_pretrained``): float32 on the CPU,
    in training mode, checked against the target (``head``: its config and embedding, which
    the draft shares frozen)."""
    draft = (loader or load_exported_draft)(
        export_dir,
        target_config=head.config,
        target_embedding=head.embed_tokens.detach().float().cpu(),
        dtype=torch.float32,
    )
    return draft.train(), draft.config


def exported_config(exported: dict, where: str, config_class=Eagle3Config) -> Eagle3Config:
    """The draft config an export's ``config.json`` describes."""
    fields = {f.name for f in dataclasses.fields(config_class)}
    values = engine_defaults(exported)
    return config_class.from_dict({k: v for k, v in values.items() if k in fields}, where)


def export_checks(export_dir: Path, exported: dict, tensors: dict, target_config, *, extra=None):
    """EAGLE-3's contract, check by check; ``extra``: a family's further tensors (name ->
    shape) beside the contract's."""
    layers = target_config.num_hidden_layers

    def weights() -> None:
        config = exported_config(exported, str(export_dir / "config.json"))
        dtype = tensors["fc.weight"].dtype if "fc.weight" in tensors else torch.bfloat16
        check_export_tensors(tensors, config, dtype, extra=extra)

    def aux_layers() -> None:
        ids = exported_aux_layer_ids(export_dir, layers)
        if not all(0 <= i < layers for i in ids):
            raise ValueError(f"aux layer ids {ids} are outside the target's {layers} layers")

    return [
        (
            "config.json against the target (architecture, one layer, tying, vocabulary, "
            "hidden size, positions, activation, RoPE)",
            lambda: check_export_config(exported, target_config),
        ),
        (
            "weights: names, shapes, dtypes, finite values, the EAGLE 3.1 norms the config "
            "asks for; d2t as offsets (arange + d2t injective, in range) and t2d consistent",
            weights,
        ),
        (f"aux layer ids within the target's {layers} layers", aux_layers),
    ]


def export_draft_config(export_dir: Path) -> Eagle3Config:
    path = Path(export_dir) / "config.json"
    return exported_config(read_json(path), str(path))


FAMILY = DraftFamily(
    name="eagle3",
    summary="EAGLE-3 (and 3.1): one layer over three fused target layers, chains and trees "
    "drafted step by step, trained with training-time test",
    offline=True,
    options=(
        "draft.variant",
        "train.ttt_length",
        "train.step_weight",
        "train.init_from_target",
        "train.freeze_lm_head",
        "vocab.draft_vocab_size",
        "train.loss",
        "train.target_temperature",
        "train.on_policy.steps",
        "train.from_pretrained",
        "train.rebuild_vocab",
    ),
    build=build,
    objective=objective,
    vocabulary=lambda cfg, draft, config, device: draft,
    metrics=ttt_metrics,
    new_model=lambda values, where: Eagle3DraftModel(Eagle3Config.from_dict(values, where)),
    write_export=write_export,
    recognizes=recognizes,
    load_export=load_export,
    load_trainable=load_trainable,
    export_checks=export_checks,
    aux_layer_ids=lambda export_dir, target: exported_aux_layer_ids(
        export_dir, text_config(target).num_hidden_layers
    ),
    draft_config=export_draft_config,
    proposer=EagleProposer,
    capabilities=Capabilities(
        auto_depth=True,
        trees=True,
        graphs=True,
        max_depth=lambda config: None,
        default_depth=lambda config: None,
    ),
    engines=EngineMethods(vllm={"method": "eagle3"}, sglang="EAGLE3"),
)
