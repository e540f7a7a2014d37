// Pipeline schedules as data: generation, printing/parsing, validation.
//
// A schedule gives each rank the ordered list of actions it executes:
// compute (F: forward, B: backward) and transfers (SEND_F/RECV_F carry a
// stage's output activation to the next stage, SEND_B/RECV_B carry the
// gradient back). Stage s lives on rank s % ranks ("looped" placement, as
// Megatron and torch.distributed.pipelining do for interleaved schedules),
// so with one stage per rank, stage s is rank s. Transfers between stages on
// the same rank are local and get no action.
//
// Execution model checked by validate(): a send never blocks (the runtime
// posts it asynchronously); a receive blocks until its matching send has
// run. Under that model a schedule is valid when simulating all ranks
// completes: every compute finds its input, every receive its send.
//
// Plain C++17, no torch.
#pragma once

#include <string>
#include <vector>

namespace dsp::pipeline {

enum class ActionType { kForward, kBackward, kSendF, kRecvF, kSendB, kRecvB };

struct Action {
  ActionType type;
  int stage;
  int microbatch;
  bool operator==(const Action& o) const {
    return type == o.type && stage == o.stage && microbatch == o.microbatch;
  }
};

// "2F0", "2B0", "2SEND_F0", "3RECV_F0", ... (stage, kind, micro-batch), as
// torch.distributed.pipelining prints them.
std::string toString(const Action& a);
Action parseAction(const std::string& text);  // throws std::invalid_argument

struct Schedule {
  int num_stages = 0;
  int num_ranks = 0;
  int num_microbatches = 0;
  std::vector<std::vector<Action>> ranks;  // per rank, in execution order
};

int rankOfStage(int stage, int num_ranks);

// Names: "gpipe", "1f1b", "interleaved_1f1b". num_stages must be a multiple
// of stages_per_rank; GPipe and 1F1B take one stage per rank; interleaved
// 1F1B needs the micro-batches to be a multiple of the ranks. Throws
// std::invalid_argument naming the numbers otherwise.
Schedule makeSchedule(const std::string& name, int num_stages, int num_microbatches,
                      int stages_per_rank = 1);

struct ScheduleStats {
  // Unit-time simulation (every F and B takes one slot, transfers none):
  int makespan = 0;                 // slots until the last rank finishes
  double bubble = 0;                // idle fraction over all ranks
  std::vector<int> peak_in_flight;  // per rank: max micro-batch-stages
                                    // forwarded but not yet backwarded
  // Per rank, per action: the slot a compute action starts in (it ends one
  // slot later); -1 for transfers. The planned timeline, for plotting.
  std::vector<std::vector<int>> start_slots;
};

// Checks the schedule (throws std::invalid_argument with the reason: an
// action on a stage the rank does not own, a duplicate or missing F/B, a
// backward before its forward, a send without receive, a deadlock naming
// the stuck actions) and returns its statistics.
ScheduleStats validate(const Schedule& s);

}  // namespace dsp::pipeline
