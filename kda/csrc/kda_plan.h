// How a forward call is spread over the GPU, chosen on the host from shapes alone (never from the contents of
// cu_seqlens, which would need a synchronisation): the V split of the recurrence and the time split of long
// sequences (docs/DESIGN.md, "The plan").
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>

#include "kda/csrc/kda_params.h"

namespace kda {

// Recurrence CTAs per (segment, head). Each CTA owns 128 / v_split state rows (16 per warp), so the split
// changes no bit. One (sequence, head) on one SM is bound by the SM's throughput (8 warps share 4
// sub-partitions and the tensor cores: 0.73-0.90 µs per step); split over 2-8 SMs a step is bound by one warp's
// own chain, about 0.65 µs (docs/DESIGN.md, "The step"). Splitting past the SM count only queues CTAs, so the
// split is the largest power of two that still fits the whole grid on the GPU at once.
inline int choose_v_split(int64_t num_seqs, int heads, int sm_count) {
  const int64_t pairs = num_seqs * heads;
  int split = 1;
  while (split < 8 && pairs * split * 2 <= sm_count) split *= 2;
  return split;
}

// Slow decay: with lower_bound above this, the state update is S ⊙ 2^Γ + U_hi·Kr + U_lo·Kr, U_hi = bf16(Uᵀ) and
// U_lo = bf16(Uᵀ − U_hi), instead of S ⊙ 2^Γ + bf16(Uᵀ)·Kr. A slowly decaying state carries every step's rounding
// of Uᵀ furthest: at lower_bound −0.01 the bf16 rounding of Uᵀ alone lifts the state's error from 3.2e-3 to
// 3.6e-3 (T131072 H1, against float64); the second product costs 3–8 % of a call (docs/DESIGN.md). The twin
// asks the extension for this rule (hi_lo_state_update), so kernel and twin always agree.
constexpr float kHiLoUpdateLowerBound = -4.0f;
inline bool hi_lo_state_update(float lower_bound) { return lower_bound > kHiLoUpdateLowerBound; }

// How fwd runs a call on the GPU (docs/DESIGN.md, "The plan"); Python sees it as flash_kda.Plan. No choice
// changes a result bit except the time split, which the numerics twin re-enacts.
struct Plan {
  int v_split = 1;             // finishing-pass CTAs per (segment, head), each owning 128 / v_split state rows
  int scan_v_split = 1;        // scan-pass CTAs per (scanned segment, head, map)
  int segment_chunks = 0;      // the time split: chunks (16 tokens) per segment; 0: none
  bool single_pass = false;    // one kernel prepares and runs each (sequence, head) (v_split 1, no time split)
  int lead_chunks = -1;        // the overlap (kda_params.h): chunks prepared before the recurrence starts; -1: none
  int tail_ctas = 0;           // the overlap: tail-kernel CTAs, one per SM the recurrence leaves free
  bool longest_first = false;  // varlen: the finishing pass runs the longest sequences first (kda_params.h)
  bool decode = false;         // the decode plan: state in registers, token by token or 16 tokens a step; nothing else

