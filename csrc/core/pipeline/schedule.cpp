#include "schedule.h"

#include <algorithm>
#include <cctype>
#include <map>
#include <sstream>
#include <stdexcept>

namespace dsp::pipeline {
namespace {

const char* kindName(ActionType t) {
  switch (t) {
    case ActionType::kForward:
      return "F";
    case ActionType::kBackward:
      return "B";
    case ActionType::kSendF:
      return "SEND_F";
    case ActionType::kRecvF:
      return "RECV_F";
    case ActionType::kSendB:
      return "SEND_B";
    case ActionType::kRecvB:
      return "RECV_B";
  }
  return "?";
}

[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument(msg); }

std::string num(int x) { return std::to_string(x); }

bool isCompute(ActionType t) {
  return t == ActionType::kForward || t == ActionType::kBackward;
}

// ---------------------------------------------------------------------------
// compute orders per rank (F and B only)

using Orders = std::vector<std::vector<Action>>;

Orders gpipe(int p, int m) {
  Orders out(p);
  for (int r = 0; r < p; ++r) {
    for (int mb = 0; mb < m; ++mb) out[r].push_back({ActionType::kForward, r, mb});
    for (int mb = 0; mb < m; ++mb) out[r].push_back({ActionType::kBackward, r, mb});
  }
  return out;
}

// 1F1B: stage r runs p - r - 1 warm-up forwards, then alternates one forward
// and one backward, then drains the backwards. At most p - r micro-batches
// are in flight, against m for GPipe, at the same bubble.
Orders oneFOneB(int p, int m) {
  Orders out(p);
  for (int r = 0; r < p; ++r) {
    const int warmup = std::min(p - r - 1, m);
    auto& o = out[r];
    for (int mb = 0; mb < warmup; ++mb) o.push_back({ActionType::kForward, r, mb});
    for (int i = 0; i < m - warmup; ++i) {
      o.push_back({ActionType::kForward, r, warmup + i});
      o.push_back({ActionType::kBackward, r, i});
    }
    for (int mb = m - warmup; mb < m; ++mb) o.push_back({ActionType::kBackward, r, mb});
  }
  return out;
}

// Interleaved 1F1B (Megatron-LM): rank r holds stages r, r + p, ..., r +
// (v-1)p. Forwards walk the rank's stages in groups of p micro-batches;
// backwards walk them in reverse. A longer warm-up fills the deeper pipe.
Orders interleaved(int p, int v, int m) {
  Orders out(p);
  const int total = m * v;
  auto mbOf = [&](int k) { return (k / (p * v)) * p + k % p; };
  for (int r = 0; r < p; ++r) {
    auto fwd = [&](int k) {
      const int chunk = (k / p) % v;
      return Action{ActionType::kForward, chunk * p + r, mbOf(k)};
    };
    auto bwd = [&](int k) {
      const int chunk = v - 1 - (k / p) % v;
      return Action{ActionType::kBackward, chunk * p + r, mbOf(k)};
    };
    const int warmup = std::min((p - r - 1) * 2 + (v - 1) * p, total);
    auto& o = out[r];
    for (int k = 0; k < warmup; ++k) o.push_back(fwd(k));
    for (int i = 0; i < total - warmup; ++i) {
      o.push_back(fwd(warmup + i));
      o.push_back(bwd(i));
    }
    for (int k = total - warmup; k < total; ++k) o.push_back(bwd(k));
  }
  return out;
}

// Adds the transfers: a receive right before the compute that needs it, a
// send right after the compute that produced it.
Schedule withTransfers(const Orders& orders, int stages, int m) {
  Schedule s;
  s.num_stages = stages;
  s.num_ranks = static_cast<int>(orders.size());
  s.num_microbatches = m;
  s.ranks.resize(orders.size());
  auto remote = [&](int a, int b) {
    return rankOfStage(a, s.num_ranks) != rankOfStage(b, s.num_ranks);
  };
  for (size_t r = 0; r < orders.size(); ++r) {
    auto& out = s.ranks[r];
    for (const Action& a : orders[r]) {
      if (a.type == ActionType::kForward) {
        if (a.stage > 0 && remote(a.stage - 1, a.stage))
          out.push_back({ActionType::kRecvF, a.stage, a.microbatch});
        out.push_back(a);
        if (a.stage < stages - 1 && remote(a.stage, a.stage + 1))
          out.push_back({ActionType::kSendF, a.stage, a.microbatch});
      } else {
        if (a.stage < stages - 1 && remote(a.stage, a.stage + 1))
          out.push_back({ActionType::kRecvB, a.stage, a.microbatch});
        out.push_back(a);
        if (a.stage > 0 && remote(a.stage - 1, a.stage))
          out.push_back({ActionType::kSendB, a.stage, a.microbatch});
      }
    }
  }
  return s;
}

}  // namespace

std::string toString(const Action& a) {
  return num(a.stage) + kindName(a.type) + num(a.microbatch);
}

Action parseAction(const std::string& text) {
  size_t i = 0;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) ++i;
  size_t j = text.size();
  while (j > i && std::isdigit(static_cast<unsigned char>(text[j - 1]))) --j;
  if (i == 0 || j == text.size() || i >= j)
    fail("cannot parse pipeline action '" + text + "'");
  const std::string kind = text.substr(i, j - i);
  static const std::map<std::string, ActionType> kKinds = {
      {"F", ActionType::kForward},    {"B", ActionType::kBackward},
      {"SEND_F", ActionType::kSendF}, {"RECV_F", ActionType::kRecvF},
      {"SEND_B", ActionType::kSendB}, {"RECV_B", ActionType::kRecvB}};
  const auto it = kKinds.find(kind);
  if (it == kKinds.end()) fail("unknown action kind '" + kind + "' in '" + text + "'");
  return {it->second, std::stoi(text.substr(0, i)), std::stoi(text.substr(j))};
}

