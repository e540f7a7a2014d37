#include "assign.h"

#include <algorithm>
#include <map>
#include <stdexcept>
#include <string>

namespace dsp {

std::vector<size_t> reverseOrder(size_t n) {
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = n - 1 - i;
  return order;
}

std::vector<std::vector<size_t>> assignBuckets(const std::vector<BucketTensor>& tensors,
                                               const std::vector<size_t>& order,
                                               const std::vector<size_t>& caps) {
  if (caps.empty()) throw std::invalid_argument("assignBuckets: no bucket caps given");
  std::vector<bool> seen(tensors.size(), false);
  if (order.size() != tensors.size()) {
    throw std::invalid_argument("assignBuckets: order lists " +
                                std::to_string(order.size()) + " tensors, expected " +
                                std::to_string(tensors.size()));
  }
  struct Open {
    std::vector<size_t> members;
    size_t bytes = 0;
    size_t closed = 0;  // buckets of this group already closed
  };
  std::map<int64_t, Open> open;
  std::vector<std::vector<size_t>> out;
  for (size_t idx : order) {
    if (idx >= tensors.size() || seen[idx]) {
      throw std::invalid_argument("assignBuckets: order is not a permutation (index " +
                                  std::to_string(idx) + ")");
    }
    seen[idx] = true;
    Open& b = open[tensors[idx].group];
    b.members.push_back(idx);
    b.bytes += tensors[idx].bytes;
    const size_t cap = caps[std::min(b.closed, caps.size() - 1)];
    if (b.bytes >= cap) {
      out.push_back(std::move(b.members));
      b.members.clear();
      b.bytes = 0;
      ++b.closed;
    }
  }
  for (auto& kv : open) {
    if (!kv.second.members.empty()) out.push_back(std::move(kv.second.members));
  }
  // Launch order: by the position in `order` of each bucket's first tensor.
  std::vector<size_t> pos(tensors.size());
  for (size_t i = 0; i < order.size(); ++i) pos[order[i]] = i;
  std::sort(out.begin(), out.end(),
            [&](const std::vector<size_t>& a, const std::vector<size_t>& b) {
              return pos[a.front()] < pos[b.front()];
            });
  return out;
}

}  // namespace dsp
