"""The engine's scheduler and the prefix cache's index, alone: no model, no torch, no reactor.

Each test drives :class:`sfnode.engines.scheduling.scheduler.Scheduler` the way the engine does
(``plan``, then ``complete`` or ``fail`` with what a runner would answer) and checks the plans it
writes against the rules of docs/engine.md section 3 and section 4.
"""

from __future__ import annotations

from collections.abc import Sequence

from twisted.trial import unittest

from sfnode.decoding.draws import draw_position
from sfnode.engines.scheduling.drafts import Speculation
from sfnode.engines.scheduling.pace import StepCost, StepRates
from sfnode.engines.scheduling.plan import StepOutput, StepPlan
from sfnode.engines.scheduling.prefix_cache import PrefixCache
from sfnode.engines.scheduling.scheduler import Ended, Request, Scheduler, blocks_for
from sfnode.generation import EngineStop
from sfnode.linkf.prefix_blocks import KV_BLOCK_TOKENS, block_keys
from sfnode.linkf.wire import GenParams

EOS = 2


def request(
    context: Sequence[int],
    max_new: int = 8,
    *,
    window: int = 4096,
    seed: int = 0,
    deadline: float | None = None,
    name: str = "",
    interactive: bool = False,
) -> Request:
    limit = min(len(context) + max_new, window)
    return Request(
        handle=name or f"r{len(context)}",
        context=tuple(context),
        params=GenParams(seed=seed),
        max_new=max_new,
        token_limit=limit,
        reserve_blocks=blocks_for(limit),
        eos_ids=frozenset({EOS}),
        deadline=deadline,
        interactive=interactive,
    )


def answer(plan: StepPlan, token: int = 7) -> StepOutput:
    """What a runner would answer: ``token`` for every decode row and finished prompt."""
    return StepOutput(
        decode=tuple(token for _ in plan.decode),
        chunks=tuple(token if chunk.last else None for chunk in plan.chunks),
    )


def run_step(scheduler: Scheduler, now: float = 0.0, token: int = 7) -> tuple[StepPlan, list]:
    plan, ended = scheduler.plan(now)
    emitted, more = scheduler.complete(plan, answer(plan, token))
    return plan, [*ended, *emitted, *more]


class AdmissionTests(unittest.SynchronousTestCase):
    """Lanes, slots and KV blocks."""

    def test_lowest_free_slots_first_come_first_served(self) -> None:
        """Requests take the lowest free slots in arrival order; the rest wait."""
        scheduler = Scheduler(interactive_lanes=0, lanes=2, kv_blocks=100)
        a, b, c = request([5] * 3, name="a"), request([6] * 3, name="b"), request([7] * 3, name="c")
        for r in (a, b, c):
            scheduler.submit(r)
        plan, _ = scheduler.plan(0.0)
        self.assertEqual(
            [(ch.slot, ch.tokens) for ch in plan.chunks], [(0, (5,) * 3), (1, (6,) * 3)]
        )
        self.assertEqual(list(scheduler.waiting), [c])

    def test_a_request_that_does_not_fit_waits_with_those_behind_it(self) -> None:
        """A request whose KV blocks do not fit waits, and so does everything behind it."""
        scheduler = Scheduler(interactive_lanes=0, lanes=4, kv_blocks=3)
        big = request([5] * 20, max_new=20, name="big")  # 40 tokens: 3 blocks
        small = request([6] * 3, max_new=3, name="small")  # 1 block
        scheduler.submit(big)
        scheduler.submit(request([8] * 30, max_new=2, name="second"))  # 2 blocks: no room left
        scheduler.submit(small)
        plan, _ = scheduler.plan(0.0)
        self.assertEqual([ch.slot for ch in plan.chunks], [0])
        self.assertEqual([r.handle for r in scheduler.waiting], ["second", "small"])

    def test_a_finished_lane_frees_its_slot_and_blocks(self) -> None:
        """When a lane ends its slot and KV blocks go to the next request in the same step."""
        scheduler = Scheduler(interactive_lanes=0, lanes=1, kv_blocks=100)
        first, second = request([5, 6], max_new=1, name="first"), request([9], name="second")
        scheduler.submit(first)
        scheduler.submit(second)
        _, events = run_step(scheduler)
        self.assertIn(Ended(first, EngineStop.LENGTH), events)
        self.assertEqual(scheduler.kv_blocks_used, 0)
        plan, _ = scheduler.plan(0.0)
        self.assertEqual([(ch.slot, ch.tokens) for ch in plan.chunks], [(0, (9,))])


