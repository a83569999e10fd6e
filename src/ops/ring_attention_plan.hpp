// The sequence layout and ring schedule of ring attention: which of a rank's query rows meet which rows of
// the K/V block in hand at each ring step, and under which mask. Host only and the same on every rank (tests
// /host check it against a brute-force enumeration of the attention pairs). The ring kernel and the Python
// shard / unshard helpers take their layout from here.
//
// Layout. The sequence is one or more documents (a packed variable-length batch: attention never crosses a
// document). Each document is cut into parts: W parts without a causal mask (rank r holds part r), 2W with
// one (zigzag: rank r holds parts r and 2W - 1 - r, so every rank holds an early and a late part and the
// causal work is even), or W with one but contiguous (rank r holds part r, the sharding many training stacks
// use: correct, but the causal work grows with the rank). Parts differ in length by at most one token (the
// first `length % parts` are one longer); a document shorter than its part count leaves some parts empty. A
// rank's local rows are its parts of document 0, then of document 1, ...; within a document, part r before
// part 2W - 1 - r.
//
// Schedule. At step s = 0 .. W-1 rank r holds the K/V rows of rank (r - s) mod W (they travel one rank
// along the ring per step). Query part i meets key part j of the same document when j < i (every key
// visible: RingMask::kFull), j == i (the same positions: RingMask::kCausal, key j visible to query i iff
// j <= i), and not when j > i. Without a causal mask every pair of parts of a document is kFull.
// With zigzag every rank does the same work at every step: two part pairs' worth (step 0: the two diagonal
// blocks and the late part against the early one; then either both query parts against the source's early
// part, or the late query part against both of the source's parts).
#pragma once
#include <algorithm>
#include <array>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace weft::ops {

enum class RingMask : uint8_t {
  kFull,    // every key visible
  kCausal,  // query row i and key row j at the same positions: visible iff j <= i
};

struct RingLayout {
  int world = 0;
  bool causal = false;  // the attention is causal (the plans' masks)
  bool zigzag = false;  // 2W parts per document (causal, balanced); else W
  std::vector<int64_t> doc_length;

  // Grain g: each part is g consecutive parts of the cut into g x parts(), the layout of a team of g x W
  // with every g consecutive ranks merged into one (1: no merging). The hybrid of Ulysses and ring attention
  // runs the ring over such a layout: rank i of its ring holds what ranks i g .. i g + g - 1 of the whole
  // team's layout hold.
  int grain = 1;
  int parts() const { return zigzag ? 2 * world : world; }
  // Part c of document d: first position in the document, and length. Of the cut into grain x parts()
  // pieces, the first doc_length % (grain x parts()) hold one row more (part_base / part_extra: filled by
  // ring_layout, as the plans ask per document and step).
  std::vector<int64_t> part_base, part_extra;
  int64_t piece_begin(int d, int64_t c) const {
    const int64_t extra = part_extra[d];
    return c * part_base[d] + (c < extra ? c : extra);
  }
  int64_t part_begin(int d, int c) const { return piece_begin(d, int64_t(c) * grain); }
  int64_t part_length(int d, int c) const {
    return piece_begin(d, int64_t(c + 1) * grain) - piece_begin(d, int64_t(c) * grain);
  }
  // The parts rank r holds of each document, in local order: one, or two when zigzag. A value, not a vector:
  // the plans ask for it per document and step, and an allocation per ask made a pass over 512 documents
  // cost ~1 ms of host time per call.
  struct Held {
    int count = 0;
    int part[2] = {0, 0};
    const int* begin() const { return part; }
    const int* end() const { return part + count; }
    int operator[](int i) const { return part[i]; }
    int size() const { return count; }
  };
  Held parts_of(int r) const {
    if (zigzag) return {2, {r, 2 * world - 1 - r}};
    return {1, {r, 0}};
  }
  // doc_row[r][d]: rank r's first local row of document d (doc_row[r][documents]: its row count). Filled by
  // ring_layout, so that a block's rows cost O(1) however many documents a packed batch holds.
  std::vector<std::vector<int64_t>> doc_row;

  // First local row of rank r's part `c` of document d (c one of parts_of(r)), and rank r's row count.
  int64_t local_row(int r, int d, int c) const {
    const Held held = parts_of(r);
    if (c == held[0]) return doc_row[r][d];
    if (held.size() > 1 && c == held[1]) return doc_row[r][d] + part_length(d, held[0]);
    throw std::invalid_argument("RingLayout::local_row: rank " + std::to_string(r) + " does not hold part " +
                                std::to_string(c));
  }
  int64_t local_rows(int r) const { return doc_row[r].back(); }
};

