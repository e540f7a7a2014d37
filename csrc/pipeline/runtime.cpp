// The pipeline runtime (see runtime.h).
//
// Transfers: a send is posted asynchronously and awaited at the end of the
// step; a receive completes at its RECV action. gloo moves a message only
// once both ends have posted it, and a message that "dsp" has the receiver
// read in place is read only when the receiver waits or tests, so a receive
// posted late can stall its sender's data until the receiving rank gets
// there. Receives are therefore posted ahead wherever their shape is
// known: a gradient as soon as its activation is sent, the next
// micro-batch's activation as soon as the previous one has arrived.
//
// An activation carries a header (shape, dtype), so that a stage whose output
// changes shape is caught on both ends. A stage's first activation sends its
// header alone, then the data; from then on both ends know the size, and
// header and payload travel as one message (one transfer, not two; over
// "dsp" written into the receiver's ring from where each is), except
// for large payloads: those keep the two messages, so that the payload goes
// straight from the stage's output, with no copy into a message first.
#include "runtime.h"

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <utility>

#include "backend/process_group_dsp.h"
#include "split_backward.h"

namespace dsparallel::pipeline {
namespace {

using dsp::pipeline::ActionType;

constexpr int kMaxDims = 8;
constexpr int kHeaderLen = 2 + kMaxDims;  // ndim, dtype code, the sizes
// Once a stage's output shape is known, an activation travels as one message:
// the header, then the payload from this byte on (aligned for every dtype).
constexpr int64_t kPayloadOffset = 128;
static_assert(kHeaderLen * 8 <= kPayloadOffset, "the header fits before the payload");
const std::vector<at::ScalarType> kDTypes = {at::kFloat,    at::kDouble, at::kHalf,
                                             at::kBFloat16, at::kLong,   at::kInt};

double now() {
  return std::chrono::duration<double>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string shapeString(at::IntArrayRef shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    out += (i ? ", " : "") + std::to_string(shape[i]);
  }
  return out + "]";
}

// A header whose first word is kFailed marks an activation that a failed
// step sends in place of an output: then come the rank, stage and
// micro-batch where the step failed.
constexpr int64_t kFailed = -1;

struct Header {
  bool failed = false;
  int64_t rank = -1, stage = -1, microbatch = -1;  // where it failed
  std::vector<int64_t> shape;
  at::ScalarType dtype = at::kFloat;
};

Header parseHeader(const at::Tensor& message) {
  const int64_t* h = reinterpret_cast<const int64_t*>(message.data_ptr());
  if (h[0] == kFailed) return {true, h[1], h[2], h[3], {}, at::kFloat};
  TORCH_CHECK(h[0] >= 0 && h[0] <= kMaxDims && h[1] >= 0 &&
                  h[1] < static_cast<int64_t>(kDTypes.size()),
              "dsp pipeline: a corrupt activation header (ndim ", h[0], ", dtype code ",
              h[1], ")");
  return {false, -1, -1, -1, std::vector<int64_t>(h + 2, h + 2 + h[0]), kDTypes[h[1]]};
}

int64_t payloadBytes(const std::vector<int64_t>& shape, at::ScalarType dtype) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n * static_cast<int64_t>(c10::elementSize(dtype));
}

// From this size a payload travels as a message of its own, after its header:
// copying 512 KiB into a one-message buffer costs more (tens of us, and the
// buffer's fresh pages) than a second message, and on one host "dsp" reads a
// payload this large in place, from the stage's output itself
// (benchmarks/p2p.py).
constexpr int64_t kPayloadAloneBytes = int64_t{512} << 10;

// Between two compute actions an operator costs 5-15 us: three views of a
// received message took 12 us after a compute, against 1.5 us repeated back to
// back (the dispatcher's code has left the caches during the compute),
// several times a transfer's copy. So the transfers allocate (at::detail::empty_cpu),
// copy and view their buffers without dispatching operators.

// The payload of a one-message activation, as a tensor over its bytes (which
// it keeps alive).
at::Tensor payloadOf(const at::Tensor& message, const std::vector<int64_t>& shape,
                     at::ScalarType dtype) {
  return at::from_blob(
      static_cast<char*>(message.data_ptr()) + kPayloadOffset, shape,
      [keep = message](void*) {}, at::TensorOptions(dtype).device(message.device()));
}

void waitAll(std::vector<c10::intrusive_ptr<c10d::Work>>& works) {
  for (auto& w : works) w->wait();
  works.clear();
}

}  // namespace

