// The residency engine and policy (allocator/residency.hpp).
//
// Algorithm
// ---------
// Every large segment of the caching allocator is a region the engine knows (swap_region); while it is live
// (allocated) it is swappable. A region is backed by device memory (one physical allocation of its size, a chunk:
// Note [Chunks]) or by one host-located VMM allocation of its size (created at its first eviction, kept for the
// region's life, pooled by size when the region goes). Its state:
//
//   device --start_evict--> moving_out --finish: remap ok--> host --start_prefetch--> moving_in --ok--> device
//                              |  (abandoned: a launch touched it)                        |  (abandoned)
//                              +--> device                                                +--> host
//
// A move never touches the region's own VA until its copy is complete (Note [Shadow copies]), and remaps it
// only through the residency gate (Note [Remap under the gate]), so the VA is always mapped to a full copy of
// the data (DESIGN.md invariant 3) and no write is lost (invariant 4).
//
// The migration thread wakes every `period` (200 µs): it completes the moves whose copy event has completed
// (query only: no host wait) and runs the policy (Note [Policy]); an idle one sleeps until the program acts (Note
// [Idle engine]). The allocation path evicts synchronously when a request does not fit (Note [Allocation under
// pressure]).
//
// Note [Shadow copies]
//   A move copies the region into its destination through a VA of the destination's own: an eviction into the
//   view of the region's host backing (mapped once, when the backing is created, and kept with it in the pool),
//   a prefetch into its chunk's home VA (mapped once, when the chunk is created: Note [Chunks]). The copy
//   runs region VA -> destination on the engine's copy stream (one for D2H, one for H2D). Before the copy, the engine
//   snapshots the region's gate sequence s, then records an event on every stream launches may use (set_streams
//   / note_stream, the legacy stream always) and makes the copy stream wait for them: every launch enqueued
//   before the snapshot has completed when the copy starts. An event recorded after the copy tells when it is
//   done. The copy is stream-ordered; the host never waits for it on the migration thread.
//
// Note [Remap under the gate]
//   When the copy is done, try_begin_remap(r, s) succeeds only if no launch touching r has been issued since the
//   snapshot and none is being issued (residency_gate.hpp). Then nothing pending on any GPU stream touches r
//   (the launches before s completed before the copy), so its VA can be unmapped and mapped to the
//   destination pages, with launches that arrive meanwhile waiting in enter(). On failure a launch may have
//   written r after the copy read it: the copy is stale, the move is abandoned (staging unmapped, pages given
//   back) and the region stays where it was; the policy may try again later.
//
// Note [Remaps outside the lock]
//   A remap is a handful of driver calls (unmap, map, set access: 0.1-0.4 ms for a 24 MiB region on the H100,
//   set access on host pages the dearest). Made with the allocator mutex held, some 300 of them per training step
//   kept the program's allocations waiting. So the migration thread finishes a move in three steps: under the
//   mutex it marks the region busy (begin_finish); without it, it takes the gate, makes the driver calls and
//   releases the gate (remap_busy); under the mutex again it updates the books (end_finish). While a region is
//   busy nobody else touches it: every engine entry point that acts on a region waits (wait_not_busy, releasing
//   the mutex) until it is not, moving_locked() says it moves, and regions cannot be removed. Settling and
//   synchronous evictions, already waiting on the host, do all three steps with the mutex held. The moves the
//   policy starts go the same way: under the mutex it decides and begins them (the region busy, defer_start);
//   without it, tick() makes a prefetch's chunk and enqueues each move's fences and copy or check
//   (start_all_deferred; the checks with one digest launch: Note [Batched checks]); under the mutex again, end_start
//   undoes a move whose copy failed to start.
//
// Note [Releasing spares outside the lock]
//   A prefetch with no spare chunk of its size and no room in the budget releases spares of other sizes to make its
//   room (claim_room, Note [Chunks]): each an unmap of its home, a release, 0.1-0.2 ms of driver calls on the H200.
//   Made with the mutex held, in the policy's round, they were the round's longest part (~22 releases a step for the
//   1.1B LoRA at 25%: `room_s` 2.2 ms a step, against 0.03 ms at 50%), and an allocation arriving meanwhile waited
//   for all of them. So the round only takes those spares off the pool, their pages still counted as held
//   (move::releasing); tick() frees them without the mutex, with the move's region busy, right before it creates the
//   chunk in their room (start_prefetch_copy), and end_start gives back, under the mutex again, the pages they had
//   beyond the chunk's (settle_room). The device never holds more than the budget: the spares are gone before the
//   chunk is made. A segment's chunk (take_chunk_locked, the program's thread) frees them at once. On the H200
//   (1.1B LoRA, interleaved against the code before, three calls, session 29): at 25% the program's waits for the
//   mutex fell from 3.1-4.2 to 1.1-1.9 ms a step (what the tracker alone leaves with nothing to move), the rounds'
//   hold from 6.6-7.9 to 4.5-6.1 ms; at 10% the waits fell from 6.3 to 1.8 ms. The steps were within the noise.
//
// Note [Chunks]
//   A region's device memory is one physical allocation of its size (a chunk), not the allocator's 2 MiB pages
//   (which slabs still use): VMM calls cost per mapping, not per byte. On the H100 (bench/vmm_sync_probe.py) a
//   32 MiB range mapped from 16 pages took 0.094 ms to map, 0.571 ms to set access and 0.367 ms to unmap; mapped
//   from one allocation, 0.008, 0.044 and 0.026 ms. A thread remapping per-page ranges also slowed a thread
//   launching kernels from 8 to 19 us per launch (the driver's lock); remapping one host allocation of the same size
//   did not. The allocator makes a new large segment from a chunk (take_chunk_locked) and maps it at the segment's
//   VA in one call. A chunk is mapped at the region's VA while it backs the region and, from the first prefetch into
//   it on, for good at a home VA of its own (its staging VA: a prefetch copies into it there). An eviction, or the
//   segment's destruction, unmaps it from the region's VA (one call) and keeps it as a spare, pooled by size, for
//   the next prefetch or new segment of that size. The engine holds chunks within the budget: take_room() counts a
//   new one as held (pooled pages released first), give_room() a released one. Spare chunks are released when a
//   prefetch or a segment needs room for another size, and when an allocation needs pages (release_spare_locked:
//   nothing pending touches a spare chunk).
//
// Note [Write-back]
//   A region's host backing is kept for its life, so after a prefetch the host copy still holds what came in. With
//   LAYERSWAP_WRITEBACK=skip-clean (the default) and a port that can digest (driver::can_digest, runtime/digest.hpp):
//   * a prefetch enqueues a digest of the staged device copy after its H2D copy, on the copy stream; when the
//     prefetch remaps, that digest describes the host copy (no launch touched the region between the snapshot and
//     the remap: Note [Remap under the gate]), and the region keeps it (digest_known);
//   * an eviction of a region with a known digest first enqueues, after its fences, only a digest of the region
//     (a "check"; the checks a policy round starts share one launch: Note [Batched checks]). When it completes
//     (poll_moves, settle: resolve_check) and equals the known one, the host copy is current: the move goes straight
//     to its remap with no copy (writeback_skipped), and the gate still refuses it if a launch touched the region
//     since the snapshot. Otherwise the region is dirty: the copy is enqueued then, its fences being long passed,
//     and the move goes on as any eviction;
//   * any copy into the host backing makes the known digest stale (digest_known = false) until the next prefetch,
//     whether or not that eviction completes;
//   * a region found dirty by two checks in a row (trained weights, optimizer state) skips the check for its next
//     k_unchecked_evictions evictions, which copy at once: a check costs a digest and a round of the migration
//     thread before the copy starts.
//   A skip loses a write only if the region changed and both 64-bit lanes of the digest still match: about 2^-128
//   for unrelated content. The result words are poisoned before each check (the complement of the known digest),
//   so a digest that never ran reads as dirty, never as clean. Where the port cannot digest, every eviction copies.
//
// Note [Batched checks]
//   A check is a digest kernel launch, and launches cost driver time whatever they digest: the ~200 checks a step of
//   the 1.1B LoRA at 25% cost the program's launching threads ~1.5 ms of driver time a step on the H100, ~7.5 us each
//   (docs/history.md, session 33), though they run on the migration thread. The evictions a policy round starts are
//   left to tick() to enqueue (defer_start), so tick() gives the checks among them one launch (start_all_deferred,
//   driver::digest_many_async; the real port takes up to 32 ranges a launch): first every check's snapshot and
//   fences (fence), then one digest of all their regions on the D2H stream, then each one's `done`
//   (end_copy_start). Each digest still comes after its own fences: fences recorded later are later points of the
//   same streams. The checks go before the batch's copies on the D2H stream, so that clean regions' pages come back
//   without waiting for dirty regions' copies. What Note [Write-back] guarantees stays: the words are poisoned
//   before, so a range the launch never digested reads as dirty; if the launch fails, every check of the batch
//   copies instead (and digests are off from now on), and the words are left to whatever the launch may have
//   digested; a check whose own fences or `done` fail is undone alone (end_start). Prefetches' digests are not
//   batched: each follows its own copy, and one launch for a batch would have every prefetch of it land only when
//   its last copy does. residency_options::batch_digests turns batching off (the unit tests compare the two).
//   On the H100 (1.1B LoRA at 25%, session 34, interleaved against the same build with batching off through a
//   development switch, two calls): the launches that met one of the engine's digest launches in the driver spent
//   1.3 ms a step there against 2.9 (58 against 259 a step, LAYERSWAP_TRACK=attribute); the step itself did not
//   change beyond the noise (the unbatched side 1.027x and 0.997x the default's per cycle).
//
// Note [Policy]
//   With a learned forecast: regions get a rank (their index in the forecast; absent = no forecast). The wanted set is
//   the forecast from the front, whole groups at a time, while its bytes fit in budget - reserve and at most
//   LAYERSWAP_PREFETCH regions (auto: no count limit). The reserve is the largest "transient" usage seen: device bytes
//   held that no move can free (live activations, partly used slabs, live regions absent from the forecast), that is
//   held less pooled pages, less the allocator's idle cache, less forecast regions' pages; an allocation that had to
//   evict synchronously raises it to what that moment needed. Forecast regions on the device or coming in may hold at
//   most capacity = budget - reserve: when the wanted regions on the host do not fit beside them, the resident,
//   unpinned, unwanted forecast regions with the farthest next use are evicted (Belady; ties by least recent use), as
//   many as that takes, at once: an eviction waits for the launches already enqueued (its fences), so it has to start
//   long before its pages are needed. Wanted regions on the host are then prefetched in forecast order within the
//   capacity, as pages allow: free pages (pooled, budget headroom), else the allocator's idle cache, reclaimed without
//   a host wait (page_source::reclaim_idle) when the copies would otherwise stop (Note [Reclaiming for a prefetch]).
//   Regions absent from the forecast are never the policy's victims (DESIGN.md invariant 6: memory that cannot move
//   comes first); only an allocation under pressure evicts them, and only when no forecast region is left. Without a
//   forecast (none, or not learned): a region on host that a launch touched since its eviction is brought back,
//   evicting the least recently used resident region if needed. Pinned regions (LAYERSWAP_PIN, from the forecast's step
//   order) are never evicted.
//   Launches that reach a region whose prefetch is still in flight wait for it in the gate (residency_gate.hpp,
//   Note [Waiting for a prefetch]); the migration thread polls every 20 µs while any does.
//
// Note [Cache reserve]
//   The policy fills its capacity with forecast regions, so under a tight budget the allocator's cache of freed
//   segments keeps only what the live activations leave. Activations come and go in many sizes within a step: an
//   allocation that finds no cached segment of its size then destroys one of another size and makes its own (a
//   chunk created, mapped and given access: driver calls that wait for the migration thread's remaps), and the next
//   allocation of the destroyed size does the same. On the H100 a LoRA step at 25% made 40 segments that way. The
//   cache reserve is device memory the policy leaves to the cache: capacity = budget - reserve for transients -
//   cache reserve. LAYERSWAP_CACHE_RESERVE=auto grows it by a segment's bytes each time an allocation misses so
//   (note_cache_miss_locked), up to half of budget - reserve for transients, so that prefetching keeps at least
//   half its room; it never shrinks. A size fixes it (at most the whole capacity). None (no cache reserve) is the
//   default since session 42, with LAYERSWAP_SPLIT: the program's requests then take ranges of the segments its stream
//   freed instead of remaking segments (caching_allocator.cpp, Notes [Split segments], [Split bound]), and the policy
//   gets the room (at LoRA's 25% on the H100, 2.9-3.2 GB moved a step instead of 3.7, launch waits 0.6-6 ms instead
//   of 9.5-15). Without splits, no cache reserve made the program remake ~19 chunks a step and gained nothing
//   (docs/history.md, session 41).
//
// Note [Following reserve]
//   The reserve of Note [Policy] is the step's peak of transient bytes, kept free at every moment. But the transient
//   bytes of a training step rise through the forward pass and fall through the backward one (LoRA at 25% on the H200:
//   0.5 GB at the step's start and end, 2.6 GB at the loss), so at the start of the forward pass most of the reserve is
//   room no activation needs yet, and the weights it could hold are evicted and prefetched again. With
//   LAYERSWAP_RESERVE=follow[:N] the engine learns the peak of each 64th of the learned step (the transient bytes seen
//   by the rounds in it, raised by an allocation that had to evict synchronously there), and once every 64th has been
//   seen with the same step length, or four steps have passed (a 64th that no round saw, such as a burst of launches in
//   a millisecond, then counts as the step's peak), a round's reserve is the peak of its own 64th and the N after it
//   (default 4): the policy evicts ahead of the activations' growth (the Belady victims of Note [Policy], the regions
//   just used) and prefetches into what they leave as they are freed. Until then, and when the step length changes
//   (relearned: the peaks start again), the reserve is the step's peak. Experimental: the room it gives the weights was
//   the activations' segments. A prefetch that finds no spare of its size and no room in the budget first reclaims an
//   idle segment whose chunk is exactly its size (page_source::reclaim_idle_sized: a region's own chunk or a home
//   segment's), which passes to it as it is; with LAYERSWAP_SPLIT the allocator places activations in the weights'
//   spare chunks where it can (Notes [Split spares] and [Home segments] in caching_allocator.cpp). On the H200 (1.1B
//   LoRA at 25%, docs/history.md, sessions 26 and 27) it cut the bytes moved per step from 3.73 to 2.1-2.5 GB, but the
//   program still made ~145 segments a step (~300 without home segments): 1.3-1.4x the resident step against 1.1x.
//   Since session 52 the learned peaks are met 64th by 64th (Note [Reserve profile]); N is the lead there.
//
// Note [Reserve profile]
//   A following reserve used to set aside, in every round, the peak of the 64ths just ahead: the room the step needs at
//   its peak had to be free at once, though the regions that will leave it by then are still in use. At LoRA's 25% on
//   the H200 (a timeline of the rounds, bench/results/timeline_s52.patch) the forward pass evicted layers it had not
//   used yet and prefetched them back before its end, and the backward pass evicted the last layers (used next in the
//   next step's forward pass) for room the falling activations would have left anyway: 2.4-2.5 GB moved a step, where
//   the room at the loss (3.46 GB of budget, 2.7-2.8 GB of activations) asks for ~1.6. So once the peaks of every 64th
//   are known (Note [Following reserve]), the round meets each 64th ahead, over a whole step, on its own: the room for
//   forecast regions in 64th k is the budget less k's peak (the present one: at least the transient bytes now). The
//   wanted set is built in forecast order as before, each run (a region with its group) held in the 64ths from its
//   hold's start to `reserve_margin` 64ths after its last member's next use (the eviction that follows a use waits
//   for its launches); a run on the host starts its hold `reserve_ahead` (N) 64ths before its first member's use, a
//   run with a member on the device now. The first run that does not fit in every 64th of its hold ends the set. The
//   resident regions not wanted may hold what the tightest 64th leaves beside the wanted ones; the rest are evicted,
//   farthest next use first, as before. Prefetches take the room of the present 64th, in forecast order; one whose
//   hold has not begun goes early only if it fits in every 64th until then. A region used before the peak is thus kept
//   until its use and evicted after it, and one used after the peak and again soon (the backward pass's first layers)
//   stays through it when there is room. Measured on the H200 per cycle against the window rule (LoRA, session 52,
//   margin 2 and N = 2; docs/history.md): at 25% 0.893x the step (quartiles 0.808-0.935; 1.79 GB moved a step against
//   2.43, the migration thread's remaps 52 ms against 69); at 10% 0.913x (0.864-0.993; 2.38 GB against 3.50, launch
//   waits 2.6 ms against 8.8); at 50% 1.049x (0.960-1.117; 1.03 GB against 1.38; pooled 0.1273 s against 0.1293).
//   Margin 1 with N = 4 and N = 8 ran 0.961x and 0.942x at 25%.
//
// Note [Automatic reserve]
//   A following reserve (above) pays off where handing room back to the activations is cheap: the evictions that give
//   it back are clean (Note [Write-back]: frozen weights, no copy to the host, only a remap). Where the regions it
//   moves are trained every step, each such eviction first copies the region back, and the activations' requests wait
//   for it. Session 46 measured both on the H100 (docs/history.md): with `follow:8` a 1.1B LoRA at 25% stepped 0.948x
//   the peak reserve's step on a host with a 0.097 s resident step (launch waits 1.4 ms a step against 6.6, 2.59 GB
//   moved against 3.18) and 0.980x at 50% (1.049x at 10%, within its quartiles on a noisy host; 99% of the evicted
//   bytes clean at each), while the UNet (1.05-1.10x) and full fine-tuning (1.05-1.10x), which copied back 58-100% of
//   the bytes they evicted, were slower at every budget (the allocations' host waits up to 1.7x).
//   LAYERSWAP_RESERVE=auto[:N] (the default, N = 8) therefore follows the step while at least nine tenths of the bytes
//   the last learned step evicted were clean (eight tenths to keep following), and keeps the step's peak otherwise. It
//   judges each step as it ends (judge_evictions); a step that evicted nothing changes nothing. Only evictions that can
//   tell count: checked ones, and those copied at once after two dirty checks (dirty). A region's first eviction, with
//   no digest yet (Note [Write-back]), copies whatever the region holds and tells nothing: counted as dirty it kept the
//   reserve at the peak one step longer at the start (session 47). With LAYERSWAP_WRITEBACK=always no eviction is
//   checked, so none counts and the reserve stays the peak. Measured as the default on a noisier H100 (resident 0.135
//   s): LoRA at 25% 0.982x the peak's step, at 10% 1.011x (inside the quartiles: the launch waits halve, the program's
//   allocator calls grow by as much); the UNet's and full fine-tuning's reserve never followed the step.
//
// Note [Reclaiming for a prefetch]
//   A prefetch with no spare of its size and no room could take the allocator's idle cache (segments the program
//   freed, fenced). The program then makes those segments again at its next requests of their sizes: on the program's
//   thread, 0.7-0.9 ms each on the H200 (create, map, set access, behind the migration thread's remaps). So the
//   engine reclaims for a prefetch only when the copies would otherwise stop: a launch waits for a prefetch, or none
//   is in flight. Otherwise the prefetch waits for the room that the evictions in flight free. Spare chunks of other
//   sizes are released for a prefetch (or a segment) only when releasing them makes its room (claim_chunk): they are
//   kept for the next prefetch of their size. On the H200 (1.1B LoRA, interleaved against the code before, session
//   28): at 25% the program made 0-0.1 segments a step instead of 2.8, its allocator calls took 5.8 ms instead of 7.4
//   (the lock waits 0.9 ms more: rounds that find no room are longer), the launches' waits for prefetches and the
//   bytes moved did not change; at 10%, 12.8 segments instead of 17 and 23.6 ms instead of 27.6 (the launches'
//   waits for prefetches 5.0 ms against 2.0 in the one process measured there). The UNet and full fine-tuning at 25%
//   were not slower; the UNet's hit rate fell from 0.967 to 0.942: a launch that reaches a region whose prefetch has
//   not started yet waits for nothing, and runs on the host copy.
//
// Note [Digest carried over]
//   A prefetch digests what it brought in (Note [Write-back]) so that the next eviction can tell a clean region.
//   When the region's digest is known and no launch touched it since its eviction (its gate sequence still equals
//   the one its eviction recorded, read at the prefetch's snapshot), its host copy is the one that digest
//   describes: the eviction either found the device copy equal to it (clean: the host copy stayed) or copied and
//   made it unknown; and only a launch on the host mapping could have written the host copy since. So the prefetch
//   enqueues no digest and the region keeps its digest (residency_stats::digests_carried): frozen LoRA weights,
//   evicted and brought back every step, cost a digest kernel per eviction instead of two. A launch that touched
//   the region on the host (the sequence moved) gets a digest as before; one during the copy abandons the move.
//
// Note [Unfenced prefetch]
//   An eviction's copy and remap complete only after every launch enqueued before it that touched the region
//   (its fences), and the remap happens under the gate. If the region's gate sequence has not moved since (no
//   launch touched it on the host), nothing pending on any stream touches it, and its host copy is final: the
//   prefetch copies at once, without fences, so it is not queued behind the program's work. The remap still
//   checks the sequence, so a launch that arrives during the copy abandons the move as usual. The sequence is read
//   at the copy's snapshot (start_copy), not when the policy began the move: a launch issued between the two
//   (before the prefetch began, so it did not wait for it) is in the snapshot, and its work may still be queued.
//
// Note [Allocation under pressure]
//   When a request does not fit in the budget, the allocator reclaims its cache first, then calls
//   evict_sync_locked(). Evictions in flight free their pages soonest: it finishes the moves whose copies are done
//   and, if none was an eviction, waits for the oldest eviction in flight alone (the D2H stream runs in order), not
//   for the prefetches, whose pages stay taken when they land. When no eviction was in flight (or it was
//   abandoned), it evicts the live, unpinned, resident region not moving with the farthest next use (ranks of the
//   last policy round; absent: least recently used), waiting for its fences and copy on the host; only if there is
//   none does it settle every move first (their regions become candidates) and try again. A
//   remap refused by the gate (a launch on another thread) abandons that victim and tries the next. Only when
//   nothing is left to evict does the allocator raise OOM.
//
// Note [Freeing a moved region]
//   deallocate() of a region moving out cancels the move (the region stays device-backed and is cached as
//   usual). A region on host or moving in is not cached: the allocator retires it (destroyed once an event on
//   its stream says its last launches are done, and its move has completed), so a host-backed block is never
//   handed out again.
//
// Note [Holds]
//   With LAYERSWAP_HOLD=1 the tracker holds launches on the GPU instead of waiting on the host for a prefetch
//   (residency_gate.hpp, Note [Holding a launch on the GPU]). The engine's side: a granule of device memory from
//   the budget (ensure_flags, at the first prefetch) holds a 32-bit flag per region (slot), with a ticket count
//   per slot that only grows. Once a prefetch's copy and fences are enqueued and the region is not busy
//   (publish_hold, mutex held), it publishes (flag, next ticket) in the gate. When the prefetch ends, however it
//   ends (remapped, abandoned, cancelled, failed to start), release_hold retracts it and writes the ticket into the
//   flag on the engine's own stream: after the remap, so a held launch always finds the final mapping.
//   A held launch blocks its stream until then, so nothing may wait on the host, with the allocator mutex held, for
//   work queued after a held launch while the move it waits for still needs the mutex to finish: the allocator's
//   host waits (fences, pending frees) and the engine's (an eviction's fences and copy, in settle) first call
//   release_holds, which finishes every prefetch with a hold, oldest first, with the mutex held. A prefetch's own
//   copy never waits for a launch held on it or on a younger prefetch (its fences were recorded before its hold was
//   published), so those host waits end. A region being remapped by the migration thread is skipped: its flag is
//   written without the mutex. DESIGN.md invariant 3 holds in this form: a remap starts when every launch known to
//   touch the region has completed or is held until after the remap.
//
// Note [No tracker]
//   Without a tracker feeding the gate (gate::fed() false) the engine cannot see launches, so it can never know
//   a region is idle: it moves nothing, not even under pressure (the allocator raises OOM as before). Tests that
//   play the tracker set residency_options::without_tracker.
//
// Note [Idle engine]
//   A process that stops launching (between steps, waiting for data, evaluating on the CPU, or a side of an
//   interleaved benchmark waiting for its turn) would go on waking its migration thread 5,000 times a second and
//   running a policy round every millisecond, for nothing, on a core the program or another process may need. So
//   after k_idle_ticks ticks in a row that ended with no move in flight, with no launch counted
//   (residency_gate::count_launch) and none waiting, the thread marks itself asleep in the gate and sleeps
//   options.idle_period (20 ms) instead of `period`. The next counted launch, a launch that waits for a prefetch,
//   or a free (residency_gate::nudge, from the allocator) wakes it at once, so a step that resumes finds it
//   polling again; a free matters because the room it leaves may be what a prefetch waits for. The mark and the
//   count are a Dekker pair (seq_cst): the engine marks itself, then reads the count; a launch counts, then reads
//   the mark. Either the engine sees the new count and stays awake, or the launch sees the mark and wakes it.
//   Counted in residency_stats::idle_sleeps.
//
// Note [Late prefetches]
//   Statistics of the prefetches a launch waited for (residency_stats::late_*), to tell why they were late: the
//   gate stamps when the first launch began waiting (take_wait_start), the move when it was begun, when
//   poll_moves first saw its copy complete and when its remap ended. A wait splits into the part before the copy
//   was seen complete (the copy was late: begun too late, or queued behind other copies) and the part after (the
//   migration thread had not remapped it yet: busy with other remaps, or between polls); the lead is how long
//   before the wait the prefetch was begun. The waits are also summed by the eighth of the learned step the
//   policy's last forecast was in, beside the peak of the transient bytes (Note [Policy]) seen in each eighth,
//   which shows where in the step the forward and backward passes lie.
//
// Note [Tuned prefetch]
//   LAYERSWAP_PREFETCH=tune (experimental): the distance is chosen per learned step length from the step times the
//   policy rounds see (allocator/prefetch_tuner.hpp). Training wants auto: a GEMM reads a weight left on the host at
//   6-25 GB/s. One token of generation reads each weight once, about as fast from the host as a copy would, and moving
//   every weight costs more in host mappings than the link does (session 58, 25% of a 1.1B Llama's weights: auto 56.5
//   ms a token, 16 regions 37.8 ms, 4 regions 38.7 ms; in training 16 regions ran 1.107x auto's step). A round that
//   sees the learned step begin at a later launch (position - step_position, read with the forecast) counts the steps
//   since the last one and times each as their mean, when the start moved by whole steps (within a 16th). Not timed:
//   the steps after one that changed the distance (they ran under it), a batch of several steps that holds a step
//   settling a distance, a step that began at no boundary a round saw (after a relearn, or the learner re-syncing by
//   part of a step), a step of no time on the clock. Auto is timed first (three steps, their median, after three to
//   warm up), then halvings of min(last distance, the most regions its wanted set held), each after one step to settle.
//   The wanted set takes whole groups, the limit checked before each, so a distance below a group's size wants the
//   group: the trial stops at a distance whose wanted set held no fewer regions than the last one's (not a choice: it
//   timed the same set), at one 10% slower than the best so far, at the fifth, or below two regions. The fastest
//   shorter distance is kept when it is at least 5% faster than auto, else auto. A relearn at a length within a 64th of
//   the one tuned keeps a choice, and a trial goes on with what it timed; after twelve steps in a row that could not be
//   timed (relearned every step or two) the trial ends with what it has (auto if auto was not timed). Another length
//   abandons a trial (prefetch_tune_abandoned) for its own, or for its remembered choice (eight lengths, the least
//   recently used forgotten), so two lengths that alternate every few steps are never tuned and stay at auto. Whether
//   the learner finds one token's pass at the same length after each prompt, and what the trials cost, are for the GPU
//   run to show.
#include "allocator/residency.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <exception>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "allocator/prefetch_tuner.hpp"
#include "allocator/residency_gate.hpp"
#include "runtime/config.hpp"
#include "runtime/digest.hpp"
#include "runtime/driver_calls.hpp"
#include "runtime/error.hpp"
#include "runtime/fast_clock.hpp"
#include "runtime/log.hpp"
#include "runtime/stats.hpp"
#include "runtime/thread_name.hpp"

