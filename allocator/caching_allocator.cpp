// The VMM caching allocator.
//
// Algorithm
// ---------
// Device memory is a pool of physical pages of one granule (2 MiB on the H100), created through the driver
// port and never more than the budget. Virtual addresses come from arenas: large VA reservations
// (LAYERSWAP_VA_RESERVE) carved at granule boundaries; an owner table per arena maps every granule to the
// segment that covers it, so finding the segment of a pointer is O(1).
//
// A segment is a range of an arena with pages mapped into it, in one of two shapes:
//   * large: one allocation larger than small_max, its size rounded up to whole granules;
//   * slab:  blocks of one size class (size_classes.hpp), for requests up to small_max.
// Each segment belongs to the pool of the stream it was created for (Note [Stream-ordered reuse]).
//
// allocate(bytes, stream)
//   small: a block from the first slab of the class with room in the stream's pool, else a new slab;
//   large: a cached large segment of the stream's pool with npages .. npages + npages/8 pages, else a free range
//          of one of its split segments (Note [Free ranges first]), else (while the reserve follows the step) a
//          range of an idle segment (Note [Idle segments before chunks]), else a new segment.
//   A new segment gathers pages: idle pooled pages first, then new pages while under the budget, then
//   pages reclaimed from idle segments, least recently freed first (Note [Unmap fences]). Only when none
//   is left does it fail, with a message that names the budget and the largest holders. With residency, a new
//   large segment is one physical allocation instead (Note [Swappable segments]).
// deallocate(ptr)
//   the block goes back to its segment at once, or waits for the streams it was recorded on
//   (Note [record_stream]). An idle segment (large and free, or a slab with no block in use) stays mapped,
//   cached, until its pages are needed elsewhere or empty_cache() is called.
//
// Note [Stream-ordered reuse]
//   A block freed by a stream S is handed out again only to allocations on S. Work enqueued on S after the
//   free runs after the work enqueued before it, so reuse on S needs no event and no wait. Memory leaves S
//   only through a reclaim (its pages are unmapped and mapped elsewhere), which is fenced.
//
// Note [Unmap fences]
//   cuMemUnmap does not wait for running kernels. Before a segment's pages are unmapped, every launch that
//   may touch it must have completed. They were all enqueued before the segment became idle, but not only on
//   its stream: PyTorch promises stream-ordered reuse, not that a block is used on its stream alone. A program
//   may use a block on another stream without record_stream and order the reuse by events instead: FSDP2's
//   reduce-scatter output is made on its reduce-scatter stream, read and written by the optimizer on the
//   compute stream, and freed by zero_grad; the reduce-scatter stream waits for the compute stream before it
//   reuses the memory. PyTorch's own allocator is safe there because it hands a block out again only on its
//   stream and synchronizes the device before it gives memory back to the driver. So a fence here is an event
//   on every stream the allocator knows (its pools' and the legacy stream) and every stream launches were seen
//   on (residency_gate.hpp, Note [Launch streams]), recorded after the segment became idle; once they have all
//   completed, every segment idle before the fence is safe to unmap. The allocator remembers the free epoch its
//   last fence covered, so a burst of reclaims waits at most once. With a residency engine, its thread also
//   records fences without waiting (maintain(): one in flight) and notes when they complete, so that a reclaim
//   usually finds a segment already fenced and waits for nothing.
//
// Note [record_stream]
//   A block used on other streams (Tensor.record_stream) is not returned at deallocate(): an event is
//   recorded on each of those streams, and the block stays active until every event has completed. Pending
//   blocks are polled at the start of each allocate() (only when there are any) and before reclaiming.
//
// Note [Swappable segments]
//   With residency enabled (allocator_options::residency), every large segment is also a region of the residency
//   engine (residency.hpp), swappable while live. Its device memory is one physical allocation of its size, a
//   chunk (Note [Chunks] in residency.cpp: VMM calls cost per mapping), which the engine holds: its `pages` stay
//   empty, and a chunk from a destroyed segment or an eviction becomes a spare for the next segment or prefetch of
//   that size (gather_chunk_locked). `n` is its size in granules either way. Only device-backed segments are
//   cached for reuse: a large segment
//   freed while host-backed is retired instead (Note [Freeing a moved region] in residency.cpp). A request that
//   does not fit in the budget reclaims the cache first, then evicts live regions synchronously
//   (Note [Allocation under pressure]), and fails only when nothing movable is left.
//
// Note [Oversize reuse]
//   A large allocation takes a cached segment of its stream's pool within 1/8 above its size. Under a tight budget
//   the cache often has none: the request then reclaims idle segments of other sizes, least recently freed first,
//   and makes a new one (with residency: a spare chunk released and a chunk made, a mapping, access granted; a fence
//   wait when the reclaimed segment's work is not known complete). With LAYERSWAP_OVERSIZE = k > 1 (experimental),
//   when no new segment fits without reclaiming (no spare chunk of the size, too little pooled memory and budget
//   headroom), the request takes the smallest idle segment of its pool up to k times its size instead: no driver
//   call and no wait, the same stream-ordered reuse as any cache hit, at the price of the unused tail while the
//   allocation lives. On the H100 (nine cases with k = 2, bench/results/swap.json) it sped full fine-tuning at 50%
//   (257 segments made per step against 436, 0.22 s per step in allocator calls against 0.33 s) and 25%, but at 10%
//   the tails it holds left the policy almost no capacity: prefetching collapsed (0.70 GB H2D per step against
//   8.92 GB, launches waiting 0.35 s per step) and the step slowed from 0.72 to 0.95 s. So it is off by default.
//
// Note [Composites]
//   Under a full budget a large request often finds no cached segment of its size (within 1/8) and no room for a
//   new chunk. Reclaiming an idle segment of another size then means unmapping its VA, which must wait until the
//   GPU is past the segment's last launches (Note [Unmap fences]); the segments there are to reclaim were mostly
//   freed moments before, so the wait is long (on the H200, batch 8 x 2048 of the 1.1B LoRA at 25%: 64-68 ms a
//   step), and a new chunk is created besides. PyTorch's allocator reuses such memory on the same stream at once:
//   work enqueued on the stream after the free runs after the work before it. A composite does the same with
//   chunks: the new segment's VA maps the chunks of idle large segments of its own stream, one after another
//   (a chunk can be mapped at several VAs), and a new chunk for what they leave, if the room there is covers it.
//   The donors' VAs stay mapped as zombies: each is unmapped, and its range released, once its stream's fence
//   covers the donor's free (maintain() records those fences; poll_fences_locked() and fence_locked() reap).
//   Only when no fenced idle segment gives the room (reclaim_fenced_locked first), and only within n .. n + n/8
//   granules from at most k_most_parts chunks (largest donors first); otherwise the ordinary way, which waits.
//   A composite is not swappable (the engine knows one chunk per region) and counts as memory that cannot move;
//   freed, it is cached like any large segment, and it may be a donor itself. Destroyed (fenced), its chunks become
//   spares, after the zombies that map them are reaped: a zombie's free is older than its composite's, on the same
//   stream, so a fence that covers the composite covers it. Memory held is what it was: no chunk is made twice.
//   A chunk is always mapped whole: the H200's driver (580.159) refuses a map at an offset into an allocation or of
//   a part of it (CUDA_ERROR_NOT_SUPPORTED; .dev probe, session 22), so a donor larger than n + n/8 is no use.
//   Experimental, off by default (LAYERSWAP_COMPOSITES=1). On the H200 (1.1B LoRA at 25%, batch 4 x 2048 and
//   8 x 2048, interleaved with it off; docs/history.md, session 22) composites halved the fence waits at 4 x 2048
//   (2.4-2.9 a step to 1.0-1.3, 9-18 ms to 6-12 ms); at 8 x 2048 they went from 3 a step to 2-2.5 but took as long
//   (67-70 ms against 72-75). The step did not move beyond the noise. Most waits left are for the loss's fp32
//   logits (1.95 GiB) and their bf16 copy (1000 MiB), where the stream's idle memory is too little or one chunk too
//   large. At batch 1 x 1024 none is made (no reclaim waits there).
//
// Note [Spare composites]
//   Under a following reserve (residency.cpp, Note [Following reserve]) the room for the step's activations is the
//   chunks of the weights evicted ahead of them: spares of the weights' sizes (the 1.1B Llama's 8 and 22 MiB). A
//   request larger than any spare (the loss's 126 MiB fp32 logits, a 40 or 64 MiB temporary) with no headroom for a
//   chunk of its own used to release spares, largest first, until the budget had room, then make a chunk and map it
//   at a new VA: for one 126 MiB segment six spares unmapped at their homes and released, a chunk created, mapped
//   and granted access, all on the launching thread; and once the logits were freed, the policy's prefetches of
//   those weights reclaimed the segment, released its chunk and made six chunks again, on the migration thread (a
//   debug log at LoRA's 25%, session 53: three such segments a step at the loss). Now such a request maps spares
//   side by side at a new VA instead, as Note [Composites] maps idle segments' chunks: largest first, within
//   n .. n + n/8 granules, at most k_most_parts chunks, and a new chunk for the rest when the budget's headroom
//   covers it. A spare is free to use at once, as when a request takes one of its own size, so nothing waits; it
//   stays mapped at its home as well. The composite is not swappable and counts as memory that cannot move,
//   as any composite; freed, it is cached like any large segment; destroyed (fenced), its VA is unmapped and its
//   chunks are spares again, still at their homes, each of a size a prefetch of its weight takes as it is. Memory
//   held is what it was, and no spare is released. Only while the reserve follows the step, when a request has no
//   spare of its size and too little headroom, so a spare would otherwise be released (with the step's peak as the
//   reserve, the room for activations is set aside and spares are the weights' own).
//
// Note [Split segments]
//   At larger batches the step's transient allocations change size all the time: the forward pass keeps activations
//   of a few sizes, the backward pass frees them and asks for gradients of others. PyTorch's allocator serves that
//   from the same memory by splitting cached blocks. Here a large segment is one allocation, so under a full budget a
//   request that finds no cached segment within 1/8 of its size reclaims an idle one of another size and makes a new
//   chunk: on the H200 (1.1B LoRA at 25%, batch 4 x 2048) 45 reclaims and 55 chunks a step, 25-31 ms of driver calls
//   on the program's threads. With LAYERSWAP_SPLIT=1 (experimental, residency only), such a request that has no room
//   for a new segment without reclaiming takes a range of granules instead: the smallest free range of a split
//   segment of its pool, or the smallest idle segment of its pool above the reuse window, at most LAYERSWAP_SPLIT
//   times its size (4 with LAYERSWAP_SPLIT=1). Same stream, so no fence and no driver call: the reuse PyTorch makes
//   (Note [Stream-ordered reuse]).
//   The segment keeps its ranges in offset order, covering it; a freed range joins its free neighbours, and when the
//   last one is freed the segment is idle again, whole. A freed range ends its segment's persistence
//   (residency_gate.hpp): the learner keys the step on persistent regions, and ranges hold activations that change
//   places from step to step (with it kept, a run with LAYERSWAP_SPLIT=8 learned no step at all). Only device-backed
//   segments that are not moving are split, and a split segment stays live (memory that cannot move, for the policy)
//   until its last range is freed; the engine may still evict it whole under pressure, and a host-backed one hands out
//   no ranges. The bound keeps a small request from pinning a much larger segment: the free ranges of a live segment
//   are room nobody else can use.
//   On the H200 (docs/history.md, session 23) it did not touch the 4 x 2048 churn at bound 4 (1-2 splits a step: the
//   churn is the loss's 1000 MiB logits and the activations turning into each other, out of reach); at 16 or more it
//   removed the churn but the big segments, split for activations that live until the backward pass, left the policy
//   no room (14x slower); full fine-tuning at 10% spent half the time in allocator calls at bound 4, and prefetched
//   25% less, for the same step. With no cache reserve (residency.cpp, Note [Cache reserve]) and the free ranges
//   bounded (Note [Split bound]), LAYERSWAP_SPLIT=8 is the default since session 42: on the H100 the UNet's step
//   0.79-0.85x the former default's at 50-10% of its movable bytes, full fine-tuning's 0.83-0.95x (0.88-1.00x in a
//   second call), the 1.1B LoRA's 0.91x at 25% and 0.96x at 10%, 1.04x at 50% (within its quartiles, 0.87-1.20).
//
// Note [Split spares]
//   With LAYERSWAP_SPLIT on, a request that finds no free range and no idle segment to split may take the smallest
//   spare chunk (residency.cpp, Note [Chunks]: an evicted region's device memory) above its reuse window and within
//   LAYERSWAP_SPLIT times its size: the chunk becomes a segment of the request's pool (mapped at a new VA, access
//   granted: the calls of any new segment), and the request a range of it; later requests of the pool take the
//   rest. Without it the request releases spare chunks and makes one of its own size, and the next prefetch of the
//   evicted size does the reverse. This is the room LAYERSWAP_RESERVE=follow moves between weights and activations
//   twice a step (residency.cpp, Note [Following reserve]): the forward pass's activations go into the chunks of
//   the weights evicted ahead of them; freed in the backward pass, the whole segment is idle again, and a prefetch
//   of that size takes its chunk back when the policy reclaims it.
//
// Note [Home segments]
//   A spare chunk that a prefetch once used is still mapped, with access, at its home VA (residency.cpp, Note
//   [Chunks]): its staging address. With LAYERSWAP_SPLIT on, the engine takes those homes from an arena of the
//   allocator's own (take_home_va), so that the owner table knows them. A request that would make a segment then
//   gets one at a spare's home instead: a spare of its size (within the reuse window) whole, else a larger one
//   (up to LAYERSWAP_SPLIT times its size) split, as Note [Split spares] does, whether or not the budget has room
//   for a new chunk. No VA is reserved, nothing is mapped, no access granted: no driver call. Under
//   LAYERSWAP_RESERVE=follow the room moves between the weights and the activations twice a step (residency.cpp,
//   Note [Following reserve]); made at new VAs, those segments cost the program ~0.3 ms each in driver calls that
//   wait behind the migration thread's remaps. A home segment is not swappable (its VA must stay the chunk's
//   home) and is never a composite's donor. Destroyed (idle and fenced, as any reclaim: its stream is past its
//   last launches), nothing is unmapped: the chunk is a spare again, mapped at its home, where the next prefetch
//   of its size stages into it. Experimental, with LAYERSWAP_SPLIT. On the H200 (1.1B LoRA at 25%,
//   docs/history.md, session 27) follow with split 8 made ~100 home segments a step, but the program still
//   made ~145 segments: the activations outgrow the spares the evictions ahead have freed, and at the step's
//   start the prefetches take back 1.5-2 GB of idle activation segments of other sizes (1.3-1.4x the resident
//   step against 1.1x by default).
//
// Note [Split bound]
//   The free ranges of a split segment are device memory in no allocation that the policy cannot use: the segment is
//   live (memory that cannot move) until its last range is freed. Left unbounded they starve it: on the H100 at 10% of
//   full fine-tuning's parameter bytes (LAYERSWAP_SPLIT=8, no cache reserve; docs/history.md, session 41) the
//   optimizer's ranges held segments 8x their size over ~15 steps, until the prefetches moved 0.06-0.7 GB a step
//   instead of 5.9 (hit rate 0.80) and the step took 1.44-1.49x the default's. So the allocator counts the granules in
//   free ranges (split_free_pages; verify() recounts them), and a split that takes a whole segment (an idle one, a
//   spare or a home) is refused when those would then exceed LAYERSWAP_SPLIT_FREE (12.5% of the budget by default);
//   the request then reclaims and makes a segment as without LAYERSWAP_SPLIT. A free range of a segment already
//   split is always taken: that lowers the count. With the bound at an eighth of the budget (session 41's dev patch)
//   full fine-tuning at 10% went from 1.40x to 0.94x the default, and the UNet at 25% kept its split gain (0.77x).
//
// Note [Splits by reserve]
//   LAYERSWAP_SPLIT's ratio and LAYERSWAP_SPLIT_FREE's bound keep the policy's room from the program's ranges (Notes
//   [Split segments], [Split bound]). How much room they keep depends on the reserve for activations. While it
//   follows the step (residency.cpp, Note [Following reserve]), the budget's room is what the reserve hands the
//   weights 64th by 64th, and a big segment split for a small request stays live, out of the policy's reach (session
//   48: splits of any size there made the 1.1B LoRA 3-7% slower at 25%). While the reserve is the step's peak, the
//   room for activations is set aside whatever their segments' sizes, and the narrow bounds only make the program
//   remake segments: on the H100 at 10% of the UNet's movable bytes, where the policy moves almost nothing, requests
//   of 1.25-12 MiB found 0 B of room, idle segments of other sizes and 144-154 MiB in free ranges, at the 160 MiB
//   bound (an eighth of the 1.28 GB budget), and more than 8 times their size; each reclaimed an idle segment and
//   made a chunk: 176-221 chunks a step, 0.10-0.11 s of allocator calls in a 0.18-0.20 s step (session 49, a debug
//   log). So the ratio and the bound are wider there: 32 times and a quarter of the budget by default (8/32 and
//   12.5%/25%). Measured as environment variants against 8 and 12.5% in both modes, per cycle of the same H100 run
//   (session 49): the UNet at 10% 0.741x the step (quartiles 0.718-0.810; chunks made 205 -> 13 a step), at 25%
//   0.977x (0.930-1.024); full fine-tuning at 10% 0.899x (0.884-1.018), at 25% 0.961x (0.918-1.032). The 1.1B LoRA
//   follows the step under LAYERSWAP_RESERVE=auto, so its bounds are unchanged (the same widening there: 1.029x,
//   0.908-1.103; the bound alone at 25%: 1.049x, 1.013-1.085). Session 41's starvation came with no bound at all;
//   at a quarter of the budget full fine-tuning at 10% ran faster, not slower.
//
// Note [Free ranges first]
//   A large request that finds no cached segment of its size but has room for a new one (pooled pages, the budget's
//   headroom, or a spare chunk released for it) used to make one: a chunk made, mapped at a new VA, access granted, on
//   the program's thread, behind the migration thread's VMM calls, while the free ranges of its stream's split
//   segments (Note [Split segments]) held memory in no allocation that the policy cannot use either (Note [Split
//   bound]). Such a request now takes the smallest of those free ranges that holds it (at most LAYERSWAP_SPLIT times
//   its size, as any split) before it makes anything: same stream, so no fence and no driver call, and the room it
//   leaves stays for the policy's prefetches. Whole idle segments are still split only when there is no room (they
//   are kept whole for requests of their own size), or while the reserve follows the step (Note [Idle segments before
//   chunks]). Measured against the code before (docs/history.md, session 45;
//   per cycle, the step of this code over the step of the code before in the same call):
//   - the 1.1B LoRA at 25%: 0.892x on an H100 whose resident step was 0.112 s (quartiles 0.837-0.924; 247 ranges
//     taken a step instead of 35, launch waits 5.9 ms a step against 4.5), and 0.981x on an H200 (resident 0.129 s;
//     launch waits 4.1 ms a step instead of 10.4); at 50% and 10% on the H200, 0.965x and 0.943x;
//   - full fine-tuning at 25%: 0.982x and 0.945x in two H100 calls (the second with two processes a side: reclaims
//     for allocations 81 -> 39 a step, chunks made for segments 116 -> 47), but 1.157x on the H200 with one process
//     a side, where this code's process fell into a churn of 201 reclaims a step (48 before); two processes of one
//     build differ that much there. At 50% and 10% on the H200, 0.996x and 0.989x;
//   - the UNet: 0.930x at 25% on the H100; on the H200 1.011x, 0.990x and 1.043x at 50%, 25% and 10% (at 10% its
//     program made 70 chunks a step for segments against 44: the room left to the policy was taken back).
//
// Note [Idle segments before chunks]
//   Under a following reserve (residency.cpp, Notes [Following reserve] and [Automatic reserve]) the room in the budget
//   is what the reserve hands the weights: every 64th, the policy fills what the activations just ahead leave. A
//   request that made a chunk there took that room back on the launching thread (create, map, set access: 0.3-0.5 ms
//   a chunk beside the migration thread's remaps), and the chunk was reclaimed for a prefetch soon after. So with a
//   following reserve, a request that finds no cached segment of its size, no free range, no home and no spare to
//   split splits an idle segment of its stream (within LAYERSWAP_SPLIT times its size and the split bound, as
//   allocate_split_locked does when there is no room) before it makes a chunk: same stream, no fence, no driver call.
//   With the step's peak as the reserve, whole idle segments are still kept for requests of their own size (Note
//   [Free ranges first]). Measured on an H100 (1.1B LoRA at 25% under auto, session 47, as a dev switch with the same
//   effect): 0.942x the step per cycle (quartiles 0.880-0.979; resident 0.122 s: 1.10x the bound against 1.17x),
//   chunks made for segments 12.6 -> 9.6 a step, the program's VMM calls 5.1 -> 3.9 ms, the autograd thread's CPU
//   81 -> 71 ms and the Python thread's 69 -> 63 ms a step (resident 63 and 59). The UNet and full fine-tuning never
//   follow the step under auto, so they are untouched.
//
// Note [Reclaim by fit]
//   A request that finds no room reclaims idle segments whose work the GPU has finished (fenced), one at a time, until
//   the room covers it. Least recently freed first (LAYERSWAP_RECLAIM=oldest) destroys whatever is oldest: on the
//   H200 at batch 4 x 2048 of the 1.1B LoRA at 25% that was often one of the loss's 1000 MiB or 500 MiB segments for an
//   88 MiB activation (a debug log per miss, session 23), and at the next loss the big request swept a dozen small
//   segments to make it again. With LAYERSWAP_RECLAIM=fit (the default) a request reclaims the smallest fenced idle
//   segment that covers what it still lacks, else the largest one, so big segments stay for big requests and fewer
//   segments go per request. The wait for an unfenced one, when no fenced one is left, still takes the oldest (its
//   work is the likeliest to be done). The policy's own reclaims for prefetches keep their order (Note [Slabs last]).
//   Measured against oldest (session 23): 2-5 ms a step less in allocator calls at 4 x 2048, 18% fewer reclaims in full
//   fine-tuning at 10%, steps within the noise: most of the churn is one big request sweeping many small segments.
//
// Note [Slabs last]
//   A prefetch that finds no room reclaims idle segments (reclaim_idle): large ones first, least recently freed
//   first, and slabs only when the large ones do not make the room. A reclaimed slab's pages are released for the
//   prefetch's chunk, and the program soon makes the slab again (pages created, one mapping each, access granted,
//   waiting for the driver's lock while the migration thread remaps), on its own thread; a large idle segment leaves
//   a spare chunk, often of a prefetch's size. On the H200 (1.1B LoRA at 25%, interleaved with the code before it)
//   the policy reclaimed 2.1 segments per step instead of 12.8, the program made 1.3 slabs per step, its allocator
//   calls took 5.9 ms per step instead of 9.3 (segment making 2.0 ms instead of 4.2, mutex waits 2.3 ms instead of
//   2.9), and launches waited no longer for prefetches (2.0 ms per step against 2.4).
//
// Note [Slabs change class]
//   A slab holds blocks of one size class. A request of a class with no slab that has a free block takes an idle slab
//   of another class first (same stream pool, same bytes, no block live or pending), and makes it a slab of its own
//   class: the same pages, still mapped, reused on the stream that freed them (Note [Stream-ordered reuse]), so no
//   driver call and no fence, where a new slab creates pages, maps them and grants access on the program's thread
//   (behind the migration thread's VMM calls), and the idle slab it replaces is destroyed by a later reclaim. The
//   1.1B LoRA frees its ~300 fp32 adapter gradients (128 KiB each, ~20 slabs) at every step's zero_grad and
//   allocates them again at the end of the backward pass; in between, reclaims take those idle slabs (a 2 MiB slab
//   is the smallest idle segment that covers one granule, Note [Reclaim by fit]) and the forward pass's 512 KiB
//   blocks want slabs of their own. On the H100 at 25% (docs/history.md, session 44) the program made 4.1 slabs a
//   step by default (~30 with LAYERSWAP_RESERVE=follow:8, a debug log) and 0.1 with this, ~40 idle slabs a step
//   changing class; its reclaims fell from 11.7 to 4.5 a step. The step was 0.93x and 1.02x the code before's in two
//   calls: the driver calls saved are within the step's noise there.
//
// Locking: one mutex per allocator; public methods take it, *_locked helpers assume it. The residency engine
// runs under the same mutex (its migration thread takes it).
#include "allocator/caching_allocator.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <mutex>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "allocator/region_map.hpp"
#include "allocator/residency_gate.hpp"
#include "allocator/size_classes.hpp"
#include "runtime/config.hpp"
#include "runtime/error.hpp"
#include "runtime/fast_clock.hpp"
#include "runtime/log.hpp"
#include "runtime/spin.hpp"

