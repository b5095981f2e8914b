"""The scheduler alone, with no model: steps are simulated (schedule, launch, one token sampled where a sequence's
last token ran, record). Decodes before prompt chunks under the token budget, admission in arrival order within
max_num_seqs, preemption of the latest arrival when KV blocks run out (named for the runner's input batch), prefix
cache hits, and the encoder's budget and readiness cutting a chunk before an image."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from fovea.core.request import MMItem, MMSpan, RequestInput
from fovea.core.sampling_params import SamplingParams
from fovea.engine.block_manager import BlockManager
from fovea.engine.encoder_cache import EncoderCache
from fovea.engine.scheduler import Scheduler
from fovea.engine.sequence import Request, Sequence

BLOCK = 4


def scheduler(
    budget=16,
    max_seqs=8,
    blocks=64,
    prefix_caching=True,
    encoder_tokens=0,
    encoder_budget=None,
    whole_images=False,
    max_loras=0,
    max_model_len=1024,
):
    config = SimpleNamespace(
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        enable_lora=max_loras > 0,
        max_loras=max_loras,
        encoder_budget=encoder_budget or budget,
        max_model_len=max_model_len,
        model=SimpleNamespace(bidirectional_images=whole_images),
    )
    return Scheduler(config, BlockManager(blocks, BLOCK, prefix_caching), EncoderCache(encoder_tokens))


def sequence(
    seq_id: int, prompt: list[int], max_tokens=100, images: list[MMItem] = (), priority=0, n=1, **request
) -> Sequence:
    """A request's first sequence; `request`: RequestInput's fields (lora) and SamplingParams' (prompt_logprobs)."""
    lora = request.pop("lora", None)
    params = SamplingParams(max_tokens=max_tokens, n=n, **request)
    request = Request(RequestInput(f"r{seq_id}", prompt, params, mm_items=list(images), lora=lora))
    request.input.arrival_index, request.input.priority = seq_id, priority
    seq = Sequence(seq_id, request)
    request.sequences.append(seq)
    return seq


def image(start: int, length: int, key: str) -> MMItem:
    return MMItem(MMSpan(start, length, key), (1, 2, 2 * length), np.zeros((1, 1, 3), np.uint8))


def step(sched: Scheduler) -> dict[int, int]:
    """One step: {sequence id: tokens it ran}; a sequence whose last token ran gains a sampled one."""
    return step_recorded(sched, sched.schedule())


def step_recorded(sched: Scheduler, batch) -> dict[int, int]:
    sched.launched(batch)
    for seq in batch.seqs:
        if seq.num_pending:  # its last token ran: one is sampled
            seq.num_pending -= 1
            seq.token_ids.append(7)
    sched.step_done(batch)
    return dict(zip((s.seq_id for s in batch.seqs), batch.num_new_tokens))


def step_with_images(sched: Scheduler) -> dict[int, int]:
    """`step`, for prompts of max_tokens=1 with images: a sequence that sampled finishes, and the encoder has the
    images the step handed it done by the next step."""
    batch = sched.schedule()
    ran = step_recorded(sched, batch)
    for seq in batch.seqs:
        if seq.num_output_tokens:
            sched.finish(seq)
    for item in batch.step.encode:
        sched.encoder_cache.put(item.content_hash, torch.zeros(item.span.length, 4))
    return ran


def test_decodes_first_then_prompt_chunks_under_the_budget():
    sched = scheduler(budget=16)
    first = sequence(0, list(range(10)))
    sched.add(first)
    assert step(sched) == {0: 10}  # the whole prompt fits
    long = sequence(1, list(range(100, 140)))  # 40 tokens: chunked
    sched.add(long)
    assert step(sched) == {0: 1, 1: 15}  # the decode first, the chunk fills what is left
    assert step(sched) == {0: 1, 1: 15}
    assert step(sched) == {0: 1, 1: 10}  # the prompt's last chunk, then both decode
    assert step(sched) == {0: 1, 1: 1}


def test_admission_in_arrival_order_within_max_num_seqs():
    sched = scheduler(budget=64, max_seqs=2)
    seqs = [sequence(i, [i] * 5) for i in range(4)]
    for seq in reversed(seqs):  # added in any order, admitted by arrival
        sched.add(seq)
    assert step(sched) == {0: 5, 1: 5}
    sched.finish(seqs[0])
    assert step(sched) == {1: 1, 2: 5}