class PrefillTests(unittest.SynchronousTestCase):
    """Prompt chunks and the step budget."""

    def test_chunks_end_on_fixed_multiples_of_the_chunk_size(self) -> None:
        """A prompt is cut at multiples of prefill_chunk from its start, one chunk per step; the
        last chunk yields the first token at draw position seed + len(context)."""
        scheduler = Scheduler(
            interactive_lanes=0, lanes=2, kv_blocks=100, prefill_chunk=8, step_tokens=100
        )
        r = request(list(range(3, 23)), seed=40)  # 20 tokens
        scheduler.submit(r)
        spans = []
        for _ in range(3):
            plan, events = run_step(scheduler)
            (chunk,) = plan.chunks
            spans.append((chunk.start, len(chunk.tokens), chunk.last))
        self.assertEqual(spans, [(0, 8, False), (8, 8, False), (16, 4, True)])
        self.assertEqual(chunk.draw, draw_position(40, 20, 0))
        self.assertEqual([e.token for e in events if hasattr(e, "token")], [7])

    def test_several_prompts_share_a_step_within_the_budget(self) -> None:
        """Prompt chunks of several lanes ride in one step up to step_tokens, oldest first, and
        at least one chunk always goes."""
        scheduler = Scheduler(
            interactive_lanes=0, lanes=4, kv_blocks=100, prefill_chunk=64, step_tokens=100
        )
        for n in (40, 40, 40):
            scheduler.submit(request([5] * n))
        plan, _ = scheduler.plan(0.0)
        self.assertEqual([ch.slot for ch in plan.chunks], [0, 1])
        lone = Scheduler(
            interactive_lanes=0, lanes=1, kv_blocks=100, prefill_chunk=64, step_tokens=10
        )
        lone.submit(request([5] * 40))
        plan, _ = lone.plan(0.0)
        self.assertEqual([len(ch.tokens) for ch in plan.chunks], [40])

    def test_decode_rows_ride_with_prompt_chunks(self) -> None:
        """A decoding lane gets one decode row per step (its last token at its position, the
        draw of its k-th token) while another lane's prompt is computed in the same step."""
        scheduler = Scheduler(interactive_lanes=0, lanes=2, kv_blocks=100, prefill_chunk=4)
        first = request([5, 6, 7], seed=3)
        scheduler.submit(first)
        run_step(scheduler, token=11)
        scheduler.submit(request([8] * 10))
        plan, _ = scheduler.plan(0.0)
        (row,) = plan.decode
        self.assertEqual((row.slot, row.token, row.position), (0, 11, 3))
        self.assertEqual(row.draw, draw_position(3, 3, 1))
        self.assertEqual([(ch.slot, ch.start, len(ch.tokens)) for ch in plan.chunks], [(1, 0, 4)])


class InteractiveTests(unittest.SynchronousTestCase):
    """Interactive work goes first (docs/engine.md section 3)."""

    def test_an_interactive_request_is_admitted_at_once_beside_batch_work(self) -> None:
        """With batch requests enough for every lane, one lane stays free: an interactive
        request that arrives later is admitted at the very next step, while batch requests
        wait."""
        scheduler = Scheduler(lanes=3, kv_blocks=1000, interactive_lanes=1)
        batch = [request([5] * 40, max_new=100, name=f"b{i}") for i in range(4)]
        for r in batch:
            scheduler.submit(r)
        run_step(scheduler)
        self.assertEqual(
            sorted(lane.request.handle for lane in scheduler.running.values()), ["b0", "b1"]
        )
        chat = request([9, 9, 9], max_new=5, name="chat", interactive=True)
        scheduler.submit(chat)
        plan, _ = scheduler.plan(0.0)
        self.assertEqual([ch.tokens for ch in plan.chunks], [(9, 9, 9)])
        self.assertEqual(len(plan.decode), 2)
        self.assertEqual([r.handle for r in scheduler.waiting], ["b2", "b3"])

    def test_an_interactive_prompt_goes_alone_ahead_of_batch_prompts(self) -> None:
        """A step that computes an interactive prompt carries no batch prompt chunk; batch
        prompts continue once it is done."""
        scheduler = Scheduler(
            lanes=3, kv_blocks=1000, prefill_chunk=32, step_tokens=1000, interactive_lanes=1
        )
        scheduler.submit(request([5] * 100, max_new=10, name="agent"))
        scheduler.plan(0.0)  # the agent's first chunk is in flight
        scheduler.submit(request([9] * 20, max_new=10, name="chat", interactive=True))
        plan, _ = scheduler.plan(0.0)
        self.assertEqual([len(ch.tokens) for ch in plan.chunks], [20])
        scheduler.complete(plan, answer(plan))
        plan, _ = scheduler.plan(0.0)
        self.assertEqual([ch.start for ch in plan.chunks], [0])  # the agent's chunk again

    def test_batch_work_is_never_starved(self) -> None:
        """While interactive requests keep coming, batch requests still run on the other lanes
        and finish; with one lane in all, batch work shares it."""
        scheduler = Scheduler(lanes=2, kv_blocks=1000, interactive_lanes=1)
        agent = request([5] * 10, max_new=6, name="agent")
        scheduler.submit(agent)
        finished = []
        for step in range(40):
            scheduler.submit(request([9, step], max_new=2, interactive=True))
            _, events = run_step(scheduler)
            finished += [e.request.handle for e in events if isinstance(e, Ended)]
        self.assertIn("agent", finished)
        lone = Scheduler(lanes=1, kv_blocks=1000, interactive_lanes=1)
        self.assertEqual(lone.batch_lanes, 1)