namespace layerswap::detail {

namespace gate = residency_gate;

namespace {
constexpr std::uint64_t k_far = std::numeric_limits<std::uint64_t>::max();
constexpr std::chrono::microseconds k_waited_period{20};
constexpr std::size_t k_no_slot = ~std::size_t{0};
constexpr std::chrono::microseconds k_policy_period{1000};
constexpr unsigned k_idle_ticks = 16;  // idle ticks in a row before the engine sleeps long (Note [Idle engine])
constexpr std::size_t k_digest_chunk = 512;         // regions' result words allocated at a time (Note [Write-back])
constexpr std::uint8_t k_unchecked_evictions = 8;   // evictions copied without a check after two dirty ones
}

// A region's host backing: one host-located allocation, and a view of it (a VA of its own, mapped once) that
// evictions copy into, so that an eviction maps nothing until its remap (Note [Shadow copies]).
struct host_backing {
  phys_handle handle = 0;
  device_ptr view = 0;
  explicit operator bool() const noexcept { return handle != 0; }
};

// Spare chunks by size (Note [Chunks]).
using spare_list = std::vector<std::pair<std::size_t, device_chunk>>;

struct move {
  bool to_device = false;
  device_ptr shadow = 0;             // prefetch: the chunk's home VA; eviction: the host view
  std::uint64_t snapshot = 0;
  std::vector<event_handle> fences;  // recorded on the known streams before the copy
  event_handle done = nullptr;       // recorded on the copy stream after the copy
  device_chunk chunk;                // prefetch: the destination (none yet: room taken, created at the start)
  std::size_t room = 0;              // prefetch: pages held for the chunk while it is not created (and beyond it)
  spare_list releasing;              // prefetch: spares that make its room, freed before it is created
  std::size_t extra = 0;             // ... their pages beyond the chunk's (Note [Releasing spares outside the lock])
  std::int64_t freed = 0;            // ... the number freed so far
  std::size_t lost = 0;              // ... the pages of one whose free failed
  bool cancelled = false;            // the region was freed (Note [Freeing a moved region])
  std::vector<stream_handle> fence_streams;  // streams to fence before the copy (none: Note [Unfenced prefetch])
  std::vector<event_handle> spare_fences;    // events reserved for start_copy
  bool refused = false;              // the gate refused the remap: a launch touched the region (abandoned)
  bool remapped = false;             // remap_busy() completed
  bool sync = false;                 // a synchronous eviction (stall)
  bool checking = false;             // eviction: only a digest is enqueued so far (Note [Write-back])
  bool digested = false;             // prefetch: a digest of the copy is enqueued, the region's at the remap
  bool carried = false;              // prefetch: the region keeps its digest (Note [Digest carried over])
  bool clean = false;                // eviction: the check proved the host copy current (no copy)
  bool judged = false;               // eviction: it tells clean from dirty (Note [Automatic reserve]): checked, or
                                     // copied at once after two dirty checks; not a region's first, with no digest
  std::uint64_t* words = nullptr;    // the region's digest result words (taken with the mutex held)
  std::uint32_t ticket = 0;          // prefetch: the hold published (0: none; Note [Holds])
  std::uint64_t number = 0;          // order of publication of the holds (release_holds)
  std::uint64_t started = 0;         // order of the moves' starts (evict_sync_locked waits for the oldest eviction)
  // Prefetch timing, steady-clock ns (Note [Late prefetches]): begun, its copy seen complete, a launch began
  // waiting for it (0: none did), remapped.
  std::uint64_t begun_ns = 0;
  std::uint64_t copy_seen_ns = 0;
  std::uint64_t waited_from_ns = 0;
  std::uint64_t remapped_ns = 0;
};

struct alignas(64) swap_region {
  // What a policy round reads of every forecast region first, in one cache line (Note [Policy rounds]).
  std::size_t bytes = 0;
  std::unique_ptr<move> mv;
  std::uint64_t rank = k_far;     // index in the last forecast; k_far: absent
  std::uint64_t wanted_round = 0;  // the last policy round that wanted it (Note [Policy rounds])
  region_id id = 0;
  std::uint32_t group = 0;
  region_residency state = region_residency::device;
  bool live = false;
  bool pinned = false;
  bool busy = false;  // the migration thread is remapping it without the mutex (Note [Remaps outside the lock])
  // The rest.
  device_ptr va = 0;
  std::size_t npages = 0;
  device_chunk chunk;  // its device memory, while it is device-backed (Note [Chunks])
  host_backing host;   // empty until the first eviction
  std::uint64_t evicted_seq = 0;  // gate sequence when it went to host (demand detection without a forecast)
  std::size_t moving_at = 0;       // its index in impl::moving while it has a move
  std::size_t flag_slot = k_no_slot;  // its word in the hold flags (Note [Holds])
  // Note [Write-back]
  std::size_t digest_slot = k_no_slot;  // its two result words
  digest128 digest;                     // the digest of its host copy, when digest_known
  bool digest_known = false;
  std::uint8_t dirty_checks = 0;        // consecutive checks that found it dirty
  std::uint8_t unchecked = 0;           // evictions left that copy without a check
};

// Region id -> region, for the policy's lookups of every forecast entry each round (Note [Policy rounds]): one
// contiguous open-addressing table (linear probing, deletion by backward shift), a few KiB that stay in cache,
// where the unordered_map that owns the regions costs a bucket and a node per lookup.
class region_index {
 public:
  [[nodiscard]] swap_region* find(region_id id) const noexcept {
    if (size_ == 0) return nullptr;
    for (std::size_t i = home(id);; i = (i + 1) & mask_) {
      if (slots_[i].id == id) return slots_[i].region;
      if (slots_[i].id == 0) return nullptr;
    }
  }
  // Adds `id`, or points it at `r` when present.
  void insert(region_id id, swap_region* r) {
    if ((size_ + 1) * 2 > slots_.size()) rehash(std::max<std::size_t>(64, slots_.size() * 2));
    std::size_t i = home(id);
    while (slots_[i].id != 0 && slots_[i].id != id) i = (i + 1) & mask_;
    if (slots_[i].id == 0) ++size_;
    slots_[i] = {id, r};
  }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  void erase(region_id id) noexcept {
    if (size_ == 0) return;
    std::size_t i = home(id);
    while (slots_[i].id != id) {
      if (slots_[i].id == 0) return;
      i = (i + 1) & mask_;
    }
    slots_[i] = {};
    --size_;
    // Backward shift: pull later entries of the probe run into the hole when their home allows it.
    for (std::size_t j = (i + 1) & mask_; slots_[j].id != 0; j = (j + 1) & mask_) {
      if (((j - home(slots_[j].id)) & mask_) >= ((j - i) & mask_)) {
        slots_[i] = slots_[j];
        slots_[j] = {};
        i = j;
      }
    }
  }