// How a sequence-parallel call shards its sequence: causal, and if so zigzag (balanced) or contiguous. From a
// bool: the zigzag layout of a causal call. A workspace is sized for both layouts a call may take (both()).
struct Sharding {
  bool causal = false, zigzag = true;
  Sharding(bool c) : causal(c) {}  // NOLINT: implicit, the layout a causal flag alone means
  Sharding(bool c, bool z) : causal(c), zigzag(z) {}
  std::array<Sharding, 2> both() const { return {Sharding{causal, true}, Sharding{causal, false}}; }
};

// zigzag (causal only): the balanced layout; false: contiguous parts.
inline RingLayout ring_layout(const std::vector<int64_t>& doc_length, int world, bool causal, int grain = 1,
                              bool zigzag = true) {
  if (world < 1) throw std::invalid_argument("ring_layout: world size must be at least 1");
  if (grain < 1) throw std::invalid_argument("ring_layout: grain must be at least 1");
  if (doc_length.empty()) throw std::invalid_argument("ring_layout: no documents");
  for (size_t d = 0; d < doc_length.size(); ++d)
    if (doc_length[d] < 0)
      throw std::invalid_argument("ring_layout: document " + std::to_string(d) + " has a negative length");
  RingLayout L;
  L.world = world, L.causal = causal, L.zigzag = causal && zigzag, L.doc_length = doc_length, L.grain = grain;
  const int64_t pieces = int64_t(L.parts()) * grain;
  for (const int64_t n : doc_length) {
    L.part_base.push_back(n / pieces);
    L.part_extra.push_back(n % pieces);
  }
  L.doc_row.assign(world, std::vector<int64_t>(doc_length.size() + 1, 0));
  for (int r = 0; r < world; ++r)
    for (size_t d = 0; d < doc_length.size(); ++d) {
      int64_t rows = 0;
      for (int c : L.parts_of(r)) rows += L.part_length(static_cast<int>(d), c);
      L.doc_row[r][d + 1] = L.doc_row[r][d] + rows;
    }
  return L;
}

// Document lengths from cumulative offsets (flash-attn's cu_seqlens: [0, l0, l0 + l1, ...]).
inline std::vector<int64_t> doc_lengths_from_offsets(const std::vector<int64_t>& cu_seqlens) {
  if (cu_seqlens.size() < 2 || cu_seqlens[0] != 0)
    throw std::invalid_argument("cu_seqlens must start with 0 and hold at least one document");
  std::vector<int64_t> len;
  for (size_t i = 1; i < cu_seqlens.size(); ++i) {
    if (cu_seqlens[i] < cu_seqlens[i - 1])
      throw std::invalid_argument("cu_seqlens must not decrease (entry " + std::to_string(i) + ")");
    len.push_back(cu_seqlens[i] - cu_seqlens[i - 1]);
  }
  return len;
}

// Rank r's local rows as positions in the whole packed sequence (documents back to back): local row i holds
// token ring_tokens(L, r)[i]. Sharding gathers these rows; unsharding scatters them back.
inline std::vector<int64_t> ring_tokens(const RingLayout& L, int r) {
  std::vector<int64_t> tokens;
  int64_t doc_start = 0;
  for (size_t d = 0; d < L.doc_length.size(); ++d) {
    for (int c : L.parts_of(r)) {
      const int64_t b = L.part_begin(static_cast<int>(d), c), n = L.part_length(static_cast<int>(d), c);
      for (int64_t i = 0; i < n; ++i) tokens.push_back(doc_start + b + i);
    }
    doc_start += L.doc_length[d];
  }
  return tokens;
}

// The layout as runs of consecutive rows: natural rows [natural, natural + length) are rank `rank`'s local
// rows [local, local + length). One run per non-empty part; the runs cover the sequence exactly once.
struct RowRun {
  int64_t natural = 0, length = 0;
  int rank = 0;
  int64_t local = 0;
};
inline std::vector<RowRun> ring_runs(const RingLayout& L) {
  std::vector<RowRun> runs;
  for (int r = 0; r < L.world; ++r) {
    int64_t doc_start = 0;
    for (int d = 0; d < static_cast<int>(L.doc_length.size()); ++d) {
      for (int c : L.parts_of(r)) {
        const int64_t n = L.part_length(d, c);
        if (n > 0) runs.push_back({doc_start + L.part_begin(d, c), n, r, L.local_row(r, d, c)});
      }
      doc_start += L.doc_length[d];
    }
  }
  return runs;
}