SLOW = StepRates(step_s=0.05, decode_row_s=0.005, prompt_row_s=0.002, keys_s=0.0)
"""A slow CPU's step: 50 ms, plus 5 ms a decode row and 2 ms a prompt token."""


def step_seconds(plan: StepPlan, rates: StepRates) -> float:
    return rates.seconds(StepCost.of(plan))


class TimeBudgetTests(unittest.SynchronousTestCase):
    """Steps sized in time while interactive work may need the engine (docs/engine.md
    section 3): the rates are values the test gives, as the engine gives measured ones."""

    def agents(self, scheduler: Scheduler, n: int, length: int = 1300) -> None:
        for i in range(n):
            scheduler.submit(request([5 + i] * length, max_new=64, name=f"agent{i}"))

    def test_a_batch_prompt_beside_a_free_lane_is_cut_to_the_budget(self) -> None:
        """With a lane free for a chat, a batch prompt's chunk is as long as fits 250 ms at
        the given rates (50 ms + 2 ms a token: 100 tokens), cut back to a block boundary (96);
        with step_ms 0, or without rates, it is the whole prefill chunk."""
        for step_ms, rates, want in ((250, SLOW, [96]), (0, SLOW, [256]), (250, None, [256])):
            scheduler = Scheduler(lanes=8, kv_blocks=10_000, step_ms=step_ms)
            self.agents(scheduler, 1)
            plan, _ = scheduler.plan(0.0, rates)
            self.assertEqual([len(chunk.tokens) for chunk in plan.chunks], want, step_ms)

    def test_the_same_budget_gives_longer_chunks_on_a_faster_machine(self) -> None:
        """Four times faster rates give chunks about four times longer for the same budget."""
        fast = StepRates(step_s=0.0125, decode_row_s=0.00125, prompt_row_s=0.0005, keys_s=0.0)
        scheduler = Scheduler(
            lanes=8, kv_blocks=10_000, prefill_chunk=512, step_tokens=1024, step_ms=250
        )
        self.agents(scheduler, 1)
        plan, _ = scheduler.plan(0.0, fast)
        self.assertEqual([len(chunk.tokens) for chunk in plan.chunks], [464])

    def test_every_planned_step_fits_the_budget_beside_decoding_lanes(self) -> None:
        """Seven agents with long prompts: every step (decode rows and the prompt chunks of
        several lanes) is predicted to take at most 250 ms, every chunk but a prompt's last
        ends on a block boundary, and every agent finishes."""
        scheduler = Scheduler(lanes=8, kv_blocks=10_000, step_ms=250)
        self.agents(scheduler, 7)
        ended = 0
        for _ in range(2000):
            plan, _ = scheduler.plan(0.0, SLOW)
            if plan.empty:
                break
            self.assertLessEqual(step_seconds(plan, SLOW), 0.25 + 1e-9)
            for chunk in plan.chunks:
                end = chunk.start + len(chunk.tokens)
                self.assertTrue(chunk.last or end % KV_BLOCK_TOKENS == 0, end)
            _, events = scheduler.complete(plan, answer(plan))
            ended += sum(isinstance(e, Ended) for e in events)
        self.assertEqual(ended, 7)
        self.assertTrue(scheduler.idle)

    def test_attention_shortens_chunks_late_in_a_long_prompt(self) -> None:
        """With a cost per attended key, a chunk late in a long prompt is shorter than its
        first one, for the same budget."""
        rates = StepRates(step_s=0.05, decode_row_s=0.005, prompt_row_s=0.001, keys_s=0.0005)
        scheduler = Scheduler(lanes=8, kv_blocks=10_000, step_ms=250, prefill_chunk=512)
        self.agents(scheduler, 1, length=4000)
        sizes = []
        for _ in range(200):
            plan, _ = scheduler.plan(0.0, rates)
            if not plan.chunks:
                break
            sizes.append(len(plan.chunks[0].tokens))
            scheduler.complete(plan, answer(plan))
        self.assertGreater(sizes[0], sizes[-2])
        self.assertEqual(sum(sizes), 4000)

    def test_a_step_moves_a_prompt_by_a_block_when_decoding_fills_the_budget(self) -> None:
        """When the decoding lanes alone are predicted to take the whole budget, the step still
        carries one block of one prompt, so prompts progress."""
        crowded = StepRates(step_s=0.3, decode_row_s=0.01, prompt_row_s=0.002, keys_s=0.0)
        scheduler = Scheduler(lanes=8, kv_blocks=10_000, step_ms=250)
        self.agents(scheduler, 2)
        plan, _ = scheduler.plan(0.0, crowded)
        self.assertEqual([len(chunk.tokens) for chunk in plan.chunks], [KV_BLOCK_TOKENS])

    def test_tokens_only_when_no_interactive_work_can_come(self) -> None:
        """With every lane held by batch work and no interactive request waiting or running, a
        step is bounded by step_tokens only; an interactive request arriving (and waiting for
        a lane) brings the time budget back."""
        scheduler = Scheduler(lanes=2, kv_blocks=10_000, interactive_lanes=0, step_ms=250)
        self.agents(scheduler, 2)
        plan, _ = scheduler.plan(0.0, SLOW)
        self.assertEqual([len(chunk.tokens) for chunk in plan.chunks], [256, 256])
        self.assertFalse(scheduler.interactive_expected())
        scheduler.complete(plan, answer(plan))
        scheduler.submit(request([9] * 10, name="chat", interactive=True))
        plan, _ = scheduler.plan(0.0, SLOW)
        self.assertTrue(scheduler.interactive_expected())
        self.assertEqual([len(chunk.tokens) for chunk in plan.chunks], [96])

    def test_an_interactive_lane_decoding_keeps_steps_short(self) -> None:
        """A chat streaming its answer keeps batch prompt chunks within the budget even when
        no lane is free."""
        scheduler = Scheduler(lanes=2, kv_blocks=10_000, interactive_lanes=1, step_ms=250)
        scheduler.submit(request([9] * 10, max_new=100, name="chat", interactive=True))
        run_step(scheduler)
        self.agents(scheduler, 1)
        plan, _ = scheduler.plan(0.0, SLOW)
        self.assertEqual(len(plan.decode), 1)
        # 250 ms - 50 ms - one decode row (5 ms) leaves 97 tokens: 96.
        self.assertEqual([len(chunk.tokens) for chunk in plan.chunks], [96])

    def test_an_interactive_prompt_is_not_cut_by_time(self) -> None:
        """A person waits on an interactive prompt: it is cut by the prefill chunk only, since
        cutting it shorter would only delay its own first token."""
        scheduler = Scheduler(lanes=8, kv_blocks=10_000, step_ms=250)
        scheduler.submit(request([9] * 600, name="chat", interactive=True))
        plan, _ = scheduler.plan(0.0, SLOW)
        self.assertEqual([len(chunk.tokens) for chunk in plan.chunks], [256])

    def test_a_chat_arriving_beside_agents_waits_for_one_short_step(self) -> None:
        """Eight agents with 1,300-token prompts, then a chat: at the given rates no step
        before the chat's is predicted past 250 ms, and the chat's own step (its prompt and
        the agents' decode rows, no batch chunk) yields its first token."""
        scheduler = Scheduler(lanes=8, kv_blocks=10_000, step_ms=250)
        self.agents(scheduler, 8)
        for _ in range(30):
            plan, _ = scheduler.plan(0.0, SLOW)
            self.assertLessEqual(step_seconds(plan, SLOW), 0.25 + 1e-9)
            scheduler.complete(plan, answer(plan))
        chat = request([9] * 30, max_new=4, name="chat", interactive=True)
        scheduler.submit(chat)
        plan, _ = scheduler.plan(0.0, SLOW)
        self.assertEqual([chunk.tokens for chunk in plan.chunks], [(9,) * 30])
        emitted, _ = scheduler.complete(plan, answer(plan))
        self.assertIn(chat, [e.request for e in emitted])