 private:
  struct slot {
    region_id id = 0;  // 0: empty (region ids start at 1)
    swap_region* region = nullptr;
  };
  [[nodiscard]] std::size_t home(region_id id) const noexcept {
    return static_cast<std::size_t>((std::uint64_t{id} * 0x9E3779B97F4A7C15ull) >> 32) & mask_;
  }
  void place(region_id id, swap_region* r) noexcept {
    std::size_t i = home(id);
    while (slots_[i].id != 0) i = (i + 1) & mask_;
    slots_[i] = {id, r};
  }
  void rehash(std::size_t capacity) {
    std::vector<slot> old = std::exchange(slots_, std::vector<slot>(capacity));
    mask_ = capacity - 1;
    for (const slot& e : old) {
      if (e.id != 0) place(e.id, e.region);
    }
  }
  std::vector<slot> slots_;
  std::size_t mask_ = 0;
  std::size_t size_ = 0;
};

struct residency_engine::impl {
  impl(driver& p, std::mutex& m, page_source& s, residency_options o)
      : port(p), mutex(m), source(s), options(std::move(o)), gran(p.granularity()) {}

  driver& port;
  std::mutex& mutex;
  page_source& source;
  residency_options options;
  std::size_t gran;

  // ---- guarded by `mutex` ----
  std::unordered_map<region_id, std::unique_ptr<swap_region>> regions;
  region_index index;  // the same regions, for lookups
  std::vector<stream_handle> streams{nullptr};  // streams launches may use; the legacy stream always
  stream_handle d2h = nullptr;
  stream_handle h2d = nullptr;
  std::vector<event_handle> spare_events;
  std::multimap<std::size_t, device_chunk> spare_chunks;  // bytes -> chunk backing no region (Note [Chunks])
  // Pages held by prefetches beyond their chunks' (spares taken for their room, not given back yet), and those of
  // spares whose free failed (Note [Releasing spares outside the lock]).
  std::size_t extra_pages = 0;
  std::size_t lost_pages = 0;
  std::size_t spare_bytes = 0;
  std::multimap<std::size_t, host_backing> spare_host;    // bytes -> pooled host backing (view still mapped)
  std::size_t host_bytes = 0;                              // host-located bytes in existence
  std::size_t max_transient = 0;  // the reserve for memory that cannot move (Note [Policy])
  // Note [Following reserve]: the transient peak of each 64th of the learned step, for a step of `phase_step`
  // launches; `phases_seen` of them have been seen since it last changed, over `phase_steps` steps (the rounds'
  // position wrapped); `phase` is the last round's.
  static constexpr std::size_t k_phases = 64;
  static constexpr std::size_t k_follow_steps = 4;  // steps after which unseen 64ths count as the step's peak
  std::array<std::size_t, k_phases> phase_peak{};
  std::array<bool, k_phases> phase_seen{};
  std::size_t phases_seen = 0;
  std::size_t phase_steps = 0;
  std::uint64_t phase_step = 0;
  std::size_t phase = 0;
  // Note [Reserve profile]: whether the peaks of every 64th are known, and a round's scratch: the room for forecast
  // regions in each 64th ahead, the wanted runs' bytes held in each, and the 64th each wanted region's hold begins.
  bool profile_ready = false;
  std::array<std::size_t, k_phases> profile_cap{};
  std::array<std::size_t, k_phases> profile_used{};
  std::vector<std::size_t> order_from;
  // Note [Automatic reserve]: the bytes evicted since the last step began by evictions that tell (move::judged), and
  // those of them clean; whether the reserve follows the step now.
  std::size_t step_evicted_bytes = 0;
  std::size_t step_clean_bytes = 0;
  bool clean_steps = false;
  std::size_t cache_grown = 0;    // the automatic cache reserve's bytes before its cap (Note [Cache reserve])
  bool forecast_applied = false;   // the last policy round had a forecast (ranks mean next uses)
  std::uint64_t pin_generation = ~std::uint64_t{0};
  residency_stats st;
  std::vector<swap_region*> moving;  // the regions with a move, in no order; its size is the moves in flight (Note [Policy rounds])
  std::vector<swap_region*> poll_scratch;  // a copy of `moving` to walk while moves end (poll_moves, evict_sync)
  std::size_t busy = 0;                 // regions being remapped outside the mutex
  std::condition_variable busy_cv;      // signalled (mutex held) when a remap outside the mutex ends
  std::vector<swap_region*> starting;   // prefetches the policy left for tick() to start without the mutex
  // Note [Holds]: one granule of device memory, a 32-bit flag per region; the last ticket of each slot.
  stream_handle sig = nullptr;          // the stream that writes the flags
  device_ptr flags = 0;                 // 0: not set up yet
  phys_handle flags_page = 0;
  bool flags_failed = false;
  std::vector<std::uint32_t> slot_ticket;
  std::vector<std::size_t> free_slots;
  std::atomic<std::size_t> held_moves{0};  // moves with a published hold (released by busy owners too)
  std::uint64_t holds_published = 0;       // holds published so far (their order: release_holds)
  std::uint64_t moves_started = 0;         // moves started so far (move::started)
  std::size_t step_phase = 0;  // the step's eighth the last forecast was made in (Note [Late prefetches])
  std::chrono::steady_clock::time_point last_policy{};  // guarded by tick_mutex
  // Note [Write-back]: result words for the regions' digests, k_digest_chunk regions per allocation.
  std::atomic<int> digest_support{0};  // 0: not asked yet; 1: the port digests; -1: no skip
  // Time in the driver calls of remaps and prefetch starts (any thread), and its parts: prefetch starts (staging
  // map, access, copy), remaps to the device, remaps to the host.
  std::atomic<std::int64_t> remap_ns{0};
  std::atomic<std::int64_t> stage_ns{0};
  // remap_ns by the eighth of the learned step the last forecast was made in (residency_stats::remap_us_by_phase).
  std::array<std::atomic<std::int64_t>, 8> remap_ns_by_phase{};
  // The slot of step_phase in the arrays by eighth of the step (these and residency_stats's), all of one size.
  [[nodiscard]] std::size_t phase_slot() const noexcept {
    constexpr std::size_t eighths = std::tuple_size_v<decltype(remap_ns_by_phase)>;
    static_assert(std::tuple_size_v<decltype(st.late_wait_us_by_phase)> == eighths &&
                  std::tuple_size_v<decltype(st.evicted_bytes_by_phase)> == eighths &&
                  std::tuple_size_v<decltype(st.prefetched_bytes_by_phase)> == eighths);
    return std::min<std::size_t>(step_phase, remap_ns_by_phase.size() - 1);
  }
  std::atomic<std::int64_t>& remap_phase_ns() noexcept { return remap_ns_by_phase[phase_slot()]; }
  std::atomic<std::int64_t> remap_in_ns{0};
  std::atomic<std::int64_t> remap_out_ns{0};
  std::atomic<std::int64_t> chunks_created{0};  // also made by start_prefetch_copy, outside the mutex
  std::vector<std::uint64_t*> digest_chunks;
  std::vector<std::size_t> free_digest_slots;

  // ---- migration thread ----
  std::atomic<forecast_source*> forecaster{nullptr};
  std::mutex tick_mutex;  // serializes tick() (the thread, and tests calling it)
  forecast fc;            // guarded by tick_mutex
  // The policy's scratch: each group's entries in the forecast, in order (kept to reuse its memory).
  // (group, entry index) of the forecast's grouped entries, sorted: a group's entries are one run, in order; and
  // each grouped entry's position in it (Note [Policy rounds]).
  std::vector<std::pair<std::uint32_t, std::size_t>> group_entries;
  std::vector<std::size_t> group_position;
  // ... guarded by `mutex`: the last forecast's regions (nullptr: not a region), the wanted set in order, one
  // group's run, and the round count that stamps the wanted set (Note [Policy rounds]).
  std::vector<swap_region*> forecast_regions;
  std::vector<swap_region*> order_scratch;
  std::vector<swap_region*> run_scratch;
  std::uint64_t policy_round = 0;
  prefetch_tuner tuner;  // LAYERSWAP_PREFETCH=tune (Note [Tuned prefetch]); guarded by `mutex`
  std::uint64_t fc_ns = 0;  // when `fc` was read (LAYERSWAP_PREFETCH=tune's clock); guarded by tick_mutex
  std::thread thread;
  std::mutex wake_mutex;
  std::condition_variable wake_cv;
  bool stopping = false;
  bool woken = false;
  bool error_logged = false;
  std::atomic<bool> quiet{false};           // the last tick ended with no move in flight (Note [Idle engine])
  std::atomic<std::int64_t> idle_sleeps{0};  // residency_stats::idle_sleeps, written by the migration thread

  [[nodiscard]] bool active() const noexcept { return options.without_tracker || gate::fed(); }

  // ---- helpers, all with `mutex` held ----
  event_handle take_event() {
    if (!spare_events.empty()) {
      event_handle e = spare_events.back();
      spare_events.pop_back();
      return e;
    }
    return port.create_event();
  }

  // A pooled item of `bytes` from one of the size-keyed pools, if there is one.
  template <class T>
  static std::optional<T> take_pooled(std::multimap<std::size_t, T>& pool, std::size_t bytes) {
    auto it = pool.find(bytes);
    if (it == pool.end()) return std::nullopt;
    T item = it->second;
    pool.erase(it);
    return item;
  }

  // ---- chunks (Note [Chunks]) ----
  // The destination of a prefetch of `r`: a spare chunk of its size, else room in the budget for a new one, which
  // start_prefetch_copy creates (outside the mutex for the policy). Room comes from the budget's headroom and
  // pooled pages, then spare chunks of other sizes (released), then the allocator's idle cache (reclaimed without
  // a host wait). False when there is none now.
  bool take_chunk(swap_region& r, move& m) {
    const auto start = std::chrono::steady_clock::now();
    // Note [Following reserve]: the room of a following reserve is the activations' segments; one of this size
    // gives its chunk as it is, where the budget has no room for a new one.
    if (following() && !spare_chunks.contains(r.bytes) && unused_bytes() < r.bytes) {
      if (source.reclaim_idle_sized(r.bytes)) {
        LAYERSWAP_LOG(debug, "a prefetch of %s took an idle segment's chunk of its size", format_bytes(r.bytes).c_str());
      }
    }
    bool ok = claim_room(r.bytes, m);
    if (!ok && prefetch_urgent()) {
      const std::size_t idle_before = source.idle_bytes();
      source.reclaim_idle(r.npages);  // a chunk-backed idle segment leaves a spare chunk of its own size
      LAYERSWAP_LOG(debug, "a prefetch of %s reclaimed %s of the idle cache", format_bytes(r.bytes).c_str(),
                    format_bytes(idle_before - std::min(idle_before, source.idle_bytes())).c_str());
      ok = claim_room(r.bytes, m);
    }
    st.room_us += elapsed_us(start);
    return ok;
  }
  // Note [Reclaiming for a prefetch]: whether a prefetch with no room may take the allocator's idle cache: only when
  // a launch waits for a prefetch or none is in flight (the copies would stop).
  [[nodiscard]] bool prefetch_urgent() const noexcept {
    if (gate::waiting() != 0) return true;
    return std::none_of(moving.begin(), moving.end(), [](const swap_region* r) { return r->mv && r->mv->to_device; });
  }
  // A spare chunk of `bytes` (in `out`), else room in the budget for a new one (`out` left empty), spare chunks of
  // other sizes released for it (mutex held) when that makes the room. False otherwise, with none released.
  bool claim_chunk(std::size_t bytes, device_chunk& out) {
    move m;
    if (!claim_room(bytes, m)) return false;
    try {
      free_releasing(m);
    } catch (...) {
      settle_room(m);
      throw;
    }
    if (!m.chunk) m.room -= bytes / gran;  // the chunk's, until the caller creates it or gives it back
    settle_room(m);
    out = m.chunk;
    return true;
  }
  // The destination of a chunk of `bytes` for `m`: a spare of its size (m.chunk), else room in the budget for a new
  // one (m.room pages held), spare chunks of other sizes taken off the pool for it, largest first (fewest), when
  // that makes the room: m.releasing, their pages still held, for free_releasing() to free before the chunk is
  // created (Note [Releasing spares outside the lock]). False otherwise, with none taken (Note [Reclaiming for a
  // prefetch]).
  bool claim_room(std::size_t bytes, move& m) {
    if (const auto it = spare_chunks.find(bytes); it != spare_chunks.end()) {
      m.chunk = take_spare(it).second;
      return true;
    }
    const std::size_t need = bytes / gran;
    if (source.take_room(need)) {
      m.room = need;
      return true;
    }
    if (free_pages() < need) return false;
    const std::size_t unused = unused_bytes() / gran;  // taking spares off the pool does not change it
    std::size_t pending = 0;
    while (unused + pending < need) {  // spares are left: free_pages() >= need
      m.releasing.push_back(take_spare(std::prev(spare_chunks.end())));
      pending += m.releasing.back().first / gran;
    }
    if (pending < need && !source.take_room(need - pending)) {  // the budget's books disagree: take nothing
      for (const auto& [b, c] : m.releasing) add_spare(b, c);
      m.releasing.clear();
      return false;
    }
    st.chunks_released_for_size += static_cast<std::int64_t>(m.releasing.size());
    m.room = pending < need ? need - pending : 0;
    m.extra = pending + m.room - need;
    extra_pages += m.extra;
    return true;
  }
  // Frees the spares taken for m's room (driver calls only: without the mutex for the policy's prefetches). One
  // whose free fails is lost with its pages still counted as held: the budget is never exceeded.
  void free_releasing(move& m) {
    while (!m.releasing.empty()) {
      const auto [bytes, c] = m.releasing.back();
      m.releasing.pop_back();
      try {
        free_chunk(bytes, c);
      } catch (...) {
        m.lost += bytes / gran;  // counted as held for good: the budget is never exceeded
        throw;
      }
      m.room += bytes / gran;
      ++m.freed;
    }
  }
  // The books of free_releasing (mutex held): spares it did not reach back to the pool, the room beyond the chunk's
  // given back (all of it when the chunk was never created).
  void settle_room(move& m) {
    for (const auto& [bytes, c] : m.releasing) add_spare(bytes, c);
    m.releasing.clear();
    st.chunks_released += std::exchange(m.freed, 0);
    if (m.room != 0) source.give_room(std::exchange(m.room, 0));
    extra_pages -= std::exchange(m.extra, 0);
    lost_pages += std::exchange(m.lost, 0);
  }
  // Room for a chunk of another size: the largest spare released (fewest releases). False when there is none.
  bool release_largest_spare() {
    if (spare_chunks.empty()) return false;
    release_spare(std::prev(spare_chunks.end()));
    ++st.chunks_released_for_size;
    return true;
  }
  // A new chunk, with its home VA when `home` (a segment's chunk gets one at its first prefetch: add_home).
  device_chunk make_chunk(std::size_t bytes, bool home) {
    device_chunk c;
    c.handle = port.create(bytes, memory_location::device);
    if (home) {
      try {
        add_home(c, bytes);
      } catch (...) {
        port.release(c.handle);
        throw;
      }
    }
    ++chunks_created;
    return c;
  }
  void add_home(device_chunk& c, std::size_t bytes) {
    device_ptr va = source.take_home_va(bytes);  // caching_allocator.cpp, Note [Home segments]
    if (!va) va = port.reserve(bytes, gran);
    try {
      map_whole(va, bytes, c.handle, 0);
    } catch (...) {
      unreserve_home(va, bytes);
      throw;
    }
    c.home = va;
  }
  void unreserve_home(device_ptr va, std::size_t bytes) {
    if (!source.give_home_va(va, bytes)) port.unreserve(va, bytes);
  }
  // The chunk's device memory, gone (mutex held: the budget's books).
  void release_chunk(std::size_t bytes, const device_chunk& c) {
    free_chunk(bytes, c);
    source.give_room(bytes / gran);
    ++st.chunks_released;
  }
  // ... the driver's part: its home unmapped and given back, its memory released.
  void free_chunk(std::size_t bytes, const device_chunk& c) {
    if (c.home) {
      port.unmap(c.home, bytes);
      unreserve_home(c.home, bytes);
    }
    port.release(c.handle);
  }
  void release_spare(std::multimap<std::size_t, device_chunk>::iterator it) {
    const auto [bytes, c] = take_spare(it);
    release_chunk(bytes, c);
  }
  // The spare pool's books: every chunk enters through add_spare and leaves through take_spare.
  void add_spare(std::size_t bytes, const device_chunk& c) {
    spare_chunks.emplace(bytes, c);
    spare_bytes += bytes;
  }
  std::pair<std::size_t, device_chunk> take_spare(std::multimap<std::size_t, device_chunk>::iterator it) {
    const std::pair<std::size_t, device_chunk> taken = *it;
    spare_chunks.erase(it);
    spare_bytes -= taken.first;
    return taken;
  }
  // The region's books, gone (remove_locked, detach_locked): its gate flags and slots, its host backing to the
  // pool, its forecast entries; `r` is destroyed.
  void forget(swap_region& r);
  // A prefetch's destination that it no longer needs: a spare chunk, or room never used.
  void drop_destination(const swap_region& r, move& m) {
    if (m.chunk) add_spare(r.bytes, m.chunk);
    m.chunk = {};
    settle_room(m);
  }