// Rank r's local rows of L as runs of the local rows of rank r / g of `coarse`, the same cut with every g
// consecutive ranks merged (ring_layout(documents, L.world / g, causal, g)): run.natural is a row of the
// coarse rank's local rows. The runs of ranks r / g x g .. r / g x g + g - 1 cover that rank's rows once.
inline std::vector<RowRun> merged_runs(const RingLayout& L, const RingLayout& coarse, int r) {
  const int g = coarse.grain;
  if (L.grain != 1 || g * coarse.world != L.world || coarse.zigzag != L.zigzag || coarse.causal != L.causal)
    throw std::invalid_argument("merged_runs: the coarse layout is not L with every " + std::to_string(g) +
                                " ranks merged");
  std::vector<RowRun> runs;
  for (int d = 0; d < static_cast<int>(L.doc_length.size()); ++d)
    for (int c : L.parts_of(r)) {
      const int64_t n = L.part_length(d, c);
      if (n == 0) continue;
      const int merged = c / g;  // the coarse part holding piece c
      const int64_t at =
          coarse.local_row(r / g, d, merged) + L.part_begin(d, c) - coarse.part_begin(d, merged);
      runs.push_back({at, n, r, L.local_row(r, d, c)});
    }
  return runs;
}

struct RingBlock {
  int doc = 0;
  int64_t q_row = 0, q_rows = 0;  // this rank's local query rows
  int64_t k_row = 0, k_rows = 0;  // rows of the source rank's local K / V
  RingMask mask = RingMask::kFull;
  // Query-key pairs that see each other: the block's share of the step's work.
  int64_t pairs() const { return mask == RingMask::kFull ? q_rows * k_rows : q_rows * (q_rows + 1) / 2; }
};

struct RingStep {
  int source = 0;  // the rank whose K / V rows this step uses
  std::vector<RingBlock> blocks;
  int64_t pairs() const {
    int64_t n = 0;
    for (const RingBlock& b : blocks) n += b.pairs();
    return n;
  }
};

// Rank r's W steps. Empty parts give no block; a step may have no block at all (a short document).
inline std::vector<RingStep> ring_schedule_of(const RingLayout& L, int r) {
  if (r < 0 || r >= L.world)
    throw std::invalid_argument("ring_schedule_of: rank " + std::to_string(r) + " outside a team of " +
                                std::to_string(L.world));
  std::vector<RingStep> steps(L.world);
  for (int s = 0; s < L.world; ++s) {
    RingStep& step = steps[s];
    step.source = (r - s + L.world) % L.world;
    for (int d = 0; d < static_cast<int>(L.doc_length.size()); ++d)
      for (int qc : L.parts_of(r))
        for (int kc : L.parts_of(step.source)) {
          if (L.causal && kc > qc) continue;  // keys after every query of the part
          RingBlock b;
          b.doc = d;
          b.q_row = L.local_row(r, d, qc);
          b.q_rows = L.part_length(d, qc);
          b.k_row = L.local_row(step.source, d, kc);
          b.k_rows = L.part_length(d, kc);
          b.mask = L.causal && kc == qc ? RingMask::kCausal : RingMask::kFull;
          if (b.q_rows > 0 && b.k_rows > 0) step.blocks.push_back(b);
        }
  }
  return steps;
}

// One ring step as one attention call (AttentionSegments, one mask for the call): per document, the step's
// blocks merged into one segment of rank r's query rows against the source's K / V rows. Step 0 (the rank's
// own K / V) is causal: its blocks are a document's diagonal parts and, with zigzag, the late part against
// the early one, i.e. the document's local rows against themselves under a causal mask (the late part comes
// after the early one in both). Later steps have no mask: either both query parts against the source's early
// part or the late query part against both source parts, contiguous rows either way.
struct RingSegment {
  int64_t q_begin = 0, q_end = 0;  // this rank's local query rows
  int64_t k_begin = 0, k_end = 0;  // the source's local K / V rows
};
struct RingCall {
  bool causal = false;
  std::vector<RingSegment> segments;  // ascending, one per document with work in the step
};
inline RingCall ring_call_of(const RingStep& step) {
  RingCall call;
  for (const RingBlock& b : step.blocks) {
    if (b.mask == RingMask::kCausal) call.causal = true;
    if (!call.segments.empty() && step.blocks[&b - step.blocks.data() - 1].doc == b.doc) {
      RingSegment& seg = call.segments.back();  // the same document: extend (blocks come in row order)
      seg.q_begin = std::min(seg.q_begin, b.q_row);
      seg.q_end = std::max(seg.q_end, b.q_row + b.q_rows);
      seg.k_begin = std::min(seg.k_begin, b.k_row);
      seg.k_end = std::max(seg.k_end, b.k_row + b.k_rows);
    } else {
      call.segments.push_back({b.q_row, b.q_row + b.q_rows, b.k_row, b.k_row + b.k_rows});
    }
  }
  return call;
}

