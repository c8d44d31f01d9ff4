"""The step plan: which path a step takes, its packed tokens, the logits rows its guesses need,
and when a lone token is padded (runtime/step_plan.py). Built from hand-made chunks and a real
scheduler and block manager; asserted on exact arrays."""

import numpy as np

from llmc.runtime.block_manager import BlockManager
from llmc.runtime.prompt_lookup import PromptLookup
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.scheduler import Chunk, Request, Scheduler, SchedulerConfig
from llmc.runtime.step_plan import PACKED, WHOLE_GRAPH, StepPaths, StepPlanner, choose_path, pack

WHOLE = StepPaths(whole_graph_rows=4, padding_row=True)


def request(name, prompt, outputs=()):
    r = Request(name, list(prompt), SamplingParams(max_new_tokens=50))
    for token in outputs:
        r.add_output(token)
    return r


def test_the_path_is_the_whole_graph_for_one_sequence_or_decodes_that_fit_its_rows():
    assert choose_path(WHOLE, 1, 300) == WHOLE_GRAPH  # a prompt alone
    assert choose_path(WHOLE, 4, 4) == WHOLE_GRAPH  # four decodes
    assert choose_path(WHOLE, 5, 5) == PACKED  # more decodes than rows
    assert choose_path(WHOLE, 2, 3) == PACKED  # a decode with a guess beside another
    assert choose_path(StepPaths(), 1, 1) == PACKED  # no whole graph


def test_decodes_pack_one_token_each_and_ask_for_every_row():
    a, b = request("a", [5, 6, 7], [8]), request("b", [9], [10, 11])
    plan = pack([Chunk(a, 3, 1), Chunk(b, 2, 1)], [[4], [2, None, 7]], WHOLE)
    assert plan.path == WHOLE_GRAPH and not plan.pad
    np.testing.assert_array_equal(plan.tokens, [8, 11])
    np.testing.assert_array_equal(plan.positions, [3, 2])
    np.testing.assert_array_equal(plan.batch.block_tables, [[4, 0, 0], [2, 0, 7]])  # None (behind a window): 0
    np.testing.assert_array_equal(plan.batch.query_start_loc, [0, 1, 2])
    np.testing.assert_array_equal(plan.rows, [0, 1])


def test_a_prompt_chunk_beside_a_decode_with_guesses_asks_for_the_guesses_rows():
    a, b = request("a", range(10)), request("b", [1, 2], [3])
    plan = pack([Chunk(a, 4, 6), Chunk(b, 2, 3, draft=(4, 5))], [[0], [1]], WHOLE)
    assert plan.path == PACKED
    np.testing.assert_array_equal(plan.tokens, [4, 5, 6, 7, 8, 9, 3, 4, 5])
    np.testing.assert_array_equal(plan.positions, [4, 5, 6, 7, 8, 9, 2, 3, 4])
    np.testing.assert_array_equal(plan.batch.context_lens, [4, 2])
    np.testing.assert_array_equal(plan.rows, [5, 6, 7, 8])  # a's last; b's token and its two guesses
    assert str(plan) == "step packed: 2 seqs (1 decodes), 9 tokens, 2 guesses, 4 logits rows"


def test_only_a_lone_token_of_a_guessing_request_on_the_whole_graph_is_padded():
    a = request("a", [1, 2, 3])
    assert pack([Chunk(a, 2, 1)], [[0]], WHOLE, exact=True).pad
    assert not pack([Chunk(a, 2, 1)], [[0]], WHOLE, exact=False).pad
    assert not pack([Chunk(a, 0, 3)], [[0]], WHOLE, exact=True).pad  # several tokens: no padding row
    assert not pack([Chunk(a, 2, 1)], [[0]], StepPaths(4, padding_row=False), exact=True).pad
    assert not pack([Chunk(a, 2, 1)], [[0]], StepPaths(), exact=True).pad  # packed


def test_the_planner_adds_a_lone_requests_guesses_and_holds_their_slots():
    blocks = BlockManager(8, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4).filled(4, 512, lone_prompt_uses_budget=True), blocks)
    r = request("r", [1, 2, 3, 1, 2, 3, 1, 2])  # its last tokens repeat: a guess "3, 1, 2"
    scheduler.add(r)
    planner = StepPlanner(WHOLE, 4, True, scheduler, lambda req: 50)
    prefill = planner.plan(scheduler.schedule(), {})
    assert prefill.path == WHOLE_GRAPH and len(prefill.tokens) == 8
    r.num_computed = 8
    blocks.mark_computed("r", 8)
    r.add_output(3)
    lookups = {"r": PromptLookup(r.token_ids)}
    plan = planner.plan(scheduler.schedule(), lookups)
    (chunk,) = plan.chunks
    assert chunk.draft == (1, 2, 3, 1) and plan.tokens.tolist() == [3, 1, 2, 3, 1]
    assert blocks.num_tokens("r") == 13  # the guesses' slots are held
    assert plan.path == WHOLE_GRAPH and not plan.pad  # several tokens
    np.testing.assert_array_equal(plan.rows, np.arange(5))
    assert str(plan) == "step whole-graph: 1 seqs (1 decodes), 5 tokens, 4 guesses, 5 logits rows"