def test_the_latest_arrival_is_preempted_when_blocks_run_out_and_is_named_for_the_runner():
    sched = scheduler(budget=64, blocks=6, prefix_caching=False)
    early, late = sequence(0, list(range(8))), sequence(1, list(range(50, 58)))
    sched.add(early)
    sched.add(late)
    assert step(sched) == {0: 8, 1: 8}  # 2 blocks each, 2 free
    for _ in range(4):  # each grows into its third block (4 tokens)
        assert step(sched) == {0: 1, 1: 1}
    batch = sched.schedule()  # the next token needs a fourth block each: the late one gives its blocks up
    assert sched.num_preemptions == 1 and [s.seq_id for s in batch.seqs] == [0]
    assert late.num_computed_tokens == 0 and late.block_table == [] and late in sched.waiting
    assert batch.step.relaid == [1]  # the runner lays it out afresh when it comes back


def test_priorities_order_admission_and_the_lowest_priority_is_preempted_first():
    """--scheduling-policy priority (the front end lets non-zero priorities through only then): the lowest value is
    admitted first, arrival breaking ties, and when KV blocks run out the running sequence with the highest value
    gives its blocks up, however early it arrived."""
    sched = scheduler(budget=64, max_seqs=2, blocks=6, prefix_caching=False)
    seqs = [sequence(i, list(range(10 * i, 10 * i + 8)), priority=p) for i, p in enumerate([5, 1, 1, 0])]
    for seq in seqs:
        sched.add(seq)
    assert step(sched) == {3: 8, 1: 8}  # priority 0, then the first of the two 1s
    for _ in range(4):
        assert step(sched) == {3: 1, 1: 1}
    batch = sched.schedule()  # each needs a fourth block, none is free: the priority-1 one, not the latest, gives way
    assert sched.num_preemptions == 1 and [s.seq_id for s in batch.seqs] == [3]
    assert seqs[1] in sched.waiting and [s.seq_id for s in sched.waiting] == [1, 2, 0]


def test_a_second_sequence_starts_after_the_cached_prefix():
    sched = scheduler(budget=64)
    shared = list(range(12))  # three full blocks
    sched.add(sequence(0, shared + [99]))
    step(sched)
    second = sequence(1, shared + [55, 56])
    sched.add(second)
    assert step(sched) == {0: 1, 1: 2}  # only what the cache lacks
    assert second.num_computed_tokens == 14 and sched.prefix_cache_hits == 12
    assert second.request.num_cached_tokens == 12


def test_blocks_filled_by_generated_tokens_are_cached_for_a_next_turn():
    sched = scheduler(budget=64)
    first = sequence(0, list(range(6)))  # one full block and 2 tokens
    sched.add(first)
    for _ in range(7):  # the prompt, then 6 decodes: tokens 0-11 computed; blocks 1 and 2 filled by decodes
        step(sched)
    assert first.num_computed_tokens == 12 and len(first.token_ids) == 13
    turn = sequence(1, first.token_ids + [55])  # a next turn: the conversation so far, then more
    sched.add(turn)
    assert step(sched) == {0: 1, 1: 2}  # blocks 0-2 came from the cache, 6 generated tokens included
    assert turn.request.num_cached_tokens == 12


def test_a_chunk_stops_before_an_image_the_encoder_has_not_finished():
    sched = scheduler(budget=64, encoder_tokens=100, encoder_budget=8)
    first = sequence(0, [1, 2] + [9] * 8 + [3] * 4 + [9] * 8 + [4], images=[image(2, 8, "a"), image(14, 8, "b")])
    sched.add(first)
    batch = sched.schedule()  # the text before the first image; both images go to the encoder, one per step
    assert batch.num_new_tokens == [2] and [i.content_hash for i in batch.step.encode] == ["a"]
    sched.launched(batch)
    sched.step_done(batch)
    sched.encoder_cache.put("a", torch.zeros(8, 4))
    batch = sched.schedule()
    assert batch.num_new_tokens == [12] and [i.content_hash for i in batch.step.encode] == ["b"]  # up to image b
    sched.launched(batch)
    sched.step_done(batch)
    sched.encoder_cache.put("b", torch.zeros(8, 4))
    assert step(sched) == {0: 9}  # the rest of the prompt


