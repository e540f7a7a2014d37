// ProcessGroupDSP's point-to-point send/recv.
//
// Between ranks of one host a message goes through the shared-memory rings:
// the send copies it into the receiver's ring in the caller's thread and is
// complete when it returns (it waits only while that ring is full); the
// receive is matched and copied out by whichever thread tests or waits on its
// Work. That takes gloo's socket and helper thread out of the path, which is
// what a pipeline's activations and gradients wait on. A message larger than
// the ring takes is read in place by the receiver (one copy; the send's Work
// completes once it has), where the kernel lets it read the sender's memory.
// Elsewhere such a message, a CUDA tensor (NCCL) and any message of a group
// spanning hosts go to another backend; both ends route by the same facts
// (size, device, layout, the single-copy table), so they always meet.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstring>

#include "process_group_dsp.h"
#include "tensor_adapt.h"

namespace dsparallel {
namespace {

// A transfer through the rings that completes later: a receive, or a send
// read in place. Completes when a test or wait finds it done.
class ShmP2PWork : public c10d::Work {
 public:
  ShmP2PWork(c10::intrusive_ptr<ProcessGroupDSP> pg, dsp::ShmP2P* p2p, c10d::OpType type)
      : c10d::Work(pg->getRank(), type),
        p2p_(p2p),
        pg_(std::move(pg)) {}  // keeps the rings mapped while this is pending

  bool isCompleted() override {
    if (!Work::isCompleted() && !claimed_.load()) {
      try {
        if (poll()) done(nullptr);
      } catch (...) {
        done(std::current_exception());
      }
    }
    return Work::isCompleted();
  }

  bool wait(std::chrono::milliseconds timeout) override {
    if (!Work::isCompleted() && !claimed_.load()) {
      const bool bounded = timeout != kNoTimeout;
      try {
        block(bounded ? timeout : std::chrono::milliseconds(0));
        done(nullptr);
      } catch (...) {
        // A receive left posted would later be filled into memory that may
        // be gone, a send not yet read still stands announced, and the peers
        // are out of step: as for a collective, an expired bounded wait
        // breaks the group.
        if (bounded && !Work::isCompleted()) {
          pg_->breakGroup(std::string("dsp: a ") +
                          (retrieveOpType() == c10d::OpType::SEND ? "send" : "recv") +
                          "'s Work.wait(timeout) expired after " +
                          std::to_string(timeout.count()) + " ms on rank " +
                          std::to_string(pg_->getRank()) +
                          "; this process group refuses further work: create a new "
                          "group");
        }
        done(std::current_exception());
      }
    }
    // Another thread may be completing it (the copy-back): wait for that.
    return c10d::Work::wait(timeout);
  }

 protected:
  virtual bool poll() = 0;
  virtual void block(std::chrono::milliseconds timeout) = 0;
  virtual void completed() {}

  dsp::ShmP2P* p2p_;

 private:
  // Completes the Work once: two threads may both find the transfer done
  // (is_completed() polled from two threads, a wait beside a poll), and a
  // second copy-back would overwrite what the first one's caller has since
  // written into the tensor.
  void done(std::exception_ptr error) {
    if (claimed_.exchange(true)) return;
    if (!error) completed();
    finish(error);
  }

  std::atomic<bool> claimed_{false};
  c10::intrusive_ptr<ProcessGroupDSP> pg_;
};

class ShmRecvWork : public ShmP2PWork {
 public:
  ShmRecvWork(c10::intrusive_ptr<ProcessGroupDSP> pg, dsp::ShmP2P* p2p, at::Tensor t,
              int src, int tag)
      : ShmP2PWork(std::move(pg), p2p,
                   src < 0 ? c10d::OpType::RECVANYSOURCE : c10d::OpType::RECV),
        staged_(t) {
    request_ = p2p_->postRecv(src, tag, staged_.ptr(), staged_.bytes());
  }
  // A receive dropped before it completed (a failed pipeline step's, one
  // nobody waited on) is withdrawn before its buffer goes: otherwise a later
  // drain would copy the next message with its tag into freed memory, and
  // the receive posted for that message would never get it.
  ~ShmRecvWork() override { p2p_->cancel(request_); }
  int sourceRank() const override { return p2p_->sourceOf(request_); }

 private:
  bool poll() override { return p2p_->test(request_); }
  void block(std::chrono::milliseconds timeout) override {
    try {
      p2p_->wait(request_, timeout);
    } catch (...) {
      p2p_->cancel(request_);  // failed: the caller may free the tensor now
      throw;
    }
  }
  void completed() override { staged_.copyBack(); }

  Staged staged_;
  dsp::ShmP2P::RequestPtr request_;
};

// A send too large for a ring, read in place by the receiver: complete once
// it has. (The rings hold the tensor until then, whatever becomes of this.)
class ShmSendInPlaceWork : public ShmP2PWork {
 public:
  ShmSendInPlaceWork(c10::intrusive_ptr<ProcessGroupDSP> pg, dsp::ShmP2P* p2p,
                     dsp::ShmP2P::SendTicket ticket)
      : ShmP2PWork(std::move(pg), p2p, c10d::OpType::SEND), ticket_(ticket) {}