namespace layerswap {

namespace {

constexpr std::uint32_t k_none = std::numeric_limits<std::uint32_t>::max();

struct segment;
struct stream_pool;

// Note [Split segments]: a range of granules of a large segment, holding one allocation or free.
enum class range_state : std::uint8_t { free, live, pending };  // pending: freed, waiting for other streams
struct split_range {
  std::uint32_t first = 0;  // granules from the segment's start
  std::uint32_t n = 0;      // granules
  std::size_t requested = 0;
  range_state state = range_state::free;
};

// The range of a split segment that starts at granule `first`; ranges.end() when none does.
std::vector<split_range>::iterator range_starting_at(std::vector<split_range>& ranges, std::uint32_t first) {
  return std::find_if(ranges.begin(), ranges.end(), [&](const split_range& r) { return r.first == first; });
}

// Intrusive doubly linked list over segments; `Hook` selects which pair of links.
struct list_hook {
  segment* prev = nullptr;
  segment* next = nullptr;
  bool linked = false;
};

template <list_hook segment::*Hook>
struct segment_list {
  segment* head = nullptr;
  segment* tail = nullptr;

  void push_back(segment* s) noexcept;
  void erase(segment* s) noexcept;
  [[nodiscard]] bool empty() const noexcept { return head == nullptr; }
};

struct segment {
  device_ptr va = 0;
  std::size_t bytes = 0;
  std::vector<phys_handle> pages;  // device pages backing it now (Note [Swappable segments])
  // A composite's chunks in VA order, each with its bytes (Note [Composites]); empty for any other segment.
  std::vector<std::pair<std::size_t, detail::device_chunk>> parts;
  std::size_t n = 0;               // size in granules
  detail::swap_region* swap = nullptr;  // its residency record (large segments, residency enabled)
  stream_pool* pool = nullptr;
  std::uint64_t free_epoch = 0;  // when it last became idle (Note [Unmap fences])
  region_id region = 0;         // its id in the region map (region_map.hpp), given when first published
  bool slab = false;
  bool home = false;  // Note [Home segments]: its VA is its one part's home; destroyed, the chunk stays mapped there

  // large
  bool live = false;  // an allocation (or, split, any range) is live or waits for other streams
  std::size_t requested = 0;
  // Note [Split segments]: the allocations sharing it, by offset, covering it; empty for one allocation or none.
  std::vector<split_range> ranges;
  std::uint32_t split_slot = k_none;  // its index in pool->split while it has ranges

  // slab
  std::uint32_t cls = 0;
  std::size_t block = 0;
  std::uint32_t nblocks = 0;
  std::uint32_t used = 0;  // blocks live or pending (Note [record_stream])
  std::uint32_t free_head = k_none;
  std::vector<std::uint32_t> next_free;     // free list through block indices
  std::vector<std::size_t> requested_of;   // requested bytes of each live block; 0 when free

  list_hook pool_hook;  // large: pool->free_by_pages[npages]; slab: pool->partial[cls]
  list_hook idle_hook;  // impl::idle_: reclaimable (large and free, or a slab with used == 0)

  [[nodiscard]] std::size_t npages() const noexcept { return n; }
};

template <list_hook segment::*Hook>
void segment_list<Hook>::push_back(segment* s) noexcept {
  list_hook& h = s->*Hook;
  h.prev = tail;
  h.next = nullptr;
  h.linked = true;
  if (tail) (tail->*Hook).next = s; else head = s;
  tail = s;
}

template <list_hook segment::*Hook>
void segment_list<Hook>::erase(segment* s) noexcept {
  list_hook& h = s->*Hook;
  if (!h.linked) return;
  if (h.prev) (h.prev->*Hook).next = h.next; else head = h.next;
  if (h.next) (h.next->*Hook).prev = h.prev; else tail = h.prev;
  h = list_hook{};
}

using pool_list = segment_list<&segment::pool_hook>;
// The idle list, with the granules its segments hold: idle_bytes() and obtainable_pages_locked() read the count,
// where a walk over hundreds of segments, every policy round, was most of the round's cache misses.
struct idle_list : segment_list<&segment::idle_hook> {
  std::size_t pages = 0;
  void push_back(segment* s) noexcept {
    if (s->idle_hook.linked) return;
    segment_list::push_back(s);
    pages += s->npages();
  }
  void erase(segment* s) noexcept {
    if (!s->idle_hook.linked) return;
    segment_list::erase(s);
    pages -= s->npages();
  }
};

struct stream_pool {
  stream_handle stream = nullptr;
  std::vector<pool_list> free_by_pages;  // cached large segments, indexed by page count
  std::vector<pool_list> partial;        // slabs with a free block, indexed by size class
  std::vector<segment*> split;           // large segments shared by allocations (Note [Split segments])
};

struct arena {
  device_ptr base = 0;
  std::size_t bytes = 0;
  std::vector<segment*> owner;                   // per granule
  std::map<std::size_t, std::size_t> free_runs;  // first granule -> granule count (slow path only)
  std::unique_ptr<published_arena> published;    // the owner table's image in the region map
  bool homes = false;  // Note [Home segments]: the chunks' home VAs; its free runs are under impl::home_mutex
};

// A segment's VA range whose chunks went to a composite before the GPU was past its last launches (Note
// [Composites]): each mapping is unmapped, and the range released, once its pool's fence covers `free_epoch`. The
// owner table no longer knows it.
struct zombie {
  device_ptr va = 0;
  std::size_t n = 0;  // granules
  stream_pool* pool = nullptr;
  std::uint64_t free_epoch = 0;
  std::vector<std::pair<device_ptr, std::size_t>> maps;  // start and bytes of each mapping
};

struct pending_free {
  segment* seg = nullptr;
  std::uint32_t block = 0;  // slab block index; unused for large segments
  std::vector<event_handle> events;
};

}  // namespace

// Note [Free without a second lock]
//   A free first has to find its allocator (registry.cpp, owner_of: one per device). That used to be owns(), which
//   takes the allocator's mutex, and deallocate() then took it again: two acquisitions per free, the first not
//   counted in the lock-wait statistics. The migration thread holds that mutex for its policy rounds, so under
//   a budget a free could wait twice (seen on the H200 in stack samples of the Llama LoRA benchmark). owner_of now
//   asks in_arena(): is the pointer inside a VA arena this allocator reserved? Arenas are only ever added while the
//   allocator lives (released by its destructor), and each is published in a fixed array of atomics (base, end)
//   before the count that covers it, so a reader that sees the count sees the range. VA ranges of different
//   allocators never overlap, and none of ours can be a pointer of the CUDA runtime's own allocator, so the answer
//   names the right allocator; deallocate() still checks, under its lock, that the pointer is a live block.
//   Arenas beyond k_published_arenas are answered under the mutex, as before. On the H200 (Llama LoRA at 25%) the
//   counted lock waits per step doubled (82 to 150: the waits that hid in owns(), now seen) and the step time did
//   not change beyond the machine's noise: a free still waits once while a policy round holds the mutex.
inline constexpr std::size_t k_published_arenas = 64;

// Note [Waiting for the mutex]
//   The program's allocate and deallocate calls are on its launching thread's critical path (a LoRA step makes one
//   every ~25 us), and the migration thread's policy rounds hold the mutex, 100-150 times per step. A call that
//   found the mutex taken used to sleep in the kernel at once; waking it costs a futex wake and, in a virtual
//   machine, an interrupt to an idle vCPU. So a program call first spins (pause instructions between try_locks) for
//   up to k_lock_spin, longer than a round, and only then sleeps. The migration thread never spins: it is not on the
//   critical path. On the H200 (1.1B LoRA at 25%, three runs against three of the code before, alternating in one
//   call), together with the shorter rounds of Note [Policy rounds] in residency.cpp: 93-103 waits per step taking
//   3.7-3.8 ms in all (90-97 of them ended while spinning), against 145-147 waits taking 9.1-10.2 ms.
inline constexpr std::chrono::microseconds k_lock_spin{200};

// Note [Composites]: the most chunks one composite maps (a mapping each, and each unmapped when it goes).
inline constexpr std::size_t k_most_parts = 32;

struct caching_allocator::impl final : detail::page_source {
  impl(driver& p, allocator_options o);
  ~impl() override;

