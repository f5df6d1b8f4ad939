"""Sampling verification follows the target's distribution exactly (chi-square tests)."""

import copy

import pytest
import torch
from scipy.stats import chisquare

from specforge.data.vocab import build_vocab_map
from specforge.engine.cpu.int8_linear import int8_linear_available, quantize_linears
from specforge.engine.generation import NUCLEUS_CANDIDATES, warp_probs
from specforge.engine.target import TargetEngine
from specforge.families import family
from specforge.families.dflash.model import DFlashConfig, build_dflash_model
from specforge.models.eagle3 import Eagle3Config, build_draft_model
from specforge.serving.sampling import accept_sampling
from specforge.serving.speculative import SpeculativeDecoder
from specforge.serving.tree import DraftTree
from tests.helpers import make_tiny_llama

VOCAB, DRAWS, TEMPERATURE = 8, 6000, 1.0
PROMPT = torch.tensor([[3, 1, 4, 1]])


@pytest.fixture(scope="module")
def models():
    target = make_tiny_llama(VOCAB, num_layers=4, seed=11, initializer_range=0.3).float()
    other = make_tiny_llama(VOCAB, num_layers=4, seed=12, initializer_range=0.3).float()
    config = Eagle3Config.from_target(target.config, draft_vocab_size=6)  # 2 ids unreachable
    vocab = build_vocab_map(torch.arange(VOCAB), 6)
    draft = build_draft_model(
        config,
        target_embedding=target.get_input_embeddings().weight,
        target_lm_head=other.get_output_embeddings().weight,
        d2t=vocab.d2t,
        t2d=vocab.t2d,
        seed=3,
    )
    return target, draft


@pytest.fixture(scope="module")
def compiled_engine(models):
    """The target's compiled engine, built once for the module (its graphs too)."""
    return TargetEngine(models[0], aux_layer_ids=[1, 1, 0], compile=True)


def exact_joint(target, length: int, top_p: float) -> dict[tuple[int, ...], float]:
    """P(first `length` sampled tokens) under the target, by enumerating prefixes."""
    probs = {(): 1.0}
    for _ in range(length):
        grown = {}
        for prefix, mass in probs.items():
            ids = torch.cat([PROMPT, torch.tensor([prefix], dtype=torch.long)], 1)
            with torch.no_grad():
                p = warp_probs(target(ids).logits[0, -1], TEMPERATURE, top_p)
            for token in range(VOCAB):
                grown[prefix + (token,)] = mass * float(p[token])
        probs = grown
    return probs


def sampling_decoder(target, draft, num_steps, topk, num_draft_tokens, top_p=1.0, engine=None):
    """The runtime sampling at :data:`TEMPERATURE` over the tiny target's aux layers (its
    forwards through ``engine`` when one is given)."""
    return SpeculativeDecoder(
        target,
        draft,
        aux_layer_ids=[1, 1, 0],
        num_steps=num_steps,
        topk=topk,
        num_draft_tokens=num_draft_tokens,
        temperature=TEMPERATURE,
        top_p=top_p,
        engine=engine,
    )


def draw(decoder, length: int) -> dict[tuple[int, ...], int]:
    generator = torch.Generator().manual_seed(1234)
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(DRAWS):
        tokens, _ = decoder.generate(PROMPT, max_new_tokens=length, generator=generator)
        counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
    return counts


def chi_square_p(counts, expected_probs, min_expected=5.0) -> float:
    """p-value of observed counts against expected probabilities (sparse cells pooled)."""
    cells = sorted(expected_probs, key=expected_probs.get, reverse=True)
    observed, expected, pool_o, pool_e = [], [], 0, 0.0
    for cell in cells:
        e = expected_probs[cell] * DRAWS
        if e >= min_expected:
            observed.append(counts.get(cell, 0))
            expected.append(e)
        else:
            pool_o += counts.get(cell, 0)
            pool_e += e
    if pool_e > 0:
        observed.append(pool_o)
        expected.append(pool_e)
    else:
        assert pool_o == 0, "draws in cells the target gives no mass"
    scale = sum(observed) / sum(expected)  # float rounding only; the expectations sum to 1
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