 private:
  bool poll() override { return p2p_->test(ticket_); }
  void block(std::chrono::milliseconds timeout) override { p2p_->wait(ticket_, timeout); }

  dsp::ShmP2P::SendTicket ticket_;
};

// A send through the rings: done by the time it is returned.
class ShmSendWork : public c10d::Work {
 public:
  explicit ShmSendWork(int rank) : c10d::Work(rank, c10d::OpType::SEND) { finish(); }
};

}  // namespace

dsp::ShmP2P* ProcessGroupDSP::shmP2P(const at::Tensor& t, int reader, int writer) {
  if (multiHost() || !t.device().is_cpu() || t.is_sparse()) return nullptr;
  dsp::ShmP2P& p2p = comm_->p2p();
  if (t.nbytes() <= p2p.maxMessageBytes()) return &p2p;
  // Larger: read in place, where the reader may read the writer's memory
  // (both ends see the same table). Any source: from every peer.
  for (int w = 0; w < getSize(); ++w) {
    if (w != reader && (writer < 0 || w == writer) && !p2p.singleCopy(reader, w)) {
      return nullptr;
    }
  }
  return &p2p;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDSP::send(std::vector<at::Tensor>& tensors,
                                                     int dst_rank, int tag) {
  const at::Tensor& t = single(tensors, "send");
  if (auto* b = route(t, "send", /*across_hosts=*/false))
    return b->send(tensors, dst_rank, tag);
  if (dsp::ShmP2P* p2p = shmP2P(t, dst_rank, getRank())) {
    const at::Tensor data = t.contiguous();
    if (data.nbytes() <= p2p->maxMessageBytes()) {
      p2p->send(dst_rank, tag, data.data_ptr(), data.nbytes());
      return c10::make_intrusive<ShmSendWork>(getRank());
    }
    const auto ticket = p2p->sendInPlace(dst_rank, tag, data.data_ptr(), data.nbytes(),
                                         std::make_shared<at::Tensor>(data));
    return c10::make_intrusive<ShmSendInPlaceWork>(
        c10::intrusive_ptr<ProcessGroupDSP>::unsafe_reclaim_from_nonowning(this), p2p,
        ticket);
  }
  TORCH_CHECK(p2p_, "dsp send: this group has no point-to-point transport");
  // gloo refuses a non-contiguous tensor; the rings take any (its Work holds
  // the contiguous copy until sent).
  std::vector<at::Tensor> contiguous = {t.contiguous()};
  return p2p_->send(contiguous, dst_rank, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDSP::sendWithHead(const at::Tensor& head,
                                                             const at::Tensor& payload,
                                                             int dst_rank, int tag) {
  TORCH_CHECK_VALUE(
      head.is_cpu() && payload.is_cpu() && !head.is_sparse() && !payload.is_sparse(),
      "dsp send: a head and payload go together from host memory only, got ",
      head.device(), " and ", payload.device());
  const at::Tensor h = head.contiguous(), p = payload.contiguous();
  const size_t bytes = h.nbytes() + p.nbytes();
  dsp::ShmP2P* rings = multiHost() ? nullptr : &comm_->p2p();
  if (rings != nullptr && bytes <= rings->maxMessageBytes()) {
    rings->send(dst_rank, tag, h.data_ptr(), h.nbytes(), p.data_ptr(), p.nbytes());
    return c10::make_intrusive<ShmSendWork>(getRank());
  }
  // Any other route takes one buffer: put them together.
  at::Tensor message = at::empty({static_cast<int64_t>(bytes)}, at::kByte);
  std::memcpy(message.data_ptr(), h.data_ptr(), h.nbytes());
  std::memcpy(static_cast<char*>(message.data_ptr()) + h.nbytes(), p.data_ptr(),
              p.nbytes());
  std::vector<at::Tensor> tensors = {message};
  return send(tensors, dst_rank, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDSP::recv(std::vector<at::Tensor>& tensors,
                                                     int src_rank, int tag) {
  return receive(tensors, src_rank, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDSP::recvAnysource(
    std::vector<at::Tensor>& tensors, int tag) {
  return receive(tensors, -1, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDSP::receive(std::vector<at::Tensor>& tensors,
                                                        int src_rank, int tag) {
  const at::Tensor& t = single(tensors, "recv");
  dsp::ShmP2P* shm = nullptr;
  c10d::Backend* other = route(t, "recv", /*across_hosts=*/false);
  if (other == nullptr && (shm = shmP2P(t, getRank(), src_rank)) == nullptr) {
    TORCH_CHECK(p2p_, "dsp recv: this group has no point-to-point transport");
    other = p2p_.get();
  }
  if (shm != nullptr) {
    return c10::make_intrusive<ShmRecvWork>(
        c10::intrusive_ptr<ProcessGroupDSP>::unsafe_reclaim_from_nonowning(this), shm, t,
        src_rank, tag);
  }
  return src_rank < 0 ? other->recvAnysource(tensors, tag)
                      : other->recv(tensors, src_rank, tag);
}

}  // namespace dsparallel