class EndTests(unittest.SynchronousTestCase):
    """How lanes end."""

    def test_eos_max_new_and_token_limit(self) -> None:
        """EOS ends a lane with the EOS id as its last token; max_new and the token limit end
        it with LENGTH."""
        scheduler = Scheduler(interactive_lanes=0, lanes=3, kv_blocks=100)
        eos, budget = request([5], max_new=10, name="eos"), request([6], max_new=2, name="budget")
        window = request([7] * 4, max_new=10, window=6, name="window")
        for r in (eos, budget, window):
            scheduler.submit(r)
        run_step(scheduler, token=9)
        _, events2 = run_step(scheduler, token=9)
        self.assertIn(Ended(budget, EngineStop.LENGTH), events2)
        self.assertIn(Ended(window, EngineStop.LENGTH), events2)
        _, events3 = run_step(scheduler, token=EOS)
        self.assertIn(Ended(eos, EngineStop.EOS), events3)
        self.assertTrue(scheduler.idle)

    def test_cancel_and_deadline(self) -> None:
        """A cancelled request ends CANCELLED at the next plan, waiting or running; a passed
        deadline ends it EXPIRED; neither is in the plan."""
        scheduler = Scheduler(interactive_lanes=0, lanes=1, kv_blocks=100)
        running = request([5], max_new=100, name="running")
        waiting = request([6], name="waiting", deadline=5.0)
        scheduler.submit(running)
        scheduler.submit(waiting)
        run_step(scheduler)
        scheduler.cancel(running)
        plan, ended = scheduler.plan(6.0)
        self.assertEqual(
            set(ended), {Ended(running, EngineStop.CANCELLED), Ended(waiting, EngineStop.EXPIRED)}
        )
        self.assertTrue(plan.empty)
        self.assertTrue(scheduler.idle)

    def test_a_failed_step_fails_its_lanes_only(self) -> None:
        """A failed step ends the lanes it carried with the error; a lane that had no row in it
        runs on."""
        scheduler = Scheduler(
            interactive_lanes=0, lanes=3, kv_blocks=100, prefill_chunk=4, step_tokens=4
        )
        a, b = request([5, 6], max_new=50, name="a"), request([6] * 8, max_new=50, name="b")
        c = request([7] * 8, max_new=50, name="c")
        scheduler.submit(a)
        run_step(scheduler)
        scheduler.submit(b)
        scheduler.submit(c)
        plan, _ = scheduler.plan(0.0)
        self.assertEqual([ch.slot for ch in plan.chunks], [1])  # c waits for the budget
        error = RuntimeError("boom")
        ended = scheduler.fail(plan, error)
        self.assertEqual(set(ended), {Ended(a, None, error), Ended(b, None, error)})
        self.assertEqual(list(scheduler.running), [2])

    def test_abandon_cancels_everything(self) -> None:
        """Stopping ends waiting and running requests as CANCELLED and empties the scheduler."""
        scheduler = Scheduler(interactive_lanes=0, lanes=1, kv_blocks=100)
        a, b = request([5], name="a"), request([6], name="b")
        scheduler.submit(a)
        scheduler.submit(b)
        scheduler.plan(0.0)
        self.assertEqual(
            set(scheduler.abandon()),
            {Ended(a, EngineStop.CANCELLED), Ended(b, EngineStop.CANCELLED)},
        )
        self.assertTrue(scheduler.idle)
        self.assertEqual(scheduler.kv_blocks_used, 0)


