// ProcessGroupDSP's point-to-point send/recv.
//
// Between ranks of one host a message goes through the shared-memory rings:
// the send copies it into the receiver's ring in the caller's thread and is
// complete when it returns (it waits only while that ring is full); the
// receive is matched and copied out by whichever thread tests or waits on its
// Work. That takes gloo's socket and helper thread out of the path, which is
// what a pipeline's activations and gradients wait on. A message larger than
// the ring takes, a CUDA tensor (NCCL) and any message of a group spanning
// hosts go elsewhere; both ends route by the same facts (size, device,
// layout), so they always meet.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "process_group_dsp.h"
#include "tensor_adapt.h"

namespace dsparallel {
namespace {

// A receive through the rings: completes when a test or wait finds it done.
class ShmRecvWork : public c10d::Work {
 public:
  ShmRecvWork(c10::intrusive_ptr<ProcessGroupDSP> pg, dsp::ShmP2P* p2p, at::Tensor t,
              int src, int tag)
      : c10d::Work(pg->getRank(),
                   src < 0 ? c10d::OpType::RECVANYSOURCE : c10d::OpType::RECV),
        pg_(std::move(pg)),  // keeps the rings mapped while this is pending
        p2p_(p2p),
        staged_(t) {
    request_ = p2p_->postRecv(src, tag, staged_.ptr(), staged_.bytes());
  }

  bool isCompleted() override {
    if (!Work::isCompleted()) {
      try {
        if (p2p_->test(request_)) done(nullptr);
      } catch (...) {
        done(std::current_exception());
      }
    }
    return Work::isCompleted();
  }

  bool wait(std::chrono::milliseconds timeout) override {
    if (!Work::isCompleted()) {
      const bool bounded = timeout != kNoTimeout;
      try {
        p2p_->wait(request_, bounded ? timeout : std::chrono::milliseconds(0));
        done(nullptr);
      } catch (...) {
        // A receive left posted would later be filled into memory that may
        // be gone, and the peers are out of step: as for a collective, an
        // expired bounded wait breaks the group.
        if (bounded && !Work::isCompleted()) {
          pg_->breakGroup("dsp: a recv's Work.wait(timeout) expired after " +
                          std::to_string(timeout.count()) + " ms on rank " +
                          std::to_string(pg_->getRank()) +
                          "; this process group refuses further work: create a new "
                          "group");
        }
        done(std::current_exception());
      }
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (exception_) std::rethrow_exception(exception_);
    return true;
  }

  int sourceRank() const override { return p2p_->sourceOf(request_); }

 private:
  void done(std::exception_ptr error) {
    if (!error) staged_.copyBack();
    finish(error);
  }

  c10::intrusive_ptr<ProcessGroupDSP> pg_;
  dsp::ShmP2P* p2p_;
  Staged staged_;
  dsp::ShmP2P::RequestPtr request_;
};

// A send through the rings: done by the time it is returned.
class ShmSendWork : public c10d::Work {
 public:
  explicit ShmSendWork(int rank) : c10d::Work(rank, c10d::OpType::SEND) { finish(); }
};

}  // namespace

dsp::ShmP2P* ProcessGroupDSP::shmP2P(const at::Tensor& t) {
  if (multiHost() || !t.device().is_cpu() || t.is_sparse()) return nullptr;
  dsp::ShmP2P& p2p = comm_->p2p();
  return t.nbytes() <= p2p.maxMessageBytes() ? &p2p : nullptr;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDSP::send(std::vector<at::Tensor>& tensors,
                                                     int dst_rank, int tag) {
  const at::Tensor& t = single(tensors, "send");
  if (auto* b = route(t, "send", /*across_hosts=*/false))
    return b->send(tensors, dst_rank, tag);
  if (dsp::ShmP2P* p2p = shmP2P(t)) {
    const at::Tensor data = t.contiguous();
    p2p->send(dst_rank, tag, data.data_ptr(), data.nbytes());
    return c10::make_intrusive<ShmSendWork>(getRank());
  }
  TORCH_CHECK(p2p_, "dsp send: this group has no point-to-point transport");
  return p2p_->send(tensors, dst_rank, tag);
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
  if (other == nullptr && (shm = shmP2P(t)) == nullptr) {
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