  // Host backing of `bytes`: a pooled one of that size, else a new one within LAYERSWAP_HOST_LIMIT (pooled ones
  // of other sizes are released first to make room). Throws device_out_of_memory when there is no room.
  host_backing take_host(std::size_t bytes) {
    if (const std::optional<host_backing> h = take_pooled(spare_host, bytes)) return *h;
    while (options.host_limit && host_bytes + bytes > options.host_limit && !spare_host.empty()) {
      auto victim = spare_host.begin();
      release_host(victim->first, victim->second);
      spare_host.erase(victim);
    }
    if (options.host_limit && host_bytes + bytes > options.host_limit) {
      throw device_out_of_memory(2, "layerswap: LAYERSWAP_HOST_LIMIT (" + format_bytes(options.host_limit) +
                                        ") leaves no room for " + format_bytes(bytes) + " of host backing");
    }
    host_backing h;
    h.handle = port.create(bytes, memory_location::host);
    try {
      h.view = port.reserve(bytes, gran);
      try {
        port.map(h.view, bytes, h.handle, 0);
        try {
          port.set_access(h.view, bytes);
        } catch (...) {
          port.unmap(h.view, bytes);
          throw;
        }
      } catch (...) {
        port.unreserve(h.view, bytes);
        throw;
      }
    } catch (...) {
      port.release(h.handle);
      throw;
    }
    host_bytes += bytes;
    return h;
  }

  void release_host(std::size_t bytes, const host_backing& h) {
    port.unmap(h.view, bytes);
    port.unreserve(h.view, bytes);
    port.release(h.handle);
    host_bytes -= bytes;
  }

  // ---- holds (Note [Holds]) ----
  // The flags granule, set up at the first prefetch: one page of the budget (taken from the allocator's pool, so
  // that the budget holds), kept for the engine's life. False (and holds off for now) when no page is free.
  bool ensure_flags() {
    if (flags) return true;
    if (flags_failed) return false;
    std::vector<phys_handle> page;
    if (!source.take_pages(1, page)) return false;
    device_ptr va = 0;
    try {
      va = port.reserve(gran, gran);
      port.map(va, gran, page[0], 0);
      port.set_access(va, gran);
      const std::vector<std::byte> zeros(gran);
      port.copy_from_host(va, zeros.data(), gran);
      sig = port.create_stream();
    } catch (const std::exception& e) {
      try {
        if (va) {
          port.unmap(va, gran);
          port.unreserve(va, gran);
        }
      } catch (...) {
      }
      source.give_pages(page);
      flags_failed = true;
      LAYERSWAP_LOG(info, "residency: no hold flags (%s); launches wait on the host for prefetches", e.what());
      return false;
    }
    gate::add_internal_stream(reinterpret_cast<std::uint64_t>(sig));
    flags = va;
    flags_page = page[0];
    slot_ticket.assign(gran / sizeof(std::uint32_t), 0);
    free_slots.reserve(slot_ticket.size());
    for (std::size_t i = slot_ticket.size(); i-- > 0;) free_slots.push_back(i);
    return true;
  }
  // Publishes the hold of a prefetch whose copy (and fences) are enqueued: after the fences, so no fence can wait
  // for a launch held on it. Mutex held and the region not busy, so that release_holds() can finish the move.
  void publish_hold(swap_region& r, move& m) {
    if (!gate::holding() || r.flag_slot == k_no_slot || !m.done) return;
    m.ticket = ++slot_ticket[r.flag_slot];
    if (m.ticket == 0) m.ticket = ++slot_ticket[r.flag_slot];  // 2^32 prefetches later: 0 means none
    ++held_moves;
    m.number = ++holds_published;
    gate::publish_hold(r.id, {flag_address(r), m.ticket, r.id});
  }
  [[nodiscard]] device_ptr flag_address(const swap_region& r) const { return flags + r.flag_slot * sizeof(std::uint32_t); }
  // The prefetch has ended (remapped, abandoned or cancelled): launches held on it may run. Never throws: a
  // failed flag write is retried on the host path below, else logged (held launches would wait forever).
  void release_hold(swap_region& r, move& m) noexcept {
    if (m.ticket == 0) return;
    gate::retract_hold(r.id);
    const std::uint32_t ticket = std::exchange(m.ticket, 0);
    --held_moves;
    try {
      port.stream_write_value(sig, flag_address(r), ticket);
    } catch (const std::exception& e) {
      try {
        port.copy_from_host(flag_address(r), &ticket, sizeof ticket);
      } catch (const std::exception&) {
        LAYERSWAP_LOG(warn, "residency: could not release the launches held on region %u: %s", r.id, e.what());
      }
    }
  }
  // Finishes every prefetch with a published hold, waiting on the host for its copy: before any host wait on the
  // program's streams with the mutex held, which could otherwise wait for a held launch (Note [Holds]).
  // Never releases the mutex: a busy region with a hold is being remapped by the migration thread, which writes
  // its flag without the mutex.
  // Oldest hold first: a fenced prefetch's copy may wait for a launch held on an older prefetch (its fences come
  // after that launch), never on a younger one.
  void release_holds() {
    if (held_moves == 0) return;
    std::vector<swap_region*> held;
    for (swap_region* r : moving) {
      if (r->mv->to_device && r->mv->ticket != 0 && !r->busy) held.push_back(r);
    }
    std::sort(held.begin(), held.end(), [](const swap_region* a, const swap_region* b) { return a->mv->number < b->mv->number; });
    for (swap_region* r : held) {
      port.wait(r->mv->done);
      finish(*r);
    }
  }

  // Maps all of `handle` at `va` with access. On failure `va` is left unmapped, or mapped to `fallback` when there
  // is one (a remap to the device puts the host copy back: DESIGN.md invariant 3), and the error goes on.
  void map_whole(device_ptr va, std::size_t bytes, phys_handle handle, phys_handle fallback) {
    bool mapped = false;
    try {
      port.map(va, bytes, handle, 0);
      mapped = true;
      port.set_access(va, bytes);
    } catch (...) {
      try {
        if (mapped) port.unmap(va, bytes);
        if (fallback) {
          port.map(va, bytes, fallback, 0);
          port.set_access(va, bytes);
        }
      } catch (...) {
      }
      throw;
    }
  }

  // ---- digests (Note [Write-back]) ----
  bool digests() {
    if (!options.skip_clean) return false;
    int support = digest_support.load(std::memory_order_relaxed);
    if (support == 0) {
      try {
        support = port.can_digest() ? 1 : -1;
      } catch (const std::exception& e) {
        support = -1;
        LAYERSWAP_LOG(info, "residency: no digests (%s); evictions always copy", e.what());
      }
      digest_support.store(support, std::memory_order_relaxed);
    }
    return support > 0;
  }
  void no_digests(const std::exception& e) noexcept {
    if (digest_support.exchange(-1) > 0) {
      LAYERSWAP_LOG(warn, "residency: digests failed (%s); evictions copy from now on", e.what());
    }
  }
  [[nodiscard]] std::uint64_t* digest_words(const swap_region& r) const {
    return digest_chunks[r.digest_slot / k_digest_chunk] + 2 * (r.digest_slot % k_digest_chunk);
  }
  // Gives `r` its result words (mutex held); false when digests are off.
  bool ensure_digest_slot(swap_region& r) {
    if (!digests()) return false;
    if (r.digest_slot != k_no_slot) return true;
    if (free_digest_slots.empty()) {
      try {
        digest_chunks.push_back(port.alloc_host_words(2 * k_digest_chunk));
      } catch (const std::exception& e) {
        no_digests(e);
        return false;
      }
      const std::size_t base = (digest_chunks.size() - 1) * k_digest_chunk;
      for (std::size_t i = k_digest_chunk; i-- > 0;) free_digest_slots.push_back(base + i);
    }
    r.digest_slot = free_digest_slots.back();
    free_digest_slots.pop_back();
    return true;
  }
  // Enqueues a digest of [va, +r.bytes) into the move's words on `stream`; false (digests off from now on) if it
  // fails. Without the mutex too (a deferred prefetch's start).
  bool enqueue_digest(const swap_region& r, const move& m, device_ptr va, stream_handle stream) noexcept {
    if (digest_support.load(std::memory_order_relaxed) <= 0) return false;
    try {
      port.digest_async(va, r.bytes, m.words, stream);
      return true;
    } catch (const std::exception& e) {
      no_digests(e);
      return false;
    }
  }
  // Note [Batched checks]: enqueues the checks' digests of `checks` (evictions, their fences enqueued) on `stream`
  // in one call; false (digests off from now on) if it fails. Without the mutex.
  bool enqueue_digests(std::span<swap_region* const> checks, stream_handle stream) noexcept {
    try {
      std::vector<digest_range> ranges;
      ranges.reserve(checks.size());
      for (const swap_region* r : checks) ranges.push_back({r->va, r->bytes, r->mv->words});
      port.digest_many_async(ranges, stream);
      return true;
    } catch (const std::exception& e) {
      no_digests(e);
      return false;
    }
  }
  // An eviction's check has completed (mutex held): true when the move may finish now (clean, or cancelled);
  // false when the region was dirty and its copy is now enqueued, or (r.mv gone) the copy failed to start and the
  // move was abandoned.
  bool resolve_check(swap_region& r) {
    move& m = *r.mv;
    if (!m.checking) return true;
    m.checking = false;
    if (m.cancelled || !r.live) return true;  // begin_finish cancels it
    ++st.writeback_checked;
    if (digest128{m.words[0], m.words[1]} == r.digest) {
      m.clean = true;
      r.dirty_checks = 0;
      return true;
    }
    if (++r.dirty_checks >= 2) {
      r.dirty_checks = 0;
      r.unchecked = k_unchecked_evictions;
    }
    r.digest_known = false;  // the copy overwrites the host copy
    try {
      port.copy_async(m.shadow, r.va, r.bytes, d2h);
      port.record(m.done, d2h);
    } catch (const std::exception& e) {
      LAYERSWAP_LOG(warn, "residency: the write-back of region %u did not start (%s); it stays on the device", r.id,
                    e.what());
      spare_events.insert(spare_events.end(), m.fences.begin(), m.fences.end());
      spare_events.insert(spare_events.end(), m.spare_fences.begin(), m.spare_fences.end());
      spare_events.push_back(m.done);
      abandon(r, false);
    }
    return false;
  }

  // Starts the copy of `r` into the move's destination after fences on m.fence_streams (Note [Shadow copies]);
  // none: nothing pending on any stream touches r (Note [Unfenced prefetch]). An eviction with a check enqueues its
  // digest instead (Note [Write-back]). Events come from the caller's pool (take_event, mutex held) or are created
  // (tick(), without the mutex).
  void start_copy(swap_region& r, move& m, stream_handle copy_stream) {
    fence(r, m, copy_stream);
    bool digesting = false;
    if (m.checking && !(digesting = enqueue_digest(r, m, r.va, copy_stream))) copy_instead_of_check(r, m);
    end_copy_start(r, m, copy_stream, digesting);
  }
  // Note [Write-back]: the check's digest could not be enqueued (digests are off from now on): the eviction copies.
  static void copy_instead_of_check(swap_region& r, move& m) noexcept {
    m.checking = false;
    r.digest_known = false;
  }
  // The first part of start_copy: the snapshot, and the fences (the copy stream waits for them).
  void fence(swap_region& r, move& m, stream_handle copy_stream) {
    const std::uint64_t sequence = gate::sequence(r.id);
    m.snapshot = sequence;
    if (m.to_device) {
      m.snapshot -= std::min(m.snapshot, gate::held_sequence(r.id));  // Note [Held counters]
      // Notes [Unfenced prefetch] and [Digest carried over]: decided here, at the snapshot, not when the policy
      // began the move: a launch that touched r on the host in between (issued before the prefetch began, so it
      // did not wait for it) may still run, and may have written the host copy.
      const bool untouched = sequence == r.evicted_seq;
      if (untouched) m.fence_streams.clear();
      m.carried = m.digested && r.digest_known && untouched;  // m.digested: the region has result words
      if (m.carried) {
        m.digested = false;
      } else if (m.digested) {
        m.words[0] = m.words[1] = 0;  // what the region gets if the digest never runs: the next check poisons it
      }
    }
    if (m.fence_streams.empty()) return;
    const auto fence_on = [&](stream_handle s) {
      event_handle e = m.spare_fences.empty() ? port.create_event() : pop(m.spare_fences);
      m.fences.push_back(e);
      port.record(e, s);
      port.stream_wait(copy_stream, e);
    };
    for (stream_handle s : m.fence_streams) fence_on(s);
    // Note [Launch streams]: and the streams known only from launches, read after the snapshot.
    gate::for_each_stream_besides(port.context_id(), m.fence_streams, fence_on);
  }
  // The last part: after the fences and an eviction's check digest (`digesting`: one may be enqueued into the
  // region's words), the copy unless the move checks, a prefetch's digest, and `done`.
  void end_copy_start(swap_region& r, move& m, stream_handle copy_stream, bool digesting) {
    // m.done is set only once recorded: a move with m.done is one whose copy is enqueued (end_start, recycle).
    event_handle done = nullptr;
    try {
      done = m.spare_fences.empty() ? port.create_event() : pop(m.spare_fences);
      if (!m.checking) {
        port.copy_async(m.shadow, r.va, r.bytes, copy_stream);
        if (m.digested) m.digested = digesting = enqueue_digest(r, m, m.shadow, copy_stream);
      }
      port.record(done, copy_stream);
    } catch (...) {
      if (done) m.spare_fences.push_back(done);
      if (digesting) {  // the digest may still write the region's words: they are left to it, never reused
        r.digest_slot = k_no_slot;
        r.digest_known = false;
      }
      throw;
    }
    m.done = done;
  }
  static event_handle pop(std::vector<event_handle>& v) {
    event_handle e = v.back();
    v.pop_back();
    return e;
  }
  // Events for start_copy from the pool (mutex held): one per fence, one for `done`.
  void reserve_events(move& m) {
    while (m.spare_fences.size() < m.fence_streams.size() + 1) m.spare_fences.push_back(take_event());
  }

