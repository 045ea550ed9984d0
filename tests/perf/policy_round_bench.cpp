// Micro benchmark of a policy round (residency.cpp, Note [Policy]) on the simulated device: how long the migration
// thread's round holds the allocator mutex, which the program's allocations wait for. Not a test (nothing is
// asserted, CI does not run it): built as layerswap_policy_bench, run by hand:
//
//     layerswap_policy_bench [rounds]
//
// The shape is the 1.1B Llama LoRA step's: 22 groups of 7 forecast regions (a layer's weights) and 150 live
// regions absent from the forecast (activations). Each round the forecast slides by one region, as the launches
// move on, and the region it passed is read (a launch, framed by the gate). Two budgets: everything fits (nothing
// moves, as at LAYERSWAP_BUDGET above the model) and a quarter of the forecast bytes fit (regions move every
// round). Reports the mutex time per round from the engine's own counters (policy_us / policy_rounds), hot (rounds
// back to back) and cold (a walk over a 32 MiB buffer between rounds evicts the engine's data from the caches, as
// the migration thread's sleep between rounds and the program's threads do on a real machine).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <vector>

#include "allocator/caching_allocator.hpp"
#include "allocator/forecast.hpp"
#include "allocator/region_map.hpp"
#include "allocator/residency_gate.hpp"
#include "runtime/sim_driver.hpp"

using namespace layerswap;

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t k_groups = 22;
constexpr std::size_t k_per_group = 7;
constexpr std::size_t k_activations = 150;
constexpr std::size_t k_region = 2 * MiB;

class sliding_forecast final : public forecast_source {
 public:
  explicit sliding_forecast(std::vector<region_id> order) : order_(std::move(order)) {}
  void advance() {
    std::lock_guard lock(mutex_);
    position_ = (position_ + 1) % order_.size();
  }
  void current(forecast& out, std::size_t max_regions) override {
    std::lock_guard lock(mutex_);
    out.learned = true;
    out.generation = 1;
    out.step_launches = order_.size() * 10;
    out.position = position_ * 10;
    out.upcoming.clear();
    for (std::size_t k = 0; k < order_.size() && k < max_regions; ++k) {
      const std::size_t i = (position_ + k) % order_.size();
      out.upcoming.push_back({order_[i], static_cast<std::uint32_t>(i / k_per_group + 1), (k + 1) * 10});
    }
  }

 private:
  std::mutex mutex_;
  std::vector<region_id> order_;
  std::size_t position_ = 0;
};

struct result {
  double us_per_round;
  double maintain_us_per_round;
  double moves_per_round;
};

result run(std::size_t budget, int rounds, std::size_t cold_bytes) {
  std::vector<std::uint64_t> walk(cold_bytes / sizeof(std::uint64_t));
  sim_options so;
  so.total_memory = 2048 * MiB;
  sim_driver sim(so);
  allocator_options o;
  o.budget = budget;
  o.va_reserve = 4096 * MiB;
  o.residency.enabled = true;
  o.residency.without_tracker = true;
  o.residency.thread = false;
  caching_allocator alloc(sim, o);
  stream_handle s = sim.create_stream();
  const stream_handle streams[] = {s};
  alloc.set_streams(streams);

  std::vector<void*> weights, activations;
  std::vector<region_id> order;
  for (std::size_t i = 0; i < k_groups * k_per_group; ++i) {
    weights.push_back(alloc.allocate(k_region, s));
    order.push_back(region_map::lookup(reinterpret_cast<device_ptr>(weights.back())));
  }
  sliding_forecast f(order);
  alloc.set_forecast_source(&f);
  for (int i = 0; i < 5; ++i) alloc.residency_tick();  // the forecast's ranks, before the activations press
  for (std::size_t i = 0; i < k_activations; ++i) activations.push_back(alloc.allocate(k_region, s));
  std::uint64_t launch_no = 0;
  auto touch = [&](region_id id) {
    residency_gate::enter(id);
    residency_gate::exit(id, ++launch_no);
  };
  for (int i = 0; i < 50; ++i) alloc.residency_tick();  // settle
  const residency_stats before = alloc.residency();
  for (int i = 0; i < rounds; ++i) {
    f.advance();
    touch(order[static_cast<std::size_t>(i) % order.size()]);
    for (std::size_t k = 0; k < walk.size(); k += 8) walk[k] += 1;  // one write per cache line
    alloc.residency_tick();
  }
  const residency_stats after = alloc.residency();
  const double n = static_cast<double>(after.policy_rounds - before.policy_rounds);
  result r{static_cast<double>(after.policy_us - before.policy_us) / n,
           static_cast<double>(after.maintain_us - before.maintain_us) / n,
           static_cast<double>((after.evictions - before.evictions) + (after.prefetches - before.prefetches)) / n};
  for (void* p : activations) alloc.deallocate(p);
  for (void* p : weights) alloc.deallocate(p);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 2000;
  const std::size_t forecast_bytes = k_groups * k_per_group * k_region;
  const std::size_t transient = k_activations * k_region;
  std::printf("policy round: %zu forecast regions in %zu groups, %zu activations, %d rounds\n",
              k_groups * k_per_group, k_groups, k_activations, rounds);
  for (const auto& [name, budget] : {std::pair{"everything fits", 4 * forecast_bytes + transient},
                                     std::pair{"a quarter fits", forecast_bytes / 4 + transient + 8 * MiB}}) {
    for (const std::size_t cold : {std::size_t{0}, 32 * MiB}) {
      const result r = run(budget, cold ? rounds / 4 : rounds, cold);
      std::printf("  %-16s %-5s %8.1f us per round (mutex held; housekeeping %4.1f), %5.2f moves per round\n", name,
                  cold ? "cold" : "hot", r.us_per_round, r.maintain_us_per_round, r.moves_per_round);
    }
  }
  return 0;
}