def test_a_chunk_never_ends_inside_an_image_seen_both_ways():
    """Gemma 3's image tokens see their image's later tokens: a chunk that stopped inside an image would compute
    its first tokens without them. Such a model's chunk stops before the image instead (another model's cuts it)."""
    prompt = [1, 2, 3, 4] + [9] * 8 + [5] * 6  # the image at 4-11, a budget of 10
    cuts = {}
    for whole in (False, True):
        sched = scheduler(budget=10, encoder_tokens=100, whole_images=whole)
        sched.encoder_cache.reserve("a", 8)
        sched.encoder_cache.put("a", torch.zeros(8, 4))
        sched.add(sequence(0, prompt, images=[image(4, 8, "a")]))
        cuts[whole] = [step(sched)[0] for _ in range(3)]
    assert cuts == {False: [10, 8, 1], True: [4, 10, 4]}


def test_a_sequence_waiting_for_room_in_the_encoder_cache_holds_none_of_its_later_images():
    """Found by a cross-talk fuzz (tight caches, LLaVA's 576-token images): a prompt whose first image the full
    encoder cache could not take still took a reference to its second image, cached already for another request.
    Once that request was done, the cache was full of an image only this prompt held, and it waited for room for
    its first image forever: "the request cannot be scheduled even with the engine idle"."""
    sched = scheduler(budget=64, encoder_tokens=12)  # room for one 8-token image
    other = sequence(0, [1, 2] + [9] * 8 + [3, 3], max_tokens=1, images=[image(2, 8, "y")])
    sched.add(other)
    mine = sequence(
        1, [1, 2] + [9] * 8 + [3, 3] + [9] * 8 + [4], max_tokens=1, images=[image(2, 8, "x"), image(12, 8, "y")]
    )
    ran, added = {0: 0, 1: 0}, False
    for _ in range(12):
        for seq_id, n in step_with_images(sched).items():
            ran[seq_id] += n
        if not added and ran[0] >= 2:  # arrives once the other's image is cached and held
            sched.add(mine)
            added = True
    assert ran == {0: 12, 1: 21}


def test_a_prompt_left_waiting_for_kv_blocks_holds_none_of_the_images_it_reached():
    """Found by the cross-talk fuzz (LLaVA, 66 KV blocks, an encoder cache for one image): a waiting prompt that
    reached a cached image took a reference to it, then waited for KV blocks, holding it. The running prompt that
    had finished with that image needed the cache's room for its next one, and waited for the waiting prompt,
    which waited for its blocks: "the request cannot be scheduled even with the engine idle"."""
    sched = scheduler(budget=64, blocks=10, prefix_caching=False, encoder_tokens=12)  # room for one image
    running = sequence(
        0, [1, 2] + [9] * 8 + [3, 3] + [9] * 8 + [4], max_tokens=1, images=[image(2, 8, "a"), image(12, 8, "b")]
    )
    waiting = sequence(1, [1, 2] + [9] * 8 + [5] * 30, max_tokens=1, images=[image(2, 8, "a")])  # needs 10 blocks
    sched.add(running)
    ran = {0: 0, 1: 0}
    for turn in range(12):
        for seq_id, n in step_with_images(sched).items():
            ran[seq_id] += n
        if turn == 0:  # arrives while the running prompt holds image a, its next chunk up to image b
            sched.add(waiting)
        if waiting.num_computed_tokens == 0:
            assert sched.encoder_cache.num_references() == (1 if running.num_computed_tokens < 10 else 0), turn
    assert ran == {0: 21, 1: 40}


def test_a_step_that_preempts_the_sequence_holding_an_image_schedules_the_ones_it_passed():
    """Found by the cross-talk fuzz (LLaVA, seed 966): a prompt past its first image waits for room in the encoder
    cache for its second, which a later prompt's share of the same first image takes. In one step the earlier
    prompt is passed (no room), then the later one preempts itself for KV blocks, giving the image up: the step
    ran nothing and handed the encoder nothing, and the engine failed the request as unschedulable. The pass now
    goes again after a preemption that left it empty."""
    sched = scheduler(budget=8, blocks=7, prefix_caching=False, encoder_tokens=12)  # room for one image
    first = sequence(
        0, [1, 2] + [9] * 8 + [3, 3] + [9] * 8 + [4], max_tokens=1, images=[image(2, 8, "a"), image(12, 8, "b")]
    )
    later = sequence(1, [1] * 5 + [9] * 8 + [5] * 8, max_tokens=1, images=[image(5, 8, "a")])
    sched.add(first)
    sched.add(later)
    for turn in range(20):
        batch = sched.schedule()
        assert batch.seqs or batch.step.encode, f"step {turn} ran nothing and encoded nothing"
        step_recorded(sched, batch)
        for seq in batch.seqs:
            if seq.num_output_tokens:
                sched.finish(seq)
        for item in batch.step.encode:
            sched.encoder_cache.put(item.content_hash, torch.zeros(item.span.length, 4))
        if not sched.running and not sched.waiting:
            break
    assert first.num_output_tokens == later.num_output_tokens == 1 and sched.num_preemptions >= 1