  // Starts an eviction. With `defer` (the policy, in tick()), the region is left busy with its copy not yet
  // enqueued, for tick() to enqueue it (event records, stream waits, the copy or the check) without the mutex
  // (Note [Remaps outside the lock]); otherwise it does that now.
  bool start_evict(swap_region& r, bool sync, bool defer = false) {
    if (r.state != region_residency::device || r.mv || !r.live || r.pinned) return false;
    if (!r.host) {
      try {
        r.host = take_host(r.bytes);
      } catch (const device_out_of_memory&) {
        return false;  // LAYERSWAP_HOST_LIMIT or the host is full: this region stays
      }
    }
    auto m = std::make_unique<move>();
    m->sync = sync;
    m->shadow = r.host.view;
    m->fence_streams = streams;
    reserve_events(*m);
    // Note [Write-back]: check first when the host copy's digest is known, else copy (and the host copy's digest
    // is stale from now on).
    if (r.unchecked != 0) {
      --r.unchecked;
      m->judged = true;  // found dirty twice in a row: dirty
    } else {
      m->checking = r.digest_known && ensure_digest_slot(r);
      m->judged = m->checking;
      if (m->checking) {
        // Poisoned first: a digest that never runs (a launch that failed without a word) must not read as clean.
        m->words = digest_words(r);
        m->words[0] = ~r.digest.a;
        m->words[1] = ~r.digest.b;
      }
    }
    if (!m->checking) r.digest_known = false;
    if (defer) {
      begin(r, std::move(m), region_residency::moving_out);
      defer_start(r);
      return true;
    }
    try {
      start_copy(r, *m, d2h);
    } catch (...) {
      recycle(*m);
      throw;
    }
    begin(r, std::move(m), region_residency::moving_out);
    return true;
  }
  // A move begun with its start left to tick(), outside the mutex: the region is busy until end_start.
  void defer_start(swap_region& r) {
    r.busy = true;
    ++busy;
    starting.push_back(&r);
  }
  // tick(), without the mutex: the deferred start of a region's move.
  void start_deferred(swap_region& r) {
    if (r.mv->to_device) {
      start_prefetch_copy(r);
    } else {
      start_copy(r, *r.mv, d2h);
    }
  }
  // tick(), without the mutex: the deferred starts of the moves the policy began, the evictions' checks with one
  // digest launch (Note [Batched checks]). A move that fails to start keeps its failure in `failure` (the first) and
  // is left without `done`, for end_start to undo; the others go on.
  void start_all_deferred(std::span<swap_region* const> regions, std::exception_ptr& failure) {
    std::vector<swap_region*> checks;
    std::vector<swap_region*> others;
    for (swap_region* r : regions) {
      const bool batched = options.batch_digests && !r->mv->to_device && r->mv->checking;
      (batched ? checks : others).push_back(r);
    }
    std::vector<swap_region*> fenced;
    for (swap_region* r : checks) {
      try {
        fence(*r, *r->mv, d2h);
        fenced.push_back(r);
      } catch (...) {
        keep_first(failure);
      }
    }
    // Every check's fences, then their digests: each digest comes after its own fences.
    const bool digests_on = !fenced.empty() && digest_support.load(std::memory_order_relaxed) > 0;
    const bool digesting = digests_on && enqueue_digests(fenced, d2h);
    for (swap_region* r : fenced) {
      move& m = *r->mv;
      if (!digesting) copy_instead_of_check(*r, m);
      try {
        // A digest launch that failed may have digested some ranges first: their words are left to it too.
        end_copy_start(*r, m, d2h, digests_on);
      } catch (...) {
        keep_first(failure);
      }
    }
    for (swap_region* r : others) {
      try {
        start_deferred(*r);
      } catch (...) {
        keep_first(failure);
      }
    }
  }

  // Starts a prefetch: takes a chunk, or room for one (Note [Chunks]). With `defer` (the policy, in tick()), the
  // region is left busy with its move not yet started, for tick() to create the chunk and start the copy without
  // the mutex (Note [Remaps outside the lock]); otherwise it does that now.
  bool start_prefetch(swap_region& r, bool defer) {
    if (r.state != region_residency::host || r.mv || !r.live) return false;
    if (r.flag_slot == k_no_slot && gate::holding() && ensure_flags() && !free_slots.empty()) {
      r.flag_slot = free_slots.back();
      free_slots.pop_back();
    }
    auto m = std::make_unique<move>();
    m->to_device = true;
    if (!take_chunk(r, *m)) return false;
    m->digested = ensure_digest_slot(r);  // Note [Write-back]
    if (m->digested) m->words = digest_words(r);  // whether a digest runs: start_copy (Note [Digest carried over])
    // Note [Unfenced prefetch]: start_copy leaves the fences out when r is untouched since its eviction.
    m->fence_streams = streams;
    reserve_events(*m);
    begin(r, std::move(m), region_residency::moving_in);
    if (defer) {
      defer_start(r);
      return true;
    }
    try {
      start_prefetch_copy(r);
    } catch (...) {
      end_start(r);
      throw;
    }
    end_start(r);  // its books, and its hold
    return true;
  }

  // Creates the move's chunk if it has only room for one, and starts the copy into it: driver calls on the move's
  // own memory only.
  void start_prefetch_copy(swap_region& r) {
    const scoped_ns_timer timed(remap_ns, remap_phase_ns(), stage_ns);
    move& m = *r.mv;
    if (!m.chunk) {
      free_releasing(m);  // Note [Releasing spares outside the lock]: the room first
      m.chunk = make_chunk(r.bytes, true);
      m.room -= r.npages;
    }
    if (!m.chunk.home) add_home(m.chunk, r.bytes);
    m.shadow = m.chunk.home;
    start_copy(r, m, h2d);
  }

  // After a move's start (mutex held): a move whose copy did not start is undone.
  void end_start(swap_region& r) {
    if (r.busy) {
      r.busy = false;
      --busy;
    }
    move& m = *r.mv;
    if (m.done) {
      if (m.to_device) {
        settle_room(m);  // the released spares' pages beyond the chunk's
        publish_hold(r, m);
      }
      return;
    }
    if (m.to_device) drop_destination(r, m);
    r.state = m.to_device ? region_residency::host : region_residency::device;
    recycle(m);
    end_move(r);
  }

  // A started move becomes the region's.
  void begin(swap_region& r, std::unique_ptr<move> m, region_residency state) {
    m->started = ++moves_started;
    if (state == region_residency::moving_in) m->begun_ns = fast_clock::steady_ns();
    r.mv = std::move(m);
    r.state = state;
    r.moving_at = moving.size();
    moving.push_back(&r);
    if (state == region_residency::moving_in) gate::set_incoming(r.id, true);  // Note [Waiting for a prefetch]
  }

  // A move whose copy failed to start: its events go back to the pool.
  void recycle(move& m) {
    spare_events.insert(spare_events.end(), m.fences.begin(), m.fences.end());
    spare_events.insert(spare_events.end(), m.spare_fences.begin(), m.spare_fences.end());
    if (m.done) spare_events.push_back(m.done);
  }

  // ---- finishing a move whose copy has completed (Note [Remap under the gate]) ----
  // begin_finish (mutex held): abandon, or take the gate and mark the region busy; remap_busy (mutex not needed):
  // the driver calls that switch the region's VA, then the gate is released; end_finish (mutex held): the
  // engine's books. finish() does all three with the mutex held (Note [Remaps outside the lock]).

  // False when the move was cancelled (done here); true when the remap may be tried (the region is busy).
  bool begin_finish(swap_region& r) {
    move& m = *r.mv;
    spare_events.insert(spare_events.end(), m.fences.begin(), m.fences.end());
    m.fences.clear();
    spare_events.push_back(m.done);
    m.done = nullptr;
    spare_events.insert(spare_events.end(), m.spare_fences.begin(), m.spare_fences.end());
    m.spare_fences.clear();
    if (m.cancelled || !r.live) {
      abandon(r, true);
      return false;
    }
    r.busy = true;
    ++busy;
    return true;
  }

  // The move's copy may be stale (a launch touched the region) or the region was freed: the region stays where
  // it was.
  void abandon(swap_region& r, bool cancelled) {
    move& m = *r.mv;
    ++(cancelled ? st.cancelled : st.abandoned);
    if (m.to_device) {
      drop_destination(r, m);
      r.state = region_residency::host;
    } else {
      r.state = region_residency::device;
    }
    end_move(r);
  }

  // The remap itself: only driver calls on the region's VA and the move's own pages, so the migration thread runs
  // it without the mutex while r.busy keeps everyone else off the region. Releases the gate (and launches waiting
  // for the prefetch) whether or not a call throws.
  void remap_busy(swap_region& r) {
    move& m = *r.mv;
    const scoped_ns_timer timed(remap_ns, remap_phase_ns(), m.to_device ? remap_in_ns : remap_out_ns);
    if (!gate::try_begin_remap(r.id, m.snapshot, m.to_device)) {
      m.refused = true;
      // The move is abandoned (end_finish). A prefetch's held launches run now, on the host copy that the VA still
      // maps, released here without the mutex as a landed prefetch's are (the guard below): end_finish needs the
      // mutex, and a program thread may hold it while it waits on the host for work queued behind those launches
      // (a fence, with release_holds() skipping this busy region). Waiting for end_finish hung the 1.1B LoRA run
      // at 25% with LAYERSWAP_HOLD=1 (docs/history.md, the README's figures at session 34).
      if (m.to_device) release_hold(r, m);
      if (options.refused_hook) options.refused_hook(r.id);
      return;
    }
    struct release {
      impl& e;
      swap_region& r;
      ~release() {
        gate::end_remap(r.id);
        if (r.mv->to_device) {
          gate::set_incoming(r.id, false);  // Note [Waiting for a prefetch]
          r.mv->remapped_ns = fast_clock::steady_ns();  // Note [Late prefetches]
          r.mv->waited_from_ns = gate::take_wait_start(r.id);
          e.release_hold(r, *r.mv);         // after the remap: Note [Holds]
        }
      }
    } guard{*this, r};
    if (options.remap_hook) options.remap_hook(r.id);
    if (m.to_device) {
      port.unmap(r.va, r.bytes);  // the host mapping: one map() call
      map_whole(r.va, r.bytes, m.chunk.handle, r.host.handle);
      gate::set_on_host(r.id, false);
    } else {
      port.unmap(r.va, r.bytes);  // the chunk: one map() call
      map_whole(r.va, r.bytes, r.host.handle, r.chunk.handle);
      gate::set_on_host(r.id, true);
      m.snapshot = gate::sequence(r.id);  // still remapping: no launch can have moved it since
    }
    m.remapped = true;
  }

  void end_finish(swap_region& r) {
    move& m = *r.mv;
    r.busy = false;
    --busy;
    if (m.refused) {
      abandon(r, false);
      return;
    }
    if (!m.remapped) {  // a driver call failed: map_whole put the region's own memory back where it could
      if (m.to_device) drop_destination(r, m);
      r.state = m.to_device ? region_residency::host : region_residency::device;
      end_move(r);
      return;
    }
    if (m.to_device) {
      r.chunk = std::exchange(m.chunk, {});
      r.state = region_residency::device;
      st.bytes_h2d += static_cast<std::int64_t>(r.bytes);
      ++st.prefetches;
      st.prefetched_bytes_by_phase[phase_slot()] += static_cast<std::int64_t>(r.bytes);
      // Note [Write-back]: the digest of what came in, which the host copy holds; carried over, the one it had
      // (Note [Digest carried over]).
      r.digest_known = m.digested || m.carried;
      if (m.digested) r.digest = {m.words[0], m.words[1]};
      if (m.carried) ++st.digests_carried;
      if (m.waited_from_ns != 0) count_late(r, m);
    } else {
      add_spare(r.bytes, std::exchange(r.chunk, {}));
      r.state = region_residency::host;
      r.evicted_seq = m.snapshot;
      if (m.clean) {
        ++st.writeback_skipped;
      } else {
        st.bytes_d2h += static_cast<std::int64_t>(r.bytes);
      }
      if (m.judged) {  // Note [Automatic reserve]
        step_evicted_bytes += r.bytes;
        if (m.clean) step_clean_bytes += r.bytes;
      }
      ++st.evictions;
      st.evicted_bytes_by_phase[phase_slot()] += static_cast<std::int64_t>(r.bytes);
      if (m.sync) ++st.stall_evictions;
    }
    end_move(r);
  }

  // Note [Late prefetches]: a prefetch that a launch waited for, split into where the wait went.
  void count_late(const swap_region& r, const move& m) {
    const std::uint64_t from = m.waited_from_ns;
    const std::uint64_t copied = std::max(m.copy_seen_ns, from);
    ++st.late_prefetches;
    st.late_bytes += static_cast<std::int64_t>(r.bytes);
    st.late_lead_us += static_cast<std::int64_t>(from > m.begun_ns ? (from - m.begun_ns) / 1000 : 0);
    const auto copy_us = static_cast<std::int64_t>((copied - from) / 1000);
    const auto remap_us = static_cast<std::int64_t>(m.remapped_ns > copied ? (m.remapped_ns - copied) / 1000 : 0);
    st.late_copy_wait_us += copy_us;
    st.late_remap_wait_us += remap_us;
    st.late_wait_us_by_phase[phase_slot()] += copy_us + remap_us;
  }

  void end_move(swap_region& r) {
    const bool incoming = r.mv->to_device;
    if (incoming) release_hold(r, *r.mv);  // abandoned or cancelled: held launches run on the host copy
    r.mv.reset();
    moving[r.moving_at] = moving.back();
    moving[r.moving_at]->moving_at = r.moving_at;
    moving.pop_back();
    if (incoming) gate::set_incoming(r.id, false);  // abandoned prefetches release their waiters too
  }

  // All three steps with the mutex held (settling, synchronous evictions, tests).
  void finish(swap_region& r) {
    if (!begin_finish(r)) return;
    struct books {
      impl& e;
      swap_region& r;
      ~books() {
        e.end_finish(r);
        e.busy_cv.notify_all();
      }
    } guard{*this, r};
    remap_busy(r);
  }

  // tick(): `work` on `busy_regions` without the mutex, then `done` on each with it (Note [Remaps outside the lock]).
  // `work` keeps a region's failure in `failure` (the first) and goes on with the others; a failure of its own
  // (memory) is kept too, and `done` still sees every region.
  void outside_lock(std::unique_lock<std::mutex>& lock, const std::vector<swap_region*>& busy_regions,
                    void (impl::*work)(std::span<swap_region* const>, std::exception_ptr&),
                    void (impl::*done)(swap_region&), std::exception_ptr& failure) {
    if (busy_regions.empty()) return;
    lock.unlock();
    try {
      (this->*work)(busy_regions, failure);
    } catch (...) {
      keep_first(failure);
    }
    lock.lock();
    for (swap_region* r : busy_regions) (this->*done)(*r);
    busy_cv.notify_all();
  }
  static void keep_first(std::exception_ptr& failure) noexcept {
    if (!failure) failure = std::current_exception();
  }
  // tick(), without the mutex: the remaps of moves whose copies are done.
  void remap_all(std::span<swap_region* const> regions, std::exception_ptr& failure) {
    for (swap_region* r : regions) {
      try {
        remap_busy(*r);
      } catch (...) {
        keep_first(failure);
      }
    }
  }

  // Waits (releasing the mutex, which the caller holds) until `r` is not being remapped outside the mutex.
  void wait_not_busy(swap_region& r) {
    if (!r.busy) return;
    std::unique_lock lock(mutex, std::adopt_lock);
    busy_cv.wait(lock, [&] { return !r.busy; });
    lock.release();
  }
  // ... until no region is (the region table may change meanwhile).
  void wait_none_busy() {
    if (busy == 0) return;
    std::unique_lock lock(mutex, std::adopt_lock);
    busy_cv.wait(lock, [&] { return busy == 0; });
    lock.release();
  }

  void settle(swap_region& r) {
    wait_not_busy(r);
    if (!r.mv) return;
    if (!r.mv->to_device) release_holds();  // an eviction's fences may come after a held launch (Note [Holds])
    port.wait(r.mv->done);
    if (!resolve_check(r)) {  // dirty: its copy (Note [Write-back])
      if (!r.mv) return;     // ... failed to start: abandoned
      port.wait(r.mv->done);
    }
    finish(r);
  }

  void settle_all() {
    wait_none_busy();
    for (auto& [id, r] : regions) settle(*r);  // no region is busy: settle() never releases the mutex
  }

  // Whether `r`'s move has completed its copy (query only, no host wait), its check resolved first: a dirty region's
  // copy is enqueued then (Note [Write-back]), done already only on an eager simulated device.
  bool copy_done(swap_region& r) {
    if (!r.mv || !r.mv->done || !port.query(r.mv->done)) return false;
    if (r.mv->to_device && r.mv->copy_seen_ns == 0) {
      r.mv->copy_seen_ns = fast_clock::steady_ns();  // Note [Late prefetches]
    }
    return resolve_check(r) || (r.mv && port.query(r.mv->done));
  }

  // Moves whose copy has completed (query only, no host wait): abandoned ones are done here; the others are
  // returned busy, for remaps outside the mutex (Note [Remaps outside the lock]). Prefetches come first: a launch
  // may be waiting for one, and its remap (device pages) is quick, while an eviction's maps host pages, the slow
  // kind (8-13 us per MiB: bench/results/vmm_host_probe.json); a prefetch behind a few of those landed late.
  // Going further, remapping a landed prefetch that a launch waits for between two items of a batch (session 18,
  // docs/history.md), cut full fine-tuning's launch waits from 0.16 to 0.02 s per step on the H200 but slowed its
  // step 8-10%: the program, no longer held back, ran on host copies (hit rate 0.974 -> 0.926) and the evictions
  // behind the served remaps freed their pages later; LoRA did not change. A launch's wait is the backpressure
  // that keeps the program on the device.
  std::vector<swap_region*> poll_moves() {
    std::vector<swap_region*> ready;
    if (moving.empty()) return ready;
    poll_scratch = moving;  // copy_done and begin_finish may end moves (abandoned, cancelled)
    for (swap_region* r : poll_scratch) {
      if (!r->busy && copy_done(*r) && begin_finish(*r)) ready.push_back(r);
    }
    std::stable_partition(ready.begin(), ready.end(), [](const swap_region* r) { return r->mv->to_device; });
    order_prefetches(ready);
    return ready;
  }

