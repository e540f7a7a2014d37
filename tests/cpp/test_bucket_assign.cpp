// Bucket assignment: whole tensors, per-group buckets, the small first cap,
// and launch order.
#include <gtest/gtest.h>

#include <numeric>

#include "core/bucket/assign.h"

namespace dsp {
namespace {

using Buckets = std::vector<std::vector<size_t>>;

TEST(BucketAssign, ReverseOrderWithSmallFirstBucket) {
  // six 400-byte tensors, caps {1000, 2000}: [5 4 3] closes at 1200 >= 1000,
  // then [2 1 0] (1200 < 2000, left open and flushed).
  std::vector<BucketTensor> ts(6, BucketTensor{400, 0});
  EXPECT_EQ(assignBuckets(ts, reverseOrder(6), {1000, 2000}),
            (Buckets{{5, 4, 3}, {2, 1, 0}}));
  EXPECT_EQ(assignBuckets(ts, reverseOrder(6), {400}),
            (Buckets{{5}, {4}, {3}, {2}, {1}, {0}}));
}

TEST(BucketAssign, NeverSplitsATensorLargerThanTheCap) {
  std::vector<BucketTensor> ts = {{100, 0}, {5000, 0}, {100, 0}};
  EXPECT_EQ(assignBuckets(ts, {0, 1, 2}, {1000}), (Buckets{{0, 1}, {2}}));
}

TEST(BucketAssign, GroupsNeverMixAndOrderFollowsFirstMember) {
  // groups: float (0) and double (1), interleaved
  std::vector<BucketTensor> ts = {{300, 0}, {300, 1}, {300, 0}, {300, 1}, {300, 0}};
  const Buckets b = assignBuckets(ts, {4, 3, 2, 1, 0}, {600});
  EXPECT_EQ(b, (Buckets{{4, 2}, {3, 1}, {0}}));
  for (const auto& bucket : b) {
    for (size_t i : bucket) EXPECT_EQ(ts[i].group, ts[bucket[0]].group);
  }
}

TEST(BucketAssign, ObservedOrderIsKept) {
  std::vector<BucketTensor> ts(4, BucketTensor{10, 0});
  EXPECT_EQ(assignBuckets(ts, {2, 0, 3, 1}, {20}), (Buckets{{2, 0}, {3, 1}}));
}

TEST(BucketAssign, EveryTensorExactlyOnceOverAGrid) {
  for (size_t n : {0u, 1u, 7u, 100u}) {
    for (size_t cap : {1u, 50u, 100000u}) {
      std::vector<BucketTensor> ts;
      for (size_t i = 0; i < n; ++i) ts.push_back({(i * 37) % 91 + 1, int64_t(i % 3)});
      const Buckets b = assignBuckets(ts, reverseOrder(n), {cap / 2 + 1, cap});
      std::vector<size_t> all;
      for (const auto& x : b) {
        EXPECT_FALSE(x.empty());
        all.insert(all.end(), x.begin(), x.end());
      }
      std::sort(all.begin(), all.end());
      std::vector<size_t> expect(n);
      std::iota(expect.begin(), expect.end(), 0);
      EXPECT_EQ(all, expect);
    }
  }
}

TEST(BucketAssign, RejectsABadOrder) {
  std::vector<BucketTensor> ts(3, BucketTensor{10, 0});
  EXPECT_THROW(assignBuckets(ts, {0, 0, 1}, {10}), std::invalid_argument);
  EXPECT_THROW(assignBuckets(ts, {0, 1}, {10}), std::invalid_argument);
  EXPECT_THROW(assignBuckets(ts, {0, 1, 2}, {}), std::invalid_argument);
}

}  // namespace
}  // namespace dsp