def test_blocks_for_the_forks_of_a_completed_prompt_stay_free_for_them():
    """A prompt of a request with n=3 that this step completes forks two samples when the step is recorded, each
    copying the prompt's partly filled last block: the sequences admitted after it in the same step must leave
    those two blocks free. (They took them: the fork then found no free block, the step failed, and the forked
    sample was left in no list, so the request never finished; the offline cross-talk fuzz hung on it.)"""
    sched = scheduler(budget=32, blocks=6)
    request = Request(RequestInput("r0", list(range(1, 7)), SamplingParams(n=3, max_tokens=8)))
    request.input.arrival_index = 0
    forking = Sequence(0, request)
    request.sequences.append(forking)
    sched.add(forking)
    sched.add(sequence(1, list(range(10, 18))))  # two blocks: fits beside the two kept for the forks
    sched.add(sequence(2, list(range(20, 24))))  # one more block: would take one of them
    assert step(sched) == {0: 6, 1: 8}
    assert sched.blocks.num_free_blocks == 2
    for _ in range(2):  # what the engine does when it records the step (LLMEngine._record)
        sched.blocks.fork(forking.block_table, forking.num_computed_tokens)


def test_the_samples_a_running_prompt_will_fork_count_against_max_num_seqs():
    """A request with n=3 takes three of max_num_seqs' places from its admission, while its prompt is still being
    prefilled: prompts admitted meanwhile leave its two forks their places. (They took them: once it forked, five
    sequences ran under max_num_seqs=4; the scheduler fuzz found it.)"""
    sched = scheduler(budget=8, max_seqs=4)
    forking = sequence(0, list(range(1, 13)), n=3)
    sched.add(forking)
    assert step(sched) == {0: 8}  # a first chunk: its samples are not forked yet
    sched.add(sequence(1, [20, 21, 22]))
    sched.add(sequence(2, [30, 31, 32]))
    assert step(sched) == {0: 4, 1: 3}  # the second arrival waits: the forks will take the last two places
    for fork in (1, 2):  # what the engine does when it records the step (LLMEngine._record)
        child = Sequence(10 + fork, forking.request, fork)
        sched.fork(forking, child)
    forking.pending_forks = 0
    assert len(sched.running) == 4 and [s.seq_id for s in sched.waiting] == [2]


def test_a_suspects_turn_goes_again_when_the_others_turn_preempted_what_it_waited_for():
    """A suspect (a request of a failed step, run alone every other step) takes its turn first and waits for room in
    the encoder cache, which an image of a later prompt holds; in the others' turn that prompt needs a KV block,
    finds none and preempts itself, giving the image up. The suspect's turn goes again and hands its image to the
    encoder. (It did not: the step ran nothing and encoded nothing, and the engine failed the suspect as "cannot be
    scheduled even with the engine idle"; the scheduler fuzz found it once it drew failed steps.)"""
    sched = scheduler(budget=4, blocks=5, encoder_tokens=12, encoder_budget=12)
    text = list(range(20, 32))
    earlier = sequence(2, [*text, 7])  # leaves the suspect's first three blocks in the prefix cache
    sched.add(earlier)
    while earlier.num_computed_tokens < 13:
        step(sched)
    sched.finish(earlier)
    later = sequence(1, [9] * 12 + [15] * 4, images=[image(0, 12, "d")])  # its image fills the encoder cache
    sched.add(later)
    assert step_with_images(sched) == {}  # its image is encoded
    assert step_with_images(sched) == step_with_images(sched) == {1: 4}  # in its image, holding it
    suspect = sequence(0, [*text, 9, 9, 9, 9], images=[image(12, 4, "c")])
    sched.add(suspect)
    sched.isolate({suspect.request})
    batch = sched.schedule()  # the suspect's turn first: its cached prefix taken, its image waits for room
    assert [item.content_hash for item in batch.step.encode] == ["c"]
    assert suspect.num_computed_tokens == 12 and sched.num_preemptions == 1