  // Note [Waited prefetches first]
  //   The landed prefetches of a tick remap one after another (~0.2 ms each on the H200, with the program's
  //   launches beside them), and a launch waiting for one of them waits for those ahead of it in the batch too.
  //   They used to come in `moving`'s order, which swap-removals scramble: in session 30's record (1.1B LoRA at
  //   25%) the 3.6 prefetches a step that a launch waited for waited 1.2 ms each after poll_moves saw their copy
  //   complete (late_remap_wait_s, 4.3 ms a step). So the prefetches of a batch go in the order they are needed:
  //   those a launch waits for first (residency_gate::waited_for), then by rank, the forecast's next use. Only their
  //   order among themselves changes: the same remaps run in the same tick, and the evictions still follow them
  //   (serving a waited prefetch ahead of evictions already in the batch took away the backpressure that keeps the
  //   program on the device: session 18).
  //   On the H200, interleaved against the same build with the order switched off (session 31, two calls, 2-3
  //   processes a side, bench/results/prefetch_order_s31.json), the waits after the copy fell by a third to a half:
  //   LoRA at 25% 1.0-1.6 ms a step against 1.6-4.1, at 10% 2.6-3.2 against 3.5-4.6, the UNet at 25% 3.0-3.9 against
  //   4.4-6.7. The LoRA launches that went on sooner then reached the next prefetch while its copy was still in
  //   flight (4.1-7.9 late prefetches a step against 1.7-3.6 at 25%), so their waits in all did not fall (3.2-5.2 ms
  //   a step against 2.1-5.6); the UNet's fell (16.6-18.9 ms against 17.9-25.3). No side was slower pooled.
  static void order_prefetches(std::vector<swap_region*>& ready) {
    const auto end =
        std::partition_point(ready.begin(), ready.end(), [](const swap_region* r) { return r->mv->to_device; });
    if (end - ready.begin() < 2) return;
    std::stable_sort(ready.begin(), end, [](const swap_region* a, const swap_region* b) { return a->rank < b->rank; });
    if (gate::waiting() != 0) {
      std::stable_partition(ready.begin(), end, [](const swap_region* r) { return gate::waited_for(r->id); });
    }
  }

  // Victim order: farthest next use first (absent from the forecast = farthest), then least recently used.
  [[nodiscard]] static bool farther(const swap_region& a, std::uint64_t a_last, const swap_region& b,
                                    std::uint64_t b_last) noexcept {
    if (a.rank != b.rank) return a.rank > b.rank;
    return a_last < b_last;
  }

  // The resident region to evict next, among all: farthest next use (Note [Policy]). `excluded(region)`: true for a
  // region that must not be the victim. The gate's last use (a line the launching threads write) is read only to
  // break a tie of ranks (regions absent from the forecast).
  template <class Excluded>
  swap_region* pick_victim(const Excluded& excluded) {
    swap_region* best = nullptr;
    std::uint64_t best_last = 0;
    bool best_last_read = false;
    for (auto& [id, r] : regions) {
      if (!evictable(*r) || excluded(*r)) continue;
      if (!best || r->rank != best->rank) {
        if (!best || r->rank > best->rank) best = r.get(), best_last_read = false;
        continue;
      }
      if (!best_last_read) best_last = gate::last_use(best->id), best_last_read = true;
      const std::uint64_t last = gate::last_use(id);
      if (farther(*r, last, *best, best_last)) best = r.get(), best_last = last;
    }
    return best;
  }

  // pick_victim among the forecast regions only (activations, which cannot move usefully, are no candidates:
  // DESIGN.md invariant 6), without a pass over every region. Forecast regions have distinct ranks and the farthest
  // next use is the highest rank, so the first eligible one from the back of the forecast is the one (Note [Policy
  // rounds]).
  template <class Excluded>
  swap_region* pick_forecast_victim(const Excluded& excluded) {
    for (std::size_t i = forecast_regions.size(); i-- > 0;) {
      swap_region* r = ranked_at(i);
      if (r && evictable(*r) && !excluded(*r)) return r;
    }
    return nullptr;
  }
  // A live, unpinned region on the device with no move: one an eviction may start on.
  [[nodiscard]] static bool evictable(const swap_region& r) noexcept {
    return r.live && !r.pinned && !r.mv && r.state == region_residency::device;
  }
  // The region of forecast entry i, when that entry is the one that ranks it (a region listed twice is ranked by
  // its last entry, and counted there only); nullptr otherwise. The forecast's ranked regions are these, once each.
  [[nodiscard]] swap_region* ranked_at(std::size_t i) const noexcept {
    swap_region* r = forecast_regions[i];
    return r && r->rank == i ? r : nullptr;
  }

  // Pages a prefetch can take now without reclaiming: pooled ones, spare chunks and the budget's headroom.
  [[nodiscard]] std::size_t free_pages() const { return (unused_bytes() + spare_bytes) / gran; }
  // Device bytes a new chunk can have now without releasing or reclaiming anything: pooled pages and the headroom.
  [[nodiscard]] std::size_t unused_bytes() const {
    const std::size_t budget = source.budget();
    const std::size_t held = source.held_bytes();
    return source.pooled_bytes() + (budget > held ? budget - held : 0);
  }

  // Device bytes that no move can free: held, less pooled pages and spare chunks, the allocator's idle cache and
  // the device memory of forecast regions (resident, moving out, or taken by a prefetch in flight). Live
  // activations, partly used slabs and regions absent from the forecast (Note [Policy]).
  [[nodiscard]] std::size_t transient_bytes() const {
    std::size_t forecast_device = 0;
    for (std::size_t i = 0; i < forecast_regions.size(); ++i) {  // the regions with a rank (Note [Policy rounds])
      const swap_region* r = ranked_at(i);
      if (!r) continue;
      if (r->state == region_residency::device || r->state == region_residency::moving_out) forecast_device += r->bytes;
      if (r->mv && r->mv->to_device) forecast_device += r->bytes;
    }
    const std::size_t reclaimable = source.pooled_bytes() + spare_bytes + source.idle_bytes() + forecast_device;
    const std::size_t held = source.held_bytes();
    return held > reclaimable ? held - reclaimable : 0;
  }

  void apply_forecast(const forecast* f) {
    for (swap_region* r : forecast_regions) {  // only the last forecast's regions have a rank
      if (r) r->rank = k_far;
    }
    forecast_applied = f != nullptr;
    forecast_regions.clear();
    if (!f) return;
    forecast_regions.reserve(f->upcoming.size());
    for (std::size_t i = 0; i < f->upcoming.size(); ++i) {
      swap_region* r = index.find(f->upcoming[i].region);
      forecast_regions.push_back(r);
      if (!r) continue;
      r->rank = i;
      r->group = f->upcoming[i].group;
    }
    if (options.pin.any() && f->generation != pin_generation) update_pins(*f);
  }

  // LAYERSWAP_PIN: groups in step order (position of their next use within the step).
  void update_pins(const forecast& f) {
    pin_generation = f.generation;
    for (auto& [id, r] : regions) r->pinned = false;
    struct grp {
      std::uint64_t at;
      std::uint32_t group;
      std::vector<region_id> members;
      std::size_t bytes = 0;
    };
    std::vector<grp> groups;
    std::unordered_map<std::uint64_t, std::size_t> index;  // group key -> groups[]
    for (const forecast_entry& e : f.upcoming) {
      auto it = regions.find(e.region);
      if (it == regions.end()) continue;
      const std::uint64_t key = e.group ? e.group : (std::uint64_t{1} << 32) | e.region;
      const std::uint64_t at = f.step_launches ? (f.position + e.distance) % f.step_launches : e.distance;
      auto [slot, fresh] = index.emplace(key, groups.size());
      if (fresh) groups.push_back({at, e.group, {}, 0});
      grp& g = groups[slot->second];
      g.at = std::min(g.at, at);
      g.members.push_back(e.region);
      g.bytes += it->second->bytes;
    }
    std::sort(groups.begin(), groups.end(), [](const grp& a, const grp& b) { return a.at < b.at; });
    auto pin = [&](const grp& g) {
      for (region_id id : g.members) regions.at(id)->pinned = true;
    };
    for (std::size_t i = 0; i < groups.size() && i < options.pin.first; ++i) pin(groups[i]);
    for (std::size_t i = 0; i < groups.size() && i < options.pin.last; ++i) pin(groups[groups.size() - 1 - i]);
    std::size_t pinned_bytes = 0;
    for (std::size_t i = 0; i < groups.size() && pinned_bytes + groups[i].bytes <= options.pin.bytes; ++i) {
      pin(groups[i]);
      pinned_bytes += groups[i].bytes;
    }
  }

  void policy(const forecast* f) {
    const std::size_t budget = source.budget();
    if (budget == 0) {
      if (options.prefetch_tune) st.prefetch_limit = 0;  // no policy, no distance (Note [Tuned prefetch])
      return;
    }
    apply_forecast(f);
    if (f) {
      policy_forecast(*f, budget);
    } else {
      if (options.prefetch_tune) st.prefetch_limit = 0;  // no distance without a forecast (Note [Tuned prefetch])
      policy_demand();
    }
  }

  // Whether the reserve follows the step: LAYERSWAP_RESERVE=follow, or auto while the evictions are clean.
  [[nodiscard]] bool following() const noexcept {
    return options.reserve == reserve_mode::follow || (options.reserve == reserve_mode::automatic && clean_steps);
  }

  // Note [Automatic reserve]: a learned step has ended; with LAYERSWAP_RESERVE=auto, the reserve follows the next
  // one if at least nine tenths of the bytes this one evicted were clean (eight tenths to keep following), and is
  // the step's peak otherwise. A step whose evictions told nothing (none checked) changes nothing.
  void judge_evictions() {
    const std::size_t evicted = std::exchange(step_evicted_bytes, 0);
    const std::size_t clean = std::exchange(step_clean_bytes, 0);
    if (options.reserve != reserve_mode::automatic || evicted == 0) return;
    const bool follow = clean * 10 >= evicted * (clean_steps ? 8 : 9);
    if (follow == clean_steps) return;
    clean_steps = follow;
    ++st.reserve_auto_changes;
    LAYERSWAP_LOG(debug, "the reserve %s: %s of the %s the last step evicted were clean",
                  follow ? "follows the step" : "is the step's peak", format_bytes(clean).c_str(),
                  format_bytes(evicted).c_str());
  }

  // The reserve for memory that cannot move this round: the step's peak, or with LAYERSWAP_RESERVE=follow (auto
  // while the evictions are clean) the peak of the learned step's part just ahead (Note [Following reserve]).
  std::size_t reserve_for(const forecast& f, std::size_t transient) {
    if (f.step_launches == 0) return max_transient;
    if (f.step_launches != phase_step) {  // relearned: the peaks start again
      phase_step = f.step_launches;
      phase_peak.fill(0);
      phase_seen.fill(false);
      phases_seen = 0;
      phase_steps = 0;
    }
    const auto now = static_cast<std::size_t>(f.step_position % f.step_launches * k_phases / f.step_launches);
    if (now + k_phases / 2 < phase) {  // the position wrapped: a new step
      ++phase_steps;
      judge_evictions();
    }
    phase = now;
    phase_peak[phase] = std::max(phase_peak[phase], transient);
    if (!phase_seen[phase]) {
      phase_seen[phase] = true;
      ++phases_seen;
    }
    profile_ready = false;
    if (!following() || (phases_seen < k_phases && phase_steps < k_follow_steps)) return max_transient;
    profile_ready = true;
    std::size_t reserve = 0;
    for (std::size_t k = 0; k <= options.reserve_ahead; ++k) {
      const std::size_t at = (phase + k) % k_phases;
      reserve = std::max(reserve, learned_peak(at));
    }
    ++st.reserve_followed;
    return std::min(reserve, max_transient);
  }

  // The transient peak learned in the step's 64th `at`; while that 64th is unseen, the step's peak.
  std::size_t learned_peak(std::size_t at) const { return phase_seen[at] ? phase_peak[at] : max_transient; }

  // Note [Reserve profile]: holds `bytes` in the 64ths [first, end) ahead if they fit beside what each already holds.
  bool hold_if_fits(std::size_t first, std::size_t end, std::size_t bytes) {
    for (std::size_t k = first; k < end; ++k) {
      if (profile_used[k] + bytes > profile_cap[k]) return false;
    }
    for (std::size_t k = first; k < end; ++k) profile_used[k] += bytes;
    return true;
  }

  // Note [Tuned prefetch]: the distance the tuner has in force for this step, the step timed by when the round
  // read the forecast (fc_ns).
  std::size_t tuned_limit(const forecast& f) {
    const std::uint64_t start = f.position >= f.step_position ? f.position - f.step_position : 0;
    bool finished = false;
    const std::size_t n = tuner.observe(f.generation, f.step_launches, start, fc_ns, finished);
    if (finished) log_tuning(tuner.last());
    st.prefetch_limit = static_cast<std::int64_t>(n);
    st.prefetch_tunings = static_cast<std::int64_t>(tuner.tunings());
    st.prefetch_tune_steps = static_cast<std::int64_t>(tuner.timed_steps());
    st.prefetch_tune_abandoned = static_cast<std::int64_t>(tuner.abandoned());
    return n == prefetch_tuner::k_auto ? k_far : n;
  }

  [[nodiscard]] std::uint64_t tune_now_ns() const {
    if (options.tune_clock) return options.tune_clock();
    return static_cast<std::uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
            .count());
  }

  // One info line per finished tuning: each distance tried, the most regions its wanted set held, its step (or "not
  // timed": the trial ended on untimed steps; "the set before": it wanted no fewer regions than the distance before).
  static void log_tuning(const prefetch_tuner::outcome& o) {
    char trials[320] = "";
    std::size_t used = 0;
    for (std::size_t i = 0; i < o.count && used < sizeof trials; ++i) {
      const prefetch_tuner::trial& t = o.trials[i];
      char name[24];
      if (t.regions == prefetch_tuner::k_auto) {
        std::snprintf(name, sizeof name, "auto");
      } else {
        std::snprintf(name, sizeof name, "%zu", t.regions);
      }
      char step[64];
      if (t.step_ns == 0) {
        std::snprintf(step, sizeof step, "not timed");
      } else {
        std::snprintf(step, sizeof step, "%.1f ms%s", static_cast<double>(t.step_ns) / 1e6,
                      t.same_set ? ", the set before" : "");
      }
      const int n = std::snprintf(trials + used, sizeof trials - used, "%s%s (%zu wanted) %s", i ? ", " : "", name,
                                  t.wanted, step);
      if (n < 0) break;
      used += static_cast<std::size_t>(n);
    }
    char chosen[40];
    if (o.chosen == prefetch_tuner::k_auto) {
      std::snprintf(chosen, sizeof chosen, "auto");
    } else {
      std::snprintf(chosen, sizeof chosen, "%zu regions", o.chosen);
    }
    LAYERSWAP_LOG(info, "residency: LAYERSWAP_PREFETCH=tune: %s for a step of %llu launches (a step's median: %s)",
                  chosen, static_cast<unsigned long long>(o.step_launches), trials);
  }

