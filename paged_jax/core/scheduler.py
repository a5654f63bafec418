"""Iteration-level scheduling: one decision per engine step, made on the host.

Each step the scheduler
1. forks a request with n > 1 into its samples once their shared prompt is computed;
2. gives every running sequence its next tokens (a decode token, or the next chunk of a prompt) and
   the blocks they land in, a private copy included where a fork still shares the block, preempting
   the last in the policy's order (under FCFS the most recently admitted) when the pool runs short;
3. admits waiting sequences in the policy's order (FCFS by default, policy.py) while free blocks,
   max_num_seqs and the token budget allow (the queue's head waits rather than being overtaken, so
   under FCFS nothing starves).

Forks of n > 1 may make more than max_num_seqs run: the rest wait a step. Prompts are held back for
latency while sequences decode (step_budget.py), a prompt that cannot finish in this step is admitted
only while fewer than max_num_partial_prefills are part-way through theirs, and a prompt chunk is cut
to fill its step's token bucket.

A sequence whose last token is still on the device (asynchronous scheduling, engine.py) counts it
(Sequence.num_pending) and is scheduled past it; one that the token is certain to end by length is not.
Preempted sequences return to the head of the queue, to be prefilled again (recompute: the result is
identical) or to have their KV brought back from host memory (swap; seq_blocks.py).

The context length fits the whole pool (resolve.py), so a sequence alone always fits; the one step
that could schedule nothing while some sequence waits is when all that run are beams awaiting their
siblings' proposals, and there the newest of them makes way. So every request finishes, whatever the pool.
"""

import collections

