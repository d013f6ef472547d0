"""Seeded multi-agent workloads shaped like TokenDance's All-Gather rounds.

Every round, agent i's prompt is

    history_i SEP context_1 SEP ... SEP context_K SEP perm_i(m_1 .. m_N) SEP instruction_i

The context blocks (a broadcast event, a debate motion and its background document) and the
messages are byte-identical for all agents; only their offsets (the histories differ in
length) and, with `permute`, their order differ. That is the reuse TokenDance exploits and a
prefix cache cannot. Each message is its author's raw text (round 0: `seed_messages`; later:
`message_block(output_j)`, the previous round's generated text as is) preceded by a short
label piece "\nName:" of its own, so a message block is exactly the author's output and can
hit the segment the server registered for it (labels are below the minimum segment length,
so they stay private text).

Lengths are in words (whitespace-separated); English text is about 1.3 tokens a word.
"""

from __future__ import annotations

import dataclasses
import random
import string
from collections import ChainMap
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from sglang_tokendance.bench import text_pools as tp
from sglang_tokendance.core.segments import DEFAULT_SEPARATOR

Pools = Mapping[str, Sequence[str]]
Context = tuple[list[list[str]], dict[str, list[str]]]  # blocks per round, simulation-wide pools

MAX_AGENTS = len(tp.FIRST_NAMES) * len(tp.LAST_NAMES)  # distinct full names available


