"""Export a trained draft as the directory SGLang (``--speculative-algorithm EAGLE3
--speculative-draft-model-path DIR``) and vLLM load (docs/design.md §3.5), checked strictly first.

Both engines are lenient in dangerous ways: SGLang silently drops weight names it does not know
and leaves missing parameters uninitialized; a ``tie_word_embeddings: true`` makes it use the
(full-vocabulary) embedding as ``lm_head``; a ``max_position_embeddings`` below the target's
truncates serving. So every export is checked against :data:`EXPORT_CONTRACT` and
:func:`check_export_config` before anything is written, and written atomically (temp folder +
rename). The directory holds:

- ``config.json``: ``LlamaForCausalLMEagle3``, one layer, the target's geometry, RoPE,
  ``max_position_embeddings`` and ``vocab_size``, ``draft_vocab_size``, ``target_hidden_size``;
  RoPE is written both as ``rope_theta``/``rope_scaling`` (what transformers 4.x-based engines
  read) and as ``rope_parameters`` (transformers 5); non-default aux layers in both engines'
  conventions (SGLang ``eagle_config.eagle_aux_hidden_state_layer_ids`` = layer ids, vLLM
  top-level ``eagle_aux_hidden_state_layer_ids`` = HF ``hidden_states`` indices = ids + 1);
- ``model.safetensors``: exactly the contract's names (no ``model.`` prefix);
- ``freq_<K>.pt``: the hot target ids (1-D int64), for SGLang's EAGLE-2 / FR-Spec token map;
- the target's tokenizer files, for convenience;
- ``specforge-export.json``: what wrote the directory and the files it holds. An existing
  directory is replaced only when it is a previous export (this file lists everything in it)
  or empty, and only after the new export is complete; anything else is refused, never deleted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from specforge import __version__
from specforge.config.resolve import torch_dtype
from specforge.data.vocab import VocabMap
from specforge.errors import UserError
from specforge.io import (
    atomic_directory,
    read_json,
    read_safetensors,
    write_json_atomic,
    write_text_atomic,
)
from specforge.models.adapter import draft_rope_parameters, text_config
from specforge.models.eagle3 import (
    AUX_STATES,
    FROZEN_WEIGHTS,
    Eagle3Config,
    Eagle3DraftModel,
    load_draft_weights,
)
from specforge.models.target import default_aux_layer_ids
from specforge.serving.advice import advice_markdown

logger = logging.getLogger(__name__)

ARCHITECTURE = "LlamaForCausalLMEagle3"
"""What ``config.json``'s ``architectures`` names for both engines."""

MARKER = "specforge-export.json"
"""Written into every export: the files it holds, so a later export may replace them."""


class ExportError(UserError):
    """An export that breaks the contract; the message lists every problem found."""


@dataclass(frozen=True)
class TensorSpec:
    """One row of the export contract."""

    name: str
    shape: Callable[[Eagle3Config], tuple[int, ...]]
    kind: str
    """``float`` (the export dtype), ``int64`` or ``bool``."""
    when: Callable[[Eagle3Config], bool] = lambda c: True


def _attention_width(c: Eagle3Config) -> int:
    return c.num_attention_heads * c.head_dim


def _kv_width(c: Eagle3Config) -> int:
    return c.num_key_value_heads * c.head_dim


def _reduced(c: Eagle3Config) -> bool:
    return c.draft_vocab_size < c.vocab_size


def _fc_norm(c: Eagle3Config) -> bool:
    return c.fc_norm