Runtime::Runtime(std::vector<dsp::pipeline::Action> actions, int num_stages,
                 int num_ranks, int num_microbatches,
                 c10::intrusive_ptr<c10d::ProcessGroup> group,
                 dsp::pipeline::Placement placement)
    : actions_(std::move(actions)),
      num_stages_(num_stages),
      num_ranks_(num_ranks),
      num_microbatches_(num_microbatches),
      my_rank_(group->getRank()),
      group_(std::move(group)),
      placement_(placement) {
  TORCH_CHECK_VALUE(group_->getSize() == num_ranks_, "dsp pipeline: the schedule needs ",
                    num_ranks_, " ranks, the group has ", group_->getSize());
  tags_per_step_ = int64_t{num_stages_} * num_microbatches_ * 4;
  TORCH_CHECK_VALUE(tags_per_step_ <= std::numeric_limits<int>::max(),
                    "dsp pipeline: ", num_stages_, " stages x ", num_microbatches_,
                    " micro-batches need more message tags than an int holds");
  generations_ = std::numeric_limits<int>::max() / tags_per_step_;
}

int Runtime::tag(int stage, int mb, bool backward, bool header) const {
  const int64_t in_step =
      ((int64_t{stage} * num_microbatches_ + mb) * 2 + static_cast<int>(backward)) * 2 +
      static_cast<int>(header);
  return static_cast<int>(steps_ % generations_ * tags_per_step_ + in_step);
}

void Runtime::fail(int stage, int mb, const char* action) {
  if (failure_.rank >= 0) return;
  failure_.rank = my_rank_;
  failure_.stage = stage;
  failure_.microbatch = mb;
  failure_.error = std::current_exception();
  try {
    std::rethrow_exception(failure_.error);
  } catch (const std::exception& e) {
    failure_.what = std::string(action) + ": " + e.what();
  } catch (...) {
    failure_.what = std::string(action) + ": an unknown exception";
  }
}

c10d::Backend& Runtime::backendFor(const at::Tensor& t) {
  if (!backend_ || backend_device_ != t.device().type()) {
    backend_device_ = t.device().type();
    backend_ = group_->getBackend(backend_device_);
  }
  return *backend_;
}

c10::intrusive_ptr<c10d::Work> Runtime::send(const at::Tensor& t, int dst, int tag) {
  std::vector<at::Tensor> tensors = {t};
  return backendFor(t).send(tensors, dst, tag);
}

c10::intrusive_ptr<c10d::Work> Runtime::recv(const at::Tensor& t, int src, int tag) {
  std::vector<at::Tensor> tensors = {t};
  return backendFor(t).recv(tensors, src, tag);
}

void Runtime::checkShape(int stage, int mb, at::IntArrayRef shape, at::ScalarType dtype) {
  const auto [it, first] = shapes_.try_emplace(stage, shape.vec(), dtype);
  if (first) return;
  TORCH_CHECK(
      it->second.first == shape.vec(), "stage ", stage,
      " output changed shape between micro-batches: ", shapeString(it->second.first),
      " for the first, ", shapeString(shape), " for micro-batch ", mb);
  TORCH_CHECK(it->second.second == dtype, "stage ", stage,
              " output changed dtype between micro-batches: ", it->second.second,
              " for the first, ", dtype, " for micro-batch ", mb);
}