class PrefixReuseTests(unittest.SynchronousTestCase):
    """Reusing cached blocks (docs/engine.md section 4)."""

    def scheduler(self, capacity: int = 64, chunk: int = 32) -> Scheduler:
        return Scheduler(
            interactive_lanes=0,
            lanes=4,
            kv_blocks=1000,
            prefill_chunk=chunk,
            step_tokens=1000,
            prefix=PrefixCache(capacity),
            salt=b"test",
        )

    def finish(self, scheduler: Scheduler, steps: int = 100) -> None:
        for _ in range(steps):
            if scheduler.idle:
                return
            run_step(scheduler, token=EOS)
        self.fail("the scheduler did not go idle")

    def test_a_second_prompt_loads_the_first_ones_blocks(self) -> None:
        """After a prompt's blocks were saved, a prompt that starts with them loads them into
        its slot and computes only the rest (at least its last token)."""
        scheduler = self.scheduler()
        shared = list(range(100, 148))  # three full blocks
        scheduler.submit(request([*shared, 1, 2, 3], max_new=1))
        self.finish(scheduler)
        prefix = scheduler.prefix
        assert prefix is not None
        self.assertEqual(len(prefix), 3)
        scheduler.submit(request([*shared, 9, 9], max_new=1))
        plan, _ = scheduler.plan(0.0)
        (load,) = plan.loads
        self.assertEqual((load.slot, load.first, len(load.blocks)), (0, 0, 3))
        (chunk,) = plan.chunks
        self.assertEqual((chunk.start, chunk.tokens), (48, (9, 9)))
        self.assertEqual((prefix.stats.hits, prefix.stats.reused_tokens), (1, 48))
        # An exact repeat of a 48-token prompt takes 47 positions and computes the last one.
        scheduler.complete(plan, answer(plan, EOS))
        scheduler.submit(request(shared, max_new=1))
        plan, _ = scheduler.plan(0.0)
        self.assertEqual((len(plan.loads[0].blocks), plan.loads[0].tail), (3, 15))
        self.assertEqual(plan.chunks[0].start, 47)

    def test_a_prompt_takes_the_positions_it_shares_inside_a_block(self) -> None:
        """A prompt that leaves a cached chain inside a block takes the positions it shares
        with the cached block there, and computes from the first one that differs."""
        scheduler = self.scheduler()
        first = list(range(100, 140))  # blocks 0 and 1 full, 8 tokens in block 2
        scheduler.submit(request(first, max_new=1))
        self.finish(scheduler)
        second = [*first[:20], 7, 7, 7, 7, 7]  # block 0, then 4 of block 1's tokens
        scheduler.submit(request(second, max_new=1))
        plan, _ = scheduler.plan(0.0)
        (load,) = plan.loads
        self.assertEqual((len(load.blocks), load.tail), (2, 4))
        self.assertEqual([(c.start, c.tokens) for c in plan.chunks], [(20, (7,) * 5)])
        prefix = scheduler.prefix
        assert prefix is not None
        self.assertEqual(prefix.stats.reused_tokens, 20)

    def test_chunks_after_reused_blocks_keep_their_boundaries(self) -> None:
        """After reused blocks, the first computed chunk ends on the next multiple of the chunk
        size, where it would end without reuse."""
        scheduler = self.scheduler(chunk=32)
        shared = list(range(100, 148))
        scheduler.submit(request([*shared, 1], max_new=1))
        self.finish(scheduler)
        scheduler.submit(request([*shared, *range(300, 340)], max_new=1))
        plan, _ = scheduler.plan(0.0)
        self.assertEqual([(c.start, len(c.tokens)) for c in plan.chunks], [(48, 16)])

    def test_blocks_are_saved_after_the_step_that_computed_them(self) -> None:
        """A lane's full blocks are saved in the plan after the step that computed them, from
        its slot, generated tokens included, and each block once."""
        scheduler = self.scheduler(chunk=16)
        scheduler.submit(request(list(range(10, 42)), max_new=40))  # 2 full prompt blocks
        plan, _ = scheduler.plan(0.0)
        self.assertEqual(plan.saves, ())
        scheduler.complete(plan, answer(plan))
        plan, _ = scheduler.plan(0.0)
        self.assertEqual([(s.slot, s.first, len(s.blocks)) for s in plan.saves], [(0, 0, 1)])
        saved = 1
        for _ in range(30):
            scheduler.complete(plan, answer(plan))
            plan, _ = scheduler.plan(0.0)
            saved += sum(len(s.blocks) for s in plan.saves)
        # 32 prompt tokens + 30 decoded (the last one not yet computed) = 61 computed: 3 blocks.
        self.assertEqual(saved, 3)

    def test_a_request_waits_for_blocks_another_lane_is_computing(self) -> None:
        """A request whose next uncached block is in another lane's prompt waits for that lane
        instead of computing it too, then loads it; requests behind it are not held up."""
        scheduler = self.scheduler(chunk=16)
        shared = list(range(200, 264))  # four blocks, computed one chunk per step
        first = request([*shared, 1], max_new=1, name="first")
        scheduler.submit(first)
        scheduler.plan(0.0)  # first's chunk 0 is planned, not yet done
        twin = request([*shared, 2], max_new=1, name="twin")
        other = request([5, 6, 7], max_new=1, name="other")
        scheduler.submit(twin)
        scheduler.submit(other)
        computed_by_twin = 0
        for _ in range(40):
            if scheduler.idle:
                break
            plan, _ = scheduler.plan(0.0)
            for chunk in plan.chunks:
                if chunk.tokens[-1] == 2 or (chunk.slot != 0 and chunk.tokens[0] >= 200):
                    computed_by_twin += len(chunk.tokens)
            scheduler.complete(plan, answer(plan, EOS))
        self.assertTrue(scheduler.idle)
        self.assertEqual(computed_by_twin, 1)  # only its own last token
        prefix = scheduler.prefix
        assert prefix is not None
        self.assertEqual(prefix.stats.reused_tokens, 64)

    def test_the_least_recently_used_block_is_evicted(self) -> None:
        """A full pool gives up its least recently used block for a new one."""
        cache = PrefixCache(2)
        tokens = list(range(48))
        a, b, c = block_keys(tokens, b"s")
        blocks = [tokens[i : i + 16] for i in (0, 16, 32)]
        self.assertEqual(
            [cache.allocate(a, b"s", blocks[0]), cache.allocate(b, a, blocks[1])], [0, 1]
        )
        self.assertEqual(cache.match([a]), [0])  # a is now the most recent
        self.assertEqual(cache.allocate(c, b, blocks[2]), 1)  # b goes
        self.assertEqual(cache.match([a, b]), [0])
        self.assertEqual(cache.partial(a, blocks[1]), (-1, 0))  # b's tokens are gone with it
        self.assertEqual(cache.stats.evictions, 1)
        self.assertIsNone(cache.allocate(a, b"s", blocks[0]))  # cached already

    def test_keys_chain_over_the_whole_prefix(self) -> None:
        """A block's key depends on every token before it and on the salt."""
        base = list(range(32))
        changed = [99, *base[1:]]
        self.assertEqual(len(block_keys(base, b"s")), 2)
        self.assertNotEqual(block_keys(base, b"s")[1], block_keys(changed, b"s")[1])
        self.assertNotEqual(block_keys(base, b"s"), block_keys(base, b"t"))
        self.assertEqual(block_keys(base + [1] * 15, b"s"), block_keys(base, b"s"))
        self.assertEqual(len(block_keys(list(range(KV_BLOCK_TOKENS * 5)), b"s", limit=3)), 3)

    def test_a_failed_step_forgets_the_blocks_it_was_saving(self) -> None:
        """Blocks a failed step was writing are not left in the index."""
        scheduler = self.scheduler(chunk=16)
        scheduler.submit(request(list(range(10, 42)), max_new=40))
        plan, _ = scheduler.plan(0.0)
        scheduler.complete(plan, answer(plan))
        plan, _ = scheduler.plan(0.0)
        self.assertEqual(len(plan.saves), 1)
        scheduler.fail(plan, RuntimeError("boom"))
        prefix = scheduler.prefix
        assert prefix is not None
        self.assertEqual(len(prefix), 0)