EXPORT_CONTRACT: tuple[TensorSpec, ...] = (
    *(
        TensorSpec(f"fc_norm.{i}.weight", lambda c: (c.target_hidden_size,), "float", _fc_norm)
        for i in range(AUX_STATES)
    ),
    TensorSpec("fc.weight", lambda c: (c.hidden_size, 3 * c.target_hidden_size), "float"),
    TensorSpec("midlayer.input_layernorm.weight", lambda c: (c.hidden_size,), "float"),
    TensorSpec("midlayer.hidden_norm.weight", lambda c: (c.hidden_size,), "float"),
    TensorSpec("midlayer.post_attention_layernorm.weight", lambda c: (c.hidden_size,), "float"),
    TensorSpec(
        "midlayer.self_attn.q_proj.weight",
        lambda c: (_attention_width(c), 2 * c.hidden_size),
        "float",
    ),
    TensorSpec(
        "midlayer.self_attn.k_proj.weight", lambda c: (_kv_width(c), 2 * c.hidden_size), "float"
    ),
    TensorSpec(
        "midlayer.self_attn.v_proj.weight", lambda c: (_kv_width(c), 2 * c.hidden_size), "float"
    ),
    TensorSpec(
        "midlayer.self_attn.o_proj.weight", lambda c: (c.hidden_size, _attention_width(c)), "float"
    ),
    TensorSpec(
        "midlayer.mlp.gate_proj.weight", lambda c: (c.intermediate_size, c.hidden_size), "float"
    ),
    TensorSpec(
        "midlayer.mlp.up_proj.weight", lambda c: (c.intermediate_size, c.hidden_size), "float"
    ),
    TensorSpec(
        "midlayer.mlp.down_proj.weight", lambda c: (c.hidden_size, c.intermediate_size), "float"
    ),
    TensorSpec("norm.weight", lambda c: (c.hidden_size,), "float"),
    TensorSpec("lm_head.weight", lambda c: (c.draft_vocab_size, c.hidden_size), "float"),
    TensorSpec("d2t", lambda c: (c.draft_vocab_size,), "int64", _reduced),
    TensorSpec("t2d", lambda c: (c.vocab_size,), "bool", _reduced),
    TensorSpec(
        "embed_tokens.weight",
        lambda c: (c.vocab_size, c.hidden_size),
        "float",
        lambda c: c.hidden_size != c.target_hidden_size,
    ),
)
"""Names, shape formulas, dtypes and presence conditions of ``model.safetensors``.
``embed_tokens.weight`` is written only when the draft's width differs from the target's;
otherwise the engines share the target's embedding, which the draft's frozen copy equals."""

KIND_DTYPES = {"int64": torch.int64, "bool": torch.bool}

OPTIONAL_TENSORS = {"embed_tokens.weight": lambda c: (c.vocab_size, c.hidden_size)}
"""Tensors other exporters write where this one need not (SpecForge's ``--to hf`` ships the
draft's frozen embedding): accepted at their shape, and loaded as the draft's own, as SGLang
and vLLM load them."""


def engine_defaults(exported: dict[str, Any]) -> dict[str, Any]:
    """``config.json`` as the engines read it, in SGLang's layout: speculators' layout
    (``speculators_model_type: eagle3``) flattened onto it (:func:`from_speculators`), and
    ``target_hidden_size`` is ``hidden_size`` where it is left out (SpecForge's and
    speculators' exports leave it out when they are equal)."""
    if exported.get("speculators_model_type") == "eagle3":
        exported = from_speculators(exported)
    if exported.get("target_hidden_size") is not None or "hidden_size" not in exported:
        return exported
    return {**exported, "target_hidden_size": exported["hidden_size"]}


SPECULATORS_REFUSED = ("norm_before_residual", "norm_before_fc")
"""speculators' EAGLE-3 options with no equivalent in SGLang's layer (nor in this draft)."""


