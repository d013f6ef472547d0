"""Unmarked prompts on a server with its defaults: the same text after other text is read from
its author's Masters past the chunks it shares whole (core/plan's extension into the missed
neighbours, where the content-defined cuts fall inside the shared text's head and tail)."""

from __future__ import annotations

import pytest
import requests

from conftest import emptied, generate

pytestmark = pytest.mark.slow

SHARED = ("The council met at dawn in the old granary by the river. Mira reported that the mill wheel cracked "
          "during the storm and that the bakery has flour for four more days. Oskar offered to repair the wheel "
          "if the smith lends him iron bands, and the council agreed to pay him in grain after the harvest.")
AUTHOR = ("You are Ada, the weaver of Oakvale, and you keep careful notes of every meeting. Notes: " + SHARED
          + " Ada says:")
READER = ("You are Bram, the ferryman, who hears every rumour on the river first. Today's news: " + SHARED
          + " Bram says:")


def test_a_shared_text_is_read_past_the_chunks_it_shares_whole(default_server_url):
    url = emptied(default_server_url)
    author = generate(url, AUTHOR, 1)["meta_info"]["tokendance"]
    meta = generate(url, READER, 4)["meta_info"]
    reader = meta["tokendance"]
    cached = {span["hash"] for span in author["segments"]}
    whole = sum(span["end"] - span["start"] for span in reader["segments"] if span["hash"] in cached)
    assert reader["segment_hits"] >= 1 and whole > 0
    # the chunk found whole, and the shared text's head and tail in the chunks beside it
    assert whole < reader["reused_tokens"] <= meta["prompt_tokens"] - len(" Bram says:".split())


def chat(url: str, messages: list[dict], max_tokens: int) -> dict:
    r = requests.post(url + "/v1/chat/completions", timeout=900, json={
        "model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    r.raise_for_status()
    return r.json()


def test_a_transcript_pasted_into_one_chat_message_is_read_by_the_next_agent(default_server_url):
    """An unmodified chat client that sends the group's transcript as one user message after
    its own system message: the second agent's message holds the same turns after another
    opening, and reads them from the first agent's chunks (one segment per message would miss)."""
    url = emptied(default_server_url)
    turns = "\n".join(f"{name}: {SHARED}" if i == 1 else f"{name}: I will bring {i + 2} sacks of rye to the mill."
                      for i, name in enumerate(["Mira", "Oskar", "Ada"]))

    def agent(persona: str) -> list[dict]:
        return [{"role": "system", "content": f"You are {persona} of Oakvale."},
                {"role": "user", "content": f"The log of the meeting, as {persona.split(',')[0]} heard it:\n{turns}\n"
                                            "What do you say?"}]

    chat(url, agent("Ada, the weaver"), 1)
    reader = chat(url, agent("Bram, the ferryman"), 4)["metadata"]["tokendance"]
    assert reader["segment_hits"] >= 2 and reader["reused_tokens"] > 0


def test_a_long_answer_quoted_in_another_agents_user_message_is_read_from_its_chunks(default_server_url):
    """An unmodified chat framework hands one agent's answer to another as a user message. A
    message that long is cut into content chunks; the answer, registered when it finished, is
    cached as its chunks too, so the quoting agent reads it from its author's slots."""
    url = emptied(default_server_url)
    r = requests.post(url + "/v1/chat/completions", timeout=900, json={
        "model": "default", "max_tokens": 64, "temperature": 0, "ignore_eos": True, "messages": [
            {"role": "system", "content": "You are Ada, the weaver of Oakvale."},
            {"role": "user", "content": "Tell the council what you saw at the river this morning, in detail."}]})
    r.raise_for_status()
    answer = r.json()["choices"][0]["message"]["content"]
    reader = chat(url, [{"role": "system", "content": "You are Bram, the ferryman, who hears every rumour."},
                        {"role": "user", "content": answer},
                        {"role": "user", "content": "Bram, what do you say to Ada?"}], 4)["metadata"]["tokendance"]
    assert reader["segment_hits"] >= 2 and reader["reused_tokens"] > 0