  void policy_forecast(const forecast& f, std::size_t budget) {
    const std::size_t transient = transient_bytes();
    max_transient = std::max(max_transient, transient);
    const std::size_t reserve = reserve_for(f, transient);  // sets `phase`, the step's 64th
    if (f.step_launches != 0) {  // Note [Late prefetches]: the step's eighth
      static_assert(k_phases % std::tuple_size_v<decltype(st.late_wait_us_by_phase)> == 0);
      step_phase = phase / (k_phases / st.late_wait_us_by_phase.size());
      auto& peak = st.transient_peak_by_phase[step_phase];
      peak = std::max(peak, static_cast<std::int64_t>(transient));
    }
    st.reserve_bytes = static_cast<std::int64_t>(reserve);
    std::size_t capacity = budget > reserve ? budget - reserve : 0;
    // Note [Cache reserve]
    const std::size_t cache_reserve = options.cache_reserve_auto ? std::min(cache_grown, capacity / 2)
                                                                 : std::min(options.cache_reserve, capacity);
    st.cache_reserve_bytes = static_cast<std::int64_t>(cache_reserve);
    capacity -= cache_reserve;

    // The wanted set: the forecast from the front, whole groups, within capacity and LAYERSWAP_PREFETCH. Each
    // group's entries are indexed first, in one pass: a round then costs O(forecast), not O(forecast^2).
    group_entries.clear();
    for (std::size_t i = 0; i < f.upcoming.size(); ++i) {
      if (f.upcoming[i].group != 0) group_entries.emplace_back(f.upcoming[i].group, i);
    }
    std::sort(group_entries.begin(), group_entries.end());
    group_position.resize(f.upcoming.size());
    for (std::size_t p = 0; p < group_entries.size(); ++p) group_position[group_entries[p].second] = p;
    // Note [Policy rounds]: the wanted set is a stamp on the regions and the forecast's regions were looked up
    // once, by apply_forecast (forecast_regions), so a round allocates nothing and hashes each entry once.
    const std::uint64_t round = ++policy_round;
    std::vector<swap_region*>& order = order_scratch;
    std::vector<swap_region*>& run = run_scratch;
    order.clear();
    order_from.clear();
    std::size_t bytes = 0;  // the wanted set's bytes, on the step peak's path (without the profile)
    const std::size_t limit = options.prefetch_tune ? tuned_limit(f) : options.prefetch ? options.prefetch : k_far;
    // Note [Reserve profile]: the room in each 64th ahead, its own peak (unseen: the step's) set aside.
    const bool by_profile = profile_ready && f.step_launches != 0;
    if (by_profile) {
      for (std::size_t k = 0; k < k_phases; ++k) {
        const std::size_t at = (phase + k) % k_phases;
        std::size_t peak = learned_peak(at);
        if (k == 0) peak = std::max(peak, transient);
        peak = std::min(peak, max_transient);
        const std::size_t room = budget > peak ? budget - peak : 0;
        profile_cap[k] = room > cache_reserve ? room - cache_reserve : 0;
        profile_used[k] = 0;
      }
    }
    for (std::size_t i = 0; i < f.upcoming.size() && order.size() < limit; ++i) {
      // Entry i with the rest of its group (a region without a group stands alone); members already wanted
      // (an earlier entry of the same group) are skipped.
      const std::uint32_t g = f.upcoming[i].group;
      run.clear();
      auto add = [&](std::size_t k) {
        swap_region* r = forecast_regions[k];
        if (!r || !r->live || r->wanted_round == round) return;
        if (std::find(run.begin(), run.end(), r) == run.end()) run.push_back(r);
      };
      add(i);
      if (g != 0) {
        for (std::size_t p = group_position[i] + 1; p < group_entries.size() && group_entries[p].first == g; ++p) {
          add(group_entries[p].second);  // the group's later entries
        }
      }
      std::size_t run_bytes = 0;
      for (swap_region* r : run) run_bytes += r->bytes;
      if (by_profile) {
        // Held until L 64ths after its last member's next use, from now if a member is on the device, else from
        // `lead` 64ths before its first member's use (Note [Reserve profile]).
        std::uint64_t far = 0;
        std::uint64_t near = k_far;
        bool on_device = false;
        for (swap_region* r : run) {
          const std::uint64_t d = r->rank < f.upcoming.size() ? f.upcoming[r->rank].distance : 0;
          far = std::max(far, d);
          near = std::min(near, d);
          on_device = on_device || r->state == region_residency::device || r->state == region_residency::moving_in;
        }
        const std::size_t until = std::min<std::size_t>(
            k_phases - 1, static_cast<std::size_t>(far * k_phases / f.step_launches) + options.reserve_margin);
        const std::size_t near_k =
            static_cast<std::size_t>(std::min<std::uint64_t>(near * k_phases / f.step_launches, k_phases - 1));
        const std::size_t from = on_device || near_k <= options.reserve_ahead ? 0 : near_k - options.reserve_ahead;
        if (!hold_if_fits(from, until + 1, run_bytes)) break;
        for (std::size_t n = 0; n < run.size(); ++n) order_from.push_back(from);
      } else {
        if (bytes + run_bytes > capacity) break;
        bytes += run_bytes;
      }
      for (swap_region* r : run) {
        r->wanted_round = round;
        order.push_back(r);
      }
    }
    if (options.prefetch_tune) tuner.note_wanted(order.size());

    // Forecast regions on the device (or coming in) may hold at most `capacity`: the rest of the budget is the
    // reserve. When the wanted regions still on the host do not fit beside what is committed, or the commitment
    // already exceeds the capacity (the reserve grew), evict the resident forecast regions used farthest
    // (Belady), as many as that takes, at once: an eviction waits for the launches already enqueued (its
    // fences), so it has to start long before its pages are needed.
    std::size_t committed = 0;
    std::size_t unwanted = 0;  // of it, the regions not wanted (the profile's evictions read it)
    for (std::size_t i = 0; i < forecast_regions.size(); ++i) {
      const swap_region* r = ranked_at(i);
      if (!r || !r->live) continue;
      if (r->state != region_residency::device && r->state != region_residency::moving_in) continue;
      committed += r->bytes;
      if (r->wanted_round != round) unwanted += r->bytes;
    }
    // Starts evicting the resident forecast region not wanted that is used farthest; its bytes, or 0 if none goes.
    const auto evict_farthest = [&]() -> std::size_t {
      swap_region* victim = pick_forecast_victim([round](const swap_region& r) { return r.wanted_round == round; });
      if (!victim || !start_evict(*victim, false, true)) return 0;
      committed -= std::min(committed, victim->bytes);
      return victim->bytes;
    };
    if (by_profile) {
      // The regions not wanted may hold what every 64th ahead leaves beside the wanted ones; the rest are evicted,
      // farthest first. Prefetches take the room of the present 64th.
      std::size_t room = k_far;
      for (std::size_t k = 0; k < k_phases; ++k) {
        room = std::min(room, profile_cap[k] > profile_used[k] ? profile_cap[k] - profile_used[k] : 0);
      }
      while (unwanted > room) {
        const std::size_t evicted = evict_farthest();
        if (evicted == 0) break;
        unwanted -= std::min(unwanted, evicted);
      }
      capacity = profile_cap[0];
    } else {
      std::size_t need = 0;
      for (swap_region* r : order) {
        if (r->state == region_residency::host && !r->mv) need += r->bytes;
      }
      while (committed + need > capacity) {
        if (evict_farthest() == 0) break;
      }
    }
    // Prefetch in forecast order within the capacity, as pages allow (free ones, else the idle cache).
    for (std::size_t i = 0; i < order.size(); ++i) {
      swap_region* r = order[i];
      if (r->state != region_residency::host || r->mv) continue;
      if (by_profile && order_from[i] != 0) {
        // Not due yet: early only if it also fits in every 64th until its hold begins (Note [Reserve profile]).
        if (!hold_if_fits(0, order_from[i], r->bytes)) break;
      }
      if (committed + r->bytes > capacity || !start_prefetch(*r, true)) break;  // the next round continues
      committed += r->bytes;
    }
  }

  // Without a forecast: bring back regions touched since their eviction, LRU (Note [Policy]).
  void policy_demand() {
    std::size_t pages = free_pages();
    for (auto& [id, r] : regions) {
      if (!r->live || r->mv || r->state != region_residency::host) continue;
      if (gate::sequence(id) == r->evicted_seq) continue;  // not touched on host
      if (pages >= r->npages) {
        if (start_prefetch(*r, true)) pages -= r->npages;
        continue;
      }
      swap_region* victim = pick_victim([](const swap_region&) { return false; });
      if (victim && gate::last_use(victim->id) < gate::last_use(id)) start_evict(*victim, false, true);
      break;
    }
  }
};

residency_engine::residency_engine(driver& port, std::mutex& mutex, page_source& source, residency_options options)
    : impl_(std::make_unique<impl>(port, mutex, source, std::move(options))) {
  impl_->d2h = port.create_stream();
  impl_->h2d = port.create_stream();
  // The tracker must not count the engine's own copies as uses of the regions they move (residency_gate.hpp).
  gate::add_internal_stream(reinterpret_cast<std::uint64_t>(impl_->d2h));
  gate::add_internal_stream(reinterpret_cast<std::uint64_t>(impl_->h2d));
}

residency_engine::~residency_engine() {
  stop();
  impl& m = *impl_;
  try {
    for (auto& [bytes, c] : m.spare_chunks) m.free_chunk(bytes, c);  // every region is gone: its chunk is spare
    for (auto& [bytes, h] : m.spare_host) m.release_host(bytes, h);
    for (event_handle e : m.spare_events) m.port.destroy_event(e);
    for (std::uint64_t* words : m.digest_chunks) m.port.free_host_words(words);  // every move settled: none pending
    gate::remove_internal_stream(reinterpret_cast<std::uint64_t>(m.d2h));
    gate::remove_internal_stream(reinterpret_cast<std::uint64_t>(m.h2d));
    m.port.destroy_stream(m.d2h);
    m.port.destroy_stream(m.h2d);
    if (m.flags) {
      // Launches held earlier may not have read their flag yet: the program's streams first (Note [Holds]).
      for (stream_handle s : m.streams) m.port.synchronize(s);
      gate::for_each_stream(m.port.context_id(), [&](std::uint64_t s) {  // Note [Launch streams]
        m.port.synchronize(reinterpret_cast<stream_handle>(s));
      });
      m.port.synchronize(m.sig);
      gate::remove_internal_stream(reinterpret_cast<std::uint64_t>(m.sig));
      m.port.destroy_stream(m.sig);
      m.port.unmap(m.flags, m.gran);
      m.port.release(m.flags_page);
      m.port.unreserve(m.flags, m.gran);
    }
  } catch (const std::exception& e) {
    LAYERSWAP_LOG(warn, "residency engine shutdown failed: %s", e.what());
  }
}

void residency_engine::start() {
  impl& m = *impl_;
  if (!m.options.thread || m.thread.joinable()) return;
  m.stopping = false;
  gate::set_counting(true);  // the tracker counts launches that found a region on the host (the hit rate)
  gate::set_waiter_wake([](void* engine) { static_cast<residency_engine*>(engine)->wake(); }, this);
  m.thread = std::thread([this] {
    name_this_thread("layerswap-move");
    driver_calls::set_engine_thread();  // its driver calls are counted apart (runtime/driver_calls.hpp)
    impl& e = *impl_;
    std::unique_lock lock(e.wake_mutex);
    std::uint64_t launches = gate::counts().launches;
    unsigned idle_ticks = 0;
    while (!e.stopping) {
      // While launches wait for a prefetch (Note [Waiting for a prefetch]), poll the moves far more often; while
      // nothing happens, sleep until something does (Note [Idle engine]).
      auto period = gate::waiting() != 0 ? k_waited_period : e.options.period;
      bool asleep = false;
      if (idle_ticks >= k_idle_ticks && e.options.idle_period > period) {
        gate::set_engine_asleep(true);
        if (gate::counts().launches == launches && gate::waiting() == 0) {
          period = e.options.idle_period;
          asleep = true;
          ++e.idle_sleeps;
        } else {
          gate::set_engine_asleep(false);
        }
      }
      e.wake_cv.wait_for(lock, period, [&] { return e.stopping || e.woken; });
      if (asleep) gate::set_engine_asleep(false);
      if (e.stopping) break;
      e.woken = false;
      lock.unlock();
      const auto log_once = [&](const char* what) {
        if (e.error_logged) return;  // once: the engine keeps going, the next round may succeed
        e.error_logged = true;
        LAYERSWAP_LOG(warn, "residency engine: %s (further errors are not logged)", what);
      };
      try {
        tick();
      } catch (const cuda_error& ex) {
        // Note [Driver shut down]: at process exit the driver can be deinitialized while this thread still runs
        // (torchrun's workers exit so): nothing can move any more, and there is nothing to report.
        if (ex.code() == k_cuda_deinitialized) {
          LAYERSWAP_LOG(debug, "residency engine: the CUDA driver has shut down; the migration thread stops");
          break;
        }
        log_once(ex.what());
      } catch (const std::exception& ex) {
        log_once(ex.what());
      }
      const std::uint64_t now_launches = gate::counts().launches;
      const bool idle = e.quiet.load(std::memory_order_relaxed) && now_launches == launches && gate::waiting() == 0;
      idle_ticks = idle ? idle_ticks + 1 : 0;
      launches = now_launches;
      lock.lock();
    }
  });
}

void residency_engine::stop() noexcept {
  impl& m = *impl_;
  gate::clear_waiter_wake(this);
  {
    std::lock_guard lock(m.wake_mutex);
    m.stopping = true;
  }
  m.wake_cv.notify_all();
  if (m.thread.joinable()) m.thread.join();
}

void residency_engine::wake() noexcept {
  {
    std::lock_guard lock(impl_->wake_mutex);
    impl_->woken = true;
  }
  impl_->wake_cv.notify_all();
}

std::pair<stream_handle, stream_handle> residency_engine::copy_streams() const noexcept {
  return {impl_->d2h, impl_->h2d};
}

void residency_engine::set_forecast_source(forecast_source* source) noexcept {
  // Under tick_mutex: once this returns, no round still uses the previous source (it may be destroyed).
  std::lock_guard lock(impl_->tick_mutex);
  impl_->forecaster.store(source);
}

void residency_engine::tick() {
  impl& m = *impl_;
  std::lock_guard tick_lock(m.tick_mutex);
  // The forecast is fetched without the allocator mutex: the learner may take its own locks (and call into the
  // allocator), so the order is learner -> allocator, never the reverse.
  // Note [Forecast when due]: only a round of the policy reads the forecast, and most ticks only poll the moves
  // (a round runs at most every k_policy_period unless a move finished or a launch waits). Fetching it at every
  // tick copied up to 4096 entries 5,000 times a second: a quarter of an idle engine's samples on the H200
  // (learner::current), and time before every poll of a busy one. So it is fetched when a round is due: before
  // the mutex when the period has passed, else after the moves' remaps when one finished or a launch waits.
  const forecast* f = nullptr;
  bool fetched = false;
  const auto fetch_forecast = [&] {
    fetched = true;
    if (forecast_source* src = m.forecaster.load(); src && m.active()) {
      m.fc.upcoming.clear();
      src->current(m.fc, 4096);
      if (m.options.prefetch_tune) m.fc_ns = m.tune_now_ns();  // Note [Tuned prefetch]
      if (m.fc.learned) f = &m.fc;
    }
  };
  const auto policy_due = [&](bool moves_finished, std::chrono::steady_clock::time_point at) {
    return !m.options.thread || moves_finished || gate::waiting() != 0 || at - m.last_policy >= k_policy_period;
  };
  if (policy_due(false, std::chrono::steady_clock::now())) fetch_forecast();
  // Note [Remaps outside the lock]: the driver calls of remaps, and of the prefetches the policy starts, run
  // without the mutex, on regions marked busy.
  std::unique_lock lock(m.mutex);
  std::exception_ptr failure;
  const std::vector<swap_region*> finished = m.poll_moves();
  m.outside_lock(lock, finished, &impl::remap_all, &impl::end_finish, failure);
  // Note [Policy rounds]: the migration thread runs the policy when a move finished (pages and regions changed)
  // or launches wait for a prefetch, else at most every k_policy_period: a round holds the allocator mutex, and
  // the program's allocations wait meanwhile (a LoRA step allocates every ~25 us, so nearly every round makes
  // one wait). A tick called by hand always runs it. So a round allocates nothing and touches as little memory as
  // it can: the migration thread sleeps between rounds and the program's threads write the allocator's data, so on
  // a real machine a round's time is mostly cache misses (the same round takes 4-9 us back to back on the simulated
  // device, 15-45 us on the H200).
  //   * apply_forecast looks each forecast entry up once, in region_index (one contiguous table), and keeps the
  //     entries' regions (forecast_regions); the passes over the forecast regions (transient_bytes, the committed
  //     bytes, the victims) walk that list, not every region (activations, cached segments), and only the last
  //     forecast's regions have their rank reset;
  //   * a policy victim is the first eligible forecast region from the back (ranks are distinct: no gate reads);
  //   * the fields those passes read sit in a region's first cache line; a group's entries are found in a sorted
  //     vector, not a map of vectors; the wanted set is a stamp on the regions (wanted_round);
  //   * poll_moves walks the regions with a move (moving), not every region;
  //   * the allocator's housekeeping no longer walks its idle list: the idle bytes are counted as segments come and
  //     go, and a pool's fence is due when its newest idle segment is not fenced.
  // On the H200 (1.1B LoRA at 25%, three runs against three of the code before, alternating in one call): the mutex
  // held by rounds 4.8-5.8 ms per step against 10.5-11.2 (housekeeping 1.0-1.6 against 2.6-2.8), the program's
  // allocator calls 11-12 ms against 17.5-18.2. What is left of a round is mostly driver calls: fence queries and
  // records (maintain), spare chunks released and idle segments reclaimed for prefetches (room, ~2.2 ms per step).
  // A longer period (4 ms) was tried before and changed nothing measurable; so did ending a round early while a
  // program thread waited for the mutex, which starved the prefetches (launches waited 80-90 ms per step).
  const auto now = std::chrono::steady_clock::now();
  if (!failure && policy_due(!finished.empty(), now)) {
    if (!fetched) {  // a move finished or a launch began waiting since the tick began
      lock.unlock();
      fetch_forecast();
      lock.lock();
    }
    m.last_policy = now;
    m.source.maintain();
    m.st.maintain_us += elapsed_us(now);
    if (m.active()) m.policy(f);  // after the finished evictions gave their pages back
    ++m.st.policy_rounds;
    m.st.policy_us += elapsed_us(now);
  }
  m.outside_lock(lock, std::exchange(m.starting, {}), &impl::start_all_deferred, &impl::end_start, failure);
  m.quiet.store(m.moving.empty() && !failure, std::memory_order_relaxed);  // Note [Idle engine]
  if (failure) std::rethrow_exception(failure);
}