  // Note [Free without a second lock]: the arenas' VA ranges, readable without the mutex.
  std::array<std::atomic<device_ptr>, k_published_arenas> arena_begin{};
  std::array<std::atomic<device_ptr>, k_published_arenas> arena_end{};
  std::atomic<std::size_t> arenas_published{0};
  std::atomic<bool> arenas_overflow{false};

  driver& port;
  allocator_options options;
  std::size_t gran = 0;
  unsigned gran_shift = 0;
  std::uint32_t small_classes = 0;

  mutable std::mutex mutex;
  std::vector<std::unique_ptr<arena>> arenas;
  // Note [Home segments]: the arena the engine's chunks take their home VAs from (with LAYERSWAP_SPLIT), and the
  // lock of its free runs (the engine takes a home without the mutex).
  arena* home_arena = nullptr;
  std::mutex home_mutex;
  std::vector<std::unique_ptr<stream_pool>> pools;
  stream_pool* last_pool = nullptr;
  std::unordered_set<segment*> segments;
  idle_list idle;
  std::vector<phys_handle> idle_pages;  // unmapped, no pending work, counted in device_bytes
  // Note [Split bound]: the granules in free ranges of split segments, and the largest segment (granules) that a
  // request of `npages` may take whole and split within options.split_free (0: none; the maximum: no bound).
  std::size_t split_free_pages = 0;
  [[nodiscard]] std::size_t split_whole_most_locked(std::size_t npages) const noexcept {
    constexpr std::size_t none = std::numeric_limits<std::size_t>::max();
    const std::size_t bound = by_reserve_locked(options.split_free, options.split_free_peak);
    if (options.budget == 0 || bound == none) return none;
    const std::size_t cap = bound >> gran_shift;
    return split_free_pages > cap ? 0 : npages + (cap - split_free_pages);
  }
  // Note [Splits by reserve]: whether the reserve for activations follows the step, and the most times its size a
  // segment may be that a request takes a range of (LAYERSWAP_SPLIT).
  [[nodiscard]] bool following_locked() const noexcept { return engine && engine->follows_step_locked(); }
  // A setting given as "F/P": `follow` while the reserve follows the step, else `peak` where set (Notes [Splits by
  // reserve], [Split bound]).
  [[nodiscard]] std::size_t by_reserve_locked(std::size_t follow,
                                              const std::optional<std::size_t>& peak) const noexcept {
    return following_locked() ? follow : peak.value_or(follow);
  }
  [[nodiscard]] std::size_t split_ratio_locked() const noexcept {
    return by_reserve_locked(options.split, options.split_peak);
  }
  std::vector<pending_free> pending;
  std::unordered_map<device_ptr, std::vector<stream_handle>> recorded;
  std::vector<event_handle> spare_events;
  std::uint64_t epoch = 0;
  // Note [Unmap fences]: every segment idle at or before `fenced_epoch` is fenced; `idle_epoch` is the newest
  // free epoch of a segment that went idle. The asynchronous fence in flight: events on every stream, recorded at
  // `fence_epoch` (empty: none); once they have all completed, fenced_epoch catches up with it.
  std::uint64_t fenced_epoch = 0;
  std::uint64_t idle_epoch = 0;
  std::vector<event_handle> fence_events;
  std::uint64_t fence_epoch = 0;
  // Whether start_fences_locked() may find a segment to fence: set when a segment goes idle or a fence completes
  // (the only ways one can need a fence); the migration thread's housekeeping runs every round, and the idle list
  // is long.
  bool fences_wanted = true;
  std::unique_ptr<detail::residency_engine> engine;  // null unless options.residency.enabled
  std::vector<segment*> retiring;  // freed host-backed segments (Note [Swappable segments])
  std::vector<zombie> zombies;  // Note [Composites]

  allocator_stats st;

  // ---- detail::page_source (the engine's view; mutex held) ----
  bool take_pages(std::size_t n, std::vector<phys_handle>& out) override;
  void give_pages(std::vector<phys_handle>& pages) override;
  bool take_room(std::size_t n) override;
  void give_room(std::size_t n) override;
  [[nodiscard]] std::size_t budget() const override { return options.budget; }
  [[nodiscard]] std::size_t held_bytes() const override { return static_cast<std::size_t>(st.device_bytes.current); }
  [[nodiscard]] std::size_t pooled_bytes() const override { return idle_pages.size() * gran; }
  [[nodiscard]] std::size_t idle_bytes() const override;
  void reclaim_idle(std::size_t n) override;
  bool reclaim_idle_sized(std::size_t bytes) override;
  void maintain() override;
  device_ptr take_home_va(std::size_t bytes) override;
  bool give_home_va(device_ptr va, std::size_t bytes) override;
  void start_engine_if_needed();
  // The mutex, for the program's allocate/deallocate: counts the calls that had to wait for it (the migration
  // thread holds it for its rounds) and how long.
  // allocate/deallocate: the time from before the lock to the end of the call, counted with the lock still held
  // (declare it after the lock, so that it is destroyed first).
  // In fast-clock ticks (runtime/fast_clock.hpp): two clock reads per call, ~14,000 per LoRA step.
  struct call_timer {
    impl& m;
    std::uint64_t start;
    ~call_timer() {
      ++m.st.num_calls;
      m.call_ticks += fast_clock::ticks() - start;
    }
  };
  std::uint64_t call_ticks = 0;  // allocator_stats::call_ns, in ticks (stats() converts)
  // Note [Waiting for the mutex]: spins before it sleeps.
  std::unique_lock<std::mutex> lock_counted() {
    std::unique_lock lock(mutex, std::try_to_lock);
    if (lock.owns_lock()) return lock;
    const auto start = std::chrono::steady_clock::now();
    bool spun = false;
    for (unsigned round = 0; !spun; ++round) {
      for (int i = 0; i < 16; ++i) cpu_relax();
      spun = lock.try_lock();
      if (!spun && round % 16 == 15 && std::chrono::steady_clock::now() - start > k_lock_spin) break;
    }
    if (!spun) lock.lock();
    ++st.num_lock_waits;
    if (spun) ++st.num_lock_spins;
    st.lock_wait_us += elapsed_us(start);
    return lock;
  }