  bool operator==(const Plan& o) const {
    return v_split == o.v_split && scan_v_split == o.scan_v_split && segment_chunks == o.segment_chunks &&
           single_pass == o.single_pass && lead_chunks == o.lead_chunks && tail_ctas == o.tail_ctas &&
           longest_first == o.longest_first && decode == o.decode;
  }
  bool operator!=(const Plan& o) const { return !(*this == o); }
};

// What a caller forces on the plan (flash_kda.testing.force_plan); an empty field leaves that choice to
// choose_plan. Forcing a V split forces two stages, and forcing anything keeps the overlap out, unless
// single_pass or lead_chunks say otherwise. Forcing anything but decode keeps the decode kernel out; decode = true
// runs it whatever the other fields say (the Python side refuses such combinations).
struct PlanOverrides {
  std::optional<int> v_split;         // 1, 2, 4 or 8 (the scan's V split too, unless scan_v_split is given)
  std::optional<int> scan_v_split;    // 1, 2, 4 or 8
  std::optional<int> segment_chunks;  // 0: no time split; L > 0: segments of L chunks, with V splits for them
  std::optional<bool> single_pass;    // true: the single pass (v_split 1, no time split); false: two stages
  std::optional<int> lead_chunks;     // L >= 0: the overlap with a lead of L chunks (fixed-length batches); -1: none
  std::optional<bool> decode;         // true: the decode kernel; false: a chunked plan
};

// The plan fields of a call's parameters (the binding fills them from a Plan).
inline Plan plan_of(const FwdParams& p) {
  return Plan{p.v_split, p.scan_v_split, p.segment_chunks, p.single_pass, p.lead_chunks, p.tail_ctas,
              p.longest_first, p.decode};
}

// Why `plan` cannot run a call of `num_seqs` sequences (`varlen`: with cu_seqlens), or "" when it can: the V
// splits are 1, 2, 4 or 8, and the single pass, the overlap and longest first each exclude a V split and the
// time split (and each other); the decode kernel excludes every other choice. fwd (kda_fwd.cu) refuses a call whose
// plan fails this.
// The single pass prepares its chunks in one scratch tile per warp, which holds no room for the softplus gate's
// anchored operands (prepare_chunk.cuh): it runs the lower-bound gate only.
inline std::string plan_error(const Plan& plan, bool varlen, int64_t num_seqs,
                              GateKind gate = GateKind::kLowerBound) {
  if (plan.single_pass && gate != GateKind::kLowerBound) {
    return "flash_kda: the single pass runs the lower-bound gate only, got the softplus gate with single_pass";
  }
  if (plan.decode && plan != Plan{1, 1, 0, false, -1, 0, false, true}) {
    return "flash_kda: the decode plan runs no V split, time split, single pass, overlap or longest first, got "
           "v_split " + std::to_string(plan.v_split) + ", scan_v_split " + std::to_string(plan.scan_v_split) +
           ", segment_chunks " + std::to_string(plan.segment_chunks) + ", single_pass " +
           std::to_string(plan.single_pass) + ", lead_chunks " + std::to_string(plan.lead_chunks) + ", tail_ctas " +
           std::to_string(plan.tail_ctas) + ", longest_first " + std::to_string(plan.longest_first);
  }
  const auto valid_split = [](int v) { return v == 1 || v == 2 || v == 4 || v == 8; };
  if (!valid_split(plan.v_split) || !valid_split(plan.scan_v_split)) {
    return "flash_kda: v_split and scan_v_split must be 1, 2, 4 or 8, got " + std::to_string(plan.v_split) +
           " and " + std::to_string(plan.scan_v_split);
  }
  if (plan.segment_chunks < 0) {
    return "flash_kda: segment_chunks must be >= 0, got " + std::to_string(plan.segment_chunks);
  }
  const bool overlap = plan.lead_chunks >= 0;
  if (overlap && (plan.v_split != 1 || plan.segment_chunks != 0 || plan.single_pass || varlen || plan.tail_ctas < 1)) {
    return "flash_kda: the overlap runs fixed-length batches at v_split 1 without a time split on at least one "
           "tail CTA, got v_split " + std::to_string(plan.v_split) + ", segment_chunks " +
           std::to_string(plan.segment_chunks) + ", tail_ctas " + std::to_string(plan.tail_ctas);
  }
  if (plan.longest_first && (!varlen || plan.v_split != 1 || plan.segment_chunks != 0 || plan.single_pass ||
                             overlap || num_seqs > kLongestFirstMaxSeqs)) {
    return "flash_kda: longest first runs varlen batches of at most " + std::to_string(kLongestFirstMaxSeqs) +
           " sequences at v_split 1 without a time split, got " + std::to_string(num_seqs) + " sequences, v_split " +
           std::to_string(plan.v_split) + ", segment_chunks " + std::to_string(plan.segment_chunks);
  }
  if (plan.single_pass && (plan.v_split != 1 || plan.segment_chunks != 0)) {
    return "flash_kda: the single pass runs v_split 1 without a time split, got v_split " +
           std::to_string(plan.v_split) + " and segment_chunks " + std::to_string(plan.segment_chunks);
  }
  return {};
}

// The cost model of the time split, in microseconds (constants measured on the H200, docs/DESIGN.md).
struct SplitCostModel {
  static constexpr double kStepAlone = 0.62;     // one 16-token step of one warp with an SM to itself
  static constexpr double kStepPerWarp = 0.075;  // added per further warp on the SM (up to 8)
  static constexpr double kStepSaturated = 0.13; // per warp-step once an SM holds more than 8 warps
  static constexpr double kScanFactor = 0.7;     // a scan step (no output) against a finishing step
  static constexpr double kCompose = 0.8;        // one link of the composition chain
  static constexpr double kOverhead = 10.0;      // the two extra launches and the table fill

