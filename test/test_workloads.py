"""bench/workloads: seeded multi-agent prompts with shared blocks at per-agent offsets."""

from __future__ import annotations

import dataclasses

import pytest

from sglang_tokendance.bench.workloads import (
    message_block,
    PRESETS, WorkloadConfig, make_simulation, preset_config,
)
from sglang_tokendance.core.segments import DEFAULT_SEPARATOR as SEP

NAMES = sorted(PRESETS)


def all_prompts(sim, separator=SEP) -> list[str]:
    return [sim.prompt_text(i, r, sim.seed_messages, separator)
            for i in range(len(sim.agents)) for r in range(sim.config.num_rounds)]


@pytest.fixture(params=NAMES)
def sim(request):
    return make_simulation(PRESETS[request.param])


def test_presets_cover_the_three_workloads():
    assert NAMES == ["agentsociety", "debate", "generative_agents"]
    assert all(PRESETS[name].preset == name for name in NAMES)


def test_same_seed_gives_same_prompts(sim):
    again = make_simulation(sim.config)
    assert again == sim
    assert all_prompts(again) == all_prompts(sim)


def test_different_seed_gives_different_prompts(sim):
    other = make_simulation(dataclasses.replace(sim.config, seed=sim.config.seed + 1))
    assert other.seed_messages != sim.seed_messages
    assert [a.history for a in other.agents] != [a.history for a in sim.agents]


def test_prompt_pieces_structure(sim):
    for i, agent in enumerate(sim.agents):
        for r in range(sim.config.num_rounds):
            pieces = sim.prompt_pieces(i, r, sim.seed_messages)
            messages = [p for j in sim.order(i, r)
                        for p in (f"\n{sim.agents[j].name}:", sim.seed_messages[j])]
            assert pieces == [agent.history, *sim.context[r], *messages, sim.instruction(i, r)]
            assert pieces[0].endswith("\n") and pieces[-1].startswith("\n")
            assert all(p.endswith("\n") for p in pieces[1:1 + len(sim.context[r])])
            assert agent.name in pieces[-1]


def test_message_blocks_are_raw_outputs_behind_their_own_label(sim):
    assert message_block("  hello there \n") == "  hello there \n"  # kept byte for byte
    assert message_block("  \n") == " (no reply)"
    outputs = [message_block(f" output {j}") for j in range(len(sim.agents))]
    pieces = sim.prompt_pieces(0, 1, outputs)
    for j, agent in enumerate(sim.agents):  # every agent's own message is in its prompt too
        at = pieces.index(outputs[j])
        assert pieces[at - 1] == f"\n{agent.name}:"
        assert sim.seed_messages[j].startswith(" ") and sim.seed_messages[j].strip()


def test_text_joins_pieces_with_and_without_separator(sim):
    for i in range(len(sim.agents)):
        pieces = sim.prompt_pieces(i, 1, sim.seed_messages)
        text = sim.prompt_text(i, 1, sim.seed_messages)
        assert text == SEP.join(pieces) and text.split(SEP) == pieces
        assert sim.plain_prompt(i, 1, sim.seed_messages) == "".join(pieces)


def test_shared_blocks_identical_across_agents_at_different_offsets(sim):
    prompts = [sim.plain_prompt(i, 0, sim.seed_messages) for i in range(len(sim.agents))]
    shared = sim.context[0] + sim.seed_messages
    for block in shared:
        assert all(p.count(block) == 1 for p in prompts)
        assert len({p.index(block) for p in prompts}) > 1


def test_permutation_per_agent_and_round():
    sim = make_simulation(preset_config("agentsociety", permute=True))
    n, rounds = len(sim.agents), sim.config.num_rounds
    orders = [sim.order(i, r) for i in range(n) for r in range(rounds)]
    assert all(sorted(o) == list(range(n)) for o in orders)
    assert len({tuple(o) for o in orders}) > n  # agents, and rounds, see their own orders
    assert make_simulation(sim.config).order(3, 2) == sim.order(3, 2)

    fixed = make_simulation(dataclasses.replace(sim.config, permute=False))
    assert all(fixed.order(i, r) == list(range(n)) for i in range(n) for r in range(rounds))


def test_shared_fraction_at_defaults(sim):
    for i in range(len(sim.agents)):
        for r in range(sim.config.num_rounds):
            words = [len(p.split()) for p in sim.prompt_pieces(i, r, sim.seed_messages)]
            assert sum(words[1:-1]) / sum(words) >= 0.5


def test_histories_distinct_and_lengths_vary(sim):
    histories = [a.history for a in sim.agents]
    assert len(set(histories)) == len(histories)
    assert len({len(h.split()) for h in histories}) > 1


def test_separator_never_inside_generated_text(sim):
    pieces = [a.history for a in sim.agents] + sim.seed_messages + [
        b for blocks in sim.context for b in blocks] + [
        sim.instruction(i, r) for i in range(len(sim.agents)) for r in range(sim.config.num_rounds)]
    assert not any("tokendance_sep" in p for p in pieces)


@pytest.mark.parametrize("preset", NAMES)
def test_many_agents(preset):
    sim = make_simulation(preset_config(preset, num_agents=64))
    assert len({a.name for a in sim.agents}) == 64
    assert len({a.history for a in sim.agents}) == 64
    pieces = sim.prompt_pieces(63, sim.config.num_rounds - 1, sim.seed_messages)
    assert len(pieces) == 2 + len(sim.context[-1]) + 2 * 64  # a label and a message per author


def test_names_stay_distinct_past_the_first_name_pool():
    sim = make_simulation(WorkloadConfig(num_agents=200, history_words=0, block_words=1))
    assert len({a.name for a in sim.agents}) == 200


@pytest.mark.parametrize("kwargs, match", [
    ({"num_agents": 0}, "num_agents"),
    ({"num_rounds": 0}, "num_rounds"),
    ({"block_words": 0}, "block_words"),
    ({"history_words": -1}, "history_words"),
    ({"preset": "town"}, "unknown preset 'town'"),
])
def test_invalid_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WorkloadConfig(**kwargs)


def test_invalid_use():
    with pytest.raises(ValueError, match="unknown preset"):
        preset_config("town")
    sim = make_simulation(PRESETS["debate"])
    with pytest.raises(ValueError, match="one per agent"):
        sim.prompt_pieces(0, 0, sim.seed_messages[:-1])
    with pytest.raises(ValueError, match="round_index"):
        sim.prompt_pieces(0, sim.config.num_rounds, sim.seed_messages)
    with pytest.raises(ValueError, match="agent_index"):
        sim.prompt_pieces(-1, 0, sim.seed_messages)
    with pytest.raises(ValueError, match="separator"):
        sim.prompt_text(0, 1, [f"a {SEP} b"] * len(sim.agents))


def test_a_conversation_prompt_extends_the_previous_prompt_and_answer(sim):
    talk = make_simulation(dataclasses.replace(sim.config, conversation=True))
    first = talk.round_pieces(0, 0, talk.seed_messages)
    assert first == sim.prompt_pieces(0, 0, sim.seed_messages) == sim.round_pieces(0, 0, sim.seed_messages)
    earlier = [*first, " my answer"]
    second = talk.round_pieces(0, 1, talk.seed_messages, earlier)
    assert second[:len(earlier)] == earlier
    assert second[len(earlier):] == talk.prompt_pieces(0, 1, talk.seed_messages)[1:]
    assert sim.round_pieces(0, 1, sim.seed_messages, earlier) == sim.prompt_pieces(0, 1, sim.seed_messages)
