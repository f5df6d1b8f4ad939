"""Second turns the target writes over its own answers: which conversations get one."""

from specforge.config import SynthesizeConfig
from specforge.distill.follow_ups import is_candidate


def record(record_id, turns=1, answered=True):
    messages = []
    for t in range(turns):
        messages += [{"role": "user", "content": f"q{t}"}, {"role": "assistant", "content": "a"}]
    return {"id": record_id, "messages": messages if answered else messages[:-1]}


def test_the_share_of_answered_synthesized_conversations_is_picked():
    ids = [f"synth-0-{i}" for i in range(2000)]
    synthesized = set(ids)
    half = SynthesizeConfig(follow_ups=0.5)
    picked = [i for i in ids if is_candidate(record(i), synthesized, half)]
    assert 900 < len(picked) < 1100
    # the same ones on every call (a hash of seed and id), and a larger share keeps them
    assert picked == [i for i in ids if is_candidate(record(i), synthesized, half)]
    more = SynthesizeConfig(follow_ups=0.8)
    assert set(picked) <= {i for i in ids if is_candidate(record(i), synthesized, more)}
    every = SynthesizeConfig(follow_ups=1.0)
    assert all(is_candidate(record(i), synthesized, every) for i in ids)
    assert not any(is_candidate(record(i), synthesized, SynthesizeConfig()) for i in ids)
    # never: a conversation that was not synthesized, one not answered, one with two turns
    # already; regenerate.num_samples' copies are synthesized
    assert not is_candidate(record("builtin-writing-001"), synthesized, every)
    assert not is_candidate(record(ids[0], answered=False), synthesized, every)
    assert not is_candidate(record(ids[0], turns=2), synthesized, every)
    assert is_candidate(record(ids[0] + "#s1"), synthesized, every)