void Runtime::sendActivation(int stage, int mb, const at::Tensor* out,
                             std::vector<c10::intrusive_ptr<c10d::Work>>& pending) {
  const int dst = rankOf(stage + 1);
  const auto known = shapes_.find(stage);
  // What the receiver expects: the payload of the shape it knows (-1: none
  // yet, the stage's first activation).
  const int64_t expected = known == shapes_.end()
                               ? -1
                               : payloadBytes(known->second.first, known->second.second);
  if (out != nullptr) {
    try {
      const bool sendable = std::find(kDTypes.begin(), kDTypes.end(),
                                      out->scalar_type()) != kDTypes.end() &&
                            out->dim() <= kMaxDims;
      TORCH_CHECK_VALUE(sendable, "stage ", stage, " output of dtype ",
                        out->scalar_type(), " and ", out->dim(),
                        " dims cannot be sent between stages");
      checkShape(stage, mb, out->sizes(), out->scalar_type());
    } catch (...) {
      fail(stage, mb, "forward");
      out = nullptr;  // sent as failed, in the sizes the receiver expects
    }
  }
  // The stage's first activation: the receiver cannot know its size, so the
  // header goes alone and the data follows; so do large ones. Later small
  // ones travel as one message of the known size: header, then payload.
  const bool alone = expected < 0 || expected >= kPayloadAloneBytes;
  // Over "dsp" the header and the payload meet in the receiver's ring, not
  // in a buffer here first: that allocation and copy cost more than the
  // ring copy of a 64 KB activation.
  auto* framed = !alone && out && out->is_cpu() && out->is_contiguous()
                     ? dynamic_cast<ProcessGroupDSP*>(&backendFor(*out))
                     : nullptr;
  const int64_t size = alone ? kHeaderLen * 8 : kPayloadOffset + (framed ? 0 : expected);
  at::Tensor message = at::detail::empty_cpu({size}, at::kByte);
  int64_t* h = reinterpret_cast<int64_t*>(message.data_ptr());
  std::fill(h, h + kHeaderLen, 0);
  if (out == nullptr) {
    // A failed step: the header says where it failed; the receiver gets
    // messages of the sizes it expects, so that none stays posted.
    h[0] = kFailed;
    h[1] = failure_.rank;
    h[2] = failure_.stage;
    h[3] = failure_.microbatch;
    pending.push_back(send(message, dst, tag(stage, mb, false, true)));
    if (alone && expected >= 0) {
      pending.push_back(send(at::detail::empty_cpu({expected}, at::kByte), dst,
                             tag(stage, mb, false, false)));
    }
    return;
  }
  h[0] = out->dim();
  h[1] = std::find(kDTypes.begin(), kDTypes.end(), out->scalar_type()) - kDTypes.begin();
  std::copy(out->sizes().begin(), out->sizes().end(), h + 2);
  if (alone) {
    // Received into host memory, as the one-message form is; no operator
    // is dispatched for an output already there (see above).
    const at::Tensor payload =
        out->is_cpu() && out->is_contiguous() ? *out : out->contiguous().cpu();
    pending.push_back(send(message, dst, tag(stage, mb, false, true)));
    pending.push_back(send(payload, dst, tag(stage, mb, false, false)));
    return;
  }
  if (framed) {
    pending.push_back(
        framed->sendWithHead(message, *out, dst, tag(stage, mb, false, true)));
    return;
  }
  if (out->is_cpu() && out->is_contiguous()) {
    std::memcpy(static_cast<char*>(message.data_ptr()) + kPayloadOffset, out->data_ptr(),
                out->nbytes());
  } else {
    payloadOf(message, known->second.first, known->second.second).copy_(*out);
  }
  pending.push_back(send(message, dst, tag(stage, mb, false, true)));
}

void Runtime::prefetchActivation(int stage, int mb) {
  const auto shape = shapes_.find(stage - 1);
  const Key key{false, stage, mb};
  if (shape == shapes_.end() || posted_.count(key)) return;
  const int src = rankOf(stage - 1);
  const auto& [sizes, dtype] = shape->second;
  const int64_t bytes = payloadBytes(sizes, dtype);
  Posted p;
  if (bytes >= kPayloadAloneBytes) {  // header, then the payload alone
    p.header = at::detail::empty_cpu({kHeaderLen * 8}, at::kByte);
    p.data = at::detail::empty_cpu(sizes, dtype);
    p.works.push_back(recv(p.header, src, tag(stage - 1, mb, false, true)));
    p.works.push_back(recv(p.data, src, tag(stage - 1, mb, false, false)));
  } else {
    p.header = at::detail::empty_cpu({kPayloadOffset + bytes}, at::kByte);
    p.works.push_back(recv(p.header, src, tag(stage - 1, mb, false, true)));
  }
  posted_.emplace(key, std::move(p));
}