@pytest.mark.slow  # 6 x 6000 speculative generations, ~5.5 minutes on 2 cores
@pytest.mark.parametrize(
    ("topk", "num_steps", "num_draft_tokens", "top_p", "draft_dtype"),
    [
        (1, 2, None, 1.0, torch.float32),
        (1, 2, None, 0.8, torch.float32),
        (2, 2, 4, 1.0, torch.float32),
        (1, "auto", None, 1.0, torch.float32),
        (1, 2, None, 1.0, torch.bfloat16),  # bench.draft_dtype beside a float32 target
        (1, 2, None, 1.0, "int8"),  # bench.draft_quantize: bfloat16 with int8 weights
        (1, 2, None, 1.0, "engine"),  # the target's forwards through the compiled engine
        (2, 2, 4, 1.0, "engine"),
    ],
    ids=[
        "chain",
        "chain-top-p",
        "tree",
        "chain-auto-depth",
        "chain-bfloat16-draft",
        "chain-int8",
        "chain-compiled-engine",
        "tree-compiled-engine",
    ],
)
def test_speculative_sampling_matches_the_target(
    models, compiled_engine, topk, num_steps, num_draft_tokens, top_p, draft_dtype
):
    target, draft = models
    engine = compiled_engine if draft_dtype == "engine" else None
    draft_dtype = torch.float32 if draft_dtype == "engine" else draft_dtype
    draft = copy.deepcopy(draft).to(torch.bfloat16 if draft_dtype == "int8" else draft_dtype)
    if draft_dtype == "int8":
        if not int8_linear_available():
            pytest.skip("no int8 kernel in this build")
        quantize_linears(draft)
    decoder = sampling_decoder(
        target, draft, num_steps, topk, num_draft_tokens, top_p=top_p, engine=engine
    )
    # tokens 2 and 3 are decided by the first verification round
    counts = draw(decoder, 3)
    expected = exact_joint(target, 3, top_p)
    assert chi_square_p(counts, expected) > 1e-3
    # the second token alone (decided by accept / residual sampling)
    second = {v: sum(c for k, c in counts.items() if k[1] == v) for v in range(VOCAB)}
    expected_second = {v: sum(p for k, p in expected.items() if k[1] == v) for v in range(VOCAB)}
    assert chi_square_p(second, expected_second) > 1e-3
    # power: the same draws reject the second-token distribution with a 2% bias
    top = sorted(expected_second, key=expected_second.get, reverse=True)
    biased = dict(expected_second)
    biased[top[1]] -= 0.02
    biased[top[2]] += 0.02
    assert chi_square_p(second, biased) < 1e-3


@pytest.mark.slow  # 6000 speculative generations, ~40 s on 2 cores
def test_dflash_block_sampling_matches_the_target(models):
    """A DFlash block's slots are drawn in parallel from the draft's distribution there;
    rejection sampling over them keeps the target's distribution."""
    target, _ = models
    other = make_tiny_llama(VOCAB, num_layers=4, seed=12, initializer_range=0.3).float()
    config = DFlashConfig.from_target(target.config, mask_token_id=VOCAB - 1, block_size=3)
    draft = build_dflash_model(
        config,
        target_embedding=target.get_input_embeddings().weight,
        target_lm_head=other.get_output_embeddings().weight,
        seed=3,
    )
    decoder = SpeculativeDecoder(
        target,
        draft,
        proposer=family("dflash").proposer,
        aux_layer_ids=config.target_layer_ids,
        num_steps=2,
        temperature=TEMPERATURE,
    )
    counts = draw(decoder, 3)
    assert chi_square_p(counts, exact_joint(target, 3, 1.0)) > 1e-3


def test_sampling_needs_a_positive_temperature():
    with pytest.raises(ValueError, match="temperature > 0, got 0"):
        warp_probs(torch.zeros(4), 0)


def test_top_p_keeps_the_smallest_nucleus():
    probs = warp_probs(torch.tensor([[2.0, 1.0, 0.0, -1.0]]).log_softmax(-1) * 1.0, 1.0, 0.7)
    assert (probs[0, 2:] == 0).all() and torch.isclose(probs.sum(), torch.tensor(1.0))