@dataclass(frozen=True)
class WorkloadConfig:
    """A workload's shape and seed. `max_new_tokens` is about 1.3 x `block_words` in the presets,
    so later rounds' generated messages are about as long as the seed messages."""

    preset: str = "generative_agents"
    num_agents: int = 4
    num_rounds: int = 3
    history_words: int = 100  # mean private-history length; each agent's is 0.6x to 1.4x of it
    block_words: int = 80  # length of each seed message and context block
    permute: bool = True  # each agent sees the messages in its own order
    conversation: bool = False  # each round's prompt extends the agent's previous prompt and answer
    blocks_cached: bool = False  # round 0's blocks were cached before (another simulation, earlier requests)
    max_new_tokens: int = 104
    seed: int = 0
    think_seconds: float = 0.0  # a simulation's pause between its rounds (its world steps, its agents act)

    def __post_init__(self) -> None:
        _check_preset(self.preset)
        for name in ("num_agents", "num_rounds", "block_words", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.think_seconds < 0:
            raise ValueError(f"think_seconds must be non-negative, got {self.think_seconds}")
        if self.history_words < 0:
            raise ValueError(f"history_words must be non-negative, got {self.history_words}")
        if self.num_agents > MAX_AGENTS:
            raise ValueError(f"num_agents must be at most {MAX_AGENTS}, got {self.num_agents}")


@dataclass(frozen=True)
class Agent:
    name: str  # full name; also the "Name:" prefix of the agent's message blocks
    role: str  # occupation, or the side ("for"/"against") in a debate
    persona: str
    history: str  # the private prompt prefix (persona, memories, notes); ends with "\n"


@dataclass(frozen=True)
class Simulation:
    config: WorkloadConfig
    agents: list[Agent]
    seed_messages: list[str]  # one formatted block per agent: the messages shared in round 0
    context: list[list[str]]  # per round: shared blocks ahead of the messages
    instruction_template: str  # fields: name, role, round (1-based), rounds

    def instruction(self, agent_index: int, round_index: int) -> str:
        self._check(agent_index, round_index)
        agent = self.agents[agent_index]
        return self.instruction_template.format(
            name=agent.name, role=agent.role, round=round_index + 1, rounds=self.config.num_rounds)

    def order(self, agent_index: int, round_index: int) -> list[int]:
        """The authors of agent_index's message blocks, in prompt order. Seeded by (seed, agent,
        round) alone, so any one prompt can be rebuilt without generating the others."""
        self._check(agent_index, round_index)
        authors = list(range(len(self.agents)))
        if self.config.permute:
            random.Random(f"{self.config.seed}:{agent_index}:{round_index}").shuffle(authors)
        return authors

    def prompt_pieces(self, agent_index: int, round_index: int,
                      shared_blocks: Sequence[str]) -> list[str]:
        """[history, *context blocks, then for each author j in this agent's order the label
        "\nName_j:" and shared_blocks[j], instruction]; `shared_blocks[j]` is agent j's
        message: a seed message, or `message_block(output_j)`."""
        if len(shared_blocks) != len(self.agents):
            raise ValueError(f"expected {len(self.agents)} shared blocks, one per agent, "
                             f"got {len(shared_blocks)}")
        messages = [piece for j in self.order(agent_index, round_index)
                    for piece in (f"\n{self.agents[j].name}:", shared_blocks[j])]
        return [self.agents[agent_index].history, *self.context[round_index], *messages,
                self.instruction(agent_index, round_index)]

    def round_pieces(self, agent_index: int, round_index: int, shared_blocks: Sequence[str],
                     earlier: Sequence[str] = ()) -> list[str]:
        """The pieces sent in a round. In a conversation (`config.conversation`) the agent's
        prompt grows: `earlier` (its previous round's pieces, then its answer as a piece of its
        own) comes first, then this round's pieces past the history; otherwise, and in the
        first round, `prompt_pieces`."""
        pieces = self.prompt_pieces(agent_index, round_index, shared_blocks)
        return [*earlier, *pieces[1:]] if self.config.conversation and earlier else pieces

    def prompt_text(self, agent_index: int, round_index: int, shared_blocks: Sequence[str],
                    separator: str = DEFAULT_SEPARATOR) -> str:
        return join_pieces(self.prompt_pieces(agent_index, round_index, shared_blocks), separator)

    def plain_prompt(self, agent_index: int, round_index: int,
                     shared_blocks: Sequence[str]) -> str:
        """The same text without markers, for servers that do not run TokenDance."""
        return self.prompt_text(agent_index, round_index, shared_blocks, separator="")

    def _check(self, agent_index: int, round_index: int) -> None:
        if not 0 <= agent_index < len(self.agents):
            raise ValueError(f"agent_index {agent_index} out of range [0, {len(self.agents)})")
        if not 0 <= round_index < self.config.num_rounds:
            raise ValueError(f"round_index {round_index} out of range "
                             f"[0, {self.config.num_rounds})")


@dataclass(frozen=True)
class _Style:
    """What makes a preset's text: persona, notes, messages and per-round shared context."""

    persona: str
    role_field: str  # the agent pool field that is the agent's role
    agent_fields: Callable[[random.Random, int], dict[str, str]]  # fixed facts of agent i
    notes_title: str
    note_templates: tuple[str, ...]
    footer: str
    message_lead: tuple[str, ...]  # templates every seed message opens with, in order
    message_templates: tuple[str, ...]
    instruction: str
    context: Callable[[WorkloadConfig, random.Random], Context]


def make_simulation(config: WorkloadConfig) -> Simulation:
    """Everything a benchmark needs for `config`; the same config gives the same text."""
    style = _STYLES[config.preset]
    rng = random.Random(config.seed)
    context, shared_pools = style.context(config, rng)
    names = _names(rng, config.num_agents)
    agents, seeds = [], []
    for i, name in enumerate(names):
        first, last = name.split(" ", 1)
        others = [n for n in names if n != name] or list(tp.TOWNSFOLK)
        fixed = {"first": first, "last": last, **style.agent_fields(rng, i)}
        pools = ChainMap({k: [v] for k, v in fixed.items()}, {"other": others}, shared_pools,
                         tp.POOLS)
        persona = _fill(rng, style.persona, pools)
        frame = f"You are {name}.\n{persona}\n\n{style.notes_title}\n"
        notes = _grow(rng, style.note_templates, pools,
                      _history_target(rng, config.history_words) - _words(frame + style.footer))
        history = frame + "".join(f"- {note}\n" for note in notes) + f"\n{style.footer}\n"
        agents.append(Agent(name, fixed[style.role_field], persona, history))
        seeds.append(message_block(" " + " ".join(_grow(
            rng, style.message_templates, pools, config.block_words, lead=style.message_lead))))
    return Simulation(config, agents, seeds, context, style.instruction)


def stand_in_messages(config: WorkloadConfig, round_index: int) -> list[str]:
    """Messages standing in for the outputs that round `round_index` shares, in prefill-only
    runs (nothing is generated): the seed messages of the same workload under another seed,
    one per agent, of the same length."""
    return make_simulation(dataclasses.replace(config, seed=config.seed + 7919 * round_index)).seed_messages


def preset_config(preset: str, **overrides) -> WorkloadConfig:
    """A preset's default config with some fields replaced (e.g. from CLI flags)."""
    _check_preset(preset)
    return dataclasses.replace(PRESETS[preset], **overrides)


def _check_preset(preset: str) -> None:
    if preset not in _STYLES:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(_STYLES)}")