MaybeTensor Runtime::receiveActivation(int stage, int mb) {
  const int src = rankOf(stage - 1);
  Header header;
  at::Tensor data, message;
  if (!shapes_.count(stage - 1)) {  // the stage's first activation: header, then data
    message = at::empty({kHeaderLen * 8}, at::kByte);
    recv(message, src, tag(stage - 1, mb, false, true))->wait();
    header = parseHeader(message);
    if (!header.failed) {
      data = at::empty(header.shape, at::TensorOptions(header.dtype));
      recv(data, src, tag(stage - 1, mb, false, false))->wait();
    }
  } else {
    prefetchActivation(stage, mb);  // if not posted ahead
    const auto posted = posted_.find({false, stage, mb});
    Posted p = std::move(posted->second);
    posted_.erase(posted);
    waitAll(p.works);
    header = parseHeader(p.header);
    message = p.header;
    data = p.data;
  }
  // The previous stage waits for a gradient wherever it knew the size to
  // post one: for every activation but a failed first one.
  grad_expected_[{stage, mb}] = !header.failed || shapes_.count(stage - 1);
  if (header.failed) {
    if (failure_.rank < 0) {
      failure_.rank = static_cast<int>(header.rank);
      failure_.stage = static_cast<int>(header.stage);
      failure_.microbatch = static_cast<int>(header.microbatch);
    }
    return std::nullopt;
  }
  checkShape(stage - 1, mb, header.shape, header.dtype);
  return data.defined() ? data : payloadOf(message, header.shape, header.dtype);
}

void Runtime::exchangeStatus() {
  // [failed?, rank, stage, micro-batch, text bytes], then the text.
  constexpr int64_t kStatusBytes = 512, kWords = 5;
  at::Tensor mine = at::zeros({kStatusBytes}, at::kByte);
  auto* w = reinterpret_cast<int64_t*>(mine.data_ptr());
  const bool here = failure_.error != nullptr;
  const std::string& what = failure_.what;
  const int64_t len = std::min<int64_t>(what.size(), kStatusBytes - kWords * 8);
  if (here) {
    w[0] = 1;
    w[1] = failure_.rank;
    w[2] = failure_.stage;
    w[3] = failure_.microbatch;
    w[4] = len;
    std::memcpy(reinterpret_cast<char*>(w + kWords), what.data(), len);
  }
  std::vector<at::Tensor> in = {mine};
  std::vector<std::vector<at::Tensor>> out(1);
  for (int r = 0; r < num_ranks_; ++r) out[0].push_back(at::empty_like(mine));
  group_->allgather(out, in)->wait();
  if (here) std::rethrow_exception(failure_.error);
  for (const at::Tensor& t : out[0]) {
    const auto* s = reinterpret_cast<const int64_t*>(t.data_ptr());
    if (s[0] == 0) continue;
    TORCH_CHECK(false, "dsp pipeline: the step failed on rank ", s[1], " (stage ", s[2],
                ", micro-batch ", s[3], ", ",
                std::string(reinterpret_cast<const char*>(s + kWords), s[4]),
                "). Every rank skipped the rest of its compute and still made its "
                "transfers, so the group is usable: zero the gradients and step again");
  }
}