class DraftTests(unittest.SynchronousTestCase):
    """Decode rows with drafts (docs/engine.md section 3.1): what the scheduler drafts, and how
    it takes the tokens a runner drew at the drafted positions."""

    PASSAGE = (10, 11, 12, 13, 14, 15, 16, 17, 18, 19)

    def drafting(self, *requests: Request, draft_tokens: int = 4, first: int = 10) -> Scheduler:
        """A scheduler with speculation, the requests submitted and their prompts computed
        (each answered with its first token ``first``)."""
        scheduler = Scheduler(
            interactive_lanes=0,
            lanes=4,
            kv_blocks=100,
            speculation=Speculation(draft_tokens=draft_tokens),
        )
        for r in requests:
            scheduler.submit(r)
        run_step(scheduler, token=first)
        return scheduler

    def test_a_row_drafts_what_followed_the_same_ngram(self) -> None:
        """A lane whose tokens end with an n-gram seen before drafts what followed it, as many
        as draft_tokens, its draw counter unchanged; without speculation it drafts nothing."""
        r = request([*self.PASSAGE, 5, 6], max_new=20, seed=3)
        scheduler = self.drafting(r, draft_tokens=3)
        plan, _ = scheduler.plan(0.0)
        (row,) = plan.decode
        # The context ends with 10 (the first token): [5, 6, 10] never occurred, so no draft yet.
        self.assertEqual((row.token, row.position, row.draft), (10, 12, ()))
        scheduler.complete(plan, StepOutput(decode=(11,)))
        plan, _ = scheduler.plan(0.0)
        (row,) = plan.decode
        self.assertEqual((row.token, row.position, row.draft), (11, 13, ()))
        scheduler.complete(plan, StepOutput(decode=(12,)))
        plan, _ = scheduler.plan(0.0)
        (row,) = plan.decode
        # [10, 11, 12] occurred at the start of the prompt, followed by 13, 14, 15, ...
        self.assertEqual((row.token, row.position, row.draft), (12, 14, (13, 14, 15)))
        self.assertEqual(row.draw, draw_position(3, 12, 3))
        self.assertEqual(plan.rows, 4)
        plain = Scheduler(interactive_lanes=0, lanes=1, kv_blocks=100)
        plain.submit(request([*self.PASSAGE, *self.PASSAGE[:3]], max_new=20))
        run_step(plain, token=13)
        plan, _ = plain.plan(0.0)
        self.assertEqual(plan.decode[0].draft, ())

    def test_accepted_tokens_are_emitted_in_order_and_counted(self) -> None:
        """The runner's drawn tokens after the accepted drafts are emitted after the row's own,
        the lane's next row starts after the last of them, and the counts say how many were
        drafted and accepted."""
        r = request([*self.PASSAGE, 10, 11], max_new=20)
        scheduler = self.drafting(r, first=12)
        plan, _ = scheduler.plan(0.0)
        (row,) = plan.decode
        self.assertEqual((row.token, row.position, row.draft), (12, 12, (13, 14, 15, 16)))
        # The sampler drew 13 (= draft[0]), then 14 (= draft[1]), then 99 (not draft[2]).
        emitted, _ = scheduler.complete(plan, StepOutput(decode=(13,), drafted=((14, 99),)))
        self.assertEqual([e.token for e in emitted], [13, 14, 99])
        plan, _ = scheduler.plan(0.0)
        (row,) = plan.decode
        self.assertEqual((row.token, row.position), (99, 15))
        counts = scheduler.counts
        self.assertEqual((counts.decode_rows, counts.decode_tokens), (1, 3))
        self.assertEqual((counts.drafted, counts.accepted), (4, 2))
        # Two of four accepted: the lane's next draft is at most three tokens long.
        length = scheduler.running[0].draft_length
        assert length is not None
        self.assertEqual(length.budget(), 3)

    def test_drafts_fit_the_budget_and_stop_before_an_eos(self) -> None:
        """A draft never runs past max_new (the token after it included) nor includes an EOS
        id; a lane that ends inside its accepted tokens emits nothing after its end; a runner
        answering more tokens than drafted is refused."""
        short = request([*self.PASSAGE, 10, 11], max_new=5, name="short")
        scheduler = self.drafting(short, first=12)
        plan, _ = scheduler.plan(0.0)
        # The first token, the row's own and three drafted make max_new.
        self.assertEqual(plan.decode[0].draft, (13, 14, 15))
        emitted, ended = scheduler.complete(plan, StepOutput(decode=(13,), drafted=((14, 15, 16),)))
        self.assertEqual([e.token for e in emitted], [13, 14, 15, 16])
        self.assertEqual(ended, [Ended(short, EngineStop.LENGTH)])

        with_eos = request([10, 11, 12, 13, EOS, 14, 10, 11], max_new=20, name="eos")
        scheduler = self.drafting(with_eos, first=12)
        plan, _ = scheduler.plan(0.0)
        self.assertEqual(plan.decode[0].draft, (13,))
        emitted, ended = scheduler.complete(plan, StepOutput(decode=(13,), drafted=((EOS,),)))
        self.assertEqual([e.token for e in emitted], [13, EOS])
        self.assertEqual(ended, [Ended(with_eos, EngineStop.EOS)])

        again = self.drafting(request([*self.PASSAGE, 10, 11], max_new=20), first=12)
        plan, _ = again.plan(0.0)
        self.assertRaises(
            ValueError,
            again.complete,
            plan,
            StepOutput(decode=(13,), drafted=((14, 15, 16, 17, 18),)),
        )