// The ring kernels' work (one persistent kernel per pass, src/ops/ring_attention.cu and
// ring_attention_backward.cu). One side of the attention stays on its rank, the other travels around the
// ring: K / V in the forward (a segment is a part of this rank's query rows), Q, dO and the per-row terms in
// the backward (a segment is a part of this rank's key rows). A segment is one document's part held by rank
// r; for each segment and step the pass gives the rows it meets of the step's source (r - s): one range of
// the source's local rows, contiguous because a source's parts of a document are adjacent (early, then late)
// and a part meets either all of the other side's parts or a prefix (keys) / suffix (queries) of them. A
// work item (segment, head, block) meets all W ranges in turn, its accumulators (O and LSE forward, dK and
// dV backward) in registers throughout. Step 0 (the rank's own rows on both sides) is causal when the
// attention is (either layout): a key is visible to a query iff its local row is not after the query's
// (within a document's local rows the positions keep their order); later steps have no mask.
enum class RingTravel : uint8_t {
  kKeys,     // forward: K / V travel; segments are query rows
  kQueries,  // backward: Q, dO, LSE and D travel; segments are key rows
};
struct RingPass {
  int steps = 0;
  bool causal = false;                      // step 0's ranges take the causal mask
  std::vector<int64_t> own_begin, own_end;  // per segment: this rank's local rows
  std::vector<int64_t> met_begin, met_end;  // [segment * steps + step]: rows of the source's local rows
  int64_t segments() const { return static_cast<int64_t>(own_begin.size()); }
};
// The rows of rank src's local rows that the part `own` of document d meets (a rank holding that part, at
// the step where src's rows are in hand): keys up to the query part (kKeys), or queries from the key part
// on (kQueries); all of the document's rows when not causal.
inline std::pair<int64_t, int64_t> ring_met_rows(const RingLayout& L, int d, int own, int src,
                                                 RingTravel travel) {
  int64_t begin = L.doc_row[src][d], end = begin;
  for (int met : L.parts_of(src)) {
    if (travel == RingTravel::kKeys) {
      if (!L.causal || met <= own) end += L.part_length(d, met);  // keys up to the query part
    } else if (L.causal && met < own) {
      begin += L.part_length(d, met);  // queries from the key part on: a suffix
    }
  }
  if (travel == RingTravel::kQueries) end = L.doc_row[src][d + 1];
  return {begin, std::max(begin, end)};
}

inline RingPass ring_pass_of(const RingLayout& L, int r, RingTravel travel = RingTravel::kKeys) {
  if (r < 0 || r >= L.world)
    throw std::invalid_argument("ring_pass_of: rank " + std::to_string(r) + " outside a team of " +
                                std::to_string(L.world));
  RingPass pass;
  pass.steps = L.world;
  pass.causal = L.causal;
  const size_t most = L.doc_length.size() * L.parts_of(r).size();
  pass.own_begin.reserve(most), pass.own_end.reserve(most);
  pass.met_begin.reserve(most * L.world), pass.met_end.reserve(most * L.world);
  for (int d = 0; d < static_cast<int>(L.doc_length.size()); ++d)
    for (int own : L.parts_of(r)) {
      const int64_t n = L.part_length(d, own);
      if (n == 0) continue;
      pass.own_begin.push_back(L.local_row(r, d, own));
      pass.own_end.push_back(L.local_row(r, d, own) + n);
      for (int s = 0; s < L.world; ++s) {
        const auto [begin, end] = ring_met_rows(L, d, own, (r - s + L.world) % L.world, travel);
        pass.met_begin.push_back(begin);
        pass.met_end.push_back(end);
      }
    }
  return pass;
}

// The order the launchers number a pass's segments in: heaviest first, by the rows they meet over the pass
// (in a causal pass a late part meets about three times an early part's), ties in pass order.
inline std::vector<int64_t> ring_segment_order(const RingPass& pass) {
  const int64_t G = pass.segments(), W = pass.steps;
  std::vector<int64_t> order(G), met(G, 0);
  for (int64_t x = 0; x < G; ++x) {
    order[x] = x;
    for (int64_t s = 0; s < W; ++s) met[x] += pass.met_end[x * W + s] - pass.met_begin[x * W + s];
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return met[a] > met[b]; });
  return order;
}

