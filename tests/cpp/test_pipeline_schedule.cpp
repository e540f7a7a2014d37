// Pipeline schedules: every generator valid over a grid, closed forms for
// bubble and in-flight micro-batches, printing round trips, broken
// schedules rejected with the reason.
#include <gtest/gtest.h>

#include <algorithm>

#include "core/pipeline/schedule.h"

namespace dsp::pipeline {
namespace {

TEST(PipelineSchedule, GPipeAnd1F1BMatchClosedForms) {
  for (int p = 1; p <= 8; ++p) {
    for (int m = 1; m <= 32; ++m) {
      const double bubble = double(p - 1) / (m + p - 1);
      const ScheduleStats g = validate(makeSchedule("gpipe", p, m));
      EXPECT_NEAR(g.bubble, bubble, 1e-12) << "gpipe p=" << p << " m=" << m;
      for (int r = 0; r < p; ++r) EXPECT_EQ(g.peak_in_flight[r], m);
      const ScheduleStats f = validate(makeSchedule("1f1b", p, m));
      EXPECT_NEAR(f.bubble, bubble, 1e-12) << "1f1b p=" << p << " m=" << m;
      for (int r = 0; r < p; ++r) {
        EXPECT_EQ(f.peak_in_flight[r], std::min(p - r, m)) << "p=" << p << " m=" << m;
      }
    }
  }
}

// The zero-bubble paper's comparison: F = I = W = 1, a whole backward B = 2.
// 1F1B idles (p-1)(F+B) = 3(p-1) slots per rank, ZB-H1 (p-1)(F+I-W) = p-1,
// at the same activation bound (p - r micro-batches on rank r).
TEST(PipelineSchedule, ZeroBubbleH1MatchesThePaper) {
  const Costs paper{1, 2, 1, 1};
  for (int p = 1; p <= 8; ++p) {
    for (int m = p; m <= 32; ++m) {
      const ScheduleStats one = validate(makeSchedule("1f1b", p, m), paper);
      EXPECT_EQ(one.makespan, 3 * m + 3 * (p - 1)) << "1f1b p=" << p << " m=" << m;
      const ScheduleStats zb = validate(makeSchedule("zb1p", p, m), paper);
      EXPECT_EQ(zb.makespan, 3 * m + (p - 1)) << "zb1p p=" << p << " m=" << m;
      EXPECT_NEAR(zb.bubble, double(p - 1) / (3 * m + p - 1), 1e-12);
      for (int r = 0; r < p; ++r) {
        EXPECT_LE(zb.peak_in_flight[r], p) << "zb1p p=" << p << " m=" << m;
      }
    }
  }
  // The zero-bubble paper's numbers: 2 stages, 13/15 of 1F1B's time at 4 micro-batches,
  // 25/27 at 8.
  EXPECT_EQ(validate(makeSchedule("zb1p", 2, 4), paper).makespan, 13);
  EXPECT_EQ(validate(makeSchedule("1f1b", 2, 4), paper).makespan, 15);
  EXPECT_EQ(validate(makeSchedule("zb1p", 2, 8), paper).makespan, 25);
  EXPECT_EQ(validate(makeSchedule("1f1b", 2, 8), paper).makespan, 27);
}

// Interleaved (v stages per rank, rank r holding r, r + p, ...), each stage
// F = I = W = 1 slot: every rank does 3vm slots of work and the last rank
// can start only after the p - 1 forwards ahead of it, so 3vm + (p - 1) is
// the least any schedule can take. Interleaved 1F1B idles (p - 1)(F + B) =
// 3(p - 1) slots on top of its work, holding 2(p - 1) + (v - 1)p + 1
// stage-activations on rank 0 (vm when fewer); zero bubble takes exactly
// the lower bound, holding vp (as torch's ScheduleInterleavedZeroBubble).
TEST(PipelineSchedule, ZeroBubbleInterleavedReachesTheLowerBound) {
  const Costs paper{1, 2, 1, 1};
  for (int v = 2; v <= 4; ++v) {
    for (int p = 1; p <= 6; ++p) {
      for (int m = p; m <= 5 * p; m += p) {
        const Schedule one = makeSchedule("interleaved_1f1b", v * p, m, v);
        const ScheduleStats base = validate(one, paper);
        EXPECT_EQ(base.makespan, 3 * v * m + 3 * (p - 1))
            << "v=" << v << " p=" << p << " m=" << m;
        EXPECT_EQ(base.peak_in_flight[0], std::min(2 * (p - 1) + (v - 1) * p + 1, v * m));
        const Schedule zb = makeSchedule("zb1p", v * p, m, v);
        const ScheduleStats s = validate(zb, paper);
        EXPECT_EQ(s.makespan, 3 * v * m + (p - 1))
            << "v=" << v << " p=" << p << " m=" << m;
        EXPECT_EQ(s.peak_in_flight[0], std::min(v * p, v * m)) << "v=" << v << " p=" << p;
        for (int r = 0; r < p; ++r) {
          EXPECT_LE(s.peak_in_flight[r], std::min(v * p, v * m))
              << "v=" << v << " p=" << p;
          for (const Action& a : zb.ranks[r]) EXPECT_EQ(a.stage % p, r);
        }
      }
    }
  }
  EXPECT_THROW(makeSchedule("zb1p", 4, 3, 2), std::invalid_argument);  // m % p
}

// Per-stage costs: the same as one cost when all are equal; otherwise each
// stage's own durations place the waits. GPipe, 2 stages, 2 micro-batches,
// stage 1 twice as slow: rank 1 runs F [1,3) [3,5), B [5,7) [7,9); rank 0
// runs F [0,1) [1,2) and each B after rank 1's: [7,8), [9,10).
TEST(PipelineSchedule, PerStageCostsPlaceTheWaits) {
  const Schedule g = makeSchedule("gpipe", 2, 2);
  const ScheduleStats slow = validate(g, std::vector<Costs>{{1, 1, 1, 1}, {2, 2, 1, 1}});
  EXPECT_EQ(slow.makespan, 10);
  EXPECT_EQ(slow.start_slots[0][0], 0);
  EXPECT_NEAR(slow.bubble, 1.0 - (4.0 + 8.0) / 20.0, 1e-12);
  const Costs paper{1, 2, 1, 1};
  for (const char* name : {"1f1b", "zb1p"}) {
    const Schedule s = makeSchedule(name, 4, 8);
    EXPECT_EQ(validate(s, std::vector<Costs>(4, paper)).makespan,
              validate(s, paper).makespan)
        << name;
  }
  EXPECT_THROW(validate(g, std::vector<Costs>(3)), std::invalid_argument);
}

// ZBV with F = I = W = 1 slot per stage (a stage is half of a ZB-H1
// stage): every rank does 6m slots of work and the last rank can start only
// after the p - 1 forwards ahead of it, so 6m + (p - 1) is the least any
// schedule can take; ZBV takes exactly that once m >= 2p - 1 (the paper's
// zero bubble: nothing idles after the ramp-up), holding at most 2p
// stage-activations on a rank, which is 1F1B's p whole stages.
TEST(PipelineSchedule, ZeroBubbleVMatchesThePaper) {
  const Costs unit{1, 2, 1, 1};
  for (int p = 1; p <= 8; ++p) {
    for (int m = 1; m <= 32; ++m) {
      const Schedule s = makeSchedule("zbv", 2 * p, m, 2);
      ASSERT_EQ(s.placement, Placement::kV);
      const ScheduleStats zb = validate(s, unit);
      if (m >= 2 * p - 1) {
        EXPECT_EQ(zb.makespan, 6 * m + (p - 1)) << "zbv p=" << p << " m=" << m;
      }
      for (int r = 0; r < p; ++r) {
        EXPECT_LE(zb.peak_in_flight[r], 2 * p) << "zbv p=" << p << " m=" << m;
      }
    }
  }
  // The V: rank r holds stages r and 2p - 1 - r, so stages 0 and 2p - 1 share
  // rank 0 and the middle two the last rank, whose hand-over is local.
  EXPECT_EQ(rankOfStage(0, 4, Placement::kV), 0);
  EXPECT_EQ(rankOfStage(7, 4, Placement::kV), 0);
  EXPECT_EQ(rankOfStage(4, 4, Placement::kV), 3);
  const Schedule s = makeSchedule("zbv", 8, 8, 2);
  for (const Action& a : s.ranks[3]) {
    EXPECT_FALSE(a.type == ActionType::kSendF && a.stage == 3) << "local hand-over sent";
  }
  EXPECT_THROW(makeSchedule("zbv", 4, 8, 1), std::invalid_argument);
}

// DualPipeV in the same units, each overlapped pair F & B run back to back
// (F&B = F + B: on one CPU there is no second stream to overlap compute
// with; the pairs overlap transfers). The DualPipe README's bubble,
// (PP/2 - 1)(F&B + B - 3W) with PP = 2p stages, counts 2(p - 1) slots here;
// the schedule reaches the 6m + (p - 1) lower bound, as ZBV does, holding
// 2p + 1 stage-activations (the README's PP + 1) on rank 0.
TEST(PipelineSchedule, DualPipeVMatchesTheReadme) {
  const Costs unit{1, 2, 1, 1};
  for (int p = 1; p <= 8; ++p) {
    for (int m = 2 * p; m <= 40; ++m) {
      const ScheduleStats s = validate(makeSchedule("dualpipev", 2 * p, m, 2), unit);
      EXPECT_EQ(s.makespan, 6 * m + (p - 1)) << "dualpipev p=" << p << " m=" << m;
      EXPECT_LE(s.makespan - 6 * m, (p - 1) * ((1 + 2) + 2 - 3 * 1));
      EXPECT_EQ(s.peak_in_flight[0], 2 * p + 1) << "dualpipev p=" << p << " m=" << m;
      for (int r = 0; r < p; ++r) EXPECT_LE(s.peak_in_flight[r], 2 * p + 1);
    }
  }
  EXPECT_THROW(makeSchedule("dualpipev", 8, 7, 2), std::invalid_argument);  // m < 2p
  EXPECT_THROW(makeSchedule("dualpipev", 4, 8, 1), std::invalid_argument);
}

TEST(PipelineSchedule, SplitBackwardIsChecked) {
  auto sched = [](std::vector<std::vector<std::string>> ranks, int stages, int m) {
    Schedule s;
    s.num_stages = stages;
    s.num_ranks = static_cast<int>(ranks.size());
    s.num_microbatches = m;
    for (const auto& r : ranks) {
      s.ranks.emplace_back();
      for (const auto& t : r) s.ranks.back().push_back(parseAction(t));
    }
    return s;
  };
  auto reason = [](const Schedule& s) {
    try {
      validate(s);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("valid");
  };
  EXPECT_EQ(reason(sched({{"0F0", "0I0", "0W0"}}, 1, 1)), "valid");
  EXPECT_NE(
      reason(sched({{"0F0", "0W0", "0I0"}}, 1, 1)).find("before its input gradient"),
      std::string::npos);
  EXPECT_NE(reason(sched({{"0F0", "0I0"}}, 1, 1)).find("one I and one W"),
            std::string::npos);
  EXPECT_NE(reason(sched({{"0F0", "0B0", "0I0", "0W0"}}, 1, 1)).find("1 B, 1 I, 1 W"),
            std::string::npos);
  EXPECT_EQ(toString(parseAction("3W7")), "3W7");
  EXPECT_EQ(toString(parseAction("0I2")), "0I2");
}

TEST(PipelineSchedule, InterleavedIsValidAndShrinksTheBubble) {
  for (int p = 1; p <= 8; ++p) {
    for (int v = 1; v <= 4; ++v) {
      for (int m = p; m <= 32; m += p) {
        const ScheduleStats s = validate(makeSchedule("interleaved_1f1b", p * v, m, v));
        // Megatron's closed form: (p-1) idle slots per rank against v*m of work.
        EXPECT_LE(s.bubble, double(p - 1) / (v * m + p - 1) + 1e-12)
            << "p=" << p << " v=" << v << " m=" << m;
        if (v == 1) {
          EXPECT_NEAR(s.bubble, double(p - 1) / (m + p - 1), 1e-12);
        }
      }
    }
  }
}

TEST(PipelineSchedule, PrintsAndParsesLikeTorch) {
  const Schedule s = makeSchedule("1f1b", 2, 2);
  std::vector<std::string> r0, r1;
  for (const Action& a : s.ranks[0]) r0.push_back(toString(a));
  for (const Action& a : s.ranks[1]) r1.push_back(toString(a));
  EXPECT_EQ(r0, (std::vector<std::string>{"0F0", "0SEND_F0", "0F1", "0SEND_F1",
                                          "0RECV_B0", "0B0", "0RECV_B1", "0B1"}));
  EXPECT_EQ(r1, (std::vector<std::string>{"1RECV_F0", "1F0", "1B0", "1SEND_B0",
                                          "1RECV_F1", "1F1", "1B1", "1SEND_B1"}));
  for (const auto& rank : s.ranks)
    for (const Action& a : rank) EXPECT_EQ(parseAction(toString(a)), a);
  EXPECT_THROW(parseAction("F0"), std::invalid_argument);
  EXPECT_THROW(parseAction("1X0"), std::invalid_argument);
}

void expectRejected(const Schedule& s, const std::string& needle) {
  try {
    validate(s);
    FAIL() << "accepted a broken schedule; expected: " << needle;
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(PipelineSchedule, BrokenSchedulesAreRejected) {
  const Schedule good = makeSchedule("1f1b", 2, 3);
  // Receive on rank 1 moved after its forward: the forward has no input.
  Schedule noInput = good;
  std::swap(noInput.ranks[1][0], noInput.ranks[1][1]);
  expectRejected(noInput, "deadlocks");
  // Backward before its forward.
  Schedule early = makeSchedule("gpipe", 1, 2);
  std::swap(early.ranks[0][0], early.ranks[0][2]);
  expectRejected(early, "before its forward");
  // A send without its receive.
  Schedule unmatched = good;
  unmatched.ranks[1].erase(unmatched.ranks[1].begin());  // 1RECV_F0
  expectRejected(unmatched, "not matched");
  // A missing backward.
  Schedule missing = makeSchedule("gpipe", 1, 2);
  missing.ranks[0].pop_back();
  expectRejected(missing, "missing");
  // An action on another rank's stage.
  Schedule foreign = good;
  foreign.ranks[0].push_back({ActionType::kForward, 1, 0});
  expectRejected(foreign, "lives on rank 1");
  // A cycle: each rank first waits for the other's gradient.
  Schedule cycle = makeSchedule("gpipe", 2, 1);
  std::rotate(cycle.ranks[1].begin(), cycle.ranks[1].begin() + 1, cycle.ranks[1].end());
  expectRejected(cycle, "deadlocks");
}

TEST(PipelineSchedule, BadArgumentsNameTheNumbers) {
  EXPECT_THROW(makeSchedule("1f1b", 4, 8, 2), std::invalid_argument);
  try {
    makeSchedule("interleaved_1f1b", 4, 3, 2);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("(3)"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("(2)"), std::string::npos) << e.what();
  }
  EXPECT_THROW(makeSchedule("zero_bubble", 2, 2), std::invalid_argument);
  EXPECT_THROW(makeSchedule("gpipe", 0, 2), std::invalid_argument);
}

}  // namespace
}  // namespace dsp::pipeline