  // ---- helpers, all *_locked ----
  stream_pool* pool_for_locked(stream_handle stream);
  const arena* arena_of_locked(device_ptr p) const noexcept;  // the arena whose VA holds p, or nullptr
  segment* owner_locked(device_ptr p) const noexcept;
  void* allocate_small_locked(std::size_t bytes, stream_pool* pool);
  void* allocate_large_locked(std::size_t bytes, stream_pool* pool);
  segment* new_segment_locked(stream_pool* pool, std::size_t bytes, std::size_t request);
  segment* new_chunk_segment_locked(stream_pool* pool, std::size_t bytes, std::size_t request);
  std::vector<phys_handle> gather_pages_locked(std::size_t n, std::size_t request);
  detail::device_chunk gather_chunk_locked(std::size_t n, std::size_t request, bool miss_noted = false);
  // `want`: the granules the request still lacks (Note [Reclaim by fit]); 0: unknown.
  bool free_some_locked(bool& retried, std::size_t want = 0);
  bool room_for_new_locked(std::size_t n) const noexcept;  // a new segment of n pages fits without reclaiming
  std::size_t obtainable_pages_locked() const noexcept;  // pooled + idle segments + budget headroom
  // Pages a request can have without reclaiming or evicting: pooled ones and the budget's headroom (none without one).
  [[nodiscard]] std::size_t unused_pages_locked() const noexcept {
    const auto held = static_cast<std::size_t>(st.device_bytes.current);
    return idle_pages.size() + (options.budget > held ? (options.budget - held) >> gran_shift : 0);
  }
  // A new segment's record: `pages` (none for a chunk) mapped at `va`, owned by `pool`, known to the owner table.
  segment* add_segment_locked(stream_pool* pool, device_ptr va, std::size_t bytes, std::vector<phys_handle> pages);
  void release_idle_pages_locked();
  bool reclaim_one_locked(std::size_t want = 0);
  // reclaim_one_locked() without a host wait: false when no idle segment is fenced.
  bool reclaim_fenced_locked(std::size_t want = 0);
  // Pages a new large segment could have now without a host wait: pooled pages, the budget's headroom, spare chunks.
  [[nodiscard]] std::size_t room_now_locked() const noexcept {
    return unused_pages_locked() + (engine ? engine->spare_pages_locked() : 0);
  }
  // Note [Composites]
  segment* compose_locked(stream_pool* pool, std::size_t n);
  // Note [Spare composites]: a new large segment of `n` granules on `pool` from spare chunks; nullptr: not here.
  segment* compose_spares_locked(stream_pool* pool, std::size_t n);
  [[nodiscard]] bool donor_locked(const segment* seg, const stream_pool* pool) const noexcept;
  void retire_donor_locked(segment* seg, std::vector<std::pair<std::size_t, detail::device_chunk>>& parts);
  void reap_zombies_locked();       // unmaps the zombies whose pool's fence covers them
  // Notes [Composites], [Spare composites]: a new VA of `total` granules with `parts` mapped side by side, in order,
  // and access granted. When a driver call fails, what it mapped is unmapped and the VA released before the error
  // goes on; the parts stay the caller's.
  device_ptr map_parts_locked(const std::vector<std::pair<std::size_t, detail::device_chunk>>& parts,
                              std::size_t total);
  // Unmaps the first `count` parts of a composite laid out from `va` (all of them by default).
  void unmap_parts_locked(device_ptr va, const std::vector<std::pair<std::size_t, detail::device_chunk>>& parts,
                          std::size_t count = SIZE_MAX);
  // Note [Unmap fences]: events recorded on every stream launches may use, appended to `out`.
  void record_fence_locked(std::vector<event_handle>& out);
  void fence_all_locked();  // a host wait for everything enqueued on every stream
  void fence_locked(segment* seg);
  void poll_fences_locked();
  void start_fences_locked();
  // An idle segment that can be destroyed without a host wait: fenced (Note [Unmap fences]) and not moving (a
  // cancelled move still in flight, Note [Freeing a moved region]).
  [[nodiscard]] bool reclaimable_now_locked(const segment* seg) const noexcept {
    return seg->free_epoch <= fenced_epoch && !(seg->swap && engine->moving_locked(seg->swap));
  }
  void destroy_segment_locked(segment* seg);
  device_ptr reserve_va_locked(std::size_t npages);
  arena& add_arena_locked(std::size_t bytes);  // a new VA reservation, published for frees
  // Note [Home segments]: a segment of `pool` at the home VA of the engine's smallest spare chunk of `lo`..`hi`
  // bytes whose home lies in the arena of homes, holding that chunk; nullptr: no such spare.
  segment* home_segment_locked(stream_pool* pool, std::size_t lo, std::size_t hi);
  // Note [Slabs change class]
  segment* idle_slab_locked(const stream_pool* pool, std::size_t bytes) const noexcept;
  [[nodiscard]] bool homes_on() const noexcept { return home_arena != nullptr; }
  void release_va_locked(device_ptr va, std::size_t npages);
  // The first free run of `a` with `npages` granules, taken (0: none), and a range given back to a's free runs,
  // joining its neighbours (the mutex held, or home_mutex for the arena of homes).
  device_ptr take_run(arena& a, std::size_t npages) const;
  void free_run(arena& a, device_ptr va, std::size_t npages) const;
  void set_owner_locked(device_ptr va, std::size_t npages, segment* seg);
  void release_block_locked(segment* seg, std::uint32_t block);
  // Note [Split segments]
  struct range_pick {
    segment* seg;
    std::size_t index;
    std::size_t n;
  };
  [[nodiscard]] range_pick smallest_free_range_locked(const stream_pool* pool, std::size_t npages) const;
  void* allocate_split_locked(std::size_t bytes, std::size_t npages, stream_pool* pool) {
    return allocate_split_locked(bytes, npages, pool, smallest_free_range_locked(pool, npages));
  }
  // ... with `best`, the pool's smallest free range that holds the request, already looked up.
  void* allocate_split_locked(std::size_t bytes, std::size_t npages, stream_pool* pool, range_pick best);
  void* allocate_spare_split_locked(std::size_t bytes, std::size_t npages, stream_pool* pool, bool homes_only);
  // The request's range from `seg`: its free range `index`, or, `whole`, the idle segment split for the first time.
  void* take_range_locked(segment* seg, std::size_t index, bool whole, std::size_t bytes, std::size_t npages);
  void note_new_large_locked(segment* seg);
  [[nodiscard]] bool splittable_locked(const segment* seg) const noexcept;
  void release_range_locked(segment* seg, std::uint32_t first);
  void cache_large_locked(segment* seg);  // a large segment with nothing live: cached, or retired if host-backed
  void log_cache_miss_locked(const stream_pool* pool, std::size_t bytes) const;
  // LAYERSWAP_LOG=debug, with residency: the program makes a `what` ("chunk", "slab") of `made` bytes for a request of
  // `bytes`, and the room, idle cache and engine state it met.
  void log_program_makes_locked(const char* what, std::size_t made, std::size_t bytes) const;
  void make_idle_locked(segment* seg);
  void process_pending_locked(bool wait);
  event_handle take_event_locked();
  [[noreturn]] void throw_oom_locked(std::size_t request);
  // Adds `delta` to one statistic of the small or large pool and, unless it is a move between the pools,
  // to the aggregate.
  void count(bool slab, stat pool_stats::*field, std::int64_t delta, bool aggregate = true) noexcept {
    pool_stats& pool = slab ? st.small : st.large;
    apply(pool.*field, delta);
    if (aggregate) apply(st.all.*field, delta);
  }
  static void apply(stat& s, std::int64_t delta) noexcept {
    if (delta >= 0) s.increase(delta); else s.decrease(-delta);
  }
};

caching_allocator::impl::impl(driver& p, allocator_options o) : port(p), options(o) {
  gran = port.granularity();
  if (gran == 0 || !std::has_single_bit(gran)) {
    throw error("layerswap: the device reports a mapping granularity of " + std::to_string(gran) +
                " bytes; layerswap needs a power of two");
  }
  gran_shift = static_cast<unsigned>(std::countr_zero(gran));
  options.small_max = std::min(options.small_max, gran / 2);
  small_classes = size_class_count(options.small_max);
  options.va_reserve = std::max(options.va_reserve, gran) / gran * gran;
  st.device = port.device();
  st.budget = options.budget;
  if (const char* v = std::getenv("LSDEV_SPARE_COMPOSITES")) options.spare_composites = std::string_view(v) != "0";
  st.granularity = gran;
  if (options.residency.enabled) {
    engine = std::make_unique<detail::residency_engine>(port, mutex, *this, options.residency);
    if (options.split > 1) {  // Note [Home segments]
      const std::lock_guard lock(mutex);
      home_arena = &add_arena_locked(options.va_reserve);
      home_arena->homes = true;
    }
    start_engine_if_needed();
  }
}

void caching_allocator::impl::start_engine_if_needed() {
  if (engine && options.budget) engine->start();  // the thread only has work under a budget
}

caching_allocator::impl::~impl() {
  // Callers are gone: wait for the streams, then give everything back. Never throws.
  if (engine) engine->stop();
  try {
    if (engine) engine->settle_all_locked();
    process_pending_locked(true);
    if (!zombies.empty()) fence_all_locked();
    for (segment* seg : std::vector<segment*>(segments.begin(), segments.end())) {
      fence_locked(seg);
      destroy_segment_locked(seg);
    }
    for (phys_handle h : idle_pages) port.release(h);
    idle_pages.clear();
    engine.reset();
    spare_events.insert(spare_events.end(), fence_events.begin(), fence_events.end());
    fence_events.clear();
    for (auto& a : arenas) port.unreserve(a->base, a->bytes);
    for (event_handle e : spare_events) port.destroy_event(e);
  } catch (const std::exception& e) {
    LAYERSWAP_LOG(warn, "releasing device %d memory at shutdown failed: %s", st.device, e.what());
  }
}

stream_pool* caching_allocator::impl::pool_for_locked(stream_handle stream) {
  if (last_pool && last_pool->stream == stream) return last_pool;
  for (auto& p : pools) {
    if (p->stream == stream) return last_pool = p.get();
  }
  auto p = std::make_unique<stream_pool>();
  p->stream = stream;
  p->partial.resize(small_classes);
  if (engine) engine->note_stream_locked(stream);
  pools.push_back(std::move(p));
  return last_pool = pools.back().get();
}

const arena* caching_allocator::impl::arena_of_locked(device_ptr p) const noexcept {
  for (const auto& a : arenas) {
    if (p >= a->base && p - a->base < a->bytes) return a.get();
  }
  return nullptr;
}

segment* caching_allocator::impl::owner_locked(device_ptr p) const noexcept {
  const arena* a = arena_of_locked(p);
  return a ? a->owner[(p - a->base) >> gran_shift] : nullptr;
}

event_handle caching_allocator::impl::take_event_locked() {
  if (!spare_events.empty()) {
    event_handle e = spare_events.back();
    spare_events.pop_back();
    return e;
  }
  return port.create_event();
}

// ---- VA arenas ----

device_ptr caching_allocator::impl::reserve_va_locked(std::size_t npages) {
  for (auto& a : arenas) {
    if (a->homes) continue;  // Note [Home segments]: the engine's
    if (const device_ptr va = take_run(*a, npages)) return va;
  }
  return take_run(add_arena_locked(std::max(options.va_reserve, npages << gran_shift)), npages);
}

arena& caching_allocator::impl::add_arena_locked(std::size_t bytes) {
  auto a = std::make_unique<arena>();
  a->base = port.reserve(bytes, gran);
  a->bytes = bytes;
  a->owner.assign(bytes >> gran_shift, nullptr);
  a->published = std::make_unique<published_arena>(a->base, bytes, gran_shift);
  a->free_runs.emplace(0, bytes >> gran_shift);
  LAYERSWAP_LOG(info, "device %d: reserved a %s virtual address arena", st.device, format_bytes(bytes).c_str());
  arenas.push_back(std::move(a));
  arena& added = *arenas.back();
  if (const std::size_t n = arenas_published.load(std::memory_order_relaxed); n < k_published_arenas) {
    arena_begin[n].store(added.base, std::memory_order_relaxed);
    arena_end[n].store(added.base + added.bytes, std::memory_order_relaxed);
    arenas_published.store(n + 1, std::memory_order_release);  // Note [Free without a second lock]
  } else {
    arenas_overflow.store(true, std::memory_order_release);
  }
  return added;
}

// Note [Home segments]: the engine's chunks take their home VAs here, first fit, without the allocator's mutex.
device_ptr caching_allocator::impl::take_home_va(std::size_t bytes) {
  if (!home_arena || bytes % gran != 0) return 0;
  const std::lock_guard lock(home_mutex);
  return take_run(*home_arena, bytes >> gran_shift);  // 0 when full: the engine reserves its own
}

bool caching_allocator::impl::give_home_va(device_ptr va, std::size_t bytes) {
  if (!home_arena || va < home_arena->base || va - home_arena->base >= home_arena->bytes) return false;
  const std::lock_guard lock(home_mutex);
  free_run(*home_arena, va, bytes >> gran_shift);
  return true;
}

void caching_allocator::impl::release_va_locked(device_ptr va, std::size_t npages) {
  for (auto& a : arenas) {
    if (a->homes || va < a->base || va - a->base >= a->bytes) continue;
    free_run(*a, va, npages);
    return;
  }
}

device_ptr caching_allocator::impl::take_run(arena& a, std::size_t npages) const {
  for (auto it = a.free_runs.begin(); it != a.free_runs.end(); ++it) {
    if (it->second < npages) continue;
    const std::size_t first = it->first, left = it->second - npages;
    a.free_runs.erase(it);
    if (left) a.free_runs.emplace(first + npages, left);
    return a.base + (first << gran_shift);
  }
  return 0;
}

void caching_allocator::impl::free_run(arena& a, device_ptr va, std::size_t npages) const {
  std::size_t first = (va - a.base) >> gran_shift;
  std::size_t count = npages;
  auto next = a.free_runs.lower_bound(first);
  if (next != a.free_runs.end() && next->first == first + count) {  // merge with the following run
    count += next->second;
    next = a.free_runs.erase(next);
  }
  if (next != a.free_runs.begin()) {  // merge with the preceding run
    auto prev = std::prev(next);
    if (prev->first + prev->second == first) {
      first = prev->first;
      count += prev->second;
      a.free_runs.erase(prev);
    }
  }
  a.free_runs.emplace(first, count);
}

void caching_allocator::impl::set_owner_locked(device_ptr va, std::size_t npages, segment* seg) {
  for (auto& a : arenas) {
    if (va < a->base || va - a->base >= a->bytes) continue;
    const std::size_t first = (va - a->base) >> gran_shift;
    std::fill_n(a->owner.begin() + static_cast<std::ptrdiff_t>(first), npages, seg);
    if (seg && seg->region == 0) {
      seg->region = region_map::next_region_id();
      residency_gate::prepare(seg->region);
    }
    a->published->publish(first, npages, seg ? seg->region : 0);
    return;
  }
}

// ---- pages and segments ----

std::size_t caching_allocator::impl::obtainable_pages_locked() const noexcept {
  std::size_t pages = unused_pages_locked() + idle.pages;  // idle segments' pages or chunks
  // Pages of resident swappable regions, and pages taken by prefetches in flight: settling a prefetch of a freed
  // region returns them, and a completed one makes its region evictable. The engine's spare chunks.
  if (engine) {
    pages += engine->evictable_pages_locked() + engine->inflight_pages_locked() + engine->spare_pages_locked();
  }
  return pages;
}

std::vector<phys_handle> caching_allocator::impl::gather_pages_locked(std::size_t n, std::size_t request) {
  if (options.budget && n > unused_pages_locked()) {
    // Not enough without reclaiming: fail before creating anything when even the whole cache is too small.
    if (n > obtainable_pages_locked() && !pending.empty()) process_pending_locked(true);
    if (n > obtainable_pages_locked()) throw_oom_locked(request);
  }
  std::vector<phys_handle> out;
  out.reserve(n);
  bool retried = false;
  auto give_back = [&] {
    idle_pages.insert(idle_pages.end(), out.begin(), out.end());
    out.clear();
  };
  while (out.size() < n) {
    if (!idle_pages.empty()) {
      out.push_back(idle_pages.back());
      idle_pages.pop_back();
      continue;
    }
    const bool under_budget =
        options.budget == 0 || static_cast<std::size_t>(st.device_bytes.current) + gran <= options.budget;
    if (under_budget) {
      try {
        out.push_back(port.create(gran, memory_location::device));
        st.device_bytes.increase(static_cast<std::int64_t>(gran));
        count(false, &pool_stats::reserved_bytes, static_cast<std::int64_t>(gran));  // a new page starts pooled
        ++st.num_device_alloc;
        continue;
      } catch (const device_out_of_memory&) {
        // The device is full (other allocations, other processes): fall back to our own cache.
      } catch (...) {
        give_back();
        throw;
      }
    }
    // The engine's spare chunks are free memory (residency.cpp, Note [Chunks]): to the budget before anything.
    if (engine && engine->release_spare_locked(n - out.size()) != 0) continue;
    // Pages `out` already holds stay with this request while the cache is reclaimed or a region evicted.
    if (free_some_locked(retried, n - out.size())) continue;
    give_back();
    throw_oom_locked(request);
  }
  return out;
}

// One rung of what a request that does not fit climbs: the blocks freed on other streams, then the idle cache,
// fenced ones first, by Note [Reclaim by fit] (waiting for the other streams' blocks if that is what is left), then a
// synchronous eviction (Note [Allocation under pressure] in residency.cpp). True when it freed something, so the
// request tries again; false when nothing is left (out of memory). `retried` counts the request once in
// num_alloc_retries.
bool caching_allocator::impl::free_some_locked(bool& retried, std::size_t want) {
  if (!retried) {
    retried = true;
    ++st.num_alloc_retries;
    if (!pending.empty()) process_pending_locked(false);
  }
  if (reclaim_one_locked(want)) return true;
  if (!pending.empty()) {  // blocks waiting on other streams: wait for them, then try again
    process_pending_locked(true);
    if (reclaim_one_locked(want)) return true;
  }
  if (!engine) return false;
  const auto start = std::chrono::steady_clock::now();
  const bool evicted = engine->evict_sync_locked();
  const std::int64_t us = elapsed_us(start);
  st.stall_us += us;
  st.host_wait_us += us;
  return evicted;
}

// Whether a new segment of `n` pages can be had without reclaiming the cache or evicting: a spare chunk of its size
// (residency), else pooled pages and the budget's headroom.
bool caching_allocator::impl::room_for_new_locked(std::size_t n) const noexcept {
  if (options.budget == 0) return true;
  if (engine && engine->has_spare_locked(n << gran_shift)) return true;
  return unused_pages_locked() >= n;
}

segment* caching_allocator::impl::new_segment_locked(stream_pool* pool, std::size_t bytes, std::size_t request) {
  const auto start = std::chrono::steady_clock::now();
  const std::int64_t waits = st.num_host_waits;
  const std::size_t n = bytes >> gran_shift;
  std::vector<phys_handle> pages = gather_pages_locked(n, request);
  device_ptr va = 0;
  std::size_t mapped = 0;
  try {
    va = reserve_va_locked(n);
    for (; mapped < n; ++mapped) port.map(va + (mapped << gran_shift), gran, pages[mapped], 0);
    port.set_access(va, bytes);
  } catch (...) {
    for (std::size_t i = 0; i < mapped; ++i) {
      try {
        port.unmap(va + (i << gran_shift), gran);
      } catch (...) {
      }
    }
    if (va) release_va_locked(va, n);
    idle_pages.insert(idle_pages.end(), pages.begin(), pages.end());
    throw;
  }
  segment* s = add_segment_locked(pool, va, bytes, std::move(pages));
  st.segment_new_ns += elapsed_ns(start);
  if (st.num_host_waits != waits) {
    LAYERSWAP_LOG(debug, "device %d: a new %s of pages (%s) waited for the GPU", st.device, format_bytes(bytes).c_str(),
                  format_bytes(request).c_str());
  }
  return s;
}

segment* caching_allocator::impl::add_segment_locked(stream_pool* pool, device_ptr va, std::size_t bytes,
                                                     std::vector<phys_handle> pages) {
  auto seg = std::make_unique<segment>();
  seg->va = va;
  seg->bytes = bytes;
  seg->n = bytes >> gran_shift;
  seg->pages = std::move(pages);
  seg->pool = pool;
  segment* s = seg.release();
  segments.insert(s);
  set_owner_locked(va, s->n, s);
  return s;
}

// Note [Chunks] (residency.cpp): with the residency engine, a large segment is one physical allocation (a chunk),
// mapped in one call: VMM calls cost per mapping, and under a tight budget segments come and go every step.
segment* caching_allocator::impl::new_chunk_segment_locked(stream_pool* pool, std::size_t bytes, std::size_t request) {
  const auto start = std::chrono::steady_clock::now();
  const std::size_t n = bytes >> gran_shift;
  const std::int64_t waits = st.num_host_waits;
  bool miss_noted = false;
  if (options.composites && options.budget && !engine->has_spare_locked(bytes)) {  // Note [Composites]
    if (room_now_locked() < n && idle.head) {  // as gather_chunk_locked() would note it
      engine->note_cache_miss_locked(bytes);
      miss_noted = true;
    }
    while (room_now_locked() < n && reclaim_fenced_locked(n - room_now_locked())) {
    }
    if (room_now_locked() < n) {
      if (segment* s = compose_locked(pool, n)) {
        st.segment_new_ns += elapsed_ns(start);
        return s;
      }
    }
  }
  const detail::device_chunk chunk = gather_chunk_locked(n, request, miss_noted);
  device_ptr va = 0;
  bool mapped = false;
  try {
    va = reserve_va_locked(n);
    port.map(va, bytes, chunk.handle, 0);
    mapped = true;
    port.set_access(va, bytes);
  } catch (...) {
    try {
      if (mapped) port.unmap(va, bytes);
    } catch (...) {
    }
    if (va) release_va_locked(va, n);
    engine->give_chunk_locked(bytes, chunk);
    throw;
  }
  segment* s = add_segment_locked(pool, va, bytes, {});
  s->swap = engine->add_locked(s->region, va, bytes, chunk);
  st.segment_new_ns += elapsed_ns(start);
  if (st.num_host_waits != waits) {
    LAYERSWAP_LOG(debug, "device %d: a new segment of %s waited for the GPU", st.device, format_bytes(bytes).c_str());
  }
  return s;
}

// A chunk of `n` pages for a new large segment: a spare one of its size or a new one within the budget (the engine),
// else the cache reclaimed, else a synchronous eviction, as gather_pages_locked does for pages.
detail::device_chunk caching_allocator::impl::gather_chunk_locked(std::size_t n, std::size_t request, bool miss_noted) {
  if (options.budget && n > obtainable_pages_locked()) {
    if (!pending.empty()) process_pending_locked(true);
    if (n > obtainable_pages_locked()) throw_oom_locked(request);
  }
  bool retried = false;
  for (;;) {
    if (detail::device_chunk c = engine->take_chunk_locked(n << gran_shift)) return c;
    // The cache holds segments, none of this size (allocate_large_locked looked), and the budget has no room for
    // a new one beside them: the policy should leave the cache more (residency.cpp, Note [Cache reserve]).
    if (!retried && !miss_noted && idle.head) engine->note_cache_miss_locked(n << gran_shift);
    // A reclaimed segment's pages join the pool, its chunk (or an evicted region's) the spares: room either way.
    const std::size_t room = room_now_locked();
    if (!free_some_locked(retried, n > room ? n - room : 1)) throw_oom_locked(request);
  }
}

// Note [Composites]: an idle large segment of `pool` whose chunks a composite may take: device-backed and not
// moving, or a composite itself (splittable_locked).
bool caching_allocator::impl::donor_locked(const segment* seg, const stream_pool* pool) const noexcept {
  return !seg->live && !seg->home && seg->pool == pool && splittable_locked(seg);
}

// A new large segment of `n` granules on `pool` from the chunks of idle segments of the same pool, freed perhaps
// moments before, with no host wait; a new chunk for what they do not cover, from the room there is. Null when
// the pool's idle segments cannot make it within n .. n + n/8 granules (the caller goes the ordinary way).
segment* caching_allocator::impl::compose_locked(stream_pool* pool, std::size_t n) {
  const std::size_t room = room_now_locked();
  const std::size_t need = n - std::min(n, room);  // granules the donors must give at least
  const std::size_t most = n + n / 8;               // ... and at most: the cache's own tolerance for a fit
  std::vector<segment*> cands;
  for (segment* seg = idle.head; seg; seg = seg->idle_hook.next) {
    if (donor_locked(seg, pool)) cands.push_back(seg);
  }
  // Largest first: the fewest parts (a mapping each). Ties keep the idle list's order (least recently freed).
  std::stable_sort(cands.begin(), cands.end(), [](const segment* a, const segment* b) { return a->n > b->n; });
  std::vector<segment*> take;
  std::size_t sum = 0, nparts = 0;
  for (segment* seg : cands) {
    if (sum >= n) break;
    const std::size_t parts = seg->parts.empty() ? 1 : seg->parts.size();
    if (sum + seg->n > most || nparts + parts > k_most_parts - 1) continue;  // one part left for the rest
    take.push_back(seg);
    sum += seg->n;
    nparts += parts;
  }
  if (take.empty() || sum < need) {
    std::size_t idle_pool = 0;
    if (log_enabled(log_level::debug)) {
      for (const segment* seg : cands) idle_pool += seg->n;
    }
    LAYERSWAP_LOG(debug, "device %d: no composite for %s: the stream's %zu idle segments hold %s, %s taken of %s needed",
                  st.device, format_bytes(n << gran_shift).c_str(), cands.size(),
                  format_bytes(idle_pool << gran_shift).c_str(), format_bytes(sum << gran_shift).c_str(),
                  format_bytes(need << gran_shift).c_str());
    return nullptr;
  }
  const std::size_t rest = sum < n ? n - sum : 0;
  detail::device_chunk extra;  // first, so that nothing has changed when there is no room for it
  if (rest != 0) {
    extra = engine->take_chunk_locked(rest << gran_shift);
    if (!extra) return nullptr;
  }
  std::vector<std::pair<std::size_t, detail::device_chunk>> parts;
  for (segment* seg : take) retire_donor_locked(seg, parts);
  if (extra) parts.emplace_back(rest << gran_shift, extra);
  fences_wanted = true;  // the zombies want their fence
  const std::size_t total = std::max(sum, n);
  device_ptr va = 0;
  try {
    va = map_parts_locked(parts, total);
  } catch (...) {
    // The parts may still be mapped at their zombies, used by queued work: they become spares only once the GPU
    // is past it (a host wait, on a path the driver failed on).
    try {
      fence_all_locked();
      for (const auto& [bytes, chunk] : parts) engine->give_chunk_locked(bytes, chunk);
    } catch (...) {
    }
    throw;
  }
  segment* s = add_segment_locked(pool, va, total << gran_shift, {});
  s->parts = std::move(parts);
  ++st.num_composites;
  st.composite_donors += static_cast<std::int64_t>(take.size());
  return s;
}

// Note [Spare composites]
segment* caching_allocator::impl::compose_spares_locked(stream_pool* pool, std::size_t n) {
  if (!options.spare_composites || !options.budget || !following_locked()) return nullptr;
  const std::size_t room = unused_pages_locked();
  if (room >= n || engine->has_spare_locked(n << gran_shift)) return nullptr;  // no spare would be released
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::pair<std::size_t, detail::device_chunk>> parts =
      engine->take_spares_locked(n << gran_shift, (n + n / 8) << gran_shift, k_most_parts - 1, room << gran_shift);
  if (parts.empty()) return nullptr;
  const auto give_back = [&] {
    for (const auto& [bytes, chunk] : parts) engine->give_chunk_locked(bytes, chunk);
  };
  std::size_t sum = 0;
  for (const auto& part : parts) sum += part.first >> gran_shift;
  if (sum < n) {  // the rest from the budget's headroom: a new chunk, no spare released
    detail::device_chunk rest;
    try {
      rest = engine->take_chunk_locked((n - sum) << gran_shift);
    } catch (...) {
      give_back();
      throw;
    }
    if (!rest) {
      give_back();
      return nullptr;
    }
    parts.emplace_back((n - sum) << gran_shift, rest);
    sum = n;
  }
  device_ptr va = 0;
  try {
    va = map_parts_locked(parts, sum);
  } catch (...) {
    give_back();  // nothing was enqueued at that VA: the chunks are spares again at once
    throw;
  }
  segment* s = add_segment_locked(pool, va, sum << gran_shift, {});
  s->parts = std::move(parts);
  ++st.num_spare_composites;
  st.spare_composite_parts += static_cast<std::int64_t>(s->parts.size());
  st.segment_new_ns += elapsed_ns(start);
  return s;
}

// Notes [Composites], [Spare composites]
device_ptr caching_allocator::impl::map_parts_locked(
    const std::vector<std::pair<std::size_t, detail::device_chunk>>& parts, std::size_t total) {
  device_ptr va = 0;
  std::size_t mapped = 0;
  try {
    va = reserve_va_locked(total);
    std::size_t off = 0;
    for (; mapped < parts.size(); ++mapped) {
      port.map(va + off, parts[mapped].first, parts[mapped].second.handle, 0);
      off += parts[mapped].first;
    }
    port.set_access(va, total << gran_shift);
  } catch (...) {
    try {
      unmap_parts_locked(va, parts, mapped);
      if (va) release_va_locked(va, total);
    } catch (...) {
    }
    throw;
  }
  return va;
}

// Note [Composites]: the donor's chunks join `parts`; its VA, still mapped, becomes a zombie; the segment is gone.
void caching_allocator::impl::retire_donor_locked(segment* seg,
                                                 std::vector<std::pair<std::size_t, detail::device_chunk>>& parts) {
  seg->pool->free_by_pages[seg->npages()].erase(seg);
  idle.erase(seg);
  zombie z{seg->va, seg->n, seg->pool, seg->free_epoch, {}};
  if (seg->parts.empty()) {
    parts.emplace_back(seg->bytes, engine->detach_locked(seg->swap));
    seg->swap = nullptr;
    z.maps.emplace_back(seg->va, seg->bytes);
  } else {
    std::size_t off = 0;
    for (const auto& part : seg->parts) {
      z.maps.emplace_back(seg->va + off, part.first);
      off += part.first;
      parts.push_back(part);
    }
  }
  set_owner_locked(seg->va, seg->n, nullptr);  // the VA stays reserved until the zombie is reaped
  count(false, &pool_stats::segments, -1);
  segments.erase(seg);
  delete seg;
  zombies.push_back(std::move(z));
}

void caching_allocator::impl::unmap_parts_locked(device_ptr va,
                                                 const std::vector<std::pair<std::size_t, detail::device_chunk>>& parts,
                                                 std::size_t count) {
  for (std::size_t i = 0; i < parts.size() && i < count; ++i) {
    port.unmap(va, parts[i].first);
    va += parts[i].first;
  }
}

void caching_allocator::impl::reap_zombies_locked() {
  std::size_t kept = 0;
  for (std::size_t i = 0; i < zombies.size(); ++i) {
    zombie& z = zombies[i];
    if (z.free_epoch <= fenced_epoch) {
      for (const auto& [va, bytes] : z.maps) port.unmap(va, bytes);
      release_va_locked(z.va, z.n);
      ++st.num_zombies_reaped;
      continue;
    }
    if (kept != i) zombies[kept] = std::move(z);
    ++kept;
  }
  zombies.resize(kept);
}

void caching_allocator::impl::record_fence_locked(std::vector<event_handle>& out) {
  std::vector<stream_handle> known{nullptr};  // the legacy stream, which waits for every blocking stream
  for (const auto& pool : pools) {
    if (std::find(known.begin(), known.end(), pool->stream) == known.end()) known.push_back(pool->stream);
  }
  const auto record_on = [&](stream_handle s) {
    event_handle e = take_event_locked();
    out.push_back(e);
    port.record(e, s);
  };
  for (stream_handle s : known) record_on(s);
  // Read now, after the segments went idle: a stream with launches before then is in the table (Note [Launch
  // streams]); one being destroyed meanwhile waits for its visit to end.
  residency_gate::for_each_stream_besides(port.context_id(), known, record_on);
}

void caching_allocator::impl::fence_all_locked() {
  const std::uint64_t now = epoch;
  std::vector<event_handle> events;
  try {
    record_fence_locked(events);
  } catch (...) {
    spare_events.insert(spare_events.end(), events.begin(), events.end());
    throw;
  }
  if (engine) engine->release_holds_locked();  // the wait may reach a launch held on a prefetch
  const auto start = std::chrono::steady_clock::now();
  for (event_handle e : events) port.wait(e);
  st.host_wait_us += elapsed_us(start);
  spare_events.insert(spare_events.end(), events.begin(), events.end());
  ++st.num_host_waits;
  fenced_epoch = std::max(fenced_epoch, now);
  if (!zombies.empty()) reap_zombies_locked();
}

void caching_allocator::impl::fence_locked(segment* seg) {
  if (seg->free_epoch <= fenced_epoch && seg->free_epoch != 0) return;
  fence_all_locked();
}

void caching_allocator::impl::destroy_segment_locked(segment* seg) {
  const auto start = std::chrono::steady_clock::now();
  if (seg->slab) {
    seg->pool->partial[seg->cls].erase(seg);
  } else if (seg->npages() < seg->pool->free_by_pages.size()) {
    seg->pool->free_by_pages[seg->npages()].erase(seg);
  }
  idle.erase(seg);
  if (const auto it = std::find(retiring.begin(), retiring.end(), seg); it != retiring.end()) retiring.erase(it);
  // A host-backed region's VA holds one host mapping, which the engine unmaps (remove_locked).
  const bool host_unmapped = seg->swap && engine->remove_locked(seg->swap);
  seg->swap = nullptr;
  if (!host_unmapped) {
    for (std::size_t i = 0; i < seg->pages.size(); ++i) port.unmap(seg->va + (i << gran_shift), gran);
  }
  if (seg->home) {  // Note [Home segments]: the chunk stays mapped at its home, a spare again
    for (const auto& [bytes, chunk] : seg->parts) engine->give_chunk_locked(bytes, chunk);
    seg->parts.clear();
  } else if (!seg->parts.empty()) {  // Note [Composites]: its chunks become spares, once no zombie maps them
    reap_zombies_locked();
    unmap_parts_locked(seg->va, seg->parts);
    for (const auto& [bytes, chunk] : seg->parts) engine->give_chunk_locked(bytes, chunk);
    seg->parts.clear();
  }
  set_owner_locked(seg->va, seg->npages(), nullptr);
  if (!seg->home) release_va_locked(seg->va, seg->npages());
  idle_pages.insert(idle_pages.end(), seg->pages.begin(), seg->pages.end());
  count(seg->slab, &pool_stats::segments, -1);
  if (seg->slab) {  // its pages return to the pool, which counts as large
    count(true, &pool_stats::reserved_bytes, -static_cast<std::int64_t>(seg->bytes), false);
    count(false, &pool_stats::reserved_bytes, static_cast<std::int64_t>(seg->bytes), false);
  }
  segments.erase(seg);
  delete seg;
  st.segment_destroy_ns += elapsed_ns(start);
}

// Destroys an idle segment whose streams' work is known complete (no wait): the least recently freed one, or with
// `want` (the granules a request still lacks) the one Note [Reclaim by fit] picks.
bool caching_allocator::impl::reclaim_fenced_locked(std::size_t want) {
  if (!idle.head) return false;
  poll_fences_locked();
  segment* pick = nullptr;
  if (want == 0 || !options.reclaim_fit) {
    for (segment* seg = idle.head; seg && !pick; seg = seg->idle_hook.next) {
      if (reclaimable_now_locked(seg)) pick = seg;
    }
  } else {  // Note [Reclaim by fit]: the smallest that covers `want`, else the largest
    segment* largest = nullptr;
    for (segment* seg = idle.head; seg; seg = seg->idle_hook.next) {
      if (!reclaimable_now_locked(seg)) continue;
      if (seg->npages() >= want) {
        if (!pick || seg->npages() < pick->npages()) pick = seg;
      } else if (!largest || seg->npages() > largest->npages()) {
        largest = seg;
      }
    }
    if (!pick) pick = largest;
  }
  if (!pick) return false;
  destroy_segment_locked(pick);
  ++st.num_reclaims;
  return true;
}

// Destroys one idle segment: one whose streams' work is known complete (no wait; reclaim_fenced_locked), else the
// least recently freed one, after a fence (a host wait).
bool caching_allocator::impl::reclaim_one_locked(std::size_t want) {
  if (!idle.head) return false;
  if (reclaim_fenced_locked(want)) return true;
  segment* seg = idle.head;
  LAYERSWAP_LOG(debug, "device %d: reclaiming an idle %s %s waits for the GPU", st.device,
                format_bytes(seg->bytes).c_str(),
                seg->slab ? "slab" : seg->home ? "home segment" : seg->parts.empty() ? "segment" : "composite");
  fence_locked(seg);
  destroy_segment_locked(seg);
  ++st.num_reclaims;
  return true;
}

void caching_allocator::impl::make_idle_locked(segment* seg) {
  seg->free_epoch = ++epoch;
  idle_epoch = seg->free_epoch;
  fences_wanted = true;
  idle.push_back(seg);
}

// Note [Slabs change class]: an idle slab of `pool` of `bytes`, least recently freed first; nullptr: none.
segment* caching_allocator::impl::idle_slab_locked(const stream_pool* pool, std::size_t bytes) const noexcept {
  for (segment* seg = idle.head; seg; seg = seg->idle_hook.next) {
    if (seg->slab && seg->pool == pool && seg->bytes == bytes && seg->used == 0) return seg;
  }
  return nullptr;
}

// ---- blocks ----

void* caching_allocator::impl::allocate_small_locked(std::size_t bytes, stream_pool* pool) {
  const std::uint32_t cls = size_class_index(bytes);
  pool_list& list = pool->partial[cls];
  segment* seg = list.head;
  if (!seg) {
    const std::size_t block = size_class_bytes(cls);
    const std::size_t slab_bytes = slab_bytes_for(block, gran);
    seg = idle_slab_locked(pool, slab_bytes);  // Note [Slabs change class]
    if (seg) {
      pool->partial[seg->cls].erase(seg);
      idle.erase(seg);
      ++st.num_slab_reuses;
    } else {
      log_program_makes_locked("slab", slab_bytes, bytes);
      seg = new_segment_locked(pool, slab_bytes, bytes);
      seg->slab = true;
      count(true, &pool_stats::segments, 1);
      count(true, &pool_stats::reserved_bytes, static_cast<std::int64_t>(slab_bytes), false);  // pages left the pool
      count(false, &pool_stats::reserved_bytes, -static_cast<std::int64_t>(slab_bytes), false);
    }
    seg->cls = cls;
    seg->block = block;
    seg->nblocks = static_cast<std::uint32_t>(slab_bytes / block);
    seg->next_free.resize(seg->nblocks);
    seg->requested_of.assign(seg->nblocks, 0);
    for (std::uint32_t i = 0; i < seg->nblocks; ++i) seg->next_free[i] = i + 1 < seg->nblocks ? i + 1 : k_none;
    seg->free_head = 0;
    list.push_back(seg);
  } else if (seg->used == 0) {
    idle.erase(seg);  // back in use
  }
  const std::uint32_t b = seg->free_head;
  seg->free_head = seg->next_free[b];
  seg->next_free[b] = k_none;
  seg->requested_of[b] = bytes;
  if (++seg->used == seg->nblocks) list.erase(seg);
  const auto blk = static_cast<std::int64_t>(seg->block);
  count(true, &pool_stats::allocations, 1);
  count(true, &pool_stats::allocated_bytes, blk);
  count(true, &pool_stats::requested_bytes, static_cast<std::int64_t>(bytes));
  count(true, &pool_stats::active, 1);
  count(true, &pool_stats::active_bytes, blk);
  return reinterpret_cast<void*>(seg->va + b * seg->block);
}

void* caching_allocator::impl::allocate_large_locked(std::size_t bytes, stream_pool* pool) {
  const std::size_t npages = (bytes + gran - 1) >> gran_shift;
  segment* seg = nullptr;
  const std::size_t last = std::min(pool->free_by_pages.size(), npages + npages / 8 + 1);
  for (std::size_t n = npages; n < last && !seg; ++n) seg = pool->free_by_pages[n].head;
  if (!seg && log_enabled(log_level::debug) && !room_for_new_locked(npages)) log_cache_miss_locked(pool, bytes);
  const std::size_t window = (npages + npages / 8) << gran_shift;  // the most a request takes whole
  bool homes_tried = false;  // Note [Home segments]: the spares' homes, already looked at for this request
  if (!seg && options.split > 1 && engine && !room_for_new_locked(npages)) {  // Note [Split segments]
    if (void* p = allocate_split_locked(bytes, npages, pool)) return p;
    seg = home_segment_locked(pool, npages << gran_shift, window);  // Note [Home segments]
    if (!seg) {
      if (void* p = allocate_spare_split_locked(bytes, npages, pool, false)) return p;  // Note [Split spares]
    }
    homes_tried = true;
  }
  if (!seg && options.oversize > 1.0 && !room_for_new_locked(npages)) {  // Note [Oversize reuse]
    const auto most = static_cast<std::size_t>(static_cast<double>(npages) * options.oversize);
    const std::size_t end = std::min(pool->free_by_pages.size(), most + 1);
    for (std::size_t n = last; n < end && !seg; ++n) seg = pool->free_by_pages[n].head;
    if (seg) ++st.num_oversize_reuses;
  }
  if (seg) {
    pool->free_by_pages[seg->npages()].erase(seg);
    idle.erase(seg);
  } else {
    if (engine && !homes_tried) {
      range_pick free_range{};  // none: nothing below takes a range or frees one unless it returns
      if (options.split > 1) {  // Note [Free ranges first]
        free_range = smallest_free_range_locked(pool, npages);
        if (free_range.seg) return take_range_locked(free_range.seg, free_range.index, false, bytes, npages);
      }
      seg = home_segment_locked(pool, npages << gran_shift, window);  // Note [Home segments]
      if (!seg && options.split > 1) {  // ... or a larger one split, rather than a chunk made and mapped
        if (void* p = allocate_spare_split_locked(bytes, npages, pool, true)) return p;
      }
      if (!seg && options.split > 1 && following_locked()) {  // Note [Idle segments before chunks]
        if (void* p = allocate_split_locked(bytes, npages, pool, free_range)) return p;
      }
    }
    if (!seg) {
      if (engine && (seg = compose_spares_locked(pool, npages))) {  // Note [Spare composites]
        log_program_makes_locked("composite of spares", seg->bytes, bytes);
      } else if (engine) {
        log_program_makes_locked("chunk", npages << gran_shift, bytes);
        seg = new_chunk_segment_locked(pool, npages << gran_shift, bytes);  // the engine knows it (add_locked)
      } else {
        seg = new_segment_locked(pool, npages << gran_shift, bytes);
      }
      note_new_large_locked(seg);
    }
  }
  seg->live = true;
  if (seg->swap) engine->set_live_locked(seg->swap, true);
  seg->requested = bytes;
  const auto sz = static_cast<std::int64_t>(seg->bytes);
  count(false, &pool_stats::allocations, 1);
  count(false, &pool_stats::allocated_bytes, sz);
  count(false, &pool_stats::requested_bytes, static_cast<std::int64_t>(bytes));
  count(false, &pool_stats::active, 1);
  count(false, &pool_stats::active_bytes, sz);
  return reinterpret_cast<void*>(seg->va);
}

// A new large segment joins its pool's books.
void caching_allocator::impl::note_new_large_locked(segment* seg) {
  stream_pool* pool = seg->pool;
  if (pool->free_by_pages.size() <= seg->npages()) pool->free_by_pages.resize(seg->npages() + 1);
  count(false, &pool_stats::segments, 1);  // its memory was already counted in the large pool's reserved bytes
  residency_gate::mark_large(seg->region);  // after add_locked, which prepares the gate entry
}

// Makes a block free for reuse on its pool's stream (its allocation was already accounted as freed).
void caching_allocator::impl::release_block_locked(segment* seg, std::uint32_t b) {
  if (!seg->ranges.empty()) {
    release_range_locked(seg, b);
    return;
  }
  count(seg->slab, &pool_stats::active, -1);
  count(seg->slab, &pool_stats::active_bytes, -static_cast<std::int64_t>(seg->slab ? seg->block : seg->bytes));
  if (!seg->slab) {
    seg->live = false;
    cache_large_locked(seg);
    return;
  }
  seg->next_free[b] = seg->free_head;
  seg->free_head = b;
  if (seg->used-- == seg->nblocks) seg->pool->partial[seg->cls].push_back(seg);
  if (seg->used == 0) make_idle_locked(seg);
}

void caching_allocator::impl::cache_large_locked(segment* seg) {
  if (seg->swap && engine->host_backed_locked(seg->swap)) {
    // Never cached (Note [Swappable segments]): destroyed by maintain() once a fence covers it (Note [Unmap
    // fences]), or by a reclaim before that (which fences).
    make_idle_locked(seg);
    retiring.push_back(seg);
    try {
      start_fences_locked();  // now, unless one is in flight: the region's host backing goes back sooner
    } catch (...) {        // maintain() starts one later
    }
    return;
  }
  seg->pool->free_by_pages[seg->npages()].push_back(seg);
  make_idle_locked(seg);
}

// A large request found no cached segment of its size and no room for a new one (LAYERSWAP_LOG=debug): what its
// stream's cache held then, to tell which sizes turn into which.
void caching_allocator::impl::log_cache_miss_locked(const stream_pool* pool, std::size_t bytes) const {
  std::string sizes;
  std::size_t shown = 0, idle_here = 0;
  for (std::size_t n = pool->free_by_pages.size(); n-- > 0;) {
    std::size_t count = 0;
    for (const segment* s = pool->free_by_pages[n].head; s; s = s->pool_hook.next) ++count;
    if (count == 0) continue;
    idle_here += count * (n << gran_shift);
    if (shown++ < 12) {
      sizes += (sizes.empty() ? "" : ", ") + std::to_string(count) + " x " + format_bytes(n << gran_shift);
    }
  }
  std::size_t split_free = 0;
  for (const segment* s : pool->split) {
    for (const split_range& r : s->ranges) {
      if (r.state == range_state::free) split_free += std::size_t{r.n} << gran_shift;
    }
  }
  LAYERSWAP_LOG(debug, "device %d: a large request of %s misses the cache with %s of room; its stream's idle segments: "
                "%s (%s in all; %s in other idle segments and slabs); %s free in %zu split segments", st.device,
                format_bytes(bytes).c_str(), format_bytes(room_now_locked() << gran_shift).c_str(),
                sizes.empty() ? "none" : sizes.c_str(), format_bytes(idle_here).c_str(),
                format_bytes((idle.pages << gran_shift) - std::min(idle.pages << gran_shift, idle_here)).c_str(),
                format_bytes(split_free).c_str(), pool->split.size());
}

void caching_allocator::impl::log_program_makes_locked(const char* what, std::size_t made, std::size_t bytes) const {
  if (!engine || !log_enabled(log_level::debug)) return;
  LAYERSWAP_LOG(debug, "device %d: the program makes a %s of %s for %s (room %s, idle %s); engine: %s", st.device, what,
                format_bytes(made).c_str(), format_bytes(bytes).c_str(),
                format_bytes(room_now_locked() << gran_shift).c_str(), format_bytes(idle.pages << gran_shift).c_str(),
                engine->describe_locked().c_str());
}

// ---- split segments (Note [Split segments]) ----

// A large segment whose device memory stays put, so that another allocation may use it (a range of it here, its
// chunks in a composite): a composite, or a device-backed region that is not moving.
bool caching_allocator::impl::splittable_locked(const segment* seg) const noexcept {
  if (seg->slab) return false;
  if (!seg->parts.empty()) return true;  // a composite: device chunks, never moved
  return seg->swap && !engine->host_backed_locked(seg->swap) && !engine->moving_locked(seg->swap);
}

// The smallest free range of `npages` .. `npages` * LAYERSWAP_SPLIT granules in a split segment of `pool`: its segment
// (nullptr: none), the range's index, and its granules.
caching_allocator::impl::range_pick caching_allocator::impl::smallest_free_range_locked(const stream_pool* pool,
                                                                                      std::size_t npages) const {
  range_pick best{nullptr, 0, npages * split_ratio_locked() + 1};
  for (segment* s : pool->split) {
    if (!splittable_locked(s)) continue;
    for (std::size_t i = 0; i < s->ranges.size(); ++i) {
      const split_range& r = s->ranges[i];
      if (r.state == range_state::free && r.n >= npages && r.n < best.n) best = {s, i, r.n};
    }
  }
  return best;
}

void* caching_allocator::impl::allocate_split_locked(std::size_t bytes, std::size_t npages, stream_pool* pool,
                                                      range_pick best) {
  bool whole = false;  // best is an idle segment
  // An idle segment above the reuse window, only if smaller than that range: whole ones are kept whole first.
  const std::size_t end = std::min(pool->free_by_pages.size(), best.n);
  const std::size_t whole_most = split_whole_most_locked(npages);  // Note [Split bound]
  for (std::size_t n = npages + npages / 8 + 1; n < end && n <= whole_most && !whole; ++n) {
    for (segment* s = pool->free_by_pages[n].head; s; s = s->pool_hook.next) {
      if (!splittable_locked(s)) continue;
      best = {s, 0, n};
      whole = true;
      break;
    }
  }
  if (!best.seg) return nullptr;
  return take_range_locked(best.seg, best.index, whole, bytes, npages);
}

void* caching_allocator::impl::take_range_locked(segment* best, std::size_t index, bool whole, std::size_t bytes,
                                                  std::size_t npages) {
  if (whole) {  // one free range covering it, split below
    stream_pool* pool = best->pool;
    pool->free_by_pages[best->npages()].erase(best);
    idle.erase(best);
    best->ranges.push_back({0, static_cast<std::uint32_t>(best->npages()), 0, range_state::free});
    split_free_pages += best->npages();
    best->split_slot = static_cast<std::uint32_t>(pool->split.size());
    pool->split.push_back(best);
    best->live = true;
    if (best->swap) engine->set_live_locked(best->swap, true);
  }
  split_range& r = best->ranges[index];
  const split_range taken{r.first, static_cast<std::uint32_t>(npages), bytes, range_state::live};
  split_free_pages -= npages;
  if (r.n > npages) {
    r.first += static_cast<std::uint32_t>(npages);
    r.n -= static_cast<std::uint32_t>(npages);
    best->ranges.insert(best->ranges.begin() + static_cast<std::ptrdiff_t>(index), taken);
  } else {
    r = taken;
  }
  ++st.num_splits;
  const auto sz = static_cast<std::int64_t>(npages << gran_shift);
  count(false, &pool_stats::allocations, 1);
  count(false, &pool_stats::allocated_bytes, sz);
  count(false, &pool_stats::requested_bytes, static_cast<std::int64_t>(bytes));
  count(false, &pool_stats::active, 1);
  count(false, &pool_stats::active_bytes, sz);
  return reinterpret_cast<void*>(best->va + (static_cast<device_ptr>(taken.first) << gran_shift));
}

// Note [Split spares]: a spare chunk above the request's reuse window and within LAYERSWAP_SPLIT times its size
// becomes an idle segment of the request's pool (one mapping, no chunk made or released), which the request then
// splits. A spare with a home becomes a segment there instead, with no driver call (Note [Home segments]); with
// `homes_only`, only such a spare. nullptr: no such spare.
void* caching_allocator::impl::allocate_spare_split_locked(std::size_t bytes, std::size_t npages, stream_pool* pool,
                                                           bool homes_only) {
  const std::size_t lo = (npages + npages / 8 + 1) << gran_shift;
  const std::size_t hi = std::min(npages * split_ratio_locked(), split_whole_most_locked(npages)) << gran_shift;
  if (hi < lo) return nullptr;  // Note [Split bound]
  segment* seg = home_segment_locked(pool, lo, hi);
  if (!seg) {
    if (homes_only) return nullptr;
    const std::size_t spare = engine->spare_within_locked(lo, hi);
    if (spare == 0) return nullptr;
    seg = new_chunk_segment_locked(pool, spare, bytes);  // takes that spare: nothing else is smaller
    note_new_large_locked(seg);
  }
  cache_large_locked(seg);
  ++st.num_spare_splits;
  return take_range_locked(seg, 0, true, bytes, npages);
}

// Note [Home segments]
segment* caching_allocator::impl::home_segment_locked(stream_pool* pool, std::size_t lo, std::size_t hi) {
  if (!homes_on()) return nullptr;
  const auto [bytes, chunk] = engine->take_homed_spare_locked(lo, hi, home_arena->base, home_arena->bytes);
  if (!chunk) return nullptr;
  segment* seg = add_segment_locked(pool, chunk.home, bytes, {});  // mapped there, access granted, for good
  seg->parts.emplace_back(bytes, chunk);
  seg->home = true;
  note_new_large_locked(seg);
  ++st.num_home_segments;
  return seg;
}

// The range at granule `first` of a split segment is free for reuse on its pool's stream (its allocation was already
// accounted as freed): it joins its free neighbours; the last one makes the segment whole again.
void caching_allocator::impl::release_range_locked(segment* seg, std::uint32_t first) {
  auto& ranges = seg->ranges;
  auto it = range_starting_at(ranges, first);
  if (it == ranges.end()) return;
  count(false, &pool_stats::active, -1);
  count(false, &pool_stats::active_bytes, -static_cast<std::int64_t>(std::size_t{it->n} << gran_shift));
  it->state = range_state::free;
  it->requested = 0;
  split_free_pages += it->n;
  if (auto next = std::next(it); next != ranges.end() && next->state == range_state::free) {
    it->n += next->n;
    it = std::prev(ranges.erase(next));
  }
  if (it != ranges.begin()) {
    if (auto prev = std::prev(it); prev->state == range_state::free) {
      prev->n += it->n;
      ranges.erase(it);
    }
  }
  if (ranges.size() != 1 || ranges.front().state != range_state::free) return;
  // The last allocation: the segment is whole and idle again.
  split_free_pages -= seg->npages();
  ranges.clear();
  stream_pool* pool = seg->pool;
  segment* moved = pool->split.back();
  pool->split[seg->split_slot] = moved;
  moved->split_slot = seg->split_slot;
  pool->split.pop_back();
  seg->split_slot = k_none;
  seg->live = false;
  if (seg->swap) engine->set_live_locked(seg->swap, false);
  cache_large_locked(seg);
}

void caching_allocator::impl::process_pending_locked(bool wait) {
  if (wait && engine) engine->release_holds_locked();  // the waits may reach a launch held on a prefetch
  std::size_t kept = 0;
  for (std::size_t i = 0; i < pending.size(); ++i) {
    pending_free& p = pending[i];
    bool done = true;
    for (event_handle e : p.events) {
      if (wait) {
        const auto start = std::chrono::steady_clock::now();
        port.wait(e);
        st.host_wait_us += elapsed_us(start);
        ++st.num_host_waits;
      } else if (!port.query(e)) {
        done = false;
        break;
      }
    }
    if (done) {
      spare_events.insert(spare_events.end(), p.events.begin(), p.events.end());
      release_block_locked(p.seg, p.block);
    } else {
      if (kept != i) pending[kept] = std::move(p);
      ++kept;
    }
  }
  pending.resize(kept);
}

void caching_allocator::impl::release_idle_pages_locked() {
  for (phys_handle h : idle_pages) {
    port.release(h);
    st.device_bytes.decrease(static_cast<std::int64_t>(gran));
    count(false, &pool_stats::reserved_bytes, -static_cast<std::int64_t>(gran));
    ++st.num_device_free;
  }
  idle_pages.clear();
}

void caching_allocator::impl::throw_oom_locked(std::size_t request) {
  ++st.num_ooms;
  try {
    release_idle_pages_locked();  // as after PyTorch's OOM, the process keeps no pooled memory it cannot use
    if (engine) engine->release_spare_locked();
  } catch (...) {
  }
  std::vector<std::size_t> live;
  std::int64_t live_bytes = 0;
  for (const segment* s : segments) {
    if (s->slab) {
      for (std::size_t r : s->requested_of) {
        if (r) live.push_back(s->block), live_bytes += static_cast<std::int64_t>(s->block);
      }
    } else if (!s->ranges.empty()) {  // Note [Split segments]
      for (const split_range& r : s->ranges) {
        if (r.state != range_state::live) continue;
        live.push_back(std::size_t{r.n} << gran_shift);
        live_bytes += static_cast<std::int64_t>(live.back());
      }
    } else if (s->live) {
      live.push_back(s->bytes);
      live_bytes += static_cast<std::int64_t>(s->bytes);
    }
  }
  std::sort(live.begin(), live.end(), std::greater<>());
  std::string largest;
  for (std::size_t i = 0; i < live.size() && i < 4; ++i) largest += (i ? ", " : "") + format_bytes(live[i]);
  const auto held = static_cast<std::uint64_t>(st.device_bytes.current);
  std::string msg = "layerswap: out of memory: cannot allocate " + format_bytes(request) + " on device " +
                    std::to_string(st.device) + ". ";
  if (options.budget) {
    msg += "LAYERSWAP_BUDGET caps layerswap at " + format_bytes(options.budget) + " of device memory and it holds " +
           format_bytes(held);
  } else {
    std::size_t free = 0, total = 0;
    try {
      free = port.free_memory();
      total = port.total_memory();
    } catch (...) {
    }
    msg += "No LAYERSWAP_BUDGET is set; the device has " + format_bytes(free) + " free of " + format_bytes(total) +
           " and layerswap holds " + format_bytes(held);
  }
  msg += ": " + format_bytes(static_cast<std::uint64_t>(live_bytes)) + " in " + std::to_string(live.size()) +
         " live allocations" + (largest.empty() ? "" : " (largest " + largest + ")");
  const std::int64_t other = static_cast<std::int64_t>(held) - live_bytes;
  if (other > 0) {
    msg += ", " + format_bytes(static_cast<std::uint64_t>(other)) +
           " cached (free blocks of partly used slabs, and blocks still in use by other streams)";
  }
  msg += ". ";
  if (options.budget) {
    msg += "Raise LAYERSWAP_BUDGET (now " + format_bytes(options.budget) + ") or reduce the batch size.";
  } else {
    msg += "Reduce the batch size or free other GPU memory; set LAYERSWAP_BUDGET to cap layerswap's share.";
  }
  throw out_of_memory(msg);
}

// ---- the residency engine's page source ----

bool caching_allocator::impl::take_pages(std::size_t n, std::vector<phys_handle>& out) {
  if (options.budget == 0 || unused_pages_locked() < n) return false;
  const std::size_t first = out.size();
  while (out.size() - first < n) {
    if (!idle_pages.empty()) {
      out.push_back(idle_pages.back());
      idle_pages.pop_back();
      continue;
    }
    try {
      out.push_back(port.create(gran, memory_location::device));
    } catch (...) {  // the device is full (or failing): give back what was taken
      idle_pages.insert(idle_pages.end(), out.begin() + static_cast<std::ptrdiff_t>(first), out.end());
      out.resize(first);
      return false;
    }
    st.device_bytes.increase(static_cast<std::int64_t>(gran));
    count(false, &pool_stats::reserved_bytes, static_cast<std::int64_t>(gran));
    ++st.num_device_alloc;
  }
  return true;
}

void caching_allocator::impl::give_pages(std::vector<phys_handle>& pages) {
  idle_pages.insert(idle_pages.end(), pages.begin(), pages.end());
  pages.clear();
}

bool caching_allocator::impl::take_room(std::size_t n) {
  const std::size_t bytes = n << gran_shift;
  if (options.budget == 0) {  // no cap: the device says whether there is room (create() fails when it is full)
    st.device_bytes.increase(static_cast<std::int64_t>(bytes));
    count(false, &pool_stats::reserved_bytes, static_cast<std::int64_t>(bytes));
    ++st.num_device_alloc;
    return true;
  }
  auto held = [&] { return static_cast<std::size_t>(st.device_bytes.current); };
  if (held() + bytes > options.budget + idle_pages.size() * gran) return false;
  while (held() + bytes > options.budget) {  // pooled pages make way (released: a chunk is one allocation)
    port.release(idle_pages.back());
    idle_pages.pop_back();
    st.device_bytes.decrease(static_cast<std::int64_t>(gran));
    count(false, &pool_stats::reserved_bytes, -static_cast<std::int64_t>(gran));
    ++st.num_device_free;
  }
  st.device_bytes.increase(static_cast<std::int64_t>(bytes));
  count(false, &pool_stats::reserved_bytes, static_cast<std::int64_t>(bytes));
  ++st.num_device_alloc;
  return true;
}

void caching_allocator::impl::give_room(std::size_t n) {
  st.device_bytes.decrease(static_cast<std::int64_t>(n << gran_shift));
  count(false, &pool_stats::reserved_bytes, -static_cast<std::int64_t>(n << gran_shift));
  ++st.num_device_free;
}

std::size_t caching_allocator::impl::idle_bytes() const { return idle.pages << gran_shift; }  // pages or chunks

// A completed asynchronous fence advances the fenced epoch.
void caching_allocator::impl::poll_fences_locked() {
  if (!fence_events.empty() &&
      std::all_of(fence_events.begin(), fence_events.end(), [&](event_handle e) { return port.query(e); })) {
    fenced_epoch = std::max(fenced_epoch, fence_epoch);
    spare_events.insert(spare_events.end(), fence_events.begin(), fence_events.end());
    fence_events.clear();
    fences_wanted = true;  // the segments freed since it was recorded want one of their own
  }
  if (!zombies.empty()) reap_zombies_locked();
}

// For a prefetch: large idle segments first, slabs only when those do not make the room (Note [Slabs last]).
void caching_allocator::impl::reclaim_idle(std::size_t n) {
  poll_fences_locked();
  for (const bool slabs : {false, true}) {
    for (segment* seg = idle.head; seg && room_now_locked() < n;) {
      segment* next = seg->idle_hook.next;
      if (seg->slab == slabs && reclaimable_now_locked(seg)) {  // its pages join the pool, its chunk the spares
        destroy_segment_locked(seg);
        ++st.num_engine_reclaims;
      }
      seg = next;
    }
  }
  start_fences_locked();
}

// For a prefetch of `bytes` (residency.cpp, Note [Following reserve]): an idle chunk-backed segment of that size,
// fenced, destroyed: its chunk is the spare the prefetch then takes, with no chunk released or made.
bool caching_allocator::impl::reclaim_idle_sized(std::size_t bytes) {
  const std::size_t n = bytes >> gran_shift;
  poll_fences_locked();
  for (auto& pool : pools) {
    if (pool->free_by_pages.size() <= n) continue;
    for (segment* seg = pool->free_by_pages[n].head; seg; seg = seg->pool_hook.next) {
      // A chunk of that size: a region's own, device-backed, or a home segment's (Note [Home segments]).
      const bool chunk = seg->home || (seg->swap && seg->parts.empty() && !engine->host_backed_locked(seg->swap));
      if (!chunk) continue;
      if (!reclaimable_now_locked(seg)) continue;
      destroy_segment_locked(seg);
      ++st.num_engine_reclaims;
      return true;
    }
  }
  return false;
}

// An asynchronous fence when segments went idle since the last one (Note [Unmap fences]), so that
// reclaim_one_locked() and reclaim_idle() find them reclaimable without a host wait. Whether the newest idle
// segment is fenced is one compare, not a pass over the idle list (hundreds of segments, read cold by the
// migration thread every round). When the unfenced segments have all left the idle list since, the fence was not
// needed: some event records.
void caching_allocator::impl::start_fences_locked() {
  if (!fences_wanted) return;
  if (fence_events.empty() && idle_epoch > fenced_epoch) {
    const std::uint64_t now = epoch;
    try {
      record_fence_locked(fence_events);
    } catch (...) {  // a fence a reclaim will make itself, waiting
      spare_events.insert(spare_events.end(), fence_events.begin(), fence_events.end());
      fence_events.clear();
      throw;
    }
    fence_epoch = now;
  }
  fences_wanted = false;  // every idle segment is fenced, or a fence is in flight
}

void caching_allocator::impl::maintain() {
  if (!pending.empty()) process_pending_locked(false);
  poll_fences_locked();
  start_fences_locked();
  if (retiring.empty()) return;
  poll_fences_locked();  // the fence just started may have completed already (idle streams)
  std::vector<segment*> ready;
  for (segment* seg : retiring) {
    if (seg->free_epoch <= fenced_epoch && !engine->moving_locked(seg->swap)) ready.push_back(seg);
  }
  for (segment* seg : ready) destroy_segment_locked(seg);  // also drops it from `retiring`
}

// ---- public interface ----

caching_allocator::caching_allocator(driver& port, allocator_options options)
    : impl_(std::make_unique<impl>(port, options)) {}

caching_allocator::~caching_allocator() = default;

void* caching_allocator::allocate(std::size_t bytes, stream_handle stream) {
  if (bytes == 0) return nullptr;
  const std::uint64_t start = fast_clock::ticks();
  const std::unique_lock lock = impl_->lock_counted();
  const impl::call_timer timed{*impl_, start};
  if (!impl_->pending.empty()) impl_->process_pending_locked(false);
  stream_pool* pool = impl_->pool_for_locked(stream);
  return bytes <= impl_->options.small_max ? impl_->allocate_small_locked(bytes, pool)
                                           : impl_->allocate_large_locked(bytes, pool);
}

bool caching_allocator::deallocate(void* ptr) noexcept {
  if (!ptr) return true;
  const auto p = reinterpret_cast<device_ptr>(ptr);
  const std::uint64_t start = fast_clock::ticks();
  const std::unique_lock lock = impl_->lock_counted();
  const impl::call_timer timed{*impl_, start};
  impl& m = *impl_;
  segment* seg = m.owner_locked(p);
  std::uint32_t b = 0;
  std::size_t requested = 0;
  std::size_t blk = 0;
  if (seg && seg->slab) {
    const std::size_t off = p - seg->va;
    b = static_cast<std::uint32_t>(off / seg->block);
    if (off % seg->block != 0 || b >= seg->nblocks || seg->requested_of[b] == 0) seg = nullptr;
    else requested = std::exchange(seg->requested_of[b], 0), blk = seg->block;
  } else if (seg && !seg->ranges.empty()) {  // Note [Split segments]
    const std::size_t off = p - seg->va;
    const auto first = static_cast<std::uint32_t>(off >> m.gran_shift);
    auto it = range_starting_at(seg->ranges, first);
    if ((off & (m.gran - 1)) != 0 || it == seg->ranges.end() || it->state != range_state::live) {
      seg = nullptr;
    } else {
      it->state = range_state::pending;
      requested = std::exchange(it->requested, 0);
      b = first;
      blk = std::size_t{it->n} << m.gran_shift;
      // No longer persistent (residency_gate.hpp): the learner keys the step on persistent regions, and a split
      // segment's ranges hold activations that change places from step to step.
      residency_gate::note_freed(seg->region);
      residency_gate::nudge();
    }
  } else if (seg) {
    if (seg->va != p || !seg->live) seg = nullptr;
    else requested = seg->requested, seg->live = false;
    if (seg && seg->swap) m.engine->set_live_locked(seg->swap, false);
    if (seg) residency_gate::note_freed(seg->region);  // no longer persistent (residency_gate.hpp)
    if (seg) residency_gate::nudge();  // its room may be what a prefetch waits for (residency.cpp, Note [Idle engine])
    if (seg) blk = seg->bytes;
  }
  if (!seg) {
    ++m.st.num_foreign_frees;
    return false;
  }
  m.count(seg->slab, &pool_stats::allocations, -1);
  m.count(seg->slab, &pool_stats::allocated_bytes, -static_cast<std::int64_t>(blk));
  m.count(seg->slab, &pool_stats::requested_bytes, -static_cast<std::int64_t>(requested));

  if (!m.recorded.empty()) {
    auto it = m.recorded.find(p);
    if (it != m.recorded.end()) {
      std::vector<stream_handle> streams = std::move(it->second);
      m.recorded.erase(it);
      try {
        pending_free pf{seg, b, {}};
        for (stream_handle s : streams) {
          event_handle e = m.take_event_locked();
          pf.events.push_back(e);
          m.port.record(e, s);
        }
        m.pending.push_back(std::move(pf));
        return true;
      } catch (const std::exception& e) {
        // Could not record events (a destroyed stream?): wait for everything instead of risking reuse.
        LAYERSWAP_LOG(warn, "record_stream fence failed (%s); waiting for the device before reuse", e.what());
        try {
          if (m.engine) m.engine->release_holds_locked();
          for (stream_handle s : streams) m.port.synchronize(s);
        } catch (...) {
        }
      }
    }
  }
  m.release_block_locked(seg, b);
  return true;
}

void caching_allocator::record_stream(void* ptr, stream_handle stream) {
  const auto p = reinterpret_cast<device_ptr>(ptr);
  std::lock_guard lock(impl_->mutex);
  segment* seg = impl_->owner_locked(p);
  if (!seg || seg->pool->stream == stream) return;  // same stream: stream order already covers it
  auto& streams = impl_->recorded[p];
  if (std::find(streams.begin(), streams.end(), stream) == streams.end()) streams.push_back(stream);
}

void caching_allocator::empty_cache() {
  std::lock_guard lock(impl_->mutex);
  impl& m = *impl_;
  if (!m.pending.empty()) m.process_pending_locked(false);
  if (!m.zombies.empty()) m.fence_all_locked();
  while (m.reclaim_one_locked()) {
  }
  m.release_idle_pages_locked();
  if (m.engine) m.engine->release_spare_locked();
}

allocator_stats caching_allocator::stats() const {
  std::lock_guard lock(impl_->mutex);
  allocator_stats s = impl_->st;
  s.call_ns = static_cast<std::int64_t>(fast_clock::to_ns(impl_->call_ticks));
  s.budget = impl_->options.budget;
  // Allocated blocks swapped out to the host hold no device bytes: the difference can be negative then.
  s.cached_bytes = std::max<std::int64_t>(0, s.device_bytes.current - s.all.allocated_bytes.current);
  return s;
}

void caching_allocator::reset_peak_stats() {
  std::lock_guard lock(impl_->mutex);
  for (pool_stats* p : {&impl_->st.small, &impl_->st.large, &impl_->st.all}) {
    for (stat* s : {&p->allocations, &p->allocated_bytes, &p->requested_bytes, &p->active, &p->active_bytes,
                    &p->segments, &p->reserved_bytes}) {
      s->reset_peak();
    }
  }
  impl_->st.device_bytes.reset_peak();
}

void caching_allocator::reset_accumulated_stats() {
  std::lock_guard lock(impl_->mutex);
  for (pool_stats* p : {&impl_->st.small, &impl_->st.large, &impl_->st.all}) {
    for (stat* s : {&p->allocations, &p->allocated_bytes, &p->requested_bytes, &p->active, &p->active_bytes,
                    &p->segments, &p->reserved_bytes}) {
      s->reset_accumulated();
    }
  }
  impl_->st.device_bytes.reset_accumulated();
  impl_->st.num_alloc_retries = impl_->st.num_ooms = 0;
  impl_->st.num_device_alloc = impl_->st.num_device_free = impl_->st.num_host_waits = 0;
  impl_->st.host_wait_us = impl_->st.stall_us = 0;
  impl_->st.num_calls = impl_->st.call_ns = 0;
  impl_->call_ticks = 0;
  impl_->st.num_reclaims = impl_->st.num_engine_reclaims = impl_->st.num_oversize_reuses = 0;
  impl_->st.num_composites = impl_->st.composite_donors = impl_->st.num_zombies_reaped = 0;
  impl_->st.num_spare_composites = impl_->st.spare_composite_parts = 0;
  impl_->st.num_splits = impl_->st.num_spare_splits = impl_->st.num_home_segments = impl_->st.num_slab_reuses = 0;
  impl_->st.segment_new_ns = impl_->st.segment_destroy_ns = 0;
}

bool caching_allocator::owns(const void* ptr) const noexcept {
  std::lock_guard lock(impl_->mutex);
  return impl_->owner_locked(reinterpret_cast<device_ptr>(ptr)) != nullptr;
}

bool caching_allocator::in_arena(const void* ptr) const noexcept {
  const auto p = reinterpret_cast<device_ptr>(ptr);
  const impl& m = *impl_;
  const std::size_t n = m.arenas_published.load(std::memory_order_acquire);
  for (std::size_t i = 0; i < n; ++i) {
    if (p >= m.arena_begin[i].load(std::memory_order_relaxed) && p < m.arena_end[i].load(std::memory_order_relaxed)) {
      return true;
    }
  }
  if (!m.arenas_overflow.load(std::memory_order_acquire)) return false;
  std::lock_guard lock(m.mutex);  // more arenas than the published array holds: ask the owner table
  return m.arena_of_locked(p) != nullptr;
}

std::pair<void*, std::size_t> caching_allocator::block_of(const void* ptr) const noexcept {
  const auto p = reinterpret_cast<device_ptr>(ptr);
  std::lock_guard lock(impl_->mutex);
  const segment* seg = impl_->owner_locked(p);
  if (!seg) return {nullptr, 0};
  if (!seg->slab && !seg->ranges.empty()) {  // Note [Split segments]
    const std::size_t g = (p - seg->va) >> impl_->gran_shift;
    for (const split_range& r : seg->ranges) {
      if (g >= r.first && g < r.first + r.n) {
        return {reinterpret_cast<void*>(seg->va + (static_cast<device_ptr>(r.first) << impl_->gran_shift)),
                std::size_t{r.n} << impl_->gran_shift};
      }
    }
    return {nullptr, 0};
  }
  if (!seg->slab) return {reinterpret_cast<void*>(seg->va), seg->bytes};
  const std::size_t b = (p - seg->va) / seg->block;
  if (b >= seg->nblocks) return {nullptr, 0};
  return {reinterpret_cast<void*>(seg->va + b * seg->block), seg->block};
}

std::size_t caching_allocator::largest_free_block() const {
  std::lock_guard lock(impl_->mutex);
  const impl& m = *impl_;
  std::size_t largest = 0;
  for (const segment* s = m.idle.head; s; s = s->idle_hook.next) {
    if (!s->slab) largest = std::max(largest, s->bytes);
  }
  const std::size_t pooled = m.idle_pages.size() * m.gran + (m.engine ? m.engine->spare_pages_locked() * m.gran : 0);
  std::size_t headroom = 0;
  if (m.options.budget) {
    const auto held = static_cast<std::size_t>(m.st.device_bytes.current);
    headroom = (m.options.budget > held ? m.options.budget - held : 0) + pooled;
  } else {
    headroom = m.port.free_memory() + pooled;
  }
  return std::max(largest, headroom);
}

std::size_t caching_allocator::budget() const noexcept {
  std::lock_guard lock(impl_->mutex);
  return impl_->options.budget;
}

void caching_allocator::set_budget(std::size_t bytes) {
  std::lock_guard lock(impl_->mutex);
  impl_->options.budget = bytes;
  impl_->st.budget = bytes;
  impl_->start_engine_if_needed();
}

driver& caching_allocator::port() const noexcept { return impl_->port; }

void caching_allocator::set_forecast_source(forecast_source* source) noexcept {
  if (impl_->engine) impl_->engine->set_forecast_source(source);
}

void caching_allocator::set_streams(std::span<const stream_handle> streams) {
  std::lock_guard lock(impl_->mutex);
  if (impl_->engine) impl_->engine->set_streams_locked(streams);
}

void caching_allocator::note_stream(stream_handle stream) {
  std::lock_guard lock(impl_->mutex);
  if (impl_->engine) impl_->engine->note_stream_locked(stream);
}

residency_stats caching_allocator::residency() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->engine ? impl_->engine->stats_locked() : residency_stats{};
}

