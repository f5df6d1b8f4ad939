"""The target's forward through the engine: a preallocated cache written by slot
(:class:`~specforge.engine.cache.SlotKVCache`), an explicit mask, and the decoder's layers run in
one function that ``torch.compile`` can capture whole (no hooks, no context state).

Shapes are a budget. A forward's token count ``T`` and key span (the cache slots it reads,
rounded up to a multiple of :data:`SPAN_STEP`) are the only sizes that vary; the function is
compiled with both dynamic, so decoding needs at most two graphs (one token, several tokens);
a new cache's first forward (the prompt, of any length) runs eagerly and takes the engine's
buffers (the previous sequence's, zeroed, when they are large enough: a CUDA graph then replays
at the same addresses), and a key span past the capacity is an error, never a new allocation.
On a CUDA device "compiled" means CUDA graphs instead (:mod:`specforge.engine.graphs`): the
eager loop captured once per token count and key span and replayed, which takes seconds where
inductor took minutes.

:class:`TargetEngine` checks itself before it serves: at construction its layer loop runs once
beside the model's own forward on a short input, and a target whose decoder does more than the
plain loop (embedding scales, per-layer windows, ...) is refused with the reason, so the caller
decodes with transformers instead of trusting a different model. :func:`build_engine` then
decides whether to compile (:class:`EnginePath`: the path taken and why): never over a layer
loop that reads a tensor on the host (:meth:`TargetEngine.host_sync`), and under ``auto`` only
where the run repays the compilation.
"""

from __future__ import annotations

import copy
import inspect
import logging
import shutil
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import transformers
from torch import nn

from specforge.engine.cache import SPAN_STEP, SlotKVCache, SlotKVPool, whole_spans
from specforge.engine.cpu.packed_linear import PackedLinear, describe_plan
from specforge.engine.cpu.row_buckets import bucket_linears
from specforge.engine.graphs import CAPTURE_BACKENDS, CudaGraphs, graph_runner
from specforge.engine.host_sync import HostSync, host_sync
from specforge.errors import UserError
from specforge.models.adapter import (
    architecture,
    check_logits,
    final_norm,
    find_decoder,
    text_config,
)
from specforge.models.kv_cache import cache_kwargs, growing_cache
from specforge.models.target import GROUPED_SDPA, check_aux_layer_ids, target_hidden_states

logger = logging.getLogger(__name__)

PROBE_TOKENS = 7
"""Tokens of the construction check (:meth:`TargetEngine.refusal`)."""


def window_refusal(model: nn.Module) -> str | None:
    """Why the engine's single full-attention mask does not fit this target, or ``None``:
    layers with sliding windows or chunks (or no attention at all) need a mask of their own."""
    config = text_config(model.config)
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    other = sorted(kinds - {"full_attention"})
    if other:
        return f"{architecture(model.config)} has {'/'.join(other)} layers"
    for name in ("sliding_window", "attention_chunk_size"):
        size = getattr(config, name, None)
        if size and getattr(config, "use_sliding_window", True) is not False:
            return f"{architecture(model.config)} attends within a window ({name} {size})"
    return None


ENGINE_ATTENTION = ("sdpa", GROUPED_SDPA)
"""Attention implementations that take the engine's boolean (B, 1, T, S) mask as it means."""


def attention_refusal(model: nn.Module) -> str | None:
    """Why the engine's boolean mask would not mean to this target's attention what it says
    (eager attention adds its mask; flash attention takes none), or ``None``."""
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation in ENGINE_ATTENTION:
        return None
    return f"its attention is {implementation!r}, not one of {list(ENGINE_ATTENTION)}"


@dataclass
class EngineStats:
    """What a :class:`TargetEngine` compiled and ran."""

    compiled: bool
    shapes: set[tuple[str, int]] = field(default_factory=set)
    """``("1" or "T", key span)`` of every forward run: the shapes the compiled function met."""
    compilations: int = 0
    """Graphs built: dynamo's unique graphs while this engine ran, or the CUDA graphs it
    captured."""
    compile_seconds: float = 0.0
    """Wall time of forwards that compiled a graph (the warm-up a user waits for)."""
    row_buckets: int = 0
    """Linear layers whose compiled calls follow a row plan
    (:func:`~specforge.engine.cpu.row_buckets.bucket_linears`; compiled on a CPU, float32)."""
    row_plan: dict[str, str] = field(default_factory=dict)
    """Their kernel by row count (:func:`~specforge.engine.cpu.packed_linear.describe_plan`)."""
    attention_backends: list[str] = field(default_factory=list)
    """The SDPA kernels a captured forward may use (CUDA graphs only:
    :data:`~specforge.engine.graphs.CAPTURE_BACKENDS`); empty: SDPA's own choice."""
    fallback: str | None = None
    """Why the compiled forwards failed and the engine runs eagerly since (``engine.compile:
    auto``), or ``None``."""

    def as_dict(self) -> dict:
        return {
            "compiled": self.compiled,
            "fallback": self.fallback,
            "attention_backends": self.attention_backends,
            "compilations": self.compilations,
            "compile_seconds": round(self.compile_seconds, 2),
            "row_buckets": self.row_buckets,
            "row_plan": self.row_plan,
            "shapes": sorted(f"{t}x{span}" for t, span in self.shapes),
        }