def join_pieces(pieces: Sequence[str], separator: str = DEFAULT_SEPARATOR) -> str:
    """A prompt's text: its pieces joined by the separator ("" for a plain prompt)."""
    if separator and any(separator in piece for piece in pieces):
        raise ValueError(f"a prompt piece contains the separator {separator!r}")
    return separator.join(pieces)


def message_block(text: str) -> str:
    """A message as its shared block: the text as is (so it keeps the hash of the segment the
    server registered for that output); an empty reply becomes a placeholder, since an empty
    segment is not a valid prompt."""
    return text if text.strip() else " (no reply)"


def _words(text: str) -> int:
    return len(text.split())


def _history_target(rng: random.Random, words: int) -> int:
    return round(words * rng.uniform(0.6, 1.4))


def _names(rng: random.Random, n: int) -> list[str]:
    """n distinct full names, with distinct first names while they last: the k-th reuse of a
    first name shifts its surname by k, so repeats get new surnames."""
    firsts = rng.sample(tp.FIRST_NAMES, len(tp.FIRST_NAMES))
    lasts = rng.sample(tp.LAST_NAMES, len(tp.LAST_NAMES))
    cycle = len(firsts)
    return [f"{firsts[i % cycle]} {lasts[(i % cycle + i // cycle) % len(lasts)]}"
            for i in range(n)]


def _fill(rng: random.Random, template: str, pools: Pools) -> str:
    """Fill each field from its pool; `{x2}` draws another `x`, distinct from `{x}` if it can."""
    values: dict[str, str] = {}
    for _, field, _, _ in string.Formatter().parse(template):
        if field and field not in values:
            base = field.rstrip("0123456789")
            taken = {v for k, v in values.items() if k.rstrip("0123456789") == base}
            choices = [c for c in pools[base] if c not in taken] or pools[base]
            values[field] = rng.choice(choices)
    return template.format(**values)


def _grow(rng: random.Random, templates: Sequence[str], pools: Pools, words: int,
          lead: Sequence[str] = ()) -> list[str]:
    """Sentences until they reach `words` words: the `lead` templates in order, then `templates`
    in shuffled rounds, so none repeats before all have been used."""
    sentences: list[str] = []
    count = 0
    leading = iter(lead)
    deck: list[str] = []
    while count < words:
        template = next(leading, None)
        if template is None:
            deck = deck or rng.sample(templates, len(templates))
            template = deck.pop()
        sentence = _fill(rng, template, pools)
        sentences.append(sentence)
        count += _words(sentence)
    return sentences


def _town_facts(rng: random.Random, index: int) -> dict[str, str]:
    return {"age": str(rng.randint(19, 79)), "occupation": rng.choice(tp.POOLS["occupation"])}


def _resident_facts(rng: random.Random, index: int) -> dict[str, str]:
    income = rng.randrange(1500, 9000, 50)
    return {**_town_facts(rng, index), "district": rng.choice(tp.POOLS["district"]),
            "household": str(rng.randint(1, 6)), "income": f"{income:,}",
            "savings": f"{rng.randrange(0, 40000, 100):,}",
            "rent": f"{rng.randrange(income // 5, income // 2, 10):,}"}