from models.kv_groups import KVGroups
from paged_jax.core import seq_blocks
from paged_jax.core.block_manager import BlockManager
from paged_jax.core.config import EngineConfig
from paged_jax.core.policy import sort_key
from paged_jax.core.scheduler_output import ScheduledSeq, SchedulerOutput
from paged_jax.core.sequence import Sequence, Status
from paged_jax.core.step_budget import StepBudget, fit_bucket, num_partial_prefills, prompt_cap
from paged_jax.core.window_blocks import WindowBlocks


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, swapper: seq_blocks.KVSwapper | None = None,
                 token_buckets: tuple[int, ...] = (), max_model_len: int | None = None, adapters=None,
                 kv_groups: KVGroups | None = None):
        """token_buckets: the step sizes the model runs at, ascending (buckets.py); none: prompt chunks are
        not cut to fit (replay.py). max_model_len: the context length, which a pending token may end a
        sequence at. adapters: the engine's AdapterSlots (LoRA): a sequence waits for its adapter's slot.
        kv_groups: the model's KV groups; past the first, their blocks are kept by window_blocks.py."""
        self.config, self.blocks, self.swapper, self.adapters = config, block_manager, swapper, adapters
        self.max_model_len, self.token_buckets = max_model_len, token_buckets
        self.windows = WindowBlocks(block_manager, kv_groups) if kv_groups and kv_groups.num_groups > 1 else None
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._key = sort_key(config.scheduling_policy)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.blocks.block_size)

    def schedule(self, num_steps: int = 1) -> SchedulerOutput:
        """num_steps: decode steps the engine may run in one dispatch (multi_step.py): a decoding sequence
        gets the blocks for up to that many tokens (ScheduledSeq.num_steps), no further than its
        max_tokens or the context allow."""
        out = SchedulerOutput(scheduled=[], copies=[], preempted=[], forked=self._fork_ready())
        if self._key is not None:
            # Stable sorts: ties keep the order of events (forks behind their parent, preempted first).
            self.waiting = collections.deque(sorted(self.waiting, key=self._key))
            self.running.sort(key=self._key)
        decoding = sum(s.num_computable_tokens - s.num_computed_tokens == 1 for s in self.running)
        budget = StepBudget(self.config.max_num_batched_tokens, prompt_cap(self.config, decoding, len(self.waiting)),
                            decoding)

        decodes_after = decoding  # those still to come in the loop below, whose tokens the step will hold
        i = 0
        while i < len(self.running) and budget.tokens > 0 and len(out.scheduled) < self.config.max_num_seqs:
            seq = self.running[i]
            num_new = 0 if self._ends_when_read(seq) else self._num_new_tokens(seq, budget)
            if seq.num_computable_tokens - seq.num_computed_tokens == 1:
                decodes_after -= 1
            elif num_new and (num_new < seq.num_computable_tokens - seq.num_computed_tokens or not self.waiting):
                num_new = self._fit(seq, num_new, budget, decodes_after)
            if num_new == 0:
                i += 1
                continue
            steps = self._num_steps(seq, num_steps) if num_new == 1 else 1
            if not self._reserve(seq, num_new + steps - 1, out):
                break  # seq itself was preempted
            self._schedule(seq, num_new, out, steps)
            budget.spend(seq, num_new)
            i += 1

        # Nobody is admitted on a step that preempted: the pool is short, and admitting would only
        # preempt again.
        while self.waiting and budget.tokens > 0 and not out.preempted and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            num_new = self._admit(seq, budget, out)
            if num_new == 0:
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            self._schedule(seq, num_new, out)
            budget.spend(seq, num_new)

        if not out.scheduled and self.waiting and self.running:
            # All that runs are beams holding their blocks until their siblings' proposals are in,
            # and the queue's head (perhaps such a sibling) may need that room: the newest makes way.
            # It goes to the back, as it has nothing to compute before its siblings catch up.
            victim = self.running[-1]
            self._preempt(victim, to_back=True)
            out.preempted.append(victim)
        return out

    def _schedule(self, seq: Sequence, num_new: int, out: SchedulerOutput, num_steps: int = 1) -> None:
        out.scheduled.append(ScheduledSeq(seq, num_new, num_steps))
        # Blocks this step fills are named now, not after the step: a request admitted later in this
        # same step can then share them, since every layer writes the step's K/V before attending. A
        # block holding a pending token is named once the token is read, a step later.
        num_cached = seq.num_cached_blocks
        seq.num_cached_blocks = self.blocks.cache_full_blocks(
            seq.token_ids, seq.block_ids, seq.num_cached_blocks,
            min(seq.num_computed_tokens + num_new, len(seq.token_ids)), seq.block_hashes, seq.prefix_root)
        if self.windows is not None:
            self.windows.cache_full_blocks(seq, num_cached, seq.num_cached_blocks)

    def _ends_when_read(self, seq: Sequence) -> bool:
        """Whether seq's pending token ends it by length: a step after it would be computed for nothing."""
        return seq.ends_when_read or (seq.num_pending > 0 and self.max_model_len is not None
                                      and seq.num_tokens >= self.max_model_len)

    def _num_steps(self, seq: Sequence, most: int) -> int:
        """Decode steps seq may run in one dispatch: at most `most`, and none past a length stop."""
        if most == 1 or seq.num_computed_tokens + 1 != seq.num_tokens:
            return 1
        left = seq.params.max_tokens - seq.num_output_tokens - seq.num_pending
        if self.max_model_len is not None:
            left = min(left, self.max_model_len - seq.num_tokens)
        return max(1, min(most, left))

    def _num_new_tokens(self, seq: Sequence, budget: StepBudget) -> int:
        """Tokens to compute for seq this step, 0 if it cannot run now."""
        remaining = seq.num_computable_tokens - seq.num_computed_tokens
        allowed = budget.for_prompt(remaining) if remaining > 1 else min(budget.tokens, remaining)
        if remaining == allowed:
            return remaining
        return allowed if self.config.enable_chunked_prefill else 0

    def _fit(self, seq: Sequence, num_new: int, budget: StepBudget, after: int) -> int:
        """A prompt chunk of num_new tokens, cut to fill its step's bucket; after: tokens to follow it.
        Only for the step's last prompt chunk (one the budget cut short, or with none waiting behind
        it): an earlier one cut part-way could keep the next prompts out (max_num_partial_prefills)
        and leave the step emptier than the padding it saved."""
        if not self.token_buckets or not self.config.enable_chunked_prefill:
            return num_new
        ends_prompt = seq.num_computed_tokens + num_new == seq.num_computable_tokens
        return fit_bucket(num_new, self.config.max_num_batched_tokens - budget.tokens, after, self.token_buckets,
                          then=budget.decodes if ends_prompt else None)

    def _reserve(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> bool:
        """Give seq the blocks its num_new more tokens land in: those it lacks, and a private copy of
        the partly filled block they start in if a fork still shares it. Preempts the last running
        sequences in the policy's order (possibly seq itself) until the pool can; False when seq was
        preempted."""
        if self.windows is not None:
            self.windows.remove_skipped(seq)
        missing = self._blocks_for(seq.num_computed_tokens + num_new) - len(seq.block_ids)
        if missing <= 0 and seq_blocks.shared_tail(seq, self.blocks) is None and not self._group_blocks(seq, num_new):
            return True  # most decodes: nothing to reserve
        # Counted again after each preemption: the victim may have been what shared the block.
        while not self.blocks.can_allocate(missing + (seq_blocks.shared_tail(seq, self.blocks) is not None)
                                           + self._group_blocks(seq, num_new)):
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        index = seq_blocks.shared_tail(seq, self.blocks)
        if index is not None:
            src, dst = self.blocks.copy_on_write(seq.block_ids[index])
            out.copies.append((src, dst))
            seq.block_ids[index] = dst
        if self.windows is not None:
            self.windows.reserve(seq, seq.num_computed_tokens + num_new, out.copies)
        seq.block_ids.extend(self.blocks.allocate(missing))
        return True

    def _group_blocks(self, seq: Sequence, num_new: int) -> int:
        """Blocks the KV groups past the first take for seq's num_new more tokens (window_blocks.py)."""
        return 0 if self.windows is None else self.windows.num_needed(seq, seq.num_computed_tokens + num_new)

    def _admit(self, seq: Sequence, budget: StepBudget, out: SchedulerOutput) -> int:
        """Give the queue's head the blocks for its first chunk; its number of new tokens, or 0."""
        if seq.swapped_kv is not None:
            return self._swap_in(seq, budget)
        if self.windows is None:
            cached, group_cached = self.blocks.match_prefix(seq.token_ids[: seq.num_computable_tokens],
                                                            seq.prefix_root), None
        else:
            cached, group_cached = self.windows.match_prefix(seq.token_ids[: seq.num_computable_tokens],
                                                             seq.prefix_root)
        num_computed = len(cached) * self.blocks.block_size
        seq.num_computed_tokens = num_computed
        num_new = self._num_new_tokens(seq, budget)
        if num_new < seq.num_computable_tokens - num_computed or len(self.waiting) == 1:
            num_new = self._fit(seq, num_new, budget, after=0)
        need = self._blocks_for(num_computed + num_new) - len(cached)
        group_need, keep = 0, cached
        if group_cached is not None:
            group_need = self.windows.num_to_admit(group_cached, num_computed + num_new)
            keep = cached + self.windows.held(group_cached)
        partial = num_computed + num_new < seq.num_computable_tokens
        if (num_new == 0 or (partial and num_partial_prefills(out.scheduled, self.running) >= self.config.max_num_partial_prefills)
                or budget.delays_first_tokens(num_new) or not self.blocks.can_allocate(need + group_need, keep=keep)
                or not self._adapter_in_slot(seq)):
            seq.num_computed_tokens = 0
            return 0
        self.blocks.share(cached)
        if group_cached is not None:
            self.windows.admit(seq, group_cached, num_computed + num_new)
        seq.block_ids = cached + self.blocks.allocate(need)
        seq.num_cached_blocks = len(cached)
        seq.num_prefix_hit_tokens = max(seq.num_prefix_hit_tokens, num_computed)
        return num_new

    def _adapter_in_slot(self, seq: Sequence) -> bool:
        """Whether seq's LoRA adapter, if it has one, is in a device slot (loaded now if a slot is free)."""
        if seq.lora is None:
            return True
        seq.lora_slot = self.adapters.acquire(seq.lora, self.running)
        return seq.lora_slot > 0

    def _swap_in(self, seq: Sequence, budget: StepBudget) -> int:
        num_new = self._num_new_tokens(seq, budget)
        need = self._blocks_for(seq.num_computed_tokens + num_new)
        extra = 0 if self.windows is None else self.windows.num_to_restore(seq, need)
        if num_new == 0 or not self.blocks.can_allocate(need + extra) or not self._adapter_in_slot(seq):
            return 0
        seq_blocks.swap_in(seq, self.blocks, self.windows, self.swapper, need)
        return num_new

    def recompute_all(self) -> None:
        """Every block's content is lost: running sequences go back to the queue, in order, to be
        computed again from their first token."""
        for seq in reversed(self.running):
            seq.num_computed_tokens = 0
            self._preempt(seq)

    def _preempt(self, seq: Sequence, *, to_back: bool = False) -> None:
        self.running.remove(seq)
        # Admission needs a token to run: a beam awaiting its siblings, with every token computed,
        # keeps all but its last.
        seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
        swap = self.config.preemption_mode == "swap"
        seq_blocks.release(seq, self.blocks, self.windows, self.swapper if swap else None)
        if not swap:
            seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if to_back:
            self.waiting.append(seq)
        else:
            self.waiting.appendleft(seq)

    def _fork_ready(self) -> list[Sequence]:
        """Split each parent whose shared prompt is computed into its n samples, sharing its blocks.
        A one-token prompt shares nothing, so its parent forks while it waits."""
        forked = []
        for parent in [s for s in (*self.running, *self.waiting)
                       if s.forks > 1 and s.num_computed_tokens == s.num_computable_tokens]:
            for k in range(parent.forks - 1, 0, -1):
                forked.append(self.fork(parent, seq_id=parent.seq_id + k, index=parent.index + k))
            parent.forks = 1
        return forked[::-1]

    def fork(self, parent: Sequence, *, seq_id: int, index: int) -> Sequence:
        """A copy of parent that shares its KV blocks (seq_blocks.fork) and queues right behind it."""
        child = seq_blocks.fork(parent, self.blocks, self.windows, seq_id=seq_id, index=index)
        queue = self.running if parent.status is Status.RUNNING else self.waiting
        queue.insert(list(queue).index(parent) + 1, child)
        return child

    def finish(self, seq: Sequence) -> None:
        """Retire seq at once and free its blocks (prefix-cached ones stay cached)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq_blocks.release(seq, self.blocks, self.windows)
        seq.swapped_kv = None
        seq.status = Status.FINISHED

