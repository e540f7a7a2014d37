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
  // The numbers: 2 stages, 13/15 of 1F1B's time at 4 micro-batches,
  // 25/27 at 8.
  EXPECT_EQ(validate(makeSchedule("zb1p", 2, 4), paper).makespan, 13);
  EXPECT_EQ(validate(makeSchedule("1f1b", 2, 4), paper).makespan, 15);
  EXPECT_EQ(validate(makeSchedule("zb1p", 2, 8), paper).makespan, 25);
  EXPECT_EQ(validate(makeSchedule("1f1b", 2, 8), paper).makespan, 27);
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