void Runtime::step(const ForwardFn& forward, const BackwardFn& backward,
                   const WeightFn& weight) {
  // What travels for one (stage, micro-batch), each dropped once consumed.
  struct Slot {
    MaybeTensor input, output, grad_output, grad_input;
  };
  std::map<std::pair<int, int>, Slot> slots;
  std::vector<c10::intrusive_ptr<c10d::Work>> pending;  // sends
  ++steps_;                                             // this step's tags
  posted_.clear();
  grad_expected_.clear();
  failure_ = Failure{};
  auto& store = weight_grads_;
  std::map<std::pair<int, int>, int64_t> deferred;  // (stage, mb) -> capture
  trace_.clear();
  transfers_.clear();
  const int last = num_stages_ - 1;
  const auto failed = [this] { return failure_.rank >= 0; };
  try {
    for (const auto& a : actions_) {
      if (a.type == ActionType::kRecvF && a.microbatch == 0)
        prefetchActivation(a.stage, 0);
    }
    for (const auto& a : actions_) {
      const int s = a.stage, mb = a.microbatch;
      Slot& slot = slots[{s, mb}];
      const bool transfer = a.type == ActionType::kSendF ||
                            a.type == ActionType::kRecvF ||
                            a.type == ActionType::kSendB || a.type == ActionType::kRecvB;
      const double started = transfer ? now() : 0.0;
      switch (a.type) {
        case ActionType::kForward: {
          MaybeTensor in = std::exchange(slot.input, std::nullopt);
          if (failed()) break;
          const double t0 = now();
          MaybeTensor out;
          try {
            out = forward(s, mb, std::move(in));
            TORCH_CHECK(s == last || (out.has_value() && out->defined()), "stage ", s,
                        " forward returned no output");
          } catch (...) {
            fail(s, mb, "forward");
            break;
          }
          trace_.emplace_back(dsp::pipeline::toString(a), t0, now());
          if (s == last) break;
          if (local(s + 1)) {
            slots[{s + 1, mb}].input = std::move(out);
          } else {
            slot.output = std::move(out);
          }
          break;
        }
        case ActionType::kBackward:
        case ActionType::kInput: {
          MaybeTensor grad;
          if (s != last) {
            grad = local(s + 1)
                       ? std::exchange(slots[{s + 1, mb}].grad_input, std::nullopt)
                       : std::exchange(slot.grad_output, std::nullopt);
          }
          if (failed()) break;
          const double t0 = now();
          // I: the weight gradients of split ops wait in the store for the W.
          const bool split = a.type == ActionType::kInput;
          if (split) store.begin();
          MaybeTensor grad_input;
          try {
            grad_input = backward(s, mb, std::move(grad));
          } catch (...) {
            if (split) store.end();
            fail(s, mb, split ? "input gradient" : "backward");
            break;
          }
          if (split) deferred[{s, mb}] = store.end();
          trace_.emplace_back(dsp::pipeline::toString(a), t0, now());
          if (s != 0) slot.grad_input = std::move(grad_input);
          break;
        }
        case ActionType::kWeight: {
          if (failed()) break;
          const auto it = deferred.find({s, mb});
          TORCH_CHECK(it != deferred.end(), "dsp pipeline: ", dsp::pipeline::toString(a),
                      " before its I");
          const double t0 = now();
          try {
            store.run(it->second, weight ? weight(s, mb) : std::vector<at::Tensor>{});
          } catch (...) {
            fail(s, mb, "weight gradient");
          }
          deferred.erase(it);
          trace_.emplace_back(dsp::pipeline::toString(a), t0, now());
          break;
        }
        case ActionType::kSendF: {
          MaybeTensor out = std::exchange(slot.output, std::nullopt);
          sendActivation(s, mb, failed() ? nullptr : &*out, pending);  // may fail
          // The gradient comes back into a buffer of the output's shape: the
          // one sent, or the stage's known one (a failed step sends zeros).
          const auto known = shapes_.find(s);  // registered by a sent output
          if (!failed() || known != shapes_.end()) {
            Posted p;
            p.data =
                !failed() && !out->is_cpu()
                    ? at::empty(out->sizes(), out->options())
                    : at::detail::empty_cpu(known->second.first, known->second.second);
            p.works.push_back(recv(p.data, rankOf(s + 1), tag(s + 1, mb, true, false)));
            posted_.emplace(Key{true, s, mb}, std::move(p));
          }
          break;
        }
        case ActionType::kRecvF:
          slot.input = receiveActivation(s, mb);
          if (mb + 1 < num_microbatches_) prefetchActivation(s, mb + 1);
          break;
        case ActionType::kSendB: {
          MaybeTensor g = std::exchange(slot.grad_input, std::nullopt);
          if (!failed()) {
            try {
              TORCH_CHECK(g.has_value() && g->defined(), "stage ", s,
                          " backward returned no gradient for its input (micro-batch ",
                          mb, ")");
            } catch (...) {
              fail(s, mb, "backward");
            }
          }
          if (!failed()) {
            pending.push_back(
                send(g->contiguous(), rankOf(s - 1), tag(s, mb, true, false)));
          } else if (grad_expected_[{s, mb}]) {
            const auto& [shape, dtype] = shapes_.at(s - 1);
            pending.push_back(send(at::zeros(shape, at::TensorOptions(dtype)),
                                   rankOf(s - 1), tag(s, mb, true, false)));
          }
          break;
        }
        case ActionType::kRecvB: {
          const auto it = posted_.find({true, s, mb});
          if (it == posted_.end()) {
            TORCH_CHECK(failed(), "dsp pipeline: ", dsp::pipeline::toString(a),
                        " before its activation was sent");
            break;  // a failed step posted none: no gradient comes
          }
          Posted p = std::move(it->second);
          posted_.erase(it);
          waitAll(p.works);
          if (!failed()) slot.grad_output = std::move(p.data);
          break;
        }
      }
      if (transfer) transfers_.emplace_back(dsp::pipeline::toString(a), started, now());
    }
    waitAll(pending);
  } catch (...) {
    // A transfer failed: the ranks are out of step. Withdraw this step's
    // receives now, while their buffers still exist.
    posted_.clear();
    store.clear();
    throw;
  }
  store.clear();  // a failed step's deferred weight gradients never run
  exchangeStatus();
}

}  // namespace dsparallel::pipeline
