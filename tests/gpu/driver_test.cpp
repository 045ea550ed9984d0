// The real driver port (cuda_driver) on a GPU: data round trips through device and host-located pages, stream
// and event ordering, errors and out of memory. A few tests pin the driver rules the simulator enforces (unmap
// of whole mappings only, no map over a mapping, released pages living until the last unmap, mapping at an
// offset), so that a simulator stricter or looser than the hardware shows up here. Every test skips, saying
// so, where no GPU is usable.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "runtime/cuda_driver.hpp"
#include "runtime/digest.hpp"
#include "runtime/driver_calls.hpp"
#include "runtime/driver.hpp"
#include "runtime/error.hpp"

namespace layerswap {
namespace {

#define EXPECT_CONTAINS(text, part) EXPECT_NE(std::string(text).find(part), std::string::npos) << (text)

struct region {
  device_ptr va = 0;
  std::size_t bytes = 0;
  phys_handle handle = 0;
};

region make_region(driver& port, std::size_t bytes, memory_location where) {
  region r;
  r.bytes = bytes;
  r.va = port.reserve(bytes, 0);
  r.handle = port.create(bytes, where);
  port.map(r.va, bytes, r.handle, 0);
  port.set_access(r.va, bytes);
  return r;
}

void free_region(driver& port, const region& r) {
  port.unmap(r.va, r.bytes);
  port.release(r.handle);
  port.unreserve(r.va, r.bytes);
}

std::vector<std::byte> pattern(std::size_t n, unsigned seed) {
  std::vector<std::byte> out(n);
  for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<std::byte>((i * 131 + seed * 7 + (i >> 12)) & 0xff);
  return out;
}

// "" when equal, else where the first difference is.
std::string difference(const std::vector<std::byte>& expected, const std::vector<std::byte>& actual) {
  if (expected.size() != actual.size()) return "sizes differ";
  auto [e, a] = std::mismatch(expected.begin(), expected.end(), actual.begin());
  if (e == expected.end()) return {};
  return "first difference at byte " + std::to_string(e - expected.begin()) + ": expected " +
         std::to_string(static_cast<int>(*e)) + ", got " + std::to_string(static_cast<int>(*a));
}

std::vector<std::byte> read_back(driver& port, device_ptr va, std::size_t bytes) {
  std::vector<std::byte> out(bytes);
  port.copy_to_host(out.data(), va, bytes);
  return out;
}

TEST(CudaDriver, ReportsTheDeviceAndAPowerOfTwoGranularity) {
  if (layerswap::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA GPU: skipped";
  auto port = make_cuda_driver(0);
  EXPECT_EQ(port->device(), 0);
  const std::size_t g = port->granularity();
  EXPECT_TRUE(std::has_single_bit(g)) << g;
  EXPECT_GE(g, std::size_t{64} << 10);
  EXPECT_GT(port->total_memory(), 0u);
  EXPECT_LE(port->free_memory(), port->total_memory());
}

TEST(CudaDriver, MissingDeviceIsReported) {
  if (layerswap::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA GPU: skipped";
  try {
    (void)make_cuda_driver(cuda_device_count());
    ADD_FAILURE() << "no error for a device that does not exist";
  } catch (const cuda_error& e) {
    EXPECT_CONTAINS(e.what(), "does not exist");
  }
}

TEST(CudaDriver, CopiesRoundTripThroughDeviceAndHostLocatedPages) {
  if (layerswap::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA GPU: skipped";
  auto port = make_cuda_driver(0);
  const std::size_t bytes = 2 * port->granularity();
  const region a = make_region(*port, bytes, memory_location::device);
  const region h = make_region(*port, bytes, memory_location::host);
  const region b = make_region(*port, bytes, memory_location::device);
  const stream_handle s = port->create_stream();
  const event_handle e = port->create_event();

  const std::vector<std::byte> in = pattern(bytes - 3, 1);
  port->copy_from_host(a.va + 1, in.data(), in.size());
  port->copy_async(h.va + 2, a.va + 1, in.size(), s);  // device -> host-located pages
  port->copy_async(b.va, h.va + 2, in.size(), s);      // and back
  port->record(e, s);
  port->wait(e);
  EXPECT_TRUE(port->query(e));
  EXPECT_EQ(difference(in, read_back(*port, h.va + 2, in.size())), "");
  EXPECT_EQ(difference(in, read_back(*port, b.va, in.size())), "");

  port->destroy_event(e);
  port->destroy_stream(s);
  free_region(*port, a);
  free_region(*port, h);
  free_region(*port, b);
}

TEST(CudaDriver, StreamWaitOrdersWorkAcrossStreams) {
  if (layerswap::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA GPU: skipped";
  auto port = make_cuda_driver(0);
  const std::size_t g = port->granularity();
  const std::size_t bytes = ((std::size_t{256} << 20) + g - 1) / g * g;  // long enough to still be running
  const region a = make_region(*port, bytes, memory_location::device);
  const region b = make_region(*port, bytes, memory_location::device);
  const region c = make_region(*port, bytes, memory_location::device);
  const stream_handle s1 = port->create_stream();
  const stream_handle s2 = port->create_stream();
  const event_handle e = port->create_event();
  EXPECT_TRUE(port->query(e)) << "a never-recorded event is complete";

  const std::vector<std::byte> in = pattern(bytes, 2);
  port->copy_from_host(a.va, in.data(), in.size());
  for (int i = 0; i < 8; ++i) port->copy_async(b.va, a.va, bytes, s1);
  port->record(e, s1);
  port->stream_wait(s2, e);
  port->copy_async(c.va, b.va, bytes, s2);
  port->synchronize(s2);
  EXPECT_TRUE(port->query(e)) << "s2 finished after s1's record";
  EXPECT_EQ(difference(in, read_back(*port, c.va, bytes)), "");

  port->destroy_event(e);
  port->destroy_stream(s1);
  port->destroy_stream(s2);
  free_region(*port, a);
  free_region(*port, b);
  free_region(*port, c);
}

// The holds of the residency engine (allocator/residency_gate.hpp): work queued behind a value wait does not run
// until another stream writes the value, however long the host takes, and then runs.
TEST(CudaDriver, ValueWaitHoldsAStreamUntilTheValueIsWritten) {
  if (layerswap::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA GPU: skipped";
  auto port = make_cuda_driver(0);
  const std::size_t g = port->granularity();
  const region flag = make_region(*port, g, memory_location::device);
  const region a = make_region(*port, g, memory_location::device);
  const region b = make_region(*port, g, memory_location::device);
  const std::vector<std::byte> zeros(g);
  port->copy_from_host(flag.va, zeros.data(), g);
  const std::vector<std::byte> in = pattern(g, 5);
  port->copy_from_host(a.va, in.data(), g);
  port->copy_from_host(b.va, zeros.data(), g);
  const stream_handle held = port->create_stream();
  const stream_handle writer = port->create_stream();
  const event_handle done = port->create_event();
  port->stream_wait_value(held, flag.va + 12, 7);
  port->copy_async(b.va, a.va, g, held);
  port->record(done, held);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(port->query(done)) << "work behind an unmet value wait ran";
  port->stream_write_value(writer, flag.va + 12, 6);  // below the value: still held
  port->synchronize(writer);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(port->query(done)) << "a smaller value released the wait (it must wait for >=)";
  port->stream_write_value(writer, flag.va + 12, 7);
  port->wait(done);
  EXPECT_EQ(difference(in, read_back(*port, b.va, g)), "");

  port->destroy_event(done);
  port->destroy_stream(held);
  port->destroy_stream(writer);
  free_region(*port, flag);
  free_region(*port, a);
  free_region(*port, b);
}

// The residency engine's write-back skip (allocator/residency.cpp, Note [Write-back]) rests on the GPU's digest
// being the function of runtime/digest.hpp: equal for equal bytes, different when one bit changes.
TEST(CudaDriver, DigestMatchesTheHostAndSeesEveryChange) {
  if (layerswap::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA GPU: skipped";
  auto port = make_cuda_driver(0);
  ASSERT_TRUE(port->can_digest()) << "the digest kernel did not load (built without nvcc?)";
  const std::size_t g = port->granularity();
  const std::size_t bytes = 64 * g;
  const region dev = make_region(*port, bytes, memory_location::device);
  const region host = make_region(*port, 2 * g, memory_location::host);
  std::vector<std::byte> in = pattern(bytes, 11);
  port->copy_from_host(dev.va, in.data(), bytes);
  port->copy_from_host(host.va, in.data(), 2 * g);
  std::uint64_t* words = port->alloc_host_words(8);
  const stream_handle s = port->create_stream();
  const event_handle done = port->create_event();
  auto gpu = [&](device_ptr va, std::size_t n, std::uint64_t* out) {
    port->digest_async(va, n, out, s);
    port->record(done, s);
    port->wait(done);
    return digest128{out[0], out[1]};
  };
  EXPECT_EQ(gpu(dev.va, bytes, words), digest_of(in.data(), bytes));
  EXPECT_EQ(gpu(dev.va + 16, g + 48, words + 2), digest_of(in.data() + 16, g + 48)) << "an unaligned, odd-sized range";
  EXPECT_EQ(gpu(host.va, 2 * g, words + 4), digest_of(in.data(), 2 * g)) << "host-located pages";
  const digest128 before = gpu(dev.va, bytes, words);
  for (const std::size_t at : {std::size_t{0}, bytes / 2 + 5, bytes - 1}) {
    in[at] ^= std::byte{0x10};
    port->copy_from_host(dev.va + at, &in[at], 1);
    const digest128 changed = gpu(dev.va, bytes, words);
    EXPECT_NE(changed.a, before.a) << "one bit flipped at byte " << at;
    EXPECT_NE(changed.b, before.b) << "one bit flipped at byte " << at;
    EXPECT_EQ(changed, digest_of(in.data(), bytes));
    in[at] ^= std::byte{0x10};
    port->copy_from_host(dev.va + at, &in[at], 1);
  }
  EXPECT_EQ(gpu(dev.va, bytes, words), before) << "restored bytes, same digest";
  // Two words swapped: the same multiset of words at other places.
  std::swap_ranges(in.begin(), in.begin() + 8, in.begin() + 8);
  port->copy_from_host(dev.va, in.data(), 16);
  EXPECT_NE(gpu(dev.va, bytes, words), before) << "a digest blind to word order";

  // Speed, for the record (not asserted): the engine digests every region it prefetches.
  const auto start = std::chrono::steady_clock::now();
  constexpr int k_rounds = 20;
  for (int i = 0; i < k_rounds; ++i) port->digest_async(dev.va, bytes, words, s);
  port->record(done, s);
  port->wait(done);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("digest: %d x %zu MiB in %.3f ms: %.0f GB/s\n", k_rounds, bytes >> 20, seconds * 1e3,
              k_rounds * static_cast<double>(bytes) / seconds / 1e9);

  port->destroy_event(done);
  port->destroy_stream(s);
  port->free_host_words(words);
  free_region(*port, dev);
  free_region(*port, host);
}

// allocator/residency.cpp, Note [Batched checks]: one digest_many_async gives every range the digest digest_async
// and the host function give it: ranges of very different sizes (one beyond what one launch's blocks cover in one
// pass, one of a single 16-byte unit, one on host-located pages, unaligned starts), more ranges than one launch
// takes (two launches), and batches again on the same stream (its scratch slot reused, by both kernels).
TEST(CudaDriver, BatchedDigestMatchesTheHostForEveryRange) {
  if (layerswap::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA GPU: skipped";
  auto port = make_cuda_driver(0);
  ASSERT_TRUE(port->can_digest()) << "the digest kernel did not load (built without nvcc?)";
  const std::size_t g = port->granularity();
  const std::size_t bytes = 16 * g;
  const region dev = make_region(*port, bytes, memory_location::device);
  const region host = make_region(*port, g, memory_location::host);
  const std::vector<std::byte> in = pattern(bytes, 23);
  port->copy_from_host(dev.va, in.data(), bytes);
  port->copy_from_host(host.va, in.data(), g);
  // (offset in `in`, bytes, on host pages); 1024 blocks x 256 threads x 16 bytes = 4 MiB per pass of one launch.
  struct piece {
    std::size_t offset;
    std::size_t bytes;
    bool on_host;
  };
  std::vector<piece> pieces = {
      {0, 12 * g + 48, false},   // 24 MiB + 48: beyond one pass
      {16, 16, false},           // one 16-byte unit
      {g + 4096, 4096 * 16 + 16, false},  // a block's worth and one unit more
      {0, g, true},              // host-located pages
      {13 * g - 16, 2 * g + 32, false},   // across the granules of the big one's end
      {48, 32, false},
  };
  for (std::size_t i = 0; pieces.size() < 40; ++i) {  // more than one launch takes
    pieces.push_back({(i * 7919 * 16) % (bytes - 64 * 1024), 16 * (1 + (i * 131) % 4000), false});
  }
  std::vector<digest_range> ranges;
  std::uint64_t* words = port->alloc_host_words(4 * pieces.size());
  std::uint64_t* single = words + 2 * pieces.size();
  for (std::size_t k = 0; k < pieces.size(); ++k) {
    const device_ptr va = (pieces[k].on_host ? host.va : dev.va) + pieces[k].offset;
    ranges.push_back({va, pieces[k].bytes, words + 2 * k});
  }
  const stream_handle s = port->create_stream();
  const event_handle done = port->create_event();
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    std::fill_n(words, 4 * pieces.size(), 0);
    port->digest_many_async(ranges, s);
    for (std::size_t k = 0; k < pieces.size(); ++k) {
      port->digest_async(ranges[k].va, ranges[k].bytes, single + 2 * k, s);
    }
    port->digest_many_async(std::span(ranges).first(3), s);  // the first three again, after digest_async's launches
    port->record(done, s);
    port->wait(done);
    for (std::size_t k = 0; k < pieces.size(); ++k) {
      const digest128 expected = digest_of(in.data() + pieces[k].offset, pieces[k].bytes);
      EXPECT_EQ((digest128{words[2 * k], words[2 * k + 1]}), expected)
          << "range " << k << ": " << pieces[k].bytes << " bytes at " << pieces[k].offset;
      EXPECT_EQ((digest128{single[2 * k], single[2 * k + 1]}), expected) << "digest_async of range " << k;
    }
  }

  // A bad range: nothing enqueued, the range named.
  std::vector<digest_range> bad(ranges.begin(), ranges.begin() + 3);
  bad[2].bytes = 24;
  try {
    port->digest_many_async(bad, s);
    ADD_FAILURE() << "no error for a range of 24 bytes";
  } catch (const cuda_error& e) {
    EXPECT_CONTAINS(e.what(), "range 2");
    EXPECT_CONTAINS(e.what(), "16-byte aligned");
  }

  // The launching thread's time, for the record (not asserted): the point of batching.
  std::vector<digest_range> small(32);
  for (std::size_t k = 0; k < small.size(); ++k) small[k] = {dev.va + k * 64 * 1024, 64 * 1024, words + 2 * k};
  constexpr int k_rounds = 50;
  auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < k_rounds; ++i) {
    for (const digest_range& r : small) port->digest_async(r.va, r.bytes, r.out, s);
  }
  const double one_each = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  port->record(done, s);
  port->wait(done);
  start = std::chrono::steady_clock::now();
  for (int i = 0; i < k_rounds; ++i) port->digest_many_async(small, s);
  const double batched = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  port->record(done, s);
  port->wait(done);
  std::printf("digest of 32 ranges: %.1f us of the launching thread in 32 launches, %.1f us in one batched launch\n",
              one_each / k_rounds * 1e6, batched / k_rounds * 1e6);

  port->destroy_event(done);
  port->destroy_stream(s);
  port->free_host_words(words);
  free_region(*port, dev);
  free_region(*port, host);
}

// Note [Batched unmaps] (allocator/residency.cpp): does one cuMemUnmap remove a run of several whole mappings?
// Either answer is fine for the engine (it falls back to one call per mapping); what must hold is that a refusal
// leaves every mapping in place, and a success leaves the range free to map again.
TEST(CudaDriver, OneUnmapOverSeveralMappingsWorksOrChangesNothing) {
  if (layerswap::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA GPU: skipped";
  auto port = make_cuda_driver(0);
  const std::size_t g = port->granularity();
  constexpr std::size_t k_pages = 8;
  const device_ptr va = port->reserve(k_pages * g, 0);
  std::vector<phys_handle> pages;
  for (std::size_t i = 0; i < k_pages; ++i) {
    pages.push_back(port->create(g, memory_location::device));
    port->map(va + i * g, g, pages[i], 0);
  }
  port->set_access(va, k_pages * g);
  const std::vector<std::byte> in = pattern(k_pages * g, 3);
  port->copy_from_host(va, in.data(), in.size());
  bool batched = true;
  const auto start = std::chrono::steady_clock::now();
  try {
    port->unmap(va, k_pages * g);
  } catch (const cuda_error& e) {
    batched = false;
    std::printf("one unmap over %zu mappings refused: %s\n", k_pages, e.what());
    EXPECT_EQ(difference(in, read_back(*port, va, in.size())), "") << "a refused unmap changed the mappings";
    for (std::size_t i = 0; i < k_pages; ++i) port->unmap(va + i * g, g);
  }
  const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
  std::printf("unmap of %zu mappings (%zu MiB): %s, %.1f us\n", k_pages, (k_pages * g) >> 20,
              batched ? "one call" : "one call each", us);
  for (std::size_t i = 0; i < k_pages; ++i) {
    EXPECT_NO_THROW(port->map(va + i * g, g, pages[i], 0)) << "page " << i << " is still mapped after the unmap";
  }
  for (std::size_t i = 0; i < k_pages; ++i) port->unmap(va + i * g, g);
  for (phys_handle h : pages) port->release(h);
  port->unreserve(va, k_pages * g);
}

TEST(CudaDriver, QueryBecomesTrueOnceTheWorkIsDone) {
  if (layerswap::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA GPU: skipped";
  auto port = make_cuda_driver(0);
  const std::size_t g = port->granularity();
  const std::size_t bytes = ((std::size_t{256} << 20) + g - 1) / g * g;
  const region a = make_region(*port, bytes, memory_location::device);
  const region h = make_region(*port, bytes, memory_location::host);
  const stream_handle s = port->create_stream();
  const event_handle e = port->create_event();
  for (int i = 0; i < 4; ++i) port->copy_async(h.va, a.va, bytes, s);  // ~20 ms over PCIe
  port->record(e, s);
  const bool done_at_once = port->query(e);
  port->wait(e);
  EXPECT_TRUE(port->query(e));
  if (done_at_once) std::printf("note: 1 GiB of copies completed before the first query\n");

  port->destroy_event(e);
  port->destroy_stream(s);
  free_region(*port, a);
  free_region(*port, h);
}

TEST(CudaDriver, CreatePastTotalMemoryThrowsDeviceOutOfMemory) {
  if (layerswap::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA GPU: skipped";
  auto port = make_cuda_driver(0);
  const std::size_t g = port->granularity();
  const std::size_t too_much = (port->total_memory() / g + 1) * g;
  try {
    const phys_handle h = port->create(too_much, memory_location::device);
    port->release(h);
    ADD_FAILURE() << "created more than the device has";
  } catch (const device_out_of_memory& e) {
    EXPECT_EQ(e.code(), 2);
    EXPECT_CONTAINS(e.what(), "cuMemCreate(");
    EXPECT_CONTAINS(e.what(), "CUDA_ERROR_OUT_OF_MEMORY");
  } catch (const cuda_error& e) {
    ADD_FAILURE() << "expected device_out_of_memory, got " << e.what();
  }
  // The port is still usable afterwards.
  const phys_handle h = port->create(g, memory_location::device);
  port->release(h);
}

TEST(CudaDriver, ErrorsNameTheCallTheArgumentsAndTheCudaError) {
  if (layerswap::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA GPU: skipped";
  auto port = make_cuda_driver(0);
  const std::size_t g = port->granularity();
  const device_ptr va = port->reserve(2 * g, 0);
  const phys_handle h = port->create(g, memory_location::device);
  try {
    port->map(va + g / 2, g, h, 0);
    ADD_FAILURE() << "misaligned map accepted";
  } catch (const cuda_error& e) {
    EXPECT_NE(e.code(), 0);
    EXPECT_CONTAINS(e.what(), "cuMemMap(va=0x");
    EXPECT_CONTAINS(e.what(), "failed: CUDA_ERROR_");
  }
  // Measured on the H100 (driver 580): cuMemUnmap of a reserved but unmapped range returns success. The
  // simulator is stricter on purpose (an unmap of nothing is an allocator bug); nothing is asserted here.
  port->unmap(va, g);
  EXPECT_THROW((void)port->create(g / 2, memory_location::device), cuda_error);
  port->release(h);
  port->unreserve(va, 2 * g);
}

// Driver rules the simulator enforces; if one of these fails, sim_driver must follow the hardware.
TEST(CudaDriver, UnmapRemovesWholeMappingsOnly) {
  if (layerswap::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA GPU: skipped";
  auto port = make_cuda_driver(0);
  const std::size_t g = port->granularity();
  const region r = make_region(*port, 2 * g, memory_location::device);
  EXPECT_THROW(port->unmap(r.va, g), cuda_error) << "the driver unmapped half of one mapping";
  free_region(*port, r);
}

TEST(CudaDriver, UnmapOfSeveralWholeMappingsAtOnce) {
  if (layerswap::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA GPU: skipped";
  auto port = make_cuda_driver(0);
  const std::size_t g = port->granularity();
  const device_ptr va = port->reserve(2 * g, 0);
  const phys_handle h1 = port->create(g, memory_location::device);
  const phys_handle h2 = port->create(g, memory_location::device);
  port->map(va, g, h1, 0);
  port->map(va + g, g, h2, 0);
  EXPECT_NO_THROW(port->unmap(va, 2 * g)) << "the simulator accepts one unmap over two whole mappings";
  port->release(h1);
  port->release(h2);
  port->unreserve(va, 2 * g);
}

TEST(CudaDriver, MapOntoAMappedRangeFails) {
  if (layerswap::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA GPU: skipped";
  auto port = make_cuda_driver(0);
  const std::size_t g = port->granularity();
  const region r = make_region(*port, g, memory_location::device);
  const phys_handle other = port->create(g, memory_location::device);
  EXPECT_THROW(port->map(r.va, g, other, 0), cuda_error);
  port->release(other);
  free_region(*port, r);
}

TEST(CudaDriver, ContentFollowsThePhysicalPagesThroughARemap) {
  if (layerswap::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA GPU: skipped";
  auto port = make_cuda_driver(0);
  const std::size_t g = port->granularity();
  const device_ptr va = port->reserve(g, 0);
  const phys_handle dev = port->create(g, memory_location::device);
  const phys_handle host = port->create(g, memory_location::host);
  const std::vector<std::byte> first = pattern(g, 3);
  const std::vector<std::byte> second = pattern(g, 4);

  port->map(va, g, dev, 0);
  port->set_access(va, g);
  port->copy_from_host(va, first.data(), g);
  port->unmap(va, g);
  port->map(va, g, host, 0);
  port->set_access(va, g);
  port->copy_from_host(va, second.data(), g);
  EXPECT_EQ(difference(second, read_back(*port, va, g)), "");
  port->unmap(va, g);
  port->map(va, g, dev, 0);
  port->set_access(va, g);
  EXPECT_EQ(difference(first, read_back(*port, va, g)), "") << "the device pages kept their content";
  port->unmap(va, g);
  port->release(dev);
  port->release(host);
  port->unreserve(va, g);
}

// A chunk (allocator/residency.cpp, Note [Chunks]) is mapped at its home VA and at its region's VA at once: both
// must show the same bytes, and unmapping one must leave the other.
TEST(CudaDriver, OneDeviceAllocationMappedAtTwoVasShowsTheSameBytes) {
  if (layerswap::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA GPU: skipped";
  auto port = make_cuda_driver(0);
  const std::size_t bytes = 4 * port->granularity();
  const region home = make_region(*port, bytes, memory_location::device);
  const device_ptr second = port->reserve(bytes, 0);
  port->map(second, bytes, home.handle, 0);
  port->set_access(second, bytes);
  const std::vector<std::byte> first = pattern(bytes, 5);
  port->copy_from_host(home.va, first.data(), bytes);
  EXPECT_EQ(difference(first, read_back(*port, second, bytes)), "");
  stream_handle s = port->create_stream();
  const region other = make_region(*port, bytes, memory_location::device);
  const std::vector<std::byte> next = pattern(bytes, 6);
  port->copy_from_host(other.va, next.data(), bytes);
  port->copy_async(second, other.va, bytes, s);  // a stream-ordered write through one VA ...
  port->synchronize(s);
  EXPECT_EQ(difference(next, read_back(*port, home.va, bytes)), "") << "... is read through the other";
  port->unmap(home.va, bytes);
  EXPECT_EQ(difference(next, read_back(*port, second, bytes)), "") << "the second mapping outlives the first";
  port->map(home.va, bytes, home.handle, 0);
  port->set_access(home.va, bytes);
  port->unmap(second, bytes);
  port->unreserve(second, bytes);
  port->destroy_stream(s);
  free_region(*port, other);
  free_region(*port, home);
}

TEST(CudaDriver, ReleasedPagesLiveUntilTheLastUnmap) {
  if (layerswap::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA GPU: skipped";
  auto port = make_cuda_driver(0);
  const std::size_t g = port->granularity();
  const region r = make_region(*port, g, memory_location::device);
  const std::vector<std::byte> in = pattern(g, 5);
  port->copy_from_host(r.va, in.data(), g);
  port->release(r.handle);
  EXPECT_EQ(difference(in, read_back(*port, r.va, g)), "");
  port->unmap(r.va, g);
  port->unreserve(r.va, g);
}

TEST(CudaDriver, MapAtANonzeroOffsetIsRefused) {
  if (layerswap::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA GPU: skipped";
  // Measured on the H100 (driver 580): cuMemMap with a non-zero offset fails with CUDA_ERROR_NOT_SUPPORTED,
  // as its documentation says ("currently must be zero"). The allocator maps whole handles only, and the
  // simulator refuses offsets the same way.
  auto port = make_cuda_driver(0);
  const std::size_t g = port->granularity();
  const region whole = make_region(*port, 2 * g, memory_location::device);
  const device_ptr tail = port->reserve(g, 0);
  try {
    port->map(tail, g, whole.handle, g);
    ADD_FAILURE() << "the driver accepted a non-zero offset: the simulator must be relaxed to match";
    port->unmap(tail, g);
  } catch (const cuda_error& e) {
    EXPECT_EQ(e.code(), 801) << e.what();  // CUDA_ERROR_NOT_SUPPORTED
  }
  port->unreserve(tail, g);
  free_region(*port, whole);
}

TEST(CudaDriver, WorksFromAThreadWithNoCurrentContext) {
  if (layerswap::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA GPU: skipped";
  auto port = make_cuda_driver(0);
  std::thread worker([&] {
    try {
      const region r = make_region(*port, port->granularity(), memory_location::device);
      const std::vector<std::byte> in = pattern(4096, 7);
      const stream_handle s = port->create_stream();
      port->copy_from_host(r.va, in.data(), in.size());
      port->copy_async(r.va + 8192, r.va, in.size(), s);
      port->synchronize(s);
      EXPECT_EQ(difference(in, read_back(*port, r.va + 8192, in.size())), "");
      port->destroy_stream(s);
      free_region(*port, r);
    } catch (const std::exception& e) {
      ADD_FAILURE() << e.what();
    }
  });
  worker.join();
}

TEST(CudaDriver, PortsShareThePrimaryContext) {
  if (layerswap::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA GPU: skipped";
  auto first = make_cuda_driver(0);
  auto second = make_cuda_driver(0);
  const stream_handle s = first->create_stream();
  const region r = make_region(*second, second->granularity(), memory_location::device);
  const std::vector<std::byte> in = pattern(4096, 8);
  second->copy_from_host(r.va, in.data(), in.size());
  second->copy_async(r.va + 4096, r.va, in.size(), s);  // a stream of one port, used by the other
  second->synchronize(s);
  first->destroy_stream(s);
  first.reset();  // drops one retain; the context stays for `second`
  EXPECT_EQ(difference(in, read_back(*second, r.va + 4096, in.size())), "");
  free_region(*second, r);
}

TEST(CudaDriver, MapsAndSetAccessAreCountedAndTimed) {
  if (layerswap::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA GPU: skipped";
  auto port = make_cuda_driver(0);
  const auto read = [](const char* name, std::uint64_t& calls, std::uint64_t& ns) {
    calls = 0;
    ns = 0;
    driver_calls::for_each([&](const driver_calls::row& r) {
      if (std::string(r.name) == name && !r.engine) {
        calls = r.calls;
        ns = r.ns;
      }
    });
  };
  std::uint64_t access0 = 0, access_ns0 = 0, map0 = 0, map_ns0 = 0;
  read("set_access", access0, access_ns0);
  read("map", map0, map_ns0);
  const std::size_t bytes = 8 * port->granularity();
  region r = make_region(*port, bytes, memory_location::host);  // map + set access of host-located pages
  std::uint64_t access1 = 0, access_ns1 = 0, map1 = 0, map_ns1 = 0;
  read("set_access", access1, access_ns1);
  read("map", map1, map_ns1);
  EXPECT_EQ(access1, access0 + 1);
  EXPECT_EQ(map1, map0 + 1);
  EXPECT_GT(access_ns1, access_ns0);  // granting access to host pages takes microseconds, never zero
  free_region(*port, r);
}

}  // namespace
}  // namespace layerswap
