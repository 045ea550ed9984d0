// The tracker's CUPTI-free core (tracker_core.hpp).
#include "profiler/tracker_core.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>

#include "runtime/fast_clock.hpp"
#include "runtime/log.hpp"
#include "runtime/thread_name.hpp"

namespace layerswap::profiler {

std::uint64_t now_ns() noexcept { return fast_clock::steady_ns(); }

const char* reason_name(undecoded_reason r) noexcept {
  switch (r) {
    case undecoded_reason::none: return "none";
    case undecoded_reason::no_layout: return "no_layout";
    case undecoded_reason::no_args: return "no_args";
    case undecoded_reason::graph: return "graph";
    case undecoded_reason::work_elsewhere: return "work_elsewhere";
    case undecoded_reason::count_: break;
  }
  return "?";
}

std::string attribution_report(const tracker_stats& s) {
  std::vector<std::pair<std::uint64_t, std::size_t>> met;  // (ns, state)
  for (std::size_t i = 0; i < k_engine_states; ++i) {
    if (s.launch_engine_calls[i] != 0) met.emplace_back(s.launch_engine_ns[i], i);
  }
  if (met.empty()) return {};
  std::sort(met.begin(), met.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::string out = "layerswap: launches' time in the driver by the migration thread's driver call they met:";
  char part[160];
  const char* sep = " ";
  for (const auto& [ns, i] : met) {
    const std::uint64_t n = s.launch_engine_calls[i];
    const char* kind = engine_state_name(i);
    const double mean_us = static_cast<double>(ns) / static_cast<double>(n) * 1e-3;
    std::snprintf(part, sizeof part, "%s%s %llu x %.1f us = %.1f ms", sep, kind, static_cast<unsigned long long>(n),
                  mean_us, static_cast<double>(ns) * 1e-6);
    out += part;
    sep = "; ";
  }
  std::uint64_t slow = 0;
  std::uint64_t slow_ns = 0;
  for (std::size_t b = 1; b < k_launch_hist; ++b) {  // bucket b's lower bound is bucket b - 1's upper one
    if (s.launch_hist_upper_ns[b - 1] < 16'000) continue;
    slow += s.launch_hist_calls[b];
    slow_ns += s.launch_hist_ns[b];
  }
  std::snprintf(part, sizeof part, "; %llu launches of 16 us or more (%.1f ms)\n",
                static_cast<unsigned long long>(slow), static_cast<double>(slow_ns) * 1e-6);
  return out + part;
}

tracker_core::tracker_core(tracker_options options)
    : options_(std::move(options)), ring_(options_.ring_capacity), origin_ns_(now_ns()) {
  if (!options_.trace_path.empty()) {
    if (trace_.open(options_.trace_path, options_.trace_max_events)) {
      stamp_ = true;
      LAYERSWAP_LOG(info, "writing a launch trace to %s", options_.trace_path.c_str());
    } else {
      LAYERSWAP_LOG(warn, "LAYERSWAP_TRACE=%s: cannot create the file; no trace is written",
                    options_.trace_path.c_str());
    }
  }
}

tracker_core::~tracker_core() {
  stop_consumer();
  try {
    consume();
  } catch (...) {
  }
  close_trace();
}

std::uint64_t tracker_core::record(launch_kind kind, std::uint64_t stream, std::uint32_t kernel,
                                   undecoded_reason reason, const region_set& regions) noexcept {
  const std::uint64_t launch = next_launch_.fetch_add(1, std::memory_order_relaxed);
  const std::uint64_t time = stamp_ ? now_ns() : 0;  // only the trace reads it
  int done = 0;
  bool first = true;
  do {
    const int n = std::min(regions.count - done, k_event_regions);
    const bool pushed = ring_.try_emplace([&](access_event& e) {
      e.launch_no = launch;
      e.stream = stream;
      e.time_ns = time;
      e.kernel = kernel;
      e.kind = kind;
      e.reason = reason;
      e.nregions = static_cast<std::uint8_t>(n);
      e.flags = static_cast<std::uint8_t>((first ? 0 : k_flag_continued) | (regions.truncated ? k_flag_truncated : 0));
      std::copy_n(regions.ids + done, n, e.regions);
    });
    if (!pushed) {
      dropped_.fetch_add(1, std::memory_order_relaxed);
      break;
    }
    done += n;
    first = false;
  } while (done < regions.count);
  if (consumer_asleep_.load(std::memory_order_seq_cst)) [[unlikely]] wake_consumer();  // Note [Idle consumer]
  return launch;
}

void tracker_core::wake_consumer() noexcept {
  if (!consumer_asleep_.exchange(false)) return;  // another producer woke it
  // Through the consumer's mutex, so that the wake cannot fall between its look at the flag and its wait.
  try {
    std::lock_guard lock(thread_mutex_);
  } catch (...) {  // cannot lock: the consumer still wakes at the end of its sleep
  }
  wake_.notify_one();
}

void tracker_core::consume_one_locked(const access_event& e) {
  if (trace_.is_open()) trace_.write(e, kernel_name(e.kind, e.kernel), origin_ns_);
  if (learner_ != nullptr) learner_->on_event(e);
  if (e.flags & k_flag_continued) {
    // Continue the launch's entry (usually the newest; another thread's launches may sit in between).
    for (auto it = recent_.rbegin(); it != recent_.rend() && it - recent_.rbegin() < 64; ++it) {
      if (it->launch_no == e.launch_no) {
        it->regions.insert(it->regions.end(), e.regions, e.regions + e.nregions);
        break;
      }
    }
    return;
  }
  tracker_stats& s = stats_;
  ++s.launches;
  switch (e.kind) {
    case launch_kind::kernel: ++s.kernels; break;
    case launch_kind::memcpy: ++s.copies; break;
    case launch_kind::memset: ++s.memsets; break;
    case launch_kind::graph: ++s.graphs; break;
  }
  if (e.reason == undecoded_reason::none) ++s.decoded;
  ++s.undecoded[static_cast<int>(e.reason)];
  if (e.nregions > 0) ++s.with_regions;
  if (e.flags & k_flag_truncated) ++s.truncated;
  if (e.kind == launch_kind::kernel && e.nregions == 0) ++no_region_by_kernel_[e.kernel];

  if (recent_.size() >= options_.recent_capacity) {
    recent_.pop_front();
    ++s.recent_dropped;
  }
  drained_event d;
  d.launch_no = e.launch_no;
  d.stream = e.stream;
  d.kernel = e.kernel;
  d.kind = e.kind;
  d.regions.assign(e.regions, e.regions + e.nregions);
  recent_.push_back(std::move(d));
}

std::size_t tracker_core::consume() {
  std::lock_guard lock(mutex_);
  std::size_t n = 0;
  access_event e;
  while (ring_.try_pop(e)) {
    consume_one_locked(e);
    ++n;
  }
  return n;
}

void tracker_core::start_consumer() {
  std::lock_guard lock(thread_mutex_);
  if (thread_.joinable()) return;
  stopping_ = false;
  thread_ = std::thread([this] {
    name_this_thread("layerswap-learn");
    std::unique_lock lock(thread_mutex_);
    int empty_polls = 0;
    while (!stopping_) {
      lock.unlock();
      std::size_t n = 0;
      try {
        n = consume();
      } catch (...) {
      }
      lock.lock();
      if (n >= ring_.capacity() / 4) continue;
      empty_polls = n == 0 ? empty_polls + 1 : 0;
      if (empty_polls < k_idle_polls) {
        // Busy producers never signal (that would be a syscall on the hot path): poll. Note [Consumer pacing]
        wake_.wait_for(lock, std::chrono::milliseconds(1));
        continue;
      }
      // Note [Idle consumer]: the mark, then a last look at the ring, then a long wait that a producer ends.
      consumer_asleep_.store(true, std::memory_order_seq_cst);
      if (!ring_empty()) {
        consumer_asleep_.store(false, std::memory_order_relaxed);
        empty_polls = 0;
        continue;
      }
      consumer_sleeps_.fetch_add(1, std::memory_order_relaxed);
      wake_.wait_for(lock, options_.idle_sleep,
                     [this] { return stopping_ || !consumer_asleep_.load(std::memory_order_relaxed); });
      // Woken by a launch: poll again. At the end of the sleep: one poll, and asleep again if it finds nothing.
      const bool woken = !consumer_asleep_.exchange(false, std::memory_order_relaxed);
      empty_polls = woken ? 0 : k_idle_polls - 1;
    }
  });
}

// Whether no record was claimed since the last consume() (under the consumer's mutex: head is its).
bool tracker_core::ring_empty() {
  std::lock_guard lock(mutex_);
  return ring_.nothing_claimed();
}

void tracker_core::stop_consumer() noexcept {
  {
    std::lock_guard lock(thread_mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

tracker_stats tracker_core::stats() {
  consume();
  std::lock_guard lock(mutex_);
  tracker_stats s = stats_;
  s.dropped = dropped_.load(std::memory_order_relaxed);
  s.nested_skipped = nested_.load(std::memory_order_relaxed);
  s.pointer_tables = pointer_tables_.load(std::memory_order_relaxed);
  s.table_launches = table_launches_.load(std::memory_order_relaxed);
  s.launch_api_ns = fast_clock::to_ns(launch_api_ticks_.load(std::memory_order_relaxed));
  s.launch_api_calls = launch_api_calls_.load(std::memory_order_relaxed);
  s.launch_driver_ns = fast_clock::to_ns(launch_driver_ticks_.load(std::memory_order_relaxed));
  for (std::size_t i = 0; i < k_engine_states; ++i) {
    s.launch_engine_calls[i] = launch_engine_calls_[i].load(std::memory_order_relaxed);
    s.launch_engine_ns[i] = fast_clock::to_ns(launch_engine_ticks_[i].load(std::memory_order_relaxed));
  }
  for (std::size_t b = 0; b < k_launch_hist; ++b) {
    s.launch_hist_calls[b] = launch_hist_calls_[b].load(std::memory_order_relaxed);
    s.launch_hist_ns[b] = fast_clock::to_ns(launch_hist_ticks_[b].load(std::memory_order_relaxed));
    const std::uint64_t upper = std::uint64_t{1} << (k_launch_hist_shift + b);
    s.launch_hist_upper_ns[b] = b + 1 < k_launch_hist ? fast_clock::to_ns(upper) : 0;  // the last bucket is open
  }
  s.consumer_sleeps = consumer_sleeps_.load(std::memory_order_relaxed);
  s.trace_written = trace_.written();
  s.trace_skipped = trace_.skipped();
  s.functions = layouts_.functions();
  std::map<std::string, std::uint64_t> families;
  for (const auto& [kernel, count] : no_region_by_kernel_) {
    const std::string name = kernel_name(launch_kind::kernel, kernel);
    families[std::string(kernel_family(name))] += count;
  }
  s.no_region_families.assign(families.begin(), families.end());
  std::sort(s.no_region_families.begin(), s.no_region_families.end(),
            [](const auto& a, const auto& b) { return a.second > b.second; });
  return s;
}

std::vector<drained_event> tracker_core::drain(std::size_t max) {
  consume();
  std::lock_guard lock(mutex_);
  const std::size_t n = std::min(max, recent_.size());
  std::vector<drained_event> out(std::make_move_iterator(recent_.begin()),
                                 std::make_move_iterator(recent_.begin() + static_cast<std::ptrdiff_t>(n)));
  recent_.erase(recent_.begin(), recent_.begin() + static_cast<std::ptrdiff_t>(n));
  return out;
}

std::string tracker_core::kernel_name(launch_kind kind, std::uint32_t kernel) const {
  switch (kind) {
    case launch_kind::memcpy: return "memcpy";
    case launch_kind::memset: return "memset";
    case launch_kind::graph: return "graph";
    case launch_kind::kernel: break;
  }
  const std::string_view name = layouts_.name(kernel);
  if (!name.empty()) return std::string(name);
  return "kernel#" + std::to_string(kernel);
}

void tracker_core::set_learner(learner* l) {
  std::lock_guard lock(mutex_);
  learner_ = l;
}

learner* tracker_core::get_learner() {
  std::lock_guard lock(mutex_);
  return learner_;
}

void tracker_core::close_trace() {
  std::lock_guard lock(mutex_);
  trace_.close();
}

}  // namespace layerswap::profiler