// L2 sections for a ring kernel's scheduler (lcsc/attention_scheduler.cuh), whose (segment, head) pairs are
// numbered segment by segment, the segments in ring_segment_order: the most pairs up to `wanted` (and up to
// `heads`) that divide `heads` and are a multiple of `granule` (whole GQA groups); `wanted` itself for a
// pass of one segment. No section then spans two segments, so the units run segment after segment, heaviest
// first, and the persistent blocks' static rotation deals each about the same share of heavy and of light
// units; a section across segments interleaves their units row by row, and the blocks that draw heavy units
// in every run end long after the rest (causal, 2k tokens a rank at W = 2: blocks ending 18-211 us).
inline int64_t ring_section_pairs(int64_t wanted, int64_t heads, int64_t segments, int64_t granule) {
  if (segments <= 1) return wanted;
  if (wanted >= heads) return heads;
  int64_t best = granule;
  for (int64_t d = granule; d <= wanted; d += granule)
    if (heads % d == 0) best = d;
  return best;
}

// The rows of rank r's local rows that the receiver of each of its slots reads (slot s: rank r + s + 1, at
// its step s + 1): the hull of that receiver's met ranges with r as the source, each range extended to whole
// boxes of `box_rows` (a range's last load reads its box whole), within the slot. The rest is never read,
// and its pushes are skipped: in a causal zigzag pass a receiver on one side of r never meets one of r's two
// parts (a quarter of all the bytes).
inline std::vector<std::pair<int64_t, int64_t>> ring_push_rows(const RingLayout& L, int r, RingTravel travel,
                                                               int box_rows, int64_t slot_rows) {
  const int W = L.world;
  std::vector<std::pair<int64_t, int64_t>> rows(std::max(1, W - 1), {0, 0});
  for (int slot = 0; slot + 1 < W; ++slot) {
    const int dst = (r + slot + 1) % W;
    int64_t lo = slot_rows, hi = 0;
    for (int d = 0; d < static_cast<int>(L.doc_length.size()); ++d)
      for (int own : L.parts_of(dst)) {
        if (L.part_length(d, own) == 0) continue;
        const auto [b, e] = ring_met_rows(L, d, own, r, travel);
        if (e <= b) continue;
        lo = std::min(lo, b);
        hi = std::max(hi, std::min(slot_rows, b + (e - b + box_rows - 1) / box_rows * box_rows));
      }
    if (hi > lo) rows[slot] = {lo, hi};
  }
  return rows;
}

// The query ranges of rank r that backward passes (RingTravel::kQueries) meet, each once: per document its
// whole rows and, zigzag, its late part alone (the met ranges of every rank's pass with source r are among
// them). The per-row terms of a range beginning at local row x live at term rows 4 x, 4 x + 1, ...: every
// range starts 16-byte aligned for TMA, and the copies of one row for the two ranges that hold it never
// land on another row's (a later part is never longer than an earlier one, so a late part is never over three
// times the early part).
inline std::vector<std::pair<int64_t, int64_t>> ring_query_ranges(const RingLayout& L, int r) {
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (int d = 0; d < static_cast<int>(L.doc_length.size()); ++d) {
    const int64_t begin = L.doc_row[r][d], end = L.doc_row[r][d + 1];
    if (end > begin) ranges.push_back({begin, end});
    const int64_t late = begin + L.part_length(d, L.parts_of(r)[0]);
    if (L.zigzag && late > begin && late < end) ranges.push_back({late, end});
  }
  return ranges;
}

// Attention over all-gathered K / V (context parallelism without a ring): every rank gathers the whole
// sequence's K / V in natural order (the packed documents back to back, ring_tokens' positions), then runs
// one attention call of its own query rows against it. Per document, each query part meets one contiguous
// key range: the document's keys up to the part's last position under a bottom-right causal mask (the part's
// first query sits part_begin keys in), or the whole document without a mask. Query ranges are rank r's
// local rows, key ranges rows of the gathered sequence.
inline RingCall gathered_call_of(const RingLayout& L, int r) {
  RingCall call;
  call.causal = L.causal;
  int64_t doc_start = 0;
  for (int d = 0; d < static_cast<int>(L.doc_length.size()); ++d) {
    if (L.causal) {
      for (int c : L.parts_of(r)) {
        const int64_t q = L.local_row(r, d, c), n = L.part_length(d, c);
        if (n > 0) call.segments.push_back({q, q + n, doc_start, doc_start + L.part_begin(d, c) + n});
      }
    } else {
      const int64_t q = L.doc_row[r][d], n = L.doc_row[r][d + 1] - q;
      if (n > 0) call.segments.push_back({q, q + n, doc_start, doc_start + L.doc_length[d]});
    }
    doc_start += L.doc_length[d];
  }
  return call;
}

}  // namespace weft::ops