class TargetEngine:
    """The target's forward over new tokens at given slots, eager or compiled, returning what
    the speculative runtime and decoding need: float32 logits (after the target's own logit
    transform) and the draft's fused auxiliary inputs.

    Args:
        model: an HF causal LM in eval mode (:func:`~specforge.models.target.load_target`).
        aux_layer_ids: the three decoder layers the draft reads.
        compile: run the layer loop through ``torch.compile`` (both sizes dynamic), or on a
            CUDA device as CUDA graphs (:class:`~specforge.engine.graphs.CudaGraphs`).
        row_buckets: compiled on a CPU, give the layers' float32 linears row buckets with
            the plan measured fastest here, or with the plan given
            (:func:`~specforge.engine.cpu.row_buckets.bucket_linears`); off: PyTorch's default
            product, a comparison's baseline.

    Raises:
        UserError: a target the engine cannot run exactly (:meth:`refusal`).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        aux_layer_ids: list[int],
        compile: bool,
        row_buckets: bool | tuple[int, ...] = True,
    ):
        self.model = model
        self.decoder, self.layers = find_decoder(model)
        self.embed = model.get_input_embeddings()
        self.rotary = getattr(self.decoder, "rotary_emb", None)
        self.norm = final_norm(model)
        self.aux_layer_ids = check_aux_layer_ids(aux_layer_ids, len(self.layers), count=None)
        count = len(self.aux_layer_ids)
        ascending = sorted(range(count), key=lambda k: self.aux_layer_ids[k])
        self._aux_order = [ascending.index(k) for k in range(count)]
        """Where each aux layer's output sits among the captured ones (in layer order)."""
        self.head = model.get_output_embeddings()
        self.transform = check_logits(model)
        self.device = next(model.parameters()).device
        self._cache_keyword = next(iter(cache_kwargs(self.layers[0], None)))
        self.stats = EngineStats(compiled=False)
        self._pool = SlotKVPool()
        self._bucketed: list[PackedLinear] = []
        """The linears this engine gave row buckets (checked by :meth:`new_cache`)."""
        refusal = attention_refusal(model) or window_refusal(model) or self.refusal()
        if refusal:
            raise UserError(f"the engine cannot run this target exactly: {refusal}")
        self._run = self._layers
        self._fallback = False
        self._row_buckets = row_buckets
        if compile:
            self.compile()

    def compile(self, *, fallback: bool = False) -> None:
        """From now on run forwards through ``torch.compile`` (both sizes dynamic; compiled at
        their first call), or on a CUDA device as CUDA graphs. ``fallback``: a forward whose
        compilation or capture fails runs eagerly, and every later one (one warning naming
        the reason, kept in ``stats.fallback``); else the failure raises.

        Raises:
            UserError: the layer loop reads a tensor on the host (dynamic RoPE): a compiled or
                captured forward cannot run it.
        """
        sync = self.host_sync()
        if sync is not None:
            raise UserError(f"the compiled engine cannot run this target: {sync}")
        self._fallback = fallback
        self.stats.compiled = True
        runner = graph_runner(self.device)
        if runner is not None:
            self._run = runner(self._layers, self._pool)
            self.stats.attention_backends = [b.name for b in CAPTURE_BACKENDS]
        else:
            # float32 linears: the kernel measured fastest here for each row count
            self._bucket(self._row_buckets)
            self._run = torch.compile(self._layers, dynamic=True, fullgraph=True)

    def _uncompile(self, error: RuntimeError) -> None:
        """Run every forward eagerly from now on, after ``error`` failed a compilation or
        capture (``compile(fallback=True)``); warned once and recorded."""
        reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
        self.stats.fallback = f"{type(error).__name__}: {reason}"
        self.stats.compiled = False
        self._run = self._layers
        logger.warning(
            "the compiled engine failed (%s): the target's forwards run eagerly from here",
            self.stats.fallback,
        )

    def _bucket(self, row_buckets: bool | tuple[int, ...]) -> None:
        """Row plans for the engine's own copy of the layers (the model's, which HF
        ``generate`` and every other caller run, keep their modules)."""
        if row_buckets is False:
            return
        layers = shared_copy(self.layers)
        plan = bucket_linears(layers, None if row_buckets is True else row_buckets)
        if not plan:
            return
        self.layers = layers
        self._bucketed = [m for m in layers.modules() if isinstance(m, PackedLinear) and m._plan]
        self.stats.row_buckets, self.stats.row_plan = len(self._bucketed), describe_plan(plan)

    @property
    def graphs(self) -> bool:
        """Whether forwards replay CUDA graphs (compiled, on a CUDA device)."""
        return isinstance(self._run, CudaGraphs)

    def new_cache(self, capacity: int) -> SlotKVCache:
        """An empty cache for one sequence of at most ``capacity`` tokens (rounded up to a
        multiple of :data:`SPAN_STEP`, so every span is a bucket). Its first forward takes the
        engine's buffers (:class:`~specforge.engine.cache.SlotKVPool`): from then on the caches
        made before it refuse to run.

        Raises:
            UserError: the target's weights changed since the engine packed them for its row
                buckets (checked here, once a sequence: 1.5 ms for SmolLM2's 210 linears).
        """
        if any(linear.buckets_stale() for linear in self._bucketed):
            raise UserError(
                "the target's weights changed after the engine packed them for its row "
                "buckets: build a new engine for the new weights"
            )
        return SlotKVCache(len(self.layers), whole_spans(capacity), self._pool)

    def _layers(self, input_ids, positions, slots, mask, cache):
        """The decoder's plain loop (what ``torch.compile`` captures): embeddings, rotary
        positions, every layer writing its keys at ``slots``, the final norm. Returns the last
        hidden states (1, T, H) and the aux layers' outputs (1, T, n * H), n the aux layers."""
        hidden = self.embed(input_ids)
        position_embeddings = self.rotary(hidden, position_ids=positions)
        cache.write_at(slots, mask.shape[-1])
        captured = []
        for index, layer in enumerate(self.layers):
            hidden = layer(
                hidden,
                attention_mask=mask,
                position_embeddings=position_embeddings,
                position_ids=positions,
                use_cache=True,
                **{self._cache_keyword: cache},
            )
            hidden = hidden[0] if isinstance(hidden, tuple) else hidden
            captured += [hidden] * self.aux_layer_ids.count(index)
        # n x (1, T, H) -> (1, T, n * H), in the draft's layer order
        fused = torch.cat([captured[i] for i in self._aux_order], -1)
        return self.norm(hidden), fused

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: SlotKVCache,
        *,
        positions: torch.Tensor | None = None,
        visible: torch.Tensor | None = None,
        logits_to_keep: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The target over new tokens ``input_ids`` (1, T), written at slots ``cache.length ..
        cache.length + T - 1``; the cache's length grows by ``T``.

        Args:
            positions: (1, T) rotary positions (a tree's depths); default the slots.
            visible: (T, T) bool, new token ``i`` sees new token ``j`` (a tree); default
                causal. Every new token sees the whole cached prefix.
            logits_to_keep: logits of the last this many tokens only (0: all).

        Returns:
            Logits (T or ``logits_to_keep``, V) in float32 and the aux inputs (1, T, n * H).

        Raises:
            ValueError: more tokens than the cache has room for.
        """
        count, start = input_ids.shape[1], cache.length
        slots, span = cache.next_slots(count, self.device)
        end = start + count
        # fresh tensors, never views: a view's base is guarded too, so inputs that are views of
        # different tensors (or of one another) would each be another graph
        input_ids = input_ids.clone()
        positions = (slots[None] if positions is None else positions).clone()
        if visible is None:  # causal among the new tokens
            visible = torch.ones(count, count, dtype=torch.bool, device=self.device).tril()
        # (T, span): the cached prefix, then the new tokens as ``visible`` says, then free slots
        mask = torch.zeros(count, span, dtype=torch.bool, device=self.device)
        mask[:, :start] = True
        mask[:, start:end] = visible
        graphs = self._graphs_built()
        began = time.perf_counter()
        # a new cache's first forward (the prompt) runs eagerly: it takes the buffers
        replayed = cache.allocated and self.graphs
        run = self._run if cache.allocated else self._layers
        args = (input_ids, positions, slots, mask[None, None])
        try:
            hidden, aux = run(*args, cache=cache)
        except RuntimeError as error:  # a compilation or capture that failed (nothing written)
            if run is self._layers or not self._fallback:
                raise
            self._uncompile(error)
            replayed = False
            hidden, aux = self._layers(*args, cache=cache)
        if replayed:
            # a CUDA graph's outputs live in its pool and the next replay overwrites them;
            # the caller keeps the aux states across forwards (the logits below are new)
            aux = aux.clone()
        built = self._graphs_built() - graphs
        if built:
            self.stats.compilations += built
            self.stats.compile_seconds += time.perf_counter() - began
        self.stats.shapes.add(("1" if count == 1 else "T", span))
        cache.length = end
        rows = hidden[0, -logits_to_keep:]
        return self.transform(self.head(rows).float()), aux

    @torch.no_grad()
    def prepare(self, capacity: int, counts) -> int:
        """Before anything is timed: the buffers for sequences of up to ``capacity`` tokens,
        taken once (a later cache that fits reuses them, so no graph is dropped for new ones),
        and every graph the forwards over ``counts`` new tokens will need: on CUDA graphs one
        per count and key span up to the capacity; compiled on a CPU the two dynamic graphs
        (one token, several), each at a first and a later span. Returns the graphs built.

        Raises:
            ValueError: a count larger than the capacity.
        """
        counts = sorted(set(counts))
        if counts[-1] > whole_spans(capacity):
            raise ValueError(f"a forward over {counts[-1]} tokens exceeds {capacity} slots")
        cache = self.new_cache(capacity)
        ones = torch.ones(1, 1, dtype=torch.long, device=self.device)
        self.forward(ones, cache)  # eager: takes the buffers, at full capacity
        spans = range(SPAN_STEP, cache.capacity + 1, SPAN_STEP)
        if not self.graphs:  # dynamic shapes: one graph per kind of token count
            counts = [c for c in (counts[0], counts[-1]) if self.stats.compiled]
            spans = [spans[0], spans[-1]]
        built = self.stats.compilations
        for span in spans:
            for count in counts:
                if count <= span:
                    cache.length = span - count  # the forward ends at the span's last slot
                    self.forward(ones.repeat(1, count), cache)
        return self.stats.compilations - built

    def _graphs_built(self) -> int:
        """Graphs compiled (dynamo's count, of this process) or captured (CUDA graphs)."""
        captured = self._run.captures if self.graphs else 0
        return torch._dynamo.utils.counters["stats"]["unique_graphs"] + captured

    @torch.no_grad()
    def refusal(self) -> str | None:
        """Why the engine's layer loop is not the model's own forward, or ``None``: both run
        on :data:`PROBE_TOKENS` tokens (a prefix, then one more), eagerly; their hidden and aux
        states must agree within 1e-4 of their largest value in float32 (4 roundings in a
        16-bit dtype). A decoder whose pieces the loop cannot call (no rotary module, layers
        that take other arguments) is refused with the error it raised, where the model's code
        raised it (:func:`raised_by_model`); raised elsewhere, it is the engine's bug and
        propagates."""
        if self.rotary is None:
            return f"{architecture(self.model.config)}'s decoder has no rotary_emb module"
        try:
            ours, theirs = self._probe()
        except (AttributeError, TypeError, ValueError, RuntimeError, IndexError) as error:
            if not raised_by_model(error, self.model):
                raise  # the engine's own bug: never a quiet path through transformers
            return (
                f"{architecture(self.model.config)}'s decoder is not the plain layer loop "
                f"({type(error).__name__}: {error})"
            )
        for (hidden, aux), (hf_hidden, hf_aux) in zip(ours, theirs, strict=True):
            for mine, reference in ((hidden, hf_hidden), (aux, hf_aux)):
                scale = float(reference.abs().max()) or 1.0
                # a different summation order (a masked span, not an exact one) rounds
                # differently; a different model is off by the states' own size
                eps = torch.finfo(reference.dtype).eps
                tolerance = scale * (1e-4 if reference.dtype == torch.float32 else 4 * eps)
                if not torch.allclose(mine.float(), reference.float(), rtol=0, atol=tolerance):
                    difference = float((mine.float() - reference.float()).abs().max())
                    return (
                        f"{architecture(self.model.config)}'s decoder is not the plain layer "
                        f"loop (its hidden states differ by {difference:.3g})"
                    )
        return None

    def _probe_forwards(self):
        """The layer loop's forwards over :data:`PROBE_TOKENS` random tokens (a prefix, then
        one more) on a fresh cache: yields each one's token ids and the arguments of
        :meth:`_layers` that run it."""
        generator = torch.Generator().manual_seed(0)
        vocab = self.head.weight.shape[0]
        ids = torch.randint(0, vocab, (1, PROBE_TOKENS), generator=generator).to(self.device)
        cache = self.new_cache(PROBE_TOKENS)
        for part in (ids[:, :-1], ids[:, -1:]):
            slots = torch.arange(cache.length, cache.length + part.shape[1], device=self.device)
            mask = torch.arange(SPAN_STEP, device=self.device) <= slots[:, None]
            yield part, (part, slots[None], slots, mask[None, None], cache)
            cache.length += part.shape[1]

    def _probe(self):
        """The layer loop's and the model's own (last hidden, aux) states on the probe."""
        ours, theirs, hf_cache = [], [], growing_cache()
        for part, args in self._probe_forwards():
            ours.append(self._layers(*args))
            states = target_hidden_states(
                self.model, part, aux_layer_ids=self.aux_layer_ids, past_key_values=hf_cache
            )
            theirs.append((states.last_hidden_state, states.aux_hidden_states))
        return ours, theirs

    @torch.no_grad()
    def host_sync(self) -> HostSync | None:
        """The first host sync of the layer loop on the probe's forwards (a prefix, then a
        token), or ``None``: what would stop a compiled or captured forward
        (:mod:`specforge.engine.host_sync`)."""
        for _, args in self._probe_forwards():
            sync = host_sync(self.model, self._layers, *args)
            if sync is not None:
                return sync
        return None

    @torch.no_grad()
    def generate(
        self, input_ids: torch.Tensor, *, max_new_tokens: int, eos_token_ids=()
    ) -> list[int]:
        """The target alone, greedy, through the engine: the new token ids after ``input_ids``
        (1, T), stopping after an EOS (included)."""
        cache = self.new_cache(input_ids.shape[1] + max_new_tokens)
        logits, _ = self.forward(input_ids.to(self.device), cache, logits_to_keep=1)
        output = [int(logits[-1].argmax())]
        while len(output) < max_new_tokens and output[-1] not in eos_token_ids:
            token = torch.tensor([[output[-1]]], device=self.device)
            logits, _ = self.forward(token, cache)
            output.append(int(logits[-1].argmax()))
        return output


def raised_by_model(error: BaseException, model: nn.Module) -> bool:
    """Whether ``error`` was raised by ``model``'s own code (transformers, or the file of one of
    its module classes, remote code included), or by PyTorch refusing the arguments the engine
    gave one of its modules: the model is not what the engine runs. Raised anywhere else (the
    engine's code), it is a bug."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return False
    where = Path(frames[-1].filename).resolve()
    if where.is_relative_to(TRANSFORMERS) or str(where) in _module_files(model):
        return True
    return isinstance(error, TypeError) and where == TORCH_MODULE


TRANSFORMERS = Path(transformers.__file__).resolve().parent
TORCH_MODULE = Path(nn.modules.module.__file__).resolve()
"""Where ``nn.Module.__call__`` calls ``forward``: a ``TypeError`` there is an argument a
module does not take."""


def _module_files(model: nn.Module) -> set[str]:
    """The source files of ``model``'s module classes."""
    files = set()
    for kind in {type(m) for m in model.modules()}:
        try:
            files.add(str(Path(inspect.getfile(kind)).resolve()))
        except (TypeError, OSError):  # a class without a source file
            continue
    return files


def shared_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module``'s tree of modules sharing every tensor with it (parameters, buffers
    and the tensors a module keeps as attributes, such as packed weights): a module swapped or
    repacked in the copy leaves the original as it was, at no cost in weights."""
    memo = {}
    for child in module.modules():
        for value in (*child._parameters.values(), *child._buffers.values(), *vars(child).values()):
            for tensor in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(tensor, torch.Tensor):
                    memo[id(tensor)] = tensor
    return copy.deepcopy(module, memo)


COMPILED_SAVING = 0.43
"""The share of the eager engine's time per token that compiling saves on a CPU: SmolLM2 ran
at 55.1 ms a token through the eager engine and 31.6 compiled on 2 cores (a 4-layer tiny Llama
33%; ``docs/results/compile_cost_cpu.json``)."""

COMPILE_SECONDS = (12.0, 3.1)
"""A cold compilation of the engine's two graphs on a CPU, estimated as ``base + per_layer *
layers`` seconds through two measurements on 2 cores: SmolLM2's 30 layers in 106 s, a 4-layer
tiny Llama's in 25 s (``docs/results/compile_cost_cpu.json``)."""

TIMED_TOKENS = 8
"""Greedy tokens through the eager engine timed to price a token (after 2 untimed)."""


@dataclass(frozen=True)
class EnginePath:
    """Which path runs a stage's target forwards, and why (``bench.json``'s ``engine``)."""

    path: Literal["compiled", "eager engine", "transformers"]
    """``compiled``: the engine through ``torch.compile`` (CUDA graphs on a GPU); ``eager
    engine``: the engine's preallocated cache, uncompiled; ``transformers``: the model's own
    forward with an HF cache (where the engine cannot run the target exactly)."""
    why: str


def build_engine(
    model: nn.Module, *, aux_layer_ids: list[int], compile: str, tokens: int
) -> tuple[TargetEngine | None, EnginePath]:
    """The engine for ``model`` as ``engine.compile`` says, and the path that runs (logged
    once, with why).

    ``true`` compiles or raises. ``false`` runs the engine eagerly. ``auto`` compiles where it
    pays: on a GPU (CUDA graphs capture in a few forwards); on a CPU with a C++ compiler when
    the ``tokens`` the run is expected to decode through the engine save more than the
    compilation's estimated cost (:data:`COMPILED_SAVING` of the eager engine's time per token,
    timed here; :data:`COMPILE_SECONDS`); never where the layer loop reads a tensor on the host
    (:meth:`TargetEngine.host_sync`: a compiled or captured forward would fail). Where the
    engine cannot run the target exactly, ``false`` and ``auto`` decode through transformers
    (``None``).

    Raises:
        UserError: ``compile`` ``true`` on a target the engine refuses or cannot compile.
    """
    try:
        engine = TargetEngine(model, aux_layer_ids=aux_layer_ids, compile=False)
    except UserError as error:
        if compile == "true":
            raise
        choice = EnginePath("transformers", str(error))
        logger.warning("the target decodes through transformers: %s", choice.why)
        return None, choice
    choice = _compile_choice(engine, compile, tokens)
    if choice.path == "compiled":
        engine.compile(fallback=compile == "auto")
    logger.info("the target's forwards: %s (%s)", choice.path, choice.why)
    return engine, choice


def _compile_choice(engine: TargetEngine, compile: str, tokens: int) -> EnginePath:
    """Whether ``engine`` (built eagerly) should compile, as :func:`build_engine` decides."""
    if compile == "false":
        return EnginePath("eager engine", "engine.compile is false")
    sync = engine.host_sync()
    if sync is not None:
        why = f"a compiled forward cannot run it: {sync}"
        if compile == "true":
            raise UserError(f"the compiled engine cannot run this target: {why}")
        return EnginePath("eager engine", why)
    if compile == "true":
        return EnginePath("compiled", "engine.compile is true")
    if graph_runner(engine.device) is not None:
        return EnginePath("compiled", "CUDA graphs capture in a few forwards")
    if not (shutil.which("g++") or shutil.which("c++")):
        return EnginePath("eager engine", "no C++ compiler on the PATH (inductor needs one)")
    per_token = _eager_seconds_per_token(engine)
    saved = tokens * per_token * COMPILED_SAVING
    base, per_layer = COMPILE_SECONDS
    cost = base + per_layer * len(engine.layers)
    measure = (
        f"~{tokens} tokens through the engine at {1000 * per_token:.1f} ms eagerly: compiling "
        f"would save ~{saved:.0f} s for ~{cost:.0f} s of compilation"
    )
    return EnginePath("compiled" if saved > cost else "eager engine", measure)


def _eager_seconds_per_token(engine: TargetEngine) -> float:
    """Seconds per greedy token of ``engine`` (eager) after a short prompt."""
    ids = torch.arange(1, 1 + PROBE_TOKENS, device=engine.device)[None]
    engine.generate(ids, max_new_tokens=2)
    began = time.perf_counter()
    engine.generate(ids, max_new_tokens=TIMED_TOKENS)
    return (time.perf_counter() - began) / TIMED_TOKENS
