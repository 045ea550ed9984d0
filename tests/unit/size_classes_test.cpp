#include "allocator/size_classes.hpp"

#include <gtest/gtest.h>

#include <random>

namespace layerswap {
namespace {

constexpr std::size_t k_mib = std::size_t{1} << 20;

void check_size(std::size_t bytes) {
  const std::uint32_t i = size_class_index(bytes);
  const std::size_t block = size_class_bytes(i);
  ASSERT_GE(block, bytes) << "class too small for " << bytes;
  ASSERT_EQ(block % k_min_block, 0u) << "class " << block << " is not 512-byte aligned";
  if (bytes <= 4096) {
    ASSERT_LT(block - bytes, k_min_block) << bytes;
  } else {
    ASSERT_LE((block - bytes) * 8, bytes) << "more than 12.5% waste for " << bytes;
  }
  if (i > 0) {
    ASSERT_LT(size_class_bytes(i - 1), bytes) << "a smaller class would hold " << bytes;
  }
}

TEST(SizeClasses, EveryClassIsTheSmallestThatFitsWithBoundedWaste) {
  for (std::size_t b = 1; b <= 64 * 1024; ++b) check_size(b);
  std::mt19937_64 rng(7);
  for (int i = 0; i < 200000; ++i) check_size(1 + rng() % (4 * k_mib));
}

TEST(SizeClasses, IndicesAreDenseAndIncreasing) {
  const std::uint32_t n = size_class_count(k_mib);
  for (std::uint32_t i = 0; i < n; ++i) {
    EXPECT_EQ(size_class_index(size_class_bytes(i)), i);
    if (i) {
      EXPECT_GT(size_class_bytes(i), size_class_bytes(i - 1));
    }
  }
  EXPECT_EQ(size_class_bytes(n - 1), k_mib);
  EXPECT_EQ(size_class_bytes(0), 512u);
}

TEST(SizeClasses, SlabTailIsAtMostAnEighth) {
  const std::size_t gran = 2 * k_mib;
  for (std::uint32_t i = 0; i < size_class_count(k_mib); ++i) {
    const std::size_t block = size_class_bytes(i);
    const std::size_t slab = slab_bytes_for(block, gran);
    EXPECT_EQ(slab % gran, 0u);
    EXPECT_GE(slab / block, 1u);
    EXPECT_LE((slab % block) * 8, slab) << "block " << block << " slab " << slab;
    EXPECT_LE(slab, 8 * gran);
  }
}

}  // namespace
}  // namespace layerswap