void caching_allocator::residency_tick() {
  if (impl_->engine) impl_->engine->tick();  // takes the mutex itself
}

region_residency caching_allocator::residency_of(const void* ptr) const {
  std::lock_guard lock(impl_->mutex);
  const segment* seg = impl_->owner_locked(reinterpret_cast<device_ptr>(ptr));
  return seg && seg->swap ? impl_->engine->state_locked(seg->swap) : region_residency::none;
}

bool caching_allocator::request_evict(const void* ptr) {
  std::lock_guard lock(impl_->mutex);
  segment* seg = impl_->owner_locked(reinterpret_cast<device_ptr>(ptr));
  return seg && seg->swap && impl_->engine->request_locked(seg->swap, false);
}

bool caching_allocator::request_prefetch(const void* ptr) {
  std::lock_guard lock(impl_->mutex);
  segment* seg = impl_->owner_locked(reinterpret_cast<device_ptr>(ptr));
  return seg && seg->swap && impl_->engine->request_locked(seg->swap, true);
}

void caching_allocator::with_lock_for_test(const std::function<void()>& fn) const {
  std::lock_guard lock(impl_->mutex);
  fn();
}

void caching_allocator::verify() const {
  std::lock_guard lock(impl_->mutex);
  const impl& m = *impl_;
  auto fail = [](const std::string& what) { throw error("layerswap: allocator invariant violated: " + what); };
  std::int64_t mapped_small = 0, mapped_large = 0, alloc_small = 0, alloc_large = 0, req = 0, live_count = 0;
  std::int64_t pending_blocks = 0;
  std::size_t split_free = 0;  // free ranges' granules, against split_free_pages (Note [Split bound])
  std::vector<std::pair<device_ptr, device_ptr>> ranges;
  for (const segment* s : m.segments) {
    if (s->bytes != s->npages() * m.gran || s->bytes == 0) fail("segment size does not match its granules");
    if (!s->swap && s->parts.empty() && s->pages.size() != s->npages()) {
      fail("a segment the engine does not know lacks device pages");
    }
    if (!s->parts.empty()) {  // Note [Composites]
      std::size_t sum = 0;
      for (const auto& part : s->parts) sum += part.first;
      if (s->swap || !s->pages.empty() || s->slab || sum != s->bytes) fail("a composite's chunks do not make it");
    }
    if (s->home && (s->parts.size() != 1 || s->parts.front().second.home != s->va)) {  // Note [Home segments]
      fail("a home segment is not its chunk's home");
    }
    if (s->swap && !s->pages.empty() && s->pages.size() != s->npages()) fail("a swappable segment is partly backed");
    if (s->swap && m.engine->host_backed_locked(s->swap) && s->pool_hook.linked) {
      fail("a host-backed segment is cached for reuse");
    }
    for (std::size_t i = 0; i < s->npages(); ++i) {
      if (m.owner_locked(s->va + i * m.gran) != s) fail("owner table does not point at its segment");
    }
    ranges.emplace_back(s->va, s->va + s->bytes);
    if (s->slab) {
      mapped_small += static_cast<std::int64_t>(s->bytes);
      std::vector<bool> is_free(s->nblocks, false);
      std::uint32_t nfree = 0;
      for (std::uint32_t b = s->free_head; b != k_none; b = s->next_free[b]) {
        if (b >= s->nblocks || is_free[b]) fail("slab free list is corrupt");
        if (s->requested_of[b] != 0) fail("a free slab block still has a requested size");
        is_free[b] = true;
        ++nfree;
      }
      if (nfree + s->used != s->nblocks) fail("slab used count does not match its free list");
      if (s->nblocks * s->block > s->bytes) fail("slab blocks overflow the slab");
      for (std::uint32_t b = 0; b < s->nblocks; ++b) {
        if (s->requested_of[b]) {
          alloc_small += static_cast<std::int64_t>(s->block);
          req += static_cast<std::int64_t>(s->requested_of[b]);
          ++live_count;
          if (s->requested_of[b] > s->block) fail("a slab block is smaller than its request");
        }
      }
      if (s->idle_hook.linked != (s->used == 0)) fail("slab idle-list membership is wrong");
      if (s->pool_hook.linked != (s->used < s->nblocks)) fail("slab partial-list membership is wrong");
    } else {
      mapped_large += static_cast<std::int64_t>(s->pages.size() * m.gran + (s->parts.empty() ? 0 : s->bytes));
      if (!s->ranges.empty()) {  // Note [Split segments]
        std::uint32_t next = 0;
        bool any = false;
        for (std::size_t i = 0; i < s->ranges.size(); ++i) {
          const split_range& r = s->ranges[i];
          if (r.first != next || r.n == 0) fail("a split segment's ranges do not cover it in order");
          next += r.n;
          if (i > 0 && r.state == range_state::free && s->ranges[i - 1].state == range_state::free) {
            fail("two free ranges of a split segment are not joined");
          }
          const bool in_pending = std::any_of(m.pending.begin(), m.pending.end(),
                                              [&](const pending_free& p) { return p.seg == s && p.block == r.first; });
          if (in_pending != (r.state == range_state::pending)) fail("a split range's pending state is wrong");
          if (r.state == range_state::live) {
            alloc_large += static_cast<std::int64_t>(std::size_t{r.n} << m.gran_shift);
            req += static_cast<std::int64_t>(r.requested);
            ++live_count;
            if (r.requested > (std::size_t{r.n} << m.gran_shift)) fail("a split range is smaller than its request");
          }
          any |= r.state != range_state::free;
          if (r.state == range_state::free) split_free += r.n;
        }
        if (next != s->npages()) fail("a split segment's ranges do not cover it");
        if (!any) fail("a split segment has no allocation");
        if (!s->live || s->idle_hook.linked || s->pool_hook.linked) fail("a split segment is cached or idle");
        if (s->split_slot >= s->pool->split.size() || s->pool->split[s->split_slot] != s) {
          fail("a split segment is not in its pool's list");
        }
        continue;
      }
      if (s->split_slot != k_none) fail("a whole segment is in its pool's split list");
      if (s->live) {
        alloc_large += static_cast<std::int64_t>(s->bytes);
        req += static_cast<std::int64_t>(s->requested);
        ++live_count;
        if (s->requested > s->bytes) fail("a large segment is smaller than its request");
      }
      const bool pending = std::any_of(m.pending.begin(), m.pending.end(), [&](const pending_free& p) { return p.seg == s; });
      if (pending) ++pending_blocks;
      if (s->idle_hook.linked != (!s->live && !pending)) fail("large idle-list membership is wrong");
    }
  }
  if (split_free != m.split_free_pages) fail("the split segments' free granules are miscounted");
  std::sort(ranges.begin(), ranges.end());
  for (std::size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].second) fail("two segments overlap");
  }
  for (const zombie& z : m.zombies) {
    if (m.owner_locked(z.va) != nullptr) fail("a zombie's VA is owned by a segment");
    for (const auto& r : ranges) {
      if (z.va < r.second && r.first < z.va + (z.n << m.gran_shift)) fail("a zombie overlaps a segment");
    }
  }
  std::size_t idle_pages = 0;
  for (const segment* s = m.idle.head; s; s = s->idle_hook.next) idle_pages += s->npages();
  if (idle_pages != m.idle.pages) fail("the idle list's page count is wrong");
  const std::int64_t inflight =
      m.engine ? static_cast<std::int64_t>((m.engine->inflight_pages_locked() + m.engine->own_pages_locked() +
                                            m.engine->chunk_pages_locked()) * m.gran)
               : 0;
  const std::int64_t held =
      mapped_small + mapped_large + static_cast<std::int64_t>(m.idle_pages.size() * m.gran) + inflight;
  if (m.engine) {
    if (std::string why = m.engine->verify_locked(); !why.empty()) fail("residency: " + why);
  }
  if (held != m.st.device_bytes.current) fail("device bytes held do not add up");
  if (m.options.budget && static_cast<std::size_t>(held) > m.options.budget) fail("the budget was exceeded");
  if (mapped_small != m.st.small.reserved_bytes.current) fail("small reserved bytes do not add up");
  if (held - mapped_small != m.st.large.reserved_bytes.current) fail("large reserved bytes do not add up");
  if (alloc_small != m.st.small.allocated_bytes.current || alloc_large != m.st.large.allocated_bytes.current) {
    fail("allocated bytes do not add up");
  }
  if (req != m.st.small.requested_bytes.current + m.st.large.requested_bytes.current) fail("requested bytes do not add up");
  if (live_count != m.st.small.allocations.current + m.st.large.allocations.current) fail("allocation count does not add up");
  if (m.st.small.segments.current + m.st.large.segments.current != static_cast<std::int64_t>(m.segments.size())) {
    fail("segment count does not add up");
  }
  if (m.st.all.allocated_bytes.current != alloc_small + alloc_large || m.st.all.reserved_bytes.current != held ||
      m.st.all.allocations.current != live_count || m.st.all.segments.current != static_cast<std::int64_t>(m.segments.size())) {
    fail("aggregate statistics do not add up");
  }
  if (m.st.all.allocated_bytes.peak < m.st.all.allocated_bytes.current || m.st.all.reserved_bytes.peak > m.st.device_bytes.peak) {
    fail("aggregate peaks are inconsistent");
  }
  (void)pending_blocks;
}

}  // namespace layerswap
