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

std::pair<std::vector<int64_t>, at::ScalarType> parseHeader(const at::Tensor& message) {
  const int64_t* h = reinterpret_cast<const int64_t*>(message.data_ptr());
  TORCH_CHECK(h[0] >= 0 && h[0] <= kMaxDims && h[1] >= 0 &&
                  h[1] < static_cast<int64_t>(kDTypes.size()),
              "dsp pipeline: a corrupt activation header (ndim ", h[0], ", dtype code ",
              h[1], ")");
  return {std::vector<int64_t>(h + 2, h + 2 + h[0]), kDTypes[h[1]]};
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
}

int Runtime::tag(int stage, int mb, bool backward, bool header) const {
  return ((stage * num_microbatches_ + mb) * 2 + static_cast<int>(backward)) * 2 +
         static_cast<int>(header);
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

void Runtime::sendActivation(int stage, int mb, const at::Tensor& out,
                             std::vector<c10::intrusive_ptr<c10d::Work>>& pending) {
  const auto code = std::find(kDTypes.begin(), kDTypes.end(), out.scalar_type());
  TORCH_CHECK_VALUE(code != kDTypes.end() && out.dim() <= kMaxDims, "stage ", stage,
                    " output of dtype ", out.scalar_type(), " and ", out.dim(),
                    " dims cannot be sent between stages");
  const int dst = rankOf(stage + 1);
  const auto known = shapes_.find(stage);
  // What the receiver expects: the payload of the shape it knows (-1: none
  // yet, the stage's first activation).
  const int64_t expected = known == shapes_.end()
                               ? -1
                               : payloadBytes(known->second.first, known->second.second);
  // The stage's first activation: the receiver cannot know its size, so the
  // header goes alone and the data follows; so do large ones. Later small
  // ones travel as one message of the known size: header, then payload.
  const bool alone = expected < 0 || expected >= kPayloadAloneBytes;
  // Over "dsp" the header and the payload meet in the receiver's ring, not
  // in a buffer here first: that allocation and copy cost more than the
  // ring copy of a 64 KB activation.
  auto* framed = !alone && out.is_cpu() && out.is_contiguous()
                     ? dynamic_cast<ProcessGroupDSP*>(&backendFor(out))
                     : nullptr;
  const int64_t size = alone ? kHeaderLen * 8 : kPayloadOffset + (framed ? 0 : expected);
  at::Tensor message = at::detail::empty_cpu({size}, at::kByte);
  int64_t* h = reinterpret_cast<int64_t*>(message.data_ptr());
  std::fill(h, h + kHeaderLen, 0);
  h[0] = out.dim();
  h[1] = code - kDTypes.begin();
  std::copy(out.sizes().begin(), out.sizes().end(), h + 2);
  try {
    checkShape(stage, mb, out.sizes(), out.scalar_type());
  } catch (...) {
    // Deliver the header (in a message of the size the receiver expects),
    // so that it raises the same error instead of waiting for data; and
    // fill the payload's receive, if it posted one, so that none stays
    // posted into memory that is gone.
    if (framed) {
      framed
          ->sendWithHead(message, at::detail::empty_cpu({expected}, at::kByte), dst,
                         tag(stage, mb, false, true))
          ->wait();
    } else {
      send(message, dst, tag(stage, mb, false, true))->wait();
    }
    if (alone && expected >= 0) {
      send(at::detail::empty_cpu({expected}, at::kByte), dst,
           tag(stage, mb, false, false))
          ->wait();
    }
    throw;
  }
  if (alone) {
    // Received into host memory, as the one-message form is; no operator
    // is dispatched for an output already there (see above).
    const at::Tensor payload =
        out.is_cpu() && out.is_contiguous() ? out : out.contiguous().cpu();
    pending.push_back(send(message, dst, tag(stage, mb, false, true)));
    pending.push_back(send(payload, dst, tag(stage, mb, false, false)));
    return;
  }
  if (framed) {
    pending.push_back(
        framed->sendWithHead(message, out, dst, tag(stage, mb, false, true)));
    return;
  }
  if (out.is_cpu() && out.is_contiguous()) {
    std::memcpy(static_cast<char*>(message.data_ptr()) + kPayloadOffset, out.data_ptr(),
                out.nbytes());
  } else {
    payloadOf(message, known->second.first, known->second.second).copy_(out);
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

at::Tensor Runtime::receiveActivation(int stage, int mb) {
  const int src = rankOf(stage - 1);
  if (!shapes_.count(stage - 1)) {  // the stage's first activation: header, then data
    const at::Tensor h = at::empty({kHeaderLen * 8}, at::kByte);
    recv(h, src, tag(stage - 1, mb, false, true))->wait();
    const auto [shape, dtype] = parseHeader(h);
    checkShape(stage - 1, mb, shape, dtype);
    const at::Tensor d = at::empty(shape, at::TensorOptions(dtype));
    recv(d, src, tag(stage - 1, mb, false, false))->wait();
    return d;
  }
  prefetchActivation(stage, mb);  // if not posted ahead
  const auto posted = posted_.find({false, stage, mb});
  Posted p = std::move(posted->second);
  posted_.erase(posted);
  waitAll(p.works);
  const auto [shape, dtype] = parseHeader(p.header);
  checkShape(stage - 1, mb, shape, dtype);
  return p.data.defined() ? p.data : payloadOf(p.header, shape, dtype);
}

void Runtime::step(const ForwardFn& forward, const BackwardFn& backward,
                   const WeightFn& weight) {
  // What travels for one (stage, micro-batch), each dropped once consumed.
  struct Slot {
    MaybeTensor input, output, grad_output, grad_input;
  };
  std::map<std::pair<int, int>, Slot> slots;
  std::vector<c10::intrusive_ptr<c10d::Work>> pending;  // sends
  posted_.clear();  // a failed step's receives never complete
  auto& store = WeightGradStore::get();
  store.clear();                                    // nor do its weight gradients
  std::map<std::pair<int, int>, int64_t> deferred;  // (stage, mb) -> capture
  trace_.clear();
  transfers_.clear();
  const int last = num_stages_ - 1;
  for (const auto& a : actions_) {
    if (a.type == ActionType::kRecvF && a.microbatch == 0) prefetchActivation(a.stage, 0);
  }
  for (const auto& a : actions_) {
    const int s = a.stage, mb = a.microbatch;
    Slot& slot = slots[{s, mb}];
    const bool transfer = a.type == ActionType::kSendF || a.type == ActionType::kRecvF ||
                          a.type == ActionType::kSendB || a.type == ActionType::kRecvB;
    const double started = transfer ? now() : 0.0;
    switch (a.type) {
      case ActionType::kForward: {
        const double t0 = now();
        MaybeTensor out = forward(s, mb, std::exchange(slot.input, std::nullopt));
        trace_.emplace_back(dsp::pipeline::toString(a), t0, now());
        if (s == last) break;
        TORCH_CHECK(out.has_value(), "stage ", s, " forward returned no output");
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
          grad = local(s + 1) ? std::exchange(slots[{s + 1, mb}].grad_input, std::nullopt)
                              : std::exchange(slot.grad_output, std::nullopt);
        }
        const double t0 = now();
        // I: the weight gradients of split ops wait in the store for the W.
        const bool split = a.type == ActionType::kInput;
        if (split) store.begin();
        MaybeTensor grad_input;
        try {
          grad_input = backward(s, mb, std::move(grad));
        } catch (...) {
          if (split) store.end();
          throw;
        }
        if (split) deferred[{s, mb}] = store.end();
        trace_.emplace_back(dsp::pipeline::toString(a), t0, now());
        if (s != 0) slot.grad_input = std::move(grad_input);
        break;
      }
      case ActionType::kWeight: {
        const auto it = deferred.find({s, mb});
        TORCH_CHECK(it != deferred.end(), "dsp pipeline: ", dsp::pipeline::toString(a),
                    " before its I");
        const double t0 = now();
        store.run(it->second, weight ? weight(s, mb) : std::vector<at::Tensor>{});
        deferred.erase(it);
        trace_.emplace_back(dsp::pipeline::toString(a), t0, now());
        break;
      }
      case ActionType::kSendF: {
        at::Tensor out = *std::exchange(slot.output, std::nullopt);
        sendActivation(s, mb, out, pending);
        Posted p;
        p.data = out.is_cpu() ? at::detail::empty_cpu(out.sizes(), out.scalar_type())
                              : at::empty(out.sizes(), out.options());
        p.works.push_back(recv(p.data, rankOf(s + 1), tag(s + 1, mb, true, false)));
        posted_.emplace(Key{true, s, mb}, std::move(p));
        break;
      }
      case ActionType::kRecvF:
        slot.input = receiveActivation(s, mb);
        if (mb + 1 < num_microbatches_) prefetchActivation(s, mb + 1);
        break;
      case ActionType::kSendB: {
        TORCH_CHECK(slot.grad_input.has_value() && slot.grad_input->defined(), "stage ",
                    s, " backward returned no gradient for its input (micro-batch ", mb,
                    ")");
        const at::Tensor g = std::exchange(slot.grad_input, std::nullopt)->contiguous();
        pending.push_back(send(g, rankOf(s - 1), tag(s, mb, true, false)));
        break;
      }
      case ActionType::kRecvB: {
        const auto it = posted_.find({true, s, mb});
        TORCH_CHECK(it != posted_.end(), "dsp pipeline: ", dsp::pipeline::toString(a),
                    " before its activation was sent");
        Posted p = std::move(it->second);
        posted_.erase(it);
        waitAll(p.works);
        slot.grad_output = std::move(p.data);
        break;
      }
    }
    if (transfer) transfers_.emplace_back(dsp::pipeline::toString(a), started, now());
  }
  waitAll(pending);
}

}  // namespace dsparallel::pipeline
