#include "schedule.h"

#include <algorithm>
#include <cctype>
#include <deque>
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
    case ActionType::kInput:
      return "I";
    case ActionType::kWeight:
      return "W";
  }
  return "?";
}

[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument(msg); }

std::string num(int x) { return std::to_string(x); }

bool isCompute(ActionType t) {
  return t == ActionType::kForward || t == ActionType::kBackward ||
         t == ActionType::kInput || t == ActionType::kWeight;
}

// The actions whose result is the gradient sent to the previous stage.
bool isInputGradient(ActionType t) {
  return t == ActionType::kBackward || t == ActionType::kInput;
}

int costOf(ActionType t, const Costs& c) {
  switch (t) {
    case ActionType::kForward:
      return c.forward;
    case ActionType::kBackward:
      return c.backward;
    case ActionType::kInput:
      return c.input;
    case ActionType::kWeight:
      return c.weight;
    default:
      return 0;
  }
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
// backwards walk them in reverse. A longer warm-up fills the deeper pipe:
// (v - 1)p forwards, and `hop` more per rank after r (2: a whole backward
// comes back through each; 1 when it splits and only I does, as in torch's
// interleaved zero bubble).
Orders interleaved(int p, int v, int m, int hop = 2) {
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
    const int warmup = std::min((p - r - 1) * hop + (v - 1) * p, total);
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

// Zero bubble (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024)
// from a 1F1B-style order `main` of F and B (stage s on rank s % ranks):
// each rank keeps that order of F and I (B becomes I) and puts a W, oldest
// I first, into every slot where the order's next action is not ready yet,
// which is where the plain order waits; a W also comes first when an F would
// otherwise hold more than `bound` micro-batch-stages (F until W), the
// order's peak on rank 0. Later ranks, whose order waits most in the
// cool-down, postpone their W's most. The order is found by list scheduling
// in unit time (F = I = W = 1).
Orders zeroBubble(const Orders& main, int stages, int m, int bound) {
  const int p = static_cast<int>(main.size());
  Orders out(p);
  constexpr int kNever = -1;
  std::vector<std::vector<int>> fEnd(stages, std::vector<int>(m, kNever));
  std::vector<std::vector<int>> iEnd(stages, std::vector<int>(m, kNever));
  std::vector<size_t> next(p, 0);
  std::vector<int> forwards(p, 0), weights(p, 0);
  std::vector<std::deque<Action>> owed(p);  // W's, oldest I first
  auto doneBy = [](int end, int t) { return end != kNever && end <= t; };
  size_t actions = 0;
  for (const auto& o : main) actions += o.size();
  for (int t = 0;; ++t) {
    // Some rank runs an action in every slot of an order that is not stuck,
    // and there are 1.5 x actions of them: past 2 x actions slots it is.
    if (static_cast<size_t>(t) > 2 * actions + 2)
      fail("zero-bubble order did not converge");
    bool all = true;
    for (int r = 0; r < p; ++r) {
      if (next[r] == main[r].size() && owed[r].empty()) continue;
      all = false;
      bool ready = false, forced = false;
      if (next[r] < main[r].size()) {
        const Action& a = main[r][next[r]];
        if (a.type == ActionType::kForward) {
          ready = a.stage == 0 || doneBy(fEnd[a.stage - 1][a.microbatch], t);
          forced = forwards[r] - weights[r] >= bound;  // a W first, to stay within it
        } else {
          ready = doneBy(fEnd[a.stage][a.microbatch], t) &&
                  (a.stage == stages - 1 || doneBy(iEnd[a.stage + 1][a.microbatch], t));
        }
      }
      if (ready && !forced) {
        const Action& a = main[r][next[r]++];
        if (a.type == ActionType::kForward) {
          out[r].push_back(a);
          fEnd[a.stage][a.microbatch] = t + 1;
          ++forwards[r];
        } else {
          out[r].push_back({ActionType::kInput, a.stage, a.microbatch});
          iEnd[a.stage][a.microbatch] = t + 1;
          owed[r].push_back({ActionType::kWeight, a.stage, a.microbatch});
        }
      } else if (!owed[r].empty()) {
        out[r].push_back(owed[r].front());
        owed[r].pop_front();
        ++weights[r];
      }
    }
    if (all) break;
  }
  return out;
}

// "zb1p", torch's ScheduleInterleavedZeroBubble: zero bubble over
// interleaved 1F1B's order with the warm-up one forward per rank after r
// (the I that comes back is half a backward), within that order's peak on
// rank 0, vp stage-activations (vm when fewer; interleaved 1F1B holds 2(p -
// 1) + (v - 1)p + 1). With one stage per rank that order is 1F1B's and this
// is ZB-H1, whose bubble is (p - 1)(F + I - W) = p - 1 slots against 1F1B's
// (p - 1)(F + B) = 3(p - 1) with B = I + W; with v stages per rank it takes
// 3vm + (p - 1) slots, the least possible (GoogleTest checks both, to the
// slot).
Orders zeroBubbleInterleaved(int p, int v, int m) {
  return zeroBubble(interleaved(p, v, m, 1), p * v, m, std::min(v * p, v * m));
}

// ZBV (the zero-bubble paper, section 6; the order of torch's
// ScheduleZBVZeroBubble): rank r holds chunk 0 = stage r and chunk 1 = stage
// 2p - 1 - r. Warm-up: 2(p - r) - 1 forwards of chunk 0, then r pairs of
// (F chunk 1, F chunk 0), then p - r triples F, I, W of chunk 1; steady
// state alternates F I W of chunk 0 and of chunk 1; the cool-down drains
// the I's (chunk 0 and 1 in turns, then chunk 0 with its W's) and the rest
// of the W's. The schedule is planned for max(m, 2p - 1) micro-batches and
// the extra ones are dropped (fewer than 2p - 1 cannot fill the V). With F
// = I = W its bubble is zero once m >= 2p, at 1F1B's activation memory (2p
// chunks in flight on rank 0, each half a 1F1B stage).
Orders zeroBubbleV(int p, int m) {
  Orders out(p);
  const int n = std::max(m, 2 * p - 1);
  for (int r = 0; r < p; ++r) {
    const int c0 = r, c1 = 2 * p - 1 - r;
    int f0 = 0, f1 = 0, b0 = 0, b1 = 0;
    std::vector<Action> o;
    auto add = [&](ActionType t, int stage, int mb) { o.push_back({t, stage, mb}); };
    for (int i = 0; i < 2 * (p - r) - 1; ++i) add(ActionType::kForward, c0, f0++);
    for (int i = 0; i < r; ++i) {
      add(ActionType::kForward, c1, f1++);
      add(ActionType::kForward, c0, f0++);
    }
    for (int i = 0; i < p - r; ++i) {
      add(ActionType::kForward, c1, f1++);
      add(ActionType::kInput, c1, b1);
      add(ActionType::kWeight, c1, b1++);
    }
    while (f1 < f0 || f0 < n) {
      if (f0 < n) add(ActionType::kForward, c0, f0++);
      add(ActionType::kInput, c0, b0);
      add(ActionType::kWeight, c0, b0++);
      add(ActionType::kForward, c1, f1++);
      add(ActionType::kInput, c1, b1);
      add(ActionType::kWeight, c1, b1++);
    }
    int w0 = b0, w1 = b1;
    for (int i = 0; i < r; ++i) {
      add(ActionType::kInput, c0, b0++);
      add(ActionType::kInput, c1, b1++);
    }
    for (int i = 0; i < p - r; ++i) {
      add(ActionType::kInput, c0, b0++);
      add(ActionType::kWeight, c0, w0++);
    }
    while (w1 < b1) add(ActionType::kWeight, c1, w1++);
    while (w0 < b0) add(ActionType::kWeight, c0, w0++);
    for (const Action& a : o)
      if (a.microbatch < m) out[r].push_back(a);
  }
  return out;
}

// DualPipeV (DeepSeek's DualPipe folded into a V; the order of
// deepseek-ai/DualPipe's dualpipev.py and of torch's ScheduleDualPipeV):
// rank r holds chunk 0 = stage r and chunk 1 = stage 2p - 1 - r. Phases:
// 2(p - r - 1) F0; r + 1 (F0, F1); p - r - 1 (I1, W, F1); m - 2p + r + 1
// (F0 & B1, F1 & B0), the pairs DualPipe overlaps; p - r - 1 (B1, F1 & B0);
// r + 1 (B1, B0), split into I from the middle on; p - r - 1 (W, B0 or
// I0); r + 1 W. W's drain a FIFO of the I's. An overlapped pair is written
// as its forward then its backward: the runtime posts both transfers
// without blocking, so each one's transfer proceeds under the other's
// compute. Needs m >= 2p.
Orders dualPipeV(int p, int m) {
  Orders out(p);
  for (int r = 0; r < p; ++r) {
    const int c0 = r, c1 = 2 * p - 1 - r;
    std::map<int, int> nextF, nextB;  // per stage: the next micro-batch
    std::deque<Action> weights;       // W's owed, oldest first
    auto& o = out[r];
    auto F = [&](int st) { o.push_back({ActionType::kForward, st, nextF[st]++}); };
    auto B = [&](int st, bool split) {
      const int mb = nextB[st]++;
      o.push_back({split ? ActionType::kInput : ActionType::kBackward, st, mb});
      if (split) weights.push_back({ActionType::kWeight, st, mb});
    };
    auto W = [&] {
      if (weights.empty()) return;
      o.push_back(weights.front());
      weights.pop_front();
    };
    for (int i = 0; i < 2 * (p - r - 1); ++i) F(c0);
    for (int i = 0; i < r + 1; ++i) F(c0), F(c1);
    for (int i = 0; i < p - r - 1; ++i) B(c1, true), W(), F(c1);
    for (int i = 0; i < m - 2 * p + r + 1; ++i) F(c0), B(c1, false), F(c1), B(c0, false);
    for (int i = 0; i < p - r - 1; ++i) B(c1, false), F(c1), B(c0, false);
    bool split = false;
    for (int i = 0; i < r + 1; ++i) {
      if (i == (r + 1) / 2 && r % 2 == 1) split = true;
      B(c1, split);
      if (i == (r + 1) / 2 && r % 2 == 0) split = true;
      B(c0, split);
    }
    for (int i = 0; i < p - r - 1; ++i) W(), B(c0, split);
    for (int i = 0; i < r + 1; ++i) W();
  }
  return out;
}

// Adds the transfers: a receive right before the compute that needs it, a
// send right after the compute that produced it.
Schedule withTransfers(const Orders& orders, int stages, int m,
                       Placement placement = Placement::kLoop) {
  Schedule s;
  s.placement = placement;
  s.num_stages = stages;
  s.num_ranks = static_cast<int>(orders.size());
  s.num_microbatches = m;
  s.ranks.resize(orders.size());
  auto remote = [&](int a, int b) {
    return rankOfStage(a, s.num_ranks, placement) !=
           rankOfStage(b, s.num_ranks, placement);
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
      } else if (isInputGradient(a.type)) {
        if (a.stage < stages - 1 && remote(a.stage, a.stage + 1))
          out.push_back({ActionType::kRecvB, a.stage, a.microbatch});
        out.push_back(a);
        if (a.stage > 0 && remote(a.stage - 1, a.stage))
          out.push_back({ActionType::kSendB, a.stage, a.microbatch});
      } else {
        out.push_back(a);  // W: nothing moves
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
      {"SEND_B", ActionType::kSendB}, {"RECV_B", ActionType::kRecvB},
      {"I", ActionType::kInput},      {"W", ActionType::kWeight}};
  const auto it = kKinds.find(kind);
  if (it == kKinds.end()) fail("unknown action kind '" + kind + "' in '" + text + "'");
  return {it->second, std::stoi(text.substr(0, i)), std::stoi(text.substr(j))};
}

int rankOfStage(int stage, int num_ranks, Placement placement) {
  if (placement == Placement::kV && stage >= num_ranks) return 2 * num_ranks - 1 - stage;
  return stage % num_ranks;
}

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
  if (name == "zb1p" && stages_per_rank == 1) {
    return withTransfers(zeroBubbleInterleaved(p, 1, m), num_stages, m);
  }
  if (name == "interleaved_1f1b" || name == "zb1p") {
    if (m % p != 0) {
      fail(name + " with " + num(stages_per_rank) +
           " stages per rank needs the micro-batches (" + num(m) +
           ") to be a multiple of the ranks (" + num(p) + ")");
    }
    const int v = stages_per_rank;
    return withTransfers(
        name == "zb1p" ? zeroBubbleInterleaved(p, v, m) : interleaved(p, v, m),
        num_stages, m);
  }
  if (name == "zbv") {
    if (stages_per_rank != 2) {
      fail("zbv runs two stages per rank (in a V); got " + num(stages_per_rank));
    }
    return withTransfers(zeroBubbleV(p, m), num_stages, m, Placement::kV);
  }
  if (name == "dualpipev") {
    if (stages_per_rank != 2) {
      fail("dualpipev runs two stages per rank (in a V); got " + num(stages_per_rank));
    }
    if (m < 2 * p) {
      fail("dualpipev needs at least twice as many micro-batches (" + num(m) +
           ") as ranks (" + num(p) + ")");
    }
    return withTransfers(dualPipeV(p, m), num_stages, m, Placement::kV);
  }
  fail("unknown pipeline schedule '" + name +
       "' (gpipe, 1f1b, interleaved_1f1b, zb1p, zbv, dualpipev)");
}

// ---------------------------------------------------------------------------
// validation: structure first, then a unit-time simulation of all ranks

ScheduleStats validate(const Schedule& s, const Costs& costs) {
  return validate(s, std::vector<Costs>(std::max(0, s.num_stages), costs));
}

ScheduleStats validate(const Schedule& s, const std::vector<Costs>& costs) {
  const int S = s.num_stages, R = s.num_ranks, M = s.num_microbatches;
  if (static_cast<int>(costs.size()) != S) {
    fail("costs are given for " + num(static_cast<int>(costs.size())) +
         " stages, the schedule has " + num(S));
  }
  if (R < 1 || S < 1 || M < 1 || static_cast<int>(s.ranks.size()) != R) {
    fail("schedule has " + num(static_cast<int>(s.ranks.size())) + " rank lists for " +
         num(R) + " ranks");
  }
  auto key = [&](int stage, int mb) { return static_cast<size_t>(stage) * M + mb; };
  const size_t N = static_cast<size_t>(S) * M;
  if (s.placement == Placement::kV && S != 2 * R) {
    fail("a V placement needs two stages per rank: " + num(S) + " stages on " + num(R) +
         " ranks");
  }
  auto rankOf = [&](int stage) { return rankOfStage(stage, R, s.placement); };
  // Each kind of action at most once per (stage, micro-batch), on its owner.
  std::map<ActionType, std::vector<int>> count;
  for (auto t : {ActionType::kForward, ActionType::kBackward, ActionType::kSendF,
                 ActionType::kRecvF, ActionType::kSendB, ActionType::kRecvB,
                 ActionType::kInput, ActionType::kWeight}) {
    count[t].assign(N, 0);
  }
  for (int r = 0; r < R; ++r) {
    std::vector<int> forwardAt(N, -1), inputAt(N, -1);
    for (size_t i = 0; i < s.ranks[r].size(); ++i) {
      const Action& a = s.ranks[r][i];
      if (a.stage < 0 || a.stage >= S || a.microbatch < 0 || a.microbatch >= M) {
        fail("rank " + num(r) + ": action " + toString(a) + " is out of range (" +
             num(S) + " stages, " + num(M) + " micro-batches)");
      }
      if (rankOf(a.stage) != r) {
        fail("rank " + num(r) + ": action " + toString(a) + " is for stage " +
             num(a.stage) + ", which lives on rank " + num(rankOf(a.stage)));
      }
      if (++count[a.type][key(a.stage, a.microbatch)] > 1) {
        fail("rank " + num(r) + ": action " + toString(a) + " appears twice");
      }
      if (a.type == ActionType::kForward) forwardAt[key(a.stage, a.microbatch)] = int(i);
      if (a.type == ActionType::kInput) inputAt[key(a.stage, a.microbatch)] = int(i);
      if (isInputGradient(a.type) && forwardAt[key(a.stage, a.microbatch)] < 0) {
        fail("rank " + num(r) + ": backward " + toString(a) +
             " comes before its forward");
      }
      if (a.type == ActionType::kWeight && inputAt[key(a.stage, a.microbatch)] < 0) {
        fail("rank " + num(r) + ": weight gradient " + toString(a) +
             " comes before its input gradient " +
             toString({ActionType::kInput, a.stage, a.microbatch}));
      }
    }
  }
  for (int st = 0; st < S; ++st) {
    for (int mb = 0; mb < M; ++mb) {
      const size_t k = key(st, mb);
      if (count[ActionType::kForward][k] != 1)
        fail("action " + toString({ActionType::kForward, st, mb}) + " is missing");
      const int b = count[ActionType::kBackward][k], in = count[ActionType::kInput][k],
                w = count[ActionType::kWeight][k];
      if (!(b == 1 && in == 0 && w == 0) && !(b == 0 && in == 1 && w == 1)) {
        fail("backward of micro-batch " + num(mb) + " of stage " + num(st) + " is " +
             (b + in + w == 0 ? "missing" : "malformed") +
             ": it needs one B, or one I and one W; it has " + num(b) + " B, " + num(in) +
             " I, " + num(w) + " W");
      }
      // A transfer exists exactly when neighbouring stages sit on different ranks.
      const bool nextRemote = st + 1 < S && rankOf(st) != rankOf(st + 1);
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
  // bwdDone: the input gradient exists (B or I); inDone: I alone, for W.
  std::vector<int> fwdDone(N, -1), bwdDone(N, -1), inDone(N, -1), sentF(N, -1),
      sentB(N, -1), recvF(N, -1), recvB(N, -1);
  std::vector<size_t> pc(R, 0);
  std::vector<int> clock(R, 0), inFlight(R, 0);
  ScheduleStats stats;
  stats.peak_in_flight.assign(R, 0);
  stats.start_slots.resize(R);
  for (int r = 0; r < R; ++r) stats.start_slots[r].assign(s.ranks[r].size(), -1);
  auto local = [&](int a, int b) { return rankOf(a) == rankOf(b); };
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
          case ActionType::kWeight:
            ready = inDone[k];
            break;
          case ActionType::kBackward:
          case ActionType::kInput:
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
          const int start = std::max(clock[r], ready);
          const int end = start + costOf(a.type, costs[a.stage]);
          stats.start_slots[r][pc[r]] = start;
          clock[r] = end;
          if (a.type == ActionType::kForward) {
            fwdDone[k] = end;
            stats.peak_in_flight[r] = std::max(stats.peak_in_flight[r], ++inFlight[r]);
          } else if (a.type == ActionType::kInput) {
            bwdDone[k] = inDone[k] = end;  // activations stay until W
          } else {
            if (a.type == ActionType::kBackward) bwdDone[k] = end;
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
    for (const Action& a : s.ranks[r]) busy += costOf(a.type, costs[a.stage]);
    stats.makespan = std::max(stats.makespan, clock[r]);
  }
  stats.bubble =
      1.0 - static_cast<double>(busy) / (static_cast<double>(R) * stats.makespan);
  return stats;
}

}  // namespace dsp::pipeline