def _debater_facts(rng: random.Random, index: int) -> dict[str, str]:
    return {"occupation": rng.choice(tp.POOLS["occupation"]),
            "side": "for" if index % 2 == 0 else "against"}


def _no_context(config: WorkloadConfig, rng: random.Random) -> Context:
    return [[] for _ in range(config.num_rounds)], {}


def _broadcasts(config: WorkloadConfig, rng: random.Random) -> Context:
    """One city broadcast per round, each about a different event while they last."""
    events = rng.sample(tp.EVENTS, len(tp.EVENTS))
    return [[f"City broadcast, day {r + 1}: " + " ".join(_grow(
        rng, tp.NEWS_FOLLOWUPS, tp.POOLS, config.block_words, lead=events[r % len(events)])) + "\n"]
        for r in range(config.num_rounds)], {}


_BACKGROUND_PARTS = 3


def _motion(config: WorkloadConfig, rng: random.Random) -> Context:
    """The motion and a background document in parts, the same blocks in every round."""
    motion, subject = rng.choice(tp.MOTIONS)
    shared_pools = {"subject": [subject]}
    pools = ChainMap(shared_pools, tp.POOLS)
    blocks = [tp.DEBATE_RULES.format(motion=motion) + "\n"] + [
        f"Background document, part {k + 1} of {_BACKGROUND_PARTS}:\n"
        + " ".join(_grow(rng, tp.BACKGROUND_TEMPLATES, pools, config.block_words)) + "\n"
        for k in range(_BACKGROUND_PARTS)]
    return [list(blocks) for _ in range(config.num_rounds)], shared_pools


_STYLES: dict[str, _Style] = {
    "generative_agents": _Style(
        persona=tp.PERSONA, role_field="occupation", agent_fields=_town_facts,
        notes_title="Memories:", note_templates=tp.MEMORY_TEMPLATES,
        footer="What everyone in town said in the last round:",
        message_lead=(), message_templates=tp.STATEMENT_TEMPLATES,
        instruction="\nRound {round} of {rounds}. You are {name}, the town's {role}. In a few "
                    "sentences, react to what the others said above and say what you will do "
                    "next.\n{name}:",
        context=_no_context),
    "agentsociety": _Style(
        persona=tp.PROFILE + "\n" + tp.ECONOMY, role_field="occupation",
        agent_fields=_resident_facts, notes_title="Past actions:",
        note_templates=tp.PAST_ACTION_TEMPLATES,
        footer="Today's city broadcast and your neighbours' latest posts:",
        message_lead=(), message_templates=tp.POST_TEMPLATES,
        instruction="\nDay {round} of {rounds}. You are {name} ({role}). Considering the "
                    "broadcast and your neighbours' posts above, decide how you will spend, save, "
                    "work and travel today, then write a short post for your neighbours.\n{name}:",
        context=_broadcasts),
    "debate": _Style(
        persona=tp.DEBATER, role_field="side", agent_fields=_debater_facts,
        notes_title="Your prepared notes:", note_templates=tp.ARGUMENT_TEMPLATES,
        footer="The motion, the background document and the latest speeches follow:",
        message_lead=(tp.OPENING,), message_templates=tp.ARGUMENT_TEMPLATES,
        instruction="\nRound {round} of {rounds}. You are {name}, speaking {role} the motion. "
                    "Rebut the strongest argument made above and add one new argument of your "
                    "own.\n{name}:",
        context=_motion),
}

# Defaults keep the shared blocks most of every prompt, as in the paper's workloads.
PRESETS: dict[str, WorkloadConfig] = {
    "generative_agents": WorkloadConfig("generative_agents", num_agents=4, history_words=100,
                                        block_words=80, max_new_tokens=104),
    "agentsociety": WorkloadConfig("agentsociety", num_agents=8, history_words=150,
                                   block_words=60, max_new_tokens=80),
    "debate": WorkloadConfig("debate", num_agents=4, history_words=80, block_words=100,
                             max_new_tokens=128),
}
