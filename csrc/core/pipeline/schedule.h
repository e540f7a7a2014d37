// Pipeline schedules as data: generation, printing/parsing, validation.
//
// A schedule gives each rank the ordered list of actions it executes:
// compute (F: forward, B: backward, or B split in two as zero-bubble
// schedules do: I, the input gradient, which the previous stage waits for,
// and W, the weight gradient, which nothing waits for) and transfers (SEND_F/RECV_F carry
// a stage's output activation to the next stage, SEND_B/RECV_B carry the gradient back).
// Stage s lives on rank s % ranks ("looped" placement, as Megatron and
// torch.distributed.pipelining do for interleaved schedules), so with one stage per rank,
// stage s is rank s; V-shaped schedules (ZBV) put two stages per rank in a V instead:
// rank r holds stages r and 2 * ranks - 1 - r, so the first and last stage share rank 0
// and the middle two the last rank. Transfers between stages on the same rank are
// local and get no action.
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

enum class ActionType {
  kForward,
  kBackward,
  kSendF,
  kRecvF,
  kSendB,
  kRecvB,
  kInput,   // I: the input gradient (sent back like B's)
  kWeight,  // W: the weight gradient, after its I on the same rank
};

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

enum class Placement { kLoop, kV };

struct Schedule {
  Placement placement = Placement::kLoop;
  int num_stages = 0;
  int num_ranks = 0;
  int num_microbatches = 0;
  std::vector<std::vector<Action>> ranks;  // per rank, in execution order
};

int rankOfStage(int stage, int num_ranks, Placement placement = Placement::kLoop);

// Names: "gpipe", "1f1b", "interleaved_1f1b", "zb1p", "zbv", "dualpipev".
// num_stages must be a multiple of stages_per_rank; GPipe and 1F1B take one
// stage per rank; "zb1p" (the zero-bubble paper's split backward) is ZB-H1
// over 1F1B with one stage per rank and the same over interleaved 1F1B
// with more; interleaved schedules need the micro-batches to be a multiple
// of the ranks; ZBV (the paper's V-shaped zero-bubble schedule) and
// DualPipeV take two stages per rank, placed in a V.
// Throws std::invalid_argument naming the numbers otherwise.
Schedule makeSchedule(const std::string& name, int num_stages, int num_microbatches,
                      int stages_per_rank = 1);

// Durations of the compute actions for the simulation, in slots. The
// defaults give every action one slot; the zero-bubble paper's comparison
// takes F = I = W = 1 and a whole backward B = 2.
struct Costs {
  int forward = 1;
  int backward = 1;
  int input = 1;
  int weight = 1;
};

struct ScheduleStats {
  // Simulation in slots (each compute action takes its cost, transfers none):
  int makespan = 0;                 // slots until the last rank finishes
  double bubble = 0;                // idle fraction over all ranks
  std::vector<int> peak_in_flight;  // per rank: max micro-batch-stages
                                    // forwarded whose B (or W) has not run:
                                    // the activations the rank holds
  // Per rank, per action: the slot a compute action starts in (it ends its
  // cost later); -1 for transfers. The planned timeline, for plotting.
  std::vector<std::vector<int>> start_slots;
};

// Checks the schedule (throws std::invalid_argument with the reason: an
// action on a stage the rank does not own, a duplicate or missing F/B (or
// I/W: each micro-batch-stage has a B, or an I and a W, not both), a
// backward before its forward, a W before its I, a send without receive, a
// deadlock naming the stuck actions) and returns its statistics.
ScheduleStats validate(const Schedule& s, const Costs& costs = Costs{});
// The same with each stage's own costs (`per_stage[stage]`; one entry per
// stage): stages differ (the first computes no input gradient, the last adds
// the loss), and a plan from one mean cost misplaces the waits they cause.
ScheduleStats validate(const Schedule& s, const std::vector<Costs>& per_stage);

}  // namespace dsp::pipeline