def from_speculators(exported: dict[str, Any]) -> dict[str, Any]:
    """A speculators EAGLE-3 ``config.json`` (the layer's settings under
    ``transformer_layer_config``, the aux layers as ``eagle_aux_hidden_state_layer_ids``) in
    SGLang's layout, which vLLM reads too.

    Raises:
        ExportError: an option SGLang's EAGLE-3 layer does not have, named.
    """
    refused = [key for key in SPECULATORS_REFUSED if exported.get(key)]
    if refused:
        raise ExportError(f"speculators' {', '.join(refused)}: true has no equivalent here")
    own = ("transformer_layer_config", "speculators_config", "architectures", "auto_map")
    flat = {
        **(exported.get("transformer_layer_config") or {}),
        **{k: v for k, v in exported.items() if k not in own and v is not None},
        "architectures": [ARCHITECTURE],
    }
    if ids := exported.get("eagle_aux_hidden_state_layer_ids"):
        flat["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(ids)}
    for switch in EAGLE31_SWITCHES:  # written only when set, as this project writes them
        if not flat.get(switch):
            flat.pop(switch, None)
    if "rope_parameters" in flat and "rope_theta" not in flat:
        flat["rope_theta"], flat["rope_scaling"] = _rope_legacy(flat["rope_parameters"])
    return flat


def engine_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``model.safetensors`` under SGLang's names: speculators' one layer (``layers.0.``) is
    SGLang's ``midlayer.``."""
    return {
        ("midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name): t
        for name, t in tensors.items()
    }


EAGLE31_SWITCHES = ("fc_norm", "norm_output")
"""The draft config's EAGLE 3.1 keys: written to ``config.json`` as ``true`` when set (top
level, as vLLM reads them), left out for an EAGLE-3 draft."""


def check_export_tensors(
    tensors: dict[str, torch.Tensor],
    config: Eagle3Config,
    dtype: torch.dtype,
    *,
    extra: dict[str, tuple[int, ...]] | None = None,
) -> None:
    """Check names, shapes, dtypes and the vocabulary-map invariants against the contract;
    ``extra``: further float tensors (name -> shape) of a family that extends EAGLE-3.

    Raises:
        ExportError: listing every problem.
    """
    expected = {
        spec.name: (spec.shape(config), KIND_DTYPES.get(spec.kind, dtype))
        for spec in EXPORT_CONTRACT
        if spec.when(config)
    }
    expected |= {name: (shape, dtype) for name, shape in (extra or {}).items()}
    expected |= {
        name: (shape(config), dtype)
        for name, shape in OPTIONAL_TENSORS.items()
        if name in tensors and name not in expected
    }
    problems = contract_problems(tensors, expected)
    if not problems and _reduced(config):
        try:
            VocabMap(d2t=tensors["d2t"], t2d=tensors["t2d"]).check()
        except ValueError as err:
            problems.append(str(err))
    if problems:
        raise ExportError("export breaks the contract:\n  " + "\n  ".join(problems))


def contract_problems(
    tensors: dict[str, torch.Tensor], expected: dict[str, tuple[tuple[int, ...], torch.dtype]]
) -> list[str]:
    """What breaks a contract of ``{name: (shape, dtype)}`` in ``tensors``: names the engines
    would drop or leave uninitialised, shapes, dtypes, and non-finite float weights."""
    problems = []
    for name in sorted(set(tensors) - set(expected)):
        problems.append(f"unexpected tensor {name!r} (engines would silently drop it)")
    for name, (want_shape, want_dtype) in expected.items():
        if name not in tensors:
            problems.append(f"missing tensor {name!r} (engines would leave it uninitialized)")
            continue
        tensor = tensors[name]
        if tuple(tensor.shape) != want_shape:
            problems.append(f"{name}: shape {tuple(tensor.shape)}, expected {want_shape}")
        if tensor.dtype != want_dtype:
            problems.append(f"{name}: dtype {tensor.dtype}, expected {want_dtype}")
        elif tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            problems.append(f"{name}: holds NaN or infinite values (a diverged training run?)")
    return problems


def rope_problems(exported: dict[str, Any], target_config) -> list[str]:
    """Where ``config.json``'s RoPE is not the target's full-attention RoPE (nested per-layer-
    type settings give their full_attention entry), in both layouts engines read."""
    problems = []
    target_rope = draft_rope_parameters(target_config)
    if exported.get("rope_parameters") != target_rope:
        problems.append(
            f"rope_parameters {exported.get('rope_parameters')} != target's full-attention "
            f"RoPE {target_rope}"
        )
    theta, scaling = _rope_legacy(target_rope)
    if exported.get("rope_theta") != theta or exported.get("rope_scaling") != scaling:
        problems.append(
            f"rope_theta/rope_scaling {exported.get('rope_theta')}/"
            f"{exported.get('rope_scaling')} != target's {theta}/{scaling}"
        )
    return problems


def _rope_legacy(rope_parameters: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) in the transformers 4.x layout."""
    theta = float(rope_parameters.get("rope_theta", 10000.0))
    scaling = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
    if scaling.get("rope_type", "default") == "default":
        return theta, None
    return theta, scaling


def layer_geometry(config) -> dict[str, Any]:
    """The ``config.json`` keys every draft's layers share with the engines: widths, heads,
    activation, norm epsilon, positions, the target's RoPE in both layouts, the vocabulary."""
    rope_theta, rope_scaling = _rope_legacy(config.rope_parameters)
    return {
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "rope_parameters": dict(config.rope_parameters),
        "vocab_size": config.vocab_size,
    }


def export_config_dict(
    config: Eagle3Config, *, aux_layer_ids: list[int], num_target_layers: int, dtype: str
) -> dict[str, Any]:
    """The ``config.json`` of an exported draft."""
    exported: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        **layer_geometry(config),
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
    }
    for switch in EAGLE31_SWITCHES:  # EAGLE 3.1, as the engines read it; absent for EAGLE-3
        if getattr(config, switch):
            exported[switch] = True
    if list(aux_layer_ids) != default_aux_layer_ids(num_target_layers):
        exported["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)}
        exported["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in aux_layer_ids]
    return exported


def check_export_config(exported: dict[str, Any], target_config) -> None:
    """Check ``config.json`` against the target it will serve with.

    Raises:
        ExportError: listing every mismatch (architecture, tying, vocabulary, positions, RoPE,
            activation).
    """
    target_config = text_config(target_config)
    exported = engine_defaults(exported)
    problems = []
    if exported.get("architectures") != [ARCHITECTURE]:
        problems.append(
            f"architectures is {exported.get('architectures')}, expected ['{ARCHITECTURE}']"
        )
    if exported.get("num_hidden_layers") != 1:
        problems.append(f"num_hidden_layers is {exported.get('num_hidden_layers')}, expected 1")
    if exported.get("tie_word_embeddings") is not False:
        problems.append(
            "tie_word_embeddings must be false (SGLang would use the full-vocabulary "
            "embedding as lm_head)"
        )
    if exported.get("vocab_size") != target_config.vocab_size:
        problems.append(
            f"vocab_size {exported.get('vocab_size')} != target's {target_config.vocab_size}"
        )
    if "draft_vocab_size" not in exported:
        problems.append(
            "draft_vocab_size is missing (SGLang would expect a full-vocabulary lm_head)"
        )
    if exported.get("target_hidden_size") != target_config.hidden_size:
        problems.append(
            f"target_hidden_size {exported.get('target_hidden_size')} != target's "
            f"hidden_size {target_config.hidden_size}"
        )
    if exported.get("max_position_embeddings") != target_config.max_position_embeddings:
        problems.append(
            f"max_position_embeddings {exported.get('max_position_embeddings')} != "
            f"target's {target_config.max_position_embeddings}"
        )
    if exported.get("hidden_act") != "silu":
        problems.append(
            f"hidden_act is {exported.get('hidden_act')!r}: SGLang's and vLLM's EAGLE-3 drafts "
            "run SiLU only"
        )
    # the draft runs the target's full-attention RoPE
    problems += rope_problems(exported, target_config)
    if problems:
        raise ExportError("export config breaks the contract:\n  " + "\n  ".join(problems))


def export_tensors(model: Eagle3DraftModel, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors of ``model.safetensors``: float weights in ``dtype``, maps as int64/bool."""
    state = model.state_dict()
    config = model.config
    tensors = {}
    for spec in EXPORT_CONTRACT:
        if not spec.when(config):
            continue
        tensor = state[spec.name].detach().cpu()
        tensors[spec.name] = (tensor.to(dtype) if spec.kind == "float" else tensor).contiguous()
    return tensors


def write_export(
    out_dir: str | Path,
    *,
    model: Eagle3DraftModel,
    target_config,
    aux_layer_ids: list[int],
    dtype: str = "bfloat16",
    tokenizer=None,
    advice: dict | None = None,
    extra_config: dict[str, Any] | None = None,
    extra_tensors: tuple[str, ...] = (),
) -> Path:
    """Check and write an export directory atomically (with ``sglang_advice.json`` / ``.md``
    when ``advice`` is given, :func:`specforge.serving.advice.sglang_advice`).
    ``extra_config`` (``config.json`` keys) and ``extra_tensors`` (``model``'s state names,
    float, in ``dtype``) are what a family that extends EAGLE-3 adds to its export.

    Raises:
        ExportError: the draft does not fit the contract or the target.
    """
    float_dtype = torch_dtype(dtype)
    config = model.config
    exported = export_config_dict(
        config,
        aux_layer_ids=aux_layer_ids,
        num_target_layers=text_config(target_config).num_hidden_layers,
        dtype=dtype,
    )
    exported |= extra_config or {}
    check_export_config(exported, target_config)
    tensors = export_tensors(model, float_dtype)
    state = model.state_dict()
    tensors |= {name: state[name].detach().cpu().to(float_dtype) for name in extra_tensors}
    extra = {name: tuple(tensors[name].shape) for name in extra_tensors}
    check_export_tensors(tensors, config, float_dtype, extra=extra)
    if len(set(aux_layer_ids)) < len(aux_layer_ids):
        logger.warning(
            "the aux layers %s repeat a layer: vLLM collects each aux layer once, so its fc "
            "would get fewer states than the draft reads and vLLM cannot serve this export "
            "(train with distinct target.aux_layer_ids to serve it with vLLM)",
            list(aux_layer_ids),
        )
    with export_directory(out_dir, exported, tensors, tokenizer) as tmp:
        torch.save(model.hot_ids.cpu().contiguous(), tmp / f"freq_{config.draft_vocab_size}.pt")
        if advice is not None:
            write_json_atomic(tmp / "sglang_advice.json", advice)
            write_text_atomic(tmp / "sglang_advice.md", advice_markdown(advice))
    return Path(out_dir)


@contextmanager
def export_directory(out_dir, exported: dict, tensors: dict[str, torch.Tensor], tokenizer):
    """Write an export atomically: ``config.json``, ``model.safetensors`` and the tokenizer,
    then what the ``with`` block adds, then the marker listing every file; the directory
    appears whole or not at all, and replaces only a previous export
    (:func:`check_replaceable`)."""
    out_dir = Path(out_dir)
    check_replaceable(out_dir)
    with atomic_directory(out_dir) as tmp:
        write_json_atomic(tmp / "config.json", exported)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        yield tmp
        files = sorted(p.name for p in tmp.iterdir()) + [MARKER]
        marker = {"written_by": f"specforge {__version__}", "files": files}
        marker["sha256"] = {name: file_sha256(tmp / name) for name in WEIGHTS_AND_CONFIG}
        write_json_atomic(tmp / MARKER, marker)


WEIGHTS_AND_CONFIG = ("config.json", "model.safetensors")
"""The files an engine reads the draft from, whose checksums the marker keeps."""


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_as_written(export_dir: Path) -> None:
    """The weights and config are those the export wrote (the marker's checksums): an edit
    after export (a hand-flipped ``norm_output``, a rewritten ``d2t``) is named, since the
    built-in runtime and an engine would both read the edited files and agree on them.

    Raises:
        ExportError: a file whose checksum differs (an export without checksums, or another
            tool's without the marker, passes).
    """
    marker = Path(export_dir) / MARKER
    if not marker.is_file():
        return
    recorded = read_json(marker).get("sha256", {})
    changed = [n for n, d in recorded.items() if file_sha256(Path(export_dir) / n) != d]
    if changed:
        raise ExportError(f"{', '.join(changed)} changed since specforge wrote the export")


def check_replaceable(out_dir: Path) -> None:
    """Refuse to write an export over anything but nothing, an empty folder, or a previous
    export (whose marker lists every entry in it); or where it cannot be written: below a
    file, or as the current directory (or one that holds it).

    Raises:
        ExportError: naming what is there.
    """
    blocked = next((p for p in out_dir.parents if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        raise ExportError(f"cannot write {out_dir}: {blocked} is a file, not a directory")
    if Path.cwd().resolve().is_relative_to(out_dir.resolve()):
        raise ExportError(
            f"cannot write the export as {out_dir}: it holds the current directory, which "
            "cannot be replaced; name a folder inside it (e.g. ./export)"
        )
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise ExportError(f"{out_dir} exists and is not a directory")
    entries = sorted(p.name for p in out_dir.iterdir())
    if not entries:
        return
    try:
        listed = set(json.loads((out_dir / MARKER).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        listed = set()
    unknown = [name for name in entries if name not in listed]
    if unknown:
        shown = ", ".join(unknown[:5]) + (", ..." if len(unknown) > 5 else "")
        raise ExportError(
            f"{out_dir} is not empty and not a previous export (it holds {shown}); "
            "nothing was written: choose a new or empty directory"
        )


def exported_aux_layer_ids(export_dir: str | Path, num_target_layers: int) -> list[int]:
    """The aux layer ids an export was trained on: SGLang's ``eagle_config`` entry when the
    ids are custom, else the default for the target's depth."""
    config = engine_defaults(read_json(Path(export_dir) / "config.json"))
    custom = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return list(custom) if custom else default_aux_layer_ids(num_target_layers)


def load_exported_draft(
    export_dir: str | Path,
    *,
    target_config,
    target_embedding: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    model_class: type[Eagle3DraftModel] | None = None,
    extra: Callable[[Any], dict[str, tuple[int, ...]]] | None = None,
) -> Eagle3DraftModel:
    """Load an exported directory as a draft model (what the built-in runtime serves), checking
    it against the contract first.

    Args:
        export_dir: the directory :func:`write_export` wrote.
        target_config: the target's HF config (vocabulary, positions, RoPE must match).
        target_embedding: (V, Ht) the target's input embedding (shared, as engines share it).
        dtype: dtype to run the draft in.
        model_class: the draft class of a family that extends EAGLE-3 (its config class is
            ``model_class.config_class``, read from ``config.json``'s keys of its fields).
        extra: the further tensors (name -> shape) such a family's export holds, given its
            config.

    Raises:
        ExportError: a directory that breaks the contract.
    """
    export_dir = Path(export_dir)
    config_path = export_dir / "config.json"
    if not config_path.is_file():
        raise ExportError(f"{export_dir} is not an export directory (no config.json)")
    exported = engine_defaults(read_json(config_path))
    check_export_config(exported, target_config)
    model_class = model_class or Eagle3DraftModel
    config_class = model_class.config_class
    fields = {f.name for f in dataclasses.fields(config_class)}
    config = config_class.from_dict(
        {k: v for k, v in exported.items() if k in fields}, str(config_path)
    )
    tensors = engine_tensors(read_safetensors(export_dir / "model.safetensors"))
    float_dtype = tensors["fc.weight"].dtype if "fc.weight" in tensors else torch.bfloat16
    check_export_tensors(tensors, config, float_dtype, extra=extra(config) if extra else None)
    model = model_class(config)
    state = dict(tensors)
    state.setdefault(FROZEN_WEIGHTS[0], target_embedding)
    if not _reduced(config):
        state["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(config.vocab_size, dtype=torch.bool)
    load_draft_weights(model, state, str(export_dir))
    return model.to(dtype).eval()