int rankOfStage(int stage, int num_ranks) { return stage % num_ranks; }

Schedule makeSchedule(const std::string& name, int num_stages, int num_microbatches,
                      int stages_per_rank) {
  if (num_stages < 1 || num_microbatches < 1 || stages_per_rank < 1) {
    fail(
        "pipeline schedule needs at least one stage, micro-batch and stage per rank "
        "(got " +
        num(num_stages) + " stages, " + num(num_microbatches) + " micro-batches, " +
        num(stages_per_rank) + " stages per rank)");
  }
  if (num_stages % stages_per_rank != 0) {
    fail(num(num_stages) + " stages cannot be split into " + num(stages_per_rank) +
         " stages per rank");
  }
  const int p = num_stages / stages_per_rank;
  const int m = num_microbatches;
  if (name == "gpipe" || name == "1f1b") {
    if (stages_per_rank != 1) {
      fail(name + " runs one stage per rank; got " + num(stages_per_rank) +
           " (use interleaved_1f1b)");
    }
    return withTransfers(name == "gpipe" ? gpipe(p, m) : oneFOneB(p, m), num_stages, m);
  }
  if (name == "interleaved_1f1b") {
    if (m % p != 0) {
      fail("interleaved_1f1b needs the micro-batches (" + num(m) +
           ") to be a multiple of the ranks (" + num(p) + ")");
    }
    return withTransfers(interleaved(p, stages_per_rank, m), num_stages, m);
  }
  fail("unknown pipeline schedule '" + name + "' (gpipe, 1f1b, interleaved_1f1b)");
}

// ---------------------------------------------------------------------------
// validation: structure first, then a unit-time simulation of all ranks

