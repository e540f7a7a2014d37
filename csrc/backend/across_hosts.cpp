// The agreement check for calls whose data crosses hosts over gloo.
//
// Within a host, the shared-memory comm compares every rank's call before
// any data moves. Gloo does not: when ranks on different hosts disagree
// about a size, gloo's network thread fails an enforce and the process is
// terminated (seen: "op.preamble.length <= op.nbytes ... Received data size
// doesn't match expected size"). So before such a call, the ranks it spans
// exchange a fixed-size signature (one small gloo all-gather, which cannot
// itself disagree) and every rank raises the same error naming every call.
// DSP_CHECK_ACROSS_HOSTS=0 skips it (one round trip per call saved).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <sstream>
#include <string>
#include <vector>

#include "process_group_dsp.h"

namespace dsparallel {
namespace {

// Fields of a signature: a hash of the collective's name, dtype, op, root,
// number of dimensions, the first kMaxDims sizes, and the element count.
constexpr int kMaxDims = 8;
constexpr int kFields = 5 + kMaxDims + 1;

int64_t nameHash(const char* s) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a: the same in every process
  for (; *s; ++s) h = (h ^ static_cast<unsigned char>(*s)) * 1099511628211ull;
  return static_cast<int64_t>(h >> 1);
}

const char* opName(int64_t op) {
  static const char* const kNames[] = {"SUM",  "AVG", "PRODUCT", "MIN",       "MAX",
                                       "BAND", "BOR", "BXOR",    "PREMUL_SUM"};
  return op >= 0 && op < 9 ? kNames[op] : "?";
}

std::string describe(const int64_t* f, const char* what, int64_t my_hash) {
  std::ostringstream o;
  o << (f[0] == my_hash ? what : "another collective") << " "
    << c10::toString(static_cast<c10::ScalarType>(f[1])) << "[";
  for (int64_t i = 0; i < std::min<int64_t>(f[4], kMaxDims); ++i)
    o << (i ? ", " : "") << f[5 + i];
  o << (f[4] > kMaxDims ? ", ...]" : "]");
  if (f[2] >= 0) o << " op " << opName(f[2]);
  if (f[3] >= 0) o << " root " << f[3];
  return o.str();
}

}  // namespace

void ProcessGroupDSP::checkAcrossHosts(c10d::Backend& group,
                                       const std::vector<int>& ranks, const char* what,
                                       const at::Tensor& t, int64_t op, int64_t root) {
  if (!check_across_hosts_) return;
  at::Tensor mine = at::full({kFields}, -1, at::kLong);
  int64_t* f = mine.data_ptr<int64_t>();
  f[0] = nameHash(what);
  f[1] = static_cast<int64_t>(t.scalar_type());
  f[2] = op;
  f[3] = root;
  f[4] = t.dim();
  for (int64_t i = 0; i < std::min<int64_t>(t.dim(), kMaxDims); ++i) f[5 + i] = t.size(i);
  f[kFields - 1] = t.numel();
  const int n = group.getSize();
  at::Tensor all = at::empty({n, kFields}, at::kLong);
  std::vector<std::vector<at::Tensor>> outs = {all.unbind(0)};
  std::vector<at::Tensor> in = {mine};
  group.allgather(outs, in)->wait();
  if (all.eq(mine).all().item<bool>()) return;
  std::ostringstream msg;
  msg << "dsp " << what << ": ranks on different hosts called mismatched collectives "
      << "(every rank must call the same collective with the same dtype, shape, op and "
      << "root); nothing crossed hosts, and the group stays usable:";
  for (int i = 0; i < n; ++i) {
    const int global = i < static_cast<int>(ranks.size()) ? ranks[i] : i;
    msg << "\n  rank " << global << ": "
        << describe(all[i].data_ptr<int64_t>(), what, f[0]);
  }
  TORCH_CHECK(false, msg.str());
}

}  // namespace dsparallel