def sorted_nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The nucleus by sorting the whole vocabulary: the reference."""
    probs = logits.float().softmax(-1)
    values, order = probs.sort(-1, descending=True)
    values = values.masked_fill(values.cumsum(-1) - values >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, values)
    return kept / kept.sum(-1, keepdim=True)


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.95, 0.999])
def test_top_p_ranks_the_top_candidates_first_and_sorts_only_wide_rows(top_p):
    generator = torch.Generator().manual_seed(0)
    vocab = 4 * NUCLEUS_CANDIDATES
    # peaked rows (nucleus within the top candidates), flat rows (nucleus past them) and 1-D input
    scales = torch.tensor([8.0, 4.0, 0.5, 0.1, 6.0])[:, None]
    logits = torch.randn(5, vocab, generator=generator) * scales
    probs = warp_probs(logits, 1.0, top_p)
    expected = sorted_nucleus(logits, top_p)
    assert torch.equal(probs, expected)
    assert torch.equal(warp_probs(logits[3], 1.0, top_p), expected[3])
    kept = (probs > 0).sum(-1)
    assert kept[0] < NUCLEUS_CANDIDATES and (top_p < 0.9 or kept[3] > NUCLEUS_CANDIDATES)


# -- deterministic checks of the acceptors (fast; the chi-square tests above are the slow proof)


def point_mass(token: int, vocab: int = VOCAB) -> torch.Tensor:
    probs = torch.zeros(vocab)
    probs[token] = 1.0
    return probs


def chain_outcome(tokens, draft_probs, target_probs, generator) -> tuple[int, int]:
    """``(accepted count, next token)`` of the acceptor on the chain ``tokens`` drawn from
    ``draft_probs``."""
    path, token = accept_sampling(DraftTree.chain(tokens, draft_probs), target_probs, generator)
    assert path == list(range(len(path)))
    return len(path), token


def test_the_acceptor_on_a_sampled_chain_keeps_tokens_the_target_is_sure_of():
    draft_tokens = torch.tensor([2, 5, 1])
    draft_probs = torch.stack([point_mass(t) for t in (2, 5, 1)])
    target_probs = torch.stack([point_mass(t) for t in (2, 5, 1, 7)])
    for seed in range(20):
        generator = torch.Generator().manual_seed(seed)
        assert chain_outcome(draft_tokens, draft_probs, target_probs, generator) == (3, 7)


def test_the_acceptor_on_a_sampled_chain_rejects_a_token_the_target_never_emits():
    draft_tokens = torch.tensor([2, 5])
    draft_probs = torch.stack([point_mass(2), point_mass(5)])
    # the target agrees on the first token, never emits the second (it wants 6 there)
    target_probs = torch.stack([point_mass(2), point_mass(6), point_mass(0)])
    for seed in range(20):
        generator = torch.Generator().manual_seed(seed)
        assert chain_outcome(draft_tokens, draft_probs, target_probs, generator) == (1, 6)


def test_the_acceptor_on_a_sampled_chain_resamples_from_the_residual_after_a_rejection():
    # draft all on token 0; target half on 0, half on 3: a rejection must then give 3
    draft_probs = point_mass(0)[None]
    target = torch.zeros(VOCAB)
    target[0] = target[3] = 0.5
    target_probs = torch.stack([target, point_mass(1)])
    outcomes = set()
    for seed in range(50):
        generator = torch.Generator().manual_seed(seed)
        outcomes.add(chain_outcome(torch.tensor([0]), draft_probs, target_probs, generator))
    assert outcomes == {(1, 1), (0, 3)}  # accepted then bonus, or rejected then the residual


def test_the_acceptor_on_a_tree_follows_the_child_the_target_draws():
    # root -> {4, 6}; node 1 (token 6) -> {2}
    tree = DraftTree(
        tokens=torch.tensor([4, 6, 2]),
        parents=torch.tensor([-1, -1, 1]),
        depths=torch.tensor([1, 1, 2]),
    )
    root, after_4, after_6, after_2 = point_mass(6), point_mass(0), point_mass(2), point_mass(5)
    target_probs = torch.stack([root, after_4, after_6, after_2])
    generator = torch.Generator().manual_seed(0)
    assert accept_sampling(tree, target_probs, generator) == ([1, 2], 5)
    # the target wants 7 at the root: no child matches, nothing accepted
    target_probs[0] = point_mass(7)
    assert accept_sampling(tree, target_probs, generator) == ([], 7)


@pytest.mark.parametrize(("topk", "num_steps", "num_draft_tokens"), [(1, 3, None), (2, 2, 4)])
def test_a_fixed_depth_sampled_run_is_reproducible_from_its_seed(
    models, topk, num_steps, num_draft_tokens
):
    """What the runtime promises for sampling (``SpeculativeDecoder``'s docstring): at a fixed
    depth the same seed gives the same tokens; ``auto``, whose depth follows wall-clock costs,
    only the same distribution."""
    target, draft = models
    runs = []
    for _ in range(2):
        decoder = sampling_decoder(target, draft, num_steps, topk, num_draft_tokens)
        generator = torch.Generator().manual_seed(7)
        runs.append(
            [decoder.generate(PROMPT, max_new_tokens=12, generator=generator)[0] for _ in range(5)]
        )
    assert runs[0] == runs[1] and len({tuple(t) for t in runs[0]}) > 1