ScheduleStats validate(const Schedule& s) {
  const int S = s.num_stages, R = s.num_ranks, M = s.num_microbatches;
  if (R < 1 || S < 1 || M < 1 || static_cast<int>(s.ranks.size()) != R) {
    fail("schedule has " + num(static_cast<int>(s.ranks.size())) + " rank lists for " +
         num(R) + " ranks");
  }
  auto key = [&](int stage, int mb) { return static_cast<size_t>(stage) * M + mb; };
  const size_t N = static_cast<size_t>(S) * M;
  // Each kind of action at most once per (stage, micro-batch), on its owner.
  std::map<ActionType, std::vector<int>> count;
  for (auto t : {ActionType::kForward, ActionType::kBackward, ActionType::kSendF,
                 ActionType::kRecvF, ActionType::kSendB, ActionType::kRecvB}) {
    count[t].assign(N, 0);
  }
  for (int r = 0; r < R; ++r) {
    std::vector<int> forwardAt(N, -1);
    for (size_t i = 0; i < s.ranks[r].size(); ++i) {
      const Action& a = s.ranks[r][i];
      if (a.stage < 0 || a.stage >= S || a.microbatch < 0 || a.microbatch >= M) {
        fail("rank " + num(r) + ": action " + toString(a) + " is out of range (" +
             num(S) + " stages, " + num(M) + " micro-batches)");
      }
      if (rankOfStage(a.stage, R) != r) {
        fail("rank " + num(r) + ": action " + toString(a) + " is for stage " +
             num(a.stage) + ", which lives on rank " + num(rankOfStage(a.stage, R)));
      }
      if (++count[a.type][key(a.stage, a.microbatch)] > 1) {
        fail("rank " + num(r) + ": action " + toString(a) + " appears twice");
      }
      if (a.type == ActionType::kForward) forwardAt[key(a.stage, a.microbatch)] = int(i);
      if (a.type == ActionType::kBackward && forwardAt[key(a.stage, a.microbatch)] < 0) {
        fail("rank " + num(r) + ": backward " + toString(a) +
             " comes before its forward");
      }
    }
  }
  for (int st = 0; st < S; ++st) {
    for (int mb = 0; mb < M; ++mb) {
      const size_t k = key(st, mb);
      for (auto t : {ActionType::kForward, ActionType::kBackward}) {
        if (count[t][k] != 1) fail("action " + toString({t, st, mb}) + " is missing");
      }
      // A transfer exists exactly when neighbouring stages sit on different ranks.
      const bool nextRemote = st + 1 < S && rankOfStage(st, R) != rankOfStage(st + 1, R);
      const std::pair<Action, Action> pairs[] = {
          {{ActionType::kSendF, st, mb}, {ActionType::kRecvF, st + 1, mb}},
          {{ActionType::kSendB, st + 1, mb}, {ActionType::kRecvB, st, mb}}};
      for (const auto& [send, recv] : pairs) {
        const int sends = send.stage < S ? count[send.type][key(send.stage, mb)] : 0;
        const int recvs = recv.stage < S ? count[recv.type][key(recv.stage, mb)] : 0;
        if (sends != (nextRemote ? 1 : 0) || recvs != sends) {
          fail(nextRemote ? "transfer " + toString(send) + " -> " + toString(recv) +
                                " is not matched (" + num(sends) + " sends, " +
                                num(recvs) + " receives)"
                          : "transfer " + toString(send) +
                                " between stages on the same "
                                "rank (or past the last stage)");
        }
      }
    }
  }

  // Unit-time simulation. ready*: the slot at which a value exists (-1: not yet).
  std::vector<int> fwdDone(N, -1), bwdDone(N, -1), sentF(N, -1), sentB(N, -1),
      recvF(N, -1), recvB(N, -1);
  std::vector<size_t> pc(R, 0);
  std::vector<int> clock(R, 0), inFlight(R, 0);
  ScheduleStats stats;
  stats.peak_in_flight.assign(R, 0);
  stats.start_slots.resize(R);
  for (int r = 0; r < R; ++r) stats.start_slots[r].assign(s.ranks[r].size(), -1);
  auto local = [&](int a, int b) { return rankOfStage(a, R) == rankOfStage(b, R); };
  for (;;) {
    bool progressed = false, finished = true;
    for (int r = 0; r < R; ++r) {
      while (pc[r] < s.ranks[r].size()) {
        finished = false;
        const Action& a = s.ranks[r][pc[r]];
        const size_t k = key(a.stage, a.microbatch);
        int ready = -1;  // slot at which this action's input exists
        switch (a.type) {
          case ActionType::kForward:
            ready = a.stage == 0 ? 0
                    : local(a.stage - 1, a.stage)
                        ? fwdDone[key(a.stage - 1, a.microbatch)]
                        : recvF[k];
            break;
          case ActionType::kBackward:
            ready = a.stage == S - 1 ? fwdDone[k]
                    : local(a.stage, a.stage + 1)
                        ? bwdDone[key(a.stage + 1, a.microbatch)]
                        : recvB[k];
            if (fwdDone[k] < 0) ready = -1;
            break;
          case ActionType::kSendF:
            ready = fwdDone[k];
            break;
          case ActionType::kSendB:
            ready = bwdDone[k];
            break;
          case ActionType::kRecvF:
            ready = sentF[key(a.stage - 1, a.microbatch)];
            break;
          case ActionType::kRecvB:
            ready = sentB[key(a.stage + 1, a.microbatch)];
            break;
        }
        if (ready < 0) break;  // blocked: wait for another rank
        if (isCompute(a.type)) {
          const int end = std::max(clock[r], ready) + 1;
          stats.start_slots[r][pc[r]] = end - 1;
          clock[r] = end;
          if (a.type == ActionType::kForward) {
            fwdDone[k] = end;
            stats.peak_in_flight[r] = std::max(stats.peak_in_flight[r], ++inFlight[r]);
          } else {
            bwdDone[k] = end;
            --inFlight[r];
          }
        } else if (a.type == ActionType::kSendF) {
          sentF[k] = ready;
        } else if (a.type == ActionType::kSendB) {
          sentB[k] = ready;
        } else if (a.type == ActionType::kRecvF) {
          recvF[k] = ready;
        } else {
          recvB[k] = ready;
        }
        ++pc[r];
        progressed = true;
      }
    }
    if (finished) break;
    if (!progressed) {
      std::ostringstream msg;
      msg << "pipeline schedule deadlocks: every rank waits:";
      for (int r = 0; r < R; ++r) {
        msg << " rank " << r << " at "
            << (pc[r] < s.ranks[r].size() ? toString(s.ranks[r][pc[r]]) : "end") << ";";
      }
      fail(msg.str());
    }
  }
  int busy = 0;
  for (int r = 0; r < R; ++r) {
    for (const Action& a : s.ranks[r]) busy += isCompute(a.type) ? 1 : 0;
    stats.makespan = std::max(stats.makespan, clock[r]);
  }
  stats.bubble =
      1.0 - static_cast<double>(busy) / (static_cast<double>(R) * stats.makespan);
  return stats;
}

}  // namespace dsp::pipeline