  // Time of `steps` dependent steps while `warps` warps share `sm_count` SMs.
  static double pass(double steps, double warps, int sm_count) {
    const double per_sm = warps / sm_count;
    const double step = per_sm <= 8.0 ? kStepAlone + kStepPerWarp * (per_sm > 1.0 ? per_sm - 1.0 : 0.0)
                                      : kStepSaturated * per_sm;
    return steps * step;
  }
};

// Segment lengths tried, in chunks (16 tokens each).
constexpr int kSegmentChoices[] = {32, 64, 128, 256, 512, 1024, 2048, 4096};

// The V splits that go with `segment_chunks` (0: no time split) when `seqs` sequences of `chunks` chunks run.
inline Plan plan_with_segments(int64_t chunks, int64_t seqs, int heads, int sm_count, int segment_chunks) {
  if (segment_chunks <= 0 || chunks <= segment_chunks) {
    const int v = choose_v_split(seqs, heads, sm_count);
    return Plan{v, v, segment_chunks > 0 ? segment_chunks : 0};
  }
  const int64_t segments = (chunks + segment_chunks - 1) / segment_chunks;
  // The scan's maps (M and Q of every scanned segment and head) as CTAs: an 8-warp CTA fits once per SM
  // (registers), a 4-warp CTA three times (shared memory). Where 4-warp CTAs still fit in one wave they beat one
  // 8-warp CTA per map; past that both need two waves and the larger CTAs win (plan_sweep, docs/DESIGN.md).
  const int64_t maps = seqs * (segments - 1) * 2 * heads;
  const int scan_split = maps * 2 <= 3 * static_cast<int64_t>(sm_count)
                             ? std::max(2, choose_v_split(seqs * (segments - 1) * 2, heads, sm_count))
                             : 1;
  return Plan{choose_v_split(seqs * segments, heads, sm_count), scan_split, segment_chunks};
}

// The segment length (chunks) the cost model prefers when `seqs` sequences of `chunks` chunks run on `heads`
// heads, or 0 when no split gains clearly.
inline int best_segment_chunks(int64_t chunks, int64_t seqs, int heads, int sm_count) {
  if (heads <= 0 || chunks <= 0) return 0;
  using M = SplitCostModel;
  const double rows = static_cast<double>(seqs) * heads * (kHeadDim / 16);  // warps of one pass over all rows
  double best = 0.9 * M::pass(static_cast<double>(chunks), rows, sm_count);  // split only for a clear gain
  int best_L = 0;
  for (const int L : kSegmentChoices) {
    const int64_t segments = (chunks + L - 1) / L;
    if (segments < 2) break;
    const double scanned = static_cast<double>(segments - 1);
    const double cost = M::kScanFactor * M::pass(L, 2.0 * rows * scanned, sm_count) + M::kCompose * scanned +
                        M::pass(L, rows * static_cast<double>(segments), sm_count) + M::kOverhead;
    if (cost < best) {
      best = cost;
      best_L = L;
    }
  }
  return best_L;
}

// A varlen batch's longest sequence is unknown on the host (reading cu_seqlens would synchronise). Whether to
// split is decided for a longest sequence of kVarlenSkew times the mean length (at most every token): assuming
// one sequence holds every token would split batches of many short sequences, which then pay the split's extra
// launches for nothing (varlen 64x128 H32: +0.17 ms on the H200). When that says split, the segment length is
// chosen for the worst case (one sequence holds every token), so that a skewed batch — one 131072-token
// sequence among 64 of 128 tokens — gets the segments of its long sequence; short sequences cost the split
// almost nothing on the device (each stays one segment, which nobody scans).
constexpr int64_t kVarlenSkew = 8;

// Many short sequences: where the grid already over-fills the GPU with one 8-warp CTA per (sequence, head),
// sequences of at most kShortSequenceChunks chunks (mean) still gain from two 4-warp CTAs per pair. Such a CTA
// spends most of its life filling its ring and loading / storing the state, and three 4-warp CTAs per SM
// overlap that with each other's steps where one 8-warp CTA per SM cannot (H200, recurrence ms, v_split 1 / 2:
// varlen 64×128 H32 0.221 / 0.196; at 32 and 64 chunks per sequence one 8-warp CTA wins: B32 T512 H32
// 0.304 / 0.329, B8 T1024 H32 0.143 / 0.166).
constexpr int64_t kShortSequenceChunks = 8;
inline Plan split_short_sequences(Plan plan, int64_t mean_chunks) {
  if (plan.segment_chunks == 0 && plan.v_split == 1 && mean_chunks <= kShortSequenceChunks) {
    plan.v_split = plan.scan_v_split = 2;
  }
  return plan;
}

// The single pass (single_pass.cuh) saves the records' round trip through HBM (1,736 of 3,018 bytes per
// token-head) and needs no workspace, but each CTA prepares its chunks and then runs them, one after the other on
// its SM: 1.68 µs per chunk against 0.74 for a finishing step (H200, one CTA per SM), so it only pays where the
// two stages waste the SMs on short sequences. Measured (GPU ms, two stages / single pass, docs/DESIGN.md): varlen
// 64×128 H32 0.349 / 0.318; B32 T512 H32 0.515 / 0.509, B8 T1024 H32 0.257 / 0.255 and varlen 1024×8 H96 0.729 /
// 0.734 are even, T8192 H96 0.765 / 0.963 and the long rows far worse. So: the many short sequences of
// split_short_sequences (a mean of at most kShortSequenceChunks chunks over more pairs than the GPU holds at once).
inline bool single_pass_pays(int64_t total_tokens, int64_t num_seqs, int heads, int sm_count) {
  const int64_t total_chunks = (total_tokens + kChunk - 1) / kChunk;
  const int64_t mean_chunks = num_seqs > 0 ? (total_chunks + num_seqs - 1) / num_seqs : total_chunks;
  return choose_v_split(num_seqs, heads, sm_count) == 1 && mean_chunks <= kShortSequenceChunks;
}

// The two-stage plan for a call; a `forced_segment_chunks` fixes the time split (0: none) and picks the V splits
// for it.
inline Plan choose_two_stage_plan(int64_t total_tokens, int64_t seqlen, int64_t num_seqs, int heads, bool varlen,
                                  int sm_count, std::optional<int> forced_segment_chunks) {
  const int64_t total_chunks = (total_tokens + kChunk - 1) / kChunk;
  const int64_t mean_chunks = num_seqs > 0 ? (total_chunks + num_seqs - 1) / num_seqs : total_chunks;
  // The longest sequence and how many sequences are that long.
  const int64_t chunks = varlen ? total_chunks : (seqlen + kChunk - 1) / kChunk;
  const int64_t seqs = varlen ? 1 : num_seqs;
  if (forced_segment_chunks.has_value()) {
    Plan plan = plan_with_segments(chunks, varlen ? num_seqs : seqs, heads, sm_count, *forced_segment_chunks);
    plan.segment_chunks = *forced_segment_chunks;
    return split_short_sequences(plan, mean_chunks);
  }
  const int64_t likely_chunks = varlen ? std::min(total_chunks, kVarlenSkew * mean_chunks) : chunks;
  const int likely_L = best_segment_chunks(likely_chunks, seqs, heads, sm_count);
  if (likely_L == 0) {
    return split_short_sequences(plan_with_segments(chunks, num_seqs, heads, sm_count, 0), mean_chunks);
  }
  // A fixed-length batch's likely length is its length; a varlen one's segments fit its worst case.
  const int L = likely_chunks == chunks ? likely_L : best_segment_chunks(chunks, seqs, heads, sm_count);
  return plan_with_segments(chunks, seqs, heads, sm_count, L);
}

// The overlap (kda_params.h): where one 8-warp finishing CTA per (sequence, head) leaves SMs free, the tail of the
// preparation runs on them while the recurrence runs on the others, after a lead prepared by the whole GPU. The
// lead is what the tail cannot catch up with: the recurrence takes pairs / kStep records per µs, the tail delivers
// kTailRate per µs and SM, so the lead is chunks · (1 − supply / demand), plus a margin (a lead too short leaves
// the recurrence waiting for the tail, pairs / supply µs per chunk missing; one too long costs the lead kernel's
// ≈ 0.7 µs per chunk). Constants from the H200 (docs/DESIGN.md, "The overlap"): the tail alone prepares 0.83
// records per µs and SM (T8192 H96, lead 0: 1.64 ms for 49,152 records on 36 SMs), and a finishing step beside it
// takes 0.78 µs instead of 0.74 (the two share the memory).
struct OverlapModel {
  static constexpr double kStep = 0.78;      // µs per step of an 8-warp finishing CTA beside the tail
  static constexpr double kTailRate = 0.8;   // records per µs of one SM of the tail kernel
  // The softplus gate's tail (anchored products): 0.7 records per µs and SM, the rate at which this model's lead
  // is the fastest one measured (H200, 2026-12-03, tools/dev/lead_sweep.py: T8192 H96 best at L 435 of 400-450,
  // 0.66-0.71; H64 at L 260 of 260-320; lead 0 at H96: 2.19 ms for 49,152 records on 36 SMs).
  static constexpr double kTailRateSoftplus = 0.7;
  static constexpr int kMarginDiv = 20;      // margin: chunks / kMarginDiv + 4
  static constexpr int kMinTailSms = 8;      // fewer free SMs: no overlap
  static constexpr int64_t kMinChunks = 64;  // shorter sequences: no overlap
};
inline int overlap_tail_ctas(int64_t pairs, int sm_count) {
  return static_cast<int>(std::max<int64_t>(1, sm_count - pairs));
}
inline int overlap_lead_chunks(int64_t chunks, int64_t pairs, int sm_count,
                               GateKind gate = GateKind::kLowerBound) {
  using M = OverlapModel;
  const double demand = static_cast<double>(pairs) / M::kStep;
  const double rate = gate == GateKind::kSoftplus ? M::kTailRateSoftplus : M::kTailRate;
  const double supply = rate * overlap_tail_ctas(pairs, sm_count);
  const double behind = supply >= demand ? 0.0 : 1.0 - supply / demand;
  const int64_t lead = static_cast<int64_t>(behind * static_cast<double>(chunks) + 0.999) + chunks / M::kMarginDiv + 4;
  return static_cast<int>(std::min(lead, chunks));
}
// Whether the overlap pays for a fixed-length batch of `pairs` (sequence, head) pairs of `chunks` chunks whose plan
// has no time split: it runs each pair on one 8-warp CTA (0.74 µs per step) instead of a V split (0.65 µs per step at
// v_split 2), so it is chosen where the V split would be 1 or 2 (more pairs than a quarter of the SMs) and so the
// preparation it hides is worth more, with at least kMinTailSms SMs free for the tail.
inline bool overlap_pays(int64_t chunks, int64_t pairs, int sm_count) {
  return chunks >= OverlapModel::kMinChunks && 4 * pairs > sm_count && pairs + OverlapModel::kMinTailSms <= sm_count;
}

// Longest first (kda_params.h): where a varlen batch's unsplit finishing pass takes more than one wave of 8-warp
// CTAs, a long sequence that happens to start last sets the end (varlen [1300, 547, 2048, 963, 271, 3063] H96:
// 576 CTAs over 132 SMs, and the 3063-token ones started last). Ranked on the device, so it needs no sync.
inline bool longest_first_pays(bool varlen, const Plan& plan, int64_t num_seqs, int heads, int sm_count) {
  return varlen && plan.segment_chunks == 0 && !plan.single_pass && plan.v_split == 1 &&
         num_seqs <= kLongestFirstMaxSeqs && num_seqs * heads > sm_count;
}

// The decode kernel (decode.cu, docs/DESIGN.md "The decode kernel") where every sequence is known to be short: a
// fixed length of at most kDecodeMaxTokens, or a varlen batch of at most kDecodeMaxTokens tokens per sequence on
// average. The host cannot read cu_seqlens (that would synchronise), so a long sequence hidden in such a batch
// (one of 1,000 tokens among 63 empty ones) also runs token by token: correct, but its steps are serial, a few
// tenths of a µs per token where a chunked step takes ≈ 0.75 µs per 16 tokens.
constexpr int64_t kDecodeMaxTokens = 16;
inline bool decode_pays(int64_t total_tokens, int64_t seqlen, int64_t num_seqs, bool varlen) {
  return varlen ? total_tokens <= kDecodeMaxTokens * num_seqs : seqlen <= kDecodeMaxTokens;
}

// Under the decode plan, the chunk step (decode_chunk.cu) for calls of at least 16 tokens per sequence on average
// without per-token states; the token-by-token kernel (decode.cu) for the rest. Per-token states are defined by the
// token-by-token recurrence; checkpoints (every C = 16·checkpoint_chunks tokens) by the recurrence that runs, so that
// asking for them changes no other bit of a call. Shorter calls stay token by token because the chunk step costs
// about the same per chunk whatever its length (H200, 2026-12-02, CUDA graphs: 128 sequences of 4 tokens H32
// 0.268 ms against 0.138; 64 of 16 tokens 0.178 against 0.198); longer sequences under a forced decode plan, or
// hidden in a varlen batch, take 16 tokens per step instead of one.
inline bool decode_chunk_runs(int64_t total_tokens, int64_t num_seqs, int state_tokens) {
  return state_tokens == 0 && total_tokens >= kChunk * num_seqs && total_tokens > 0;
}

// Under the decode plan, the stream pass (stream_pass.cuh) for fixed-length calls of exactly one chunk per sequence
// (T = 16) without per-token states or checkpoints: the chunked arithmetic (the two stages' records and step, so
// the chunked plans' bits), where the chunk step spends about twice the instructions on its fp32-grade products
// (docs/PERFORMANCE.md, "The stream pass"). Two more conditions keep the decode slice's accuracy: no fp32 final
// state (the chunk step's fp32 recurrence holds one to about 1e-7, the chunked arithmetic to about 3e-3, at its
// bound), and at least one (sequence, head) item per SM (a call of one or a few heads can exceed the short-sequence
// bounds on the chunked arithmetic; many heads average them out, and the persistent kernel needs them to pay).
// Shorter sequences keep the decode kernels' accuracy.
// (Its preparing warps count the items in 32 bits; a call of 2^31 items would hold terabytes of inputs.)
constexpr int64_t kStreamPassMaxItems = (int64_t{1} << 31) - 1;
inline bool stream_pass_runs(bool varlen, int64_t seqlen, int state_tokens, bool checkpoints, bool fp32_final,
                             int64_t items, int sm_count) {
  return !varlen && seqlen == kChunk && state_tokens == 0 && !checkpoints && !fp32_final && items >= sm_count &&
         sm_count > 0 && items <= kStreamPassMaxItems;
}

// The plan for a call, with whatever `forced` fixes.
inline Plan choose_plan(int64_t total_tokens, int64_t seqlen, int64_t num_seqs, int heads, bool varlen, int sm_count,
                        const PlanOverrides& forced = {}, GateKind gate = GateKind::kLowerBound) {
  const bool single_pass_runs = gate == GateKind::kLowerBound;  // (plan_error)
  const bool split_forced = forced.v_split.has_value() || forced.scan_v_split.has_value();
  const bool any_forced = split_forced || forced.segment_chunks.has_value() || forced.single_pass.has_value();
  const bool chunked_forced = any_forced || forced.lead_chunks.has_value();
  if (forced.decode.value_or(!chunked_forced && decode_pays(total_tokens, seqlen, num_seqs, varlen))) {
    return Plan{1, 1, 0, false, -1, 0, false, true};
  }
  // Unless given: a forced V split runs two stages, and anything forced runs without the overlap.
  std::optional<bool> single = forced.single_pass;
  if (!single.has_value() && split_forced) single = false;
  std::optional<int> lead = forced.lead_chunks;
  if (!lead.has_value() && any_forced) lead = -1;

  const int64_t chunks = (seqlen + kChunk - 1) / kChunk;
  const int64_t pairs = num_seqs * heads;
  Plan plan;
  if (lead.value_or(-1) >= 0 && !varlen) {
    // A lead of the whole sequence leaves nothing to overlap (fwd then runs the ordinary two stages).
    plan = Plan{1, 1, 0, false, *lead, overlap_tail_ctas(pairs, sm_count)};
  } else if (single.value_or(false)) {
    plan = Plan{1, 1, 0, true};
  } else {
    plan = choose_two_stage_plan(total_tokens, seqlen, num_seqs, heads, varlen, sm_count, forced.segment_chunks);
    if (!single.has_value() && plan.segment_chunks == 0 && single_pass_runs &&
        single_pass_pays(total_tokens, num_seqs, heads, sm_count)) {
      plan = Plan{1, 1, 0, true};
    } else {
      const bool overlap = !lead.has_value() && !forced.segment_chunks.has_value() && !varlen &&
                           plan.segment_chunks == 0 && overlap_pays(chunks, pairs, sm_count);
      const int lead_chunks = overlap ? overlap_lead_chunks(chunks, pairs, sm_count, gate) : -1;
      if (overlap && lead_chunks < chunks) {
        plan = Plan{1, 1, 0, false, lead_chunks, overlap_tail_ctas(pairs, sm_count)};
      } else {
        plan.longest_first = longest_first_pays(varlen, plan, num_seqs, heads, sm_count);
      }
    }
  }
  if (forced.v_split.has_value()) {
    plan.v_split = plan.scan_v_split = *forced.v_split;
    plan.longest_first = plan.longest_first && plan.v_split == 1;  // (the order is kept for 8-warp CTAs only)
  }
  if (forced.scan_v_split.has_value()) plan.scan_v_split = *forced.scan_v_split;
  return plan;
}

}  // namespace kda