void residency_engine::set_streams_locked(std::span<const stream_handle> streams) {
  impl_->streams.assign(1, nullptr);
  for (stream_handle s : streams) note_stream_locked(s);
}

void residency_engine::note_stream_locked(stream_handle stream) {
  auto& v = impl_->streams;
  if (std::find(v.begin(), v.end(), stream) == v.end()) v.push_back(stream);
}

swap_region* residency_engine::add_locked(region_id id, device_ptr va, std::size_t bytes, device_chunk chunk) {
  auto r = std::make_unique<swap_region>();
  r->id = id;
  r->va = va;
  r->bytes = bytes;
  r->npages = bytes / impl_->gran;
  r->chunk = chunk;
  swap_region* out = r.get();
  impl_->regions[id] = std::move(r);
  impl_->index.insert(id, out);
  return out;
}

void residency_engine::set_live_locked(swap_region* r, bool live) {
  impl_->wait_not_busy(*r);  // its state is final afterwards (the caller decides on it)
  r->live = live;
  if (!live && r->mv) r->mv->cancelled = true;  // Note [Freeing a moved region]
}

bool residency_engine::host_backed_locked(const swap_region* r) const noexcept {
  return r->state == region_residency::host || r->state == region_residency::moving_in;
}

bool residency_engine::moving_locked(const swap_region* r) const noexcept { return r->mv != nullptr || r->busy; }

bool residency_engine::follows_step_locked() const noexcept { return impl_->following(); }

void residency_engine::settle_locked(swap_region* r) { impl_->settle(*r); }

bool residency_engine::remove_locked(swap_region* r) {
  impl& m = *impl_;
  m.settle(*r);
  const bool host_mapped = r->state == region_residency::host;
  const bool unmapped = host_mapped || r->chunk;
  if (unmapped) m.port.unmap(r->va, r->bytes);  // one mapping: the host backing or the chunk (Note [Chunks])
  if (r->chunk) m.add_spare(r->bytes, std::exchange(r->chunk, {}));
  m.forget(*r);
  return unmapped;
}

device_chunk residency_engine::detach_locked(swap_region* r) {
  impl& m = *impl_;
  if (r->mv || r->busy || r->state != region_residency::device || !r->chunk) {
    throw error("layerswap: internal: detach_locked needs a device-backed region that is not moving");
  }
  const device_chunk c = std::exchange(r->chunk, {});
  m.forget(*r);
  return c;
}

void residency_engine::impl::forget(swap_region& region) {
  swap_region* r = &region;
  gate::set_on_host(r->id, false);
  if (r->flag_slot != k_no_slot) free_slots.push_back(r->flag_slot);  // its ticket count goes on
  if (r->digest_slot != k_no_slot) free_digest_slots.push_back(r->digest_slot);
  if (r->host) spare_host.emplace(r->bytes, r->host);  // its view stays mapped for the next region
  std::replace(forecast_regions.begin(), forecast_regions.end(), r, static_cast<swap_region*>(nullptr));
  index.erase(r->id);
  regions.erase(r->id);  // r is gone
}

void residency_engine::release_holds_locked() { impl_->release_holds(); }

bool residency_engine::evict_sync_locked() {
  impl& m = *impl_;
  if (!m.active()) return false;  // Note [No tracker]
  // The allocation this serves did not fit: the reserve for memory that cannot move was too small.
  if (m.forecast_applied) {
    const std::size_t needed = m.transient_bytes() + m.gran;
    m.max_transient = std::max(m.max_transient, needed);
    if (m.phase_step != 0) m.phase_peak[m.phase] = std::max(m.phase_peak[m.phase], needed);  // Note [Following reserve]
  }
  // Note [Allocation under pressure]: evictions already in flight free pages soonest. Finish the moves whose copies
  // are done (no host wait); if none of them was an eviction, wait for the oldest eviction in flight alone (the D2H
  // stream runs in order: its copy is the next to end), not for every move, prefetches included.
  const std::int64_t before = m.st.evictions;
  m.wait_none_busy();
  m.poll_scratch = m.moving;  // finish() ends moves
  for (swap_region* r : m.poll_scratch) {
    if (m.copy_done(*r)) m.finish(*r);
  }
  if (m.st.evictions != before) return true;
  swap_region* oldest = nullptr;
  for (swap_region* r : m.moving) {
    if (!r->mv->to_device && (!oldest || r->mv->started < oldest->mv->started)) oldest = r;
  }
  if (oldest) {
    m.settle(*oldest);
    if (m.st.evictions != before) return true;
  }
  // Forecast regions first (farthest next use); regions absent from the forecast only when none is left.
  // Victims refused by the gate are skipped for this call; each attempt either evicts or skips one region. First
  // among the regions not moving, with no other host wait; then, once every move is settled, among all.
  std::unordered_set<region_id> refused;
  const auto excluded = [&refused](const swap_region& r) { return refused.contains(r.id); };
  const auto evict_one = [&](bool forecast_only) {
    for (;;) {
      swap_region* victim = forecast_only ? m.pick_forecast_victim(excluded) : m.pick_victim(excluded);
      if (!victim) return false;
      const std::int64_t evicted = m.st.evictions;
      if (!m.start_evict(*victim, true)) {
        refused.insert(victim->id);
        continue;
      }
      for (event_handle e : victim->mv->fences) m.port.wait(e);
      m.settle(*victim);
      if (m.st.evictions != evicted) return true;
      refused.insert(victim->id);
    }
  };
  if (evict_one(true)) return true;
  m.settle_all();
  return evict_one(true) || evict_one(false);
}

void residency_engine::note_cache_miss_locked(std::size_t bytes) {
  ++impl_->st.cache_misses;
  // Capped when applied (a half of the policy's room); bounded here only so that it cannot overflow.
  if (impl_->options.cache_reserve_auto) impl_->cache_grown = std::min(impl_->cache_grown + bytes, std::size_t{1} << 50);
}

bool residency_engine::request_locked(swap_region* r, bool to_device) {
  if (!impl_->active()) return false;  // Note [No tracker]
  impl_->wait_not_busy(*r);
  return to_device ? impl_->start_prefetch(*r, false) : impl_->start_evict(*r, false);
}

std::size_t residency_engine::evictable_pages_locked() const noexcept {
  if (!impl_->active()) return 0;
  std::size_t n = 0;
  for (const auto& [id, r] : impl_->regions) {
    if (r->live && !r->pinned && r->state != region_residency::host && r->state != region_residency::moving_in) {
      n += r->npages;
    }
  }
  return n;
}

std::size_t residency_engine::own_pages_locked() const noexcept {
  return (impl_->flags ? 1 : 0) + impl_->lost_pages;
}

std::size_t residency_engine::inflight_pages_locked() const noexcept {
  std::size_t n = impl_->extra_pages;  // given back when their prefetches' starts end
  for (const auto& [id, r] : impl_->regions) {
    if (r->mv && r->mv->to_device) n += r->npages;  // its chunk, or the room taken for it
  }
  return n;
}

std::size_t residency_engine::chunk_pages_locked() const noexcept {
  std::size_t bytes = impl_->spare_bytes;
  for (const auto& [id, r] : impl_->regions) {
    if (r->chunk) bytes += r->bytes;
  }
  return bytes / impl_->gran;
}

device_chunk residency_engine::take_chunk_locked(std::size_t bytes) {
  impl& m = *impl_;
  const std::size_t n = bytes / m.gran;
  for (;;) {
    device_chunk c;
    if (!m.claim_chunk(bytes, c)) return {};
    if (c) return c;
    try {
      device_chunk made = m.make_chunk(bytes, false);
      ++m.st.chunks_for_segments;
      return made;
    } catch (const device_out_of_memory&) {  // the device is full (other processes): spares first, then the caller
      m.source.give_room(n);
    } catch (...) {
      m.source.give_room(n);
      throw;
    }
    if (!m.release_largest_spare()) return {};
  }
}

void residency_engine::give_chunk_locked(std::size_t bytes, const device_chunk& chunk) { impl_->add_spare(bytes, chunk); }

std::pair<std::size_t, device_chunk> residency_engine::take_homed_spare_locked(std::size_t lo, std::size_t hi,
                                                                              device_ptr base, std::size_t span) {
  impl& m = *impl_;
  for (auto it = m.spare_chunks.lower_bound(lo); it != m.spare_chunks.end() && it->first <= hi; ++it) {
    const device_ptr home = it->second.home;
    if (home < base || home - base >= span) continue;
    return m.take_spare(it);
  }
  return {};
}

std::vector<std::pair<std::size_t, device_chunk>> residency_engine::take_spares_locked(std::size_t lo, std::size_t hi,
                                                                                         std::size_t parts,
                                                                                         std::size_t room) {
  impl& m = *impl_;
  std::vector<std::multimap<std::size_t, device_chunk>::iterator> picked;
  std::size_t sum = 0;
  for (auto it = m.spare_chunks.end(); it != m.spare_chunks.begin() && sum < lo && picked.size() < parts;) {
    --it;
    if (sum + it->first > hi) continue;  // too large to join the ones taken: a smaller one may
    picked.push_back(it);
    sum += it->first;
  }
  std::vector<std::pair<std::size_t, device_chunk>> out;
  if (picked.empty() || sum + room < lo) return out;
  out.reserve(picked.size());
  for (const auto it : picked) out.push_back(m.take_spare(it));  // erasing one leaves the others valid
  return out;
}

std::size_t residency_engine::spare_pages_locked() const noexcept { return impl_->spare_bytes / impl_->gran; }

bool residency_engine::has_spare_locked(std::size_t bytes) const noexcept { return impl_->spare_chunks.contains(bytes); }

std::size_t residency_engine::spare_within_locked(std::size_t lo, std::size_t hi) const noexcept {
  const auto it = impl_->spare_chunks.lower_bound(lo);
  return it != impl_->spare_chunks.end() && it->first <= hi ? it->first : 0;
}

std::size_t residency_engine::release_spare_locked(std::size_t pages) {
  impl& m = *impl_;
  const std::size_t before = m.spare_bytes;
  const std::size_t want = pages > SIZE_MAX / m.gran ? SIZE_MAX : pages * m.gran;
  while (!m.spare_chunks.empty() && before - m.spare_bytes < want) {
    // The smallest spare that covers what is still wanted, else the largest.
    auto it = m.spare_chunks.lower_bound(want - (before - m.spare_bytes));
    m.release_spare(it == m.spare_chunks.end() ? std::prev(it) : it);
    ++m.st.chunks_released_for_pages;
  }
  return (before - m.spare_bytes) / m.gran;
}

region_residency residency_engine::state_locked(const swap_region* r) const noexcept { return r->state; }

std::string residency_engine::describe_locked() const {
  const impl& m = *impl_;
  std::string spares;
  std::size_t shown = 0;
  for (auto it = m.spare_chunks.begin(); it != m.spare_chunks.end(); it = m.spare_chunks.upper_bound(it->first)) {
    if (shown++ == 8) {
      spares += ", ...";
      break;
    }
    spares += (spares.empty() ? "" : ", ") + std::to_string(m.spare_chunks.count(it->first)) + " x " +
              format_bytes(it->first);
  }
  std::size_t out_n = 0, out_bytes = 0, in_n = 0, in_bytes = 0;
  for (const swap_region* r : m.moving) {
    if (!r->mv) continue;
    (r->mv->to_device ? in_n : out_n) += 1;
    (r->mv->to_device ? in_bytes : out_bytes) += r->bytes;
  }
  char line[512];
  std::snprintf(line, sizeof line,
                "64th %zu, reserve %s, unused %s; spares %s (%s); evicting %zu (%s), prefetching %zu (%s)", m.phase,
                format_bytes(static_cast<std::size_t>(m.st.reserve_bytes)).c_str(), format_bytes(m.unused_bytes()).c_str(),
                format_bytes(m.spare_bytes).c_str(), spares.empty() ? "none" : spares.c_str(), out_n,
                format_bytes(out_bytes).c_str(), in_n, format_bytes(in_bytes).c_str());
  return line;
}

residency_stats residency_engine::stats_locked() const {
  const impl& m = *impl_;
  residency_stats s = m.st;
  s.host_bytes = static_cast<std::int64_t>(m.host_bytes);
  s.moves_in_flight = static_cast<std::int64_t>(m.moving.size());
  s.active = m.active();
  const gate::launch_counts counts = gate::counts();
  s.launches_counted = counts.launches;
  s.launches_missed = counts.missed;
  const gate::wait_counts waits = gate::waits();
  s.launch_waits = waits.waits;
  s.launch_wait_us = waits.ns / 1000;
  s.launch_wait_timeouts = waits.timeouts;
  s.launch_holds = waits.holds;
  s.launch_remap_waits = waits.remap_waits;
  s.launch_remap_wait_us = waits.remap_ns / 1000;
  s.idle_sleeps = m.idle_sleeps.load(std::memory_order_relaxed);
  s.remap_us = m.remap_ns.load(std::memory_order_relaxed) / 1000;
  s.stage_us = m.stage_ns.load(std::memory_order_relaxed) / 1000;
  for (std::size_t i = 0; i < s.remap_us_by_phase.size(); ++i) {
    s.remap_us_by_phase[i] = m.remap_ns_by_phase[i].load(std::memory_order_relaxed) / 1000;
  }
  s.remap_in_us = m.remap_in_ns.load(std::memory_order_relaxed) / 1000;
  s.remap_out_us = m.remap_out_ns.load(std::memory_order_relaxed) / 1000;
  s.chunks_created = m.chunks_created.load(std::memory_order_relaxed);
  s.spare_bytes = static_cast<std::int64_t>(m.spare_bytes);
  for (const auto& [id, r] : m.regions) {
    if (!r->live) continue;
    ++s.regions_swappable;
    if (r->state == region_residency::device || r->state == region_residency::moving_out) ++s.regions_resident;
    else ++s.regions_on_host;
  }
  return s;
}

std::string residency_engine::verify_locked() const {
  const impl& m = *impl_;
  auto device_backed = [](const swap_region& r) { return static_cast<bool>(r.chunk); };  // Note [Chunks]
  std::size_t moves = 0;
  std::size_t backing = 0;
  for (const auto& [id, r] : m.regions) {
    const std::string name = "region " + std::to_string(id) + ": ";
    if (r->id != id || r->npages * m.gran != r->bytes) return name + "record is corrupt";
    if (r->host) backing += r->bytes;
    switch (r->state) {
      case region_residency::device:
        if (r->mv || !device_backed(*r)) return name + "resident without its device memory, or moving";
        break;
      case region_residency::host:
        if (r->mv || r->chunk || !r->host) {
          return name + "on host but holds device memory or no host pages";
        }
        break;
      case region_residency::moving_out:
        if (!r->mv || r->mv->to_device || !device_backed(*r) || !r->host) {
          return name + "moving out without a move, its device memory or host pages";
        }
        break;
      case region_residency::moving_in:
        if (!r->mv || !r->mv->to_device || r->chunk || !r->host) {
          return name + "moving in without a move or its host pages, or with device memory already";
        }
        break;
      case region_residency::none:
        return name + "has no state";
    }
    if (r->mv) ++moves;
  }
  if (moves != m.moving.size()) return "the count of moves in flight is wrong";
  for (std::size_t i = 0; i < m.moving.size(); ++i) {
    if (!m.moving[i]->mv || m.moving[i]->moving_at != i) return "the list of regions with a move is wrong";
  }
  if (m.index.size() != m.regions.size()) return "the region index does not match the regions";
  for (const auto& [id, r] : m.regions) {
    if (m.index.find(id) != r.get()) return "the region index does not find region " + std::to_string(id);
  }
  for (const auto& [bytes, h] : m.spare_host) backing += bytes;
  std::size_t spare = 0;
  for (const auto& [bytes, c] : m.spare_chunks) spare += bytes;
  if (spare != m.spare_bytes) return "spare chunk bytes do not add up";
  if (backing != m.host_bytes) return "host bytes do not add up";
  if (m.options.host_limit && m.host_bytes > m.options.host_limit) return "LAYERSWAP_HOST_LIMIT was exceeded";
  return {};
}

void residency_engine::settle_all_locked() { impl_->settle_all(); }

}  // namespace layerswap::detail
