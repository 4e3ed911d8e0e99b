// AquaAttention's token selection at a decode step (T = 1): read the K^ rows the selection keeps for every token,
// then all of K^ and V for the chosen tokens only (the rules: aqua_export/ops/rules.py, token selection).
//
//   1  forced   per attention_mask row: the visible count n, the forced pages (the first token_sink / last
//               token_window visible tokens) and want = max(ceil(attended / PAGE), forced), attended = token_budget or
//               max(1, ceil(ratio n - 1e-6 n - 1e-9)), at most n
//   2  score    tasks (batch, kv head, split of L): for each tile of the group's rows, s = q^[I] . K^[I, block]
//               (k of r key rows read), soft-capped; best[page] = max over the rows and the page's visible tokens
//   3  attend   tasks (batch, kv head, tile, split of the chosen pages), each first choosing its (batch, kv head)'s
//               pages, as every task of it does alike: the forced pages, then the best-scored others (a partial
//               top, nth_element; ties -> the lower page) until want, ascending (microseconds: cheaper than a
//               pass and a barrier of its own). Then up to kPos positions of its chosen pages at a time, adjacent
//               pages merged into runs, s = q^ . K^[:, run] with all r coordinates, + mask, online softmax,
//               o += e^(s - m) V[run]; then the splits merge, as the dense pass's do
//
// A page is PAGE = 16 slots counted from the first slot the step sees (its origin: a sequence after left padding, or
// placed anywhere in a batch, is cut into the same pages as alone); when the origin is a multiple of 16, one 64-byte line of each float32 K^ coordinate row (the cache is dim-major). A layout
// with each page's K^ contiguous reads the chosen pages faster but the score pass's k rows slower, by more at
// k = r/4 (measured: the dim-major layout's two passes are the cheapest pair).

#include "attention_rows.h"

namespace aqua {
namespace {

constexpr int64_t kPage = 16;  // ops/spec.py PAGE
// positions per block of the score pass: no softmax or V to keep in L1 beside the scores, so longer segments of
// each K^ row than the attention's kPos (a row's segment is a stream; short ones never reach streaming speed)
constexpr int64_t kScoreBlock = 1024;

template <typename T, typename C>
struct PageJob : QueryRows<T>, RowsOut<T> {
  const C* key;
  const C* value;
  MaskRows mask;      // [mask.rows, L]; one query position, the last
  float* best;        // [B * Hkv, pages]: each page's best approximate score
  const char* forced; // [mask.rows, pages]
  const int64_t* want;// [mask.rows]: pages a step attends
  const int64_t* origin;  // [mask.rows]: the first slot seen, where page 0 starts (len when none is)
  int64_t len, key_stride, value_slots, pages, score_splits, score_len;
  float softcap;
};

template <typename T, typename C>
Seen seen_by(const PageJob<T, C>& j, int64_t bh) {
  return j.mask.at(bh / j.heads, 0);
}

template <typename T, typename C>
int64_t origin_of(const PageJob<T, C>& j, int64_t bh) {
  return j.origin[j.mask.rows == 1 ? 0 : bh / j.heads];
}

// best[p] = max(best[p], the largest score of page p's visible positions over the nr rows) for the pages of a block
// of n positions from slot s0 (s [nr][kScoreBlock], times each token's scale when given, soft-capped when softcap >
// 0). One pass over the rows in registers: the maximum is taken before the scale, which is positive, so rounding
// (monotonic) gives the same value as scaling each row first; soft-capping (tanh) goes first, per row, as before.
inline void page_maxima(float* s, int nr, int64_t n, const float* scale, float softcap, const Seen& seen, int64_t s0,
                        float* best) {
  for (int rr = 0; rr < nr && softcap > 0.0f; ++rr) {
    float* x = s + rr * kScoreBlock;
    if (scale != nullptr) {
      for (int64_t i = 0; i < n; ++i) x[i] *= scale[i];
    }
    for (int64_t i = 0; i < n; ++i) x[i] = std::tanh(x[i] / softcap) * softcap;
  }
  if (softcap > 0.0f) scale = nullptr;  // applied above, before the cap
  // every position of the block visible (a decode step's usual case): no per-slot test
  bool whole = s0 >= seen.lo && s0 + n - 1 <= seen.hi;
  if (whole) {  // a count, not a loop that stops at the first hidden slot: the compiler vectorises it
    int64_t hidden = 0;
    for (int64_t i = 0; i < n; ++i) hidden += seen.am[s0 + i] == 0;
    whole = hidden == 0;
  }
  const f8 lowest = f8{} - INFINITY;
  int64_t i0 = 0;
  for (; i0 + kPage <= n; i0 += kPage) {
    f8 lo = load8(s + i0), hi = load8(s + i0 + 8);
    for (int rr = 1; rr < nr; ++rr) {
      const f8 a = load8(s + rr * kScoreBlock + i0), b = load8(s + rr * kScoreBlock + i0 + 8);
      lo = a > lo ? a : lo;
      hi = b > hi ? b : hi;
    }
    if (scale != nullptr) lo *= load8(scale + i0), hi *= load8(scale + i0 + 8);
    if (!whole) {
      for (int e = 0; e < 8; ++e) {
        if (!seen(s0 + i0 + e)) lo[e] = -INFINITY;
        if (!seen(s0 + i0 + 8 + e)) hi[e] = -INFINITY;
      }
    }
    f8 top = hi > lo ? hi : lo;
    top = top > lowest ? top : lowest;  // NaN ignored, as std::max ignores it
    float m = top[0];
    for (int e = 1; e < 8; ++e) m = std::max(m, top[e]);
    float& b = best[i0 / kPage];
    b = std::max(b, m);
  }
  if (i0 < n) {  // a sequence's last, partial page
    float m = -INFINITY;
    for (int64_t i = i0; i < n; ++i) {
      float x = s[i];
      for (int rr = 1; rr < nr; ++rr) x = std::max(x, s[rr * kScoreBlock + i]);
      if (scale != nullptr) x *= scale[i];
      if (seen(s0 + i)) m = std::max(m, x);
    }
    float& b = best[i0 / kPage];
    b = std::max(b, m);
  }
}

// The score pass's per-thread buffers, reached through one call: the address of a thread_local array used in an
// inlined loop was recomputed (a __tls_get_addr call) on every iteration.
struct ScoreScratch {
  alignas(64) float wbuf[kRows * kMaxWidth];
  alignas(64) float s[kRows * kScoreBlock];
  alignas(64) float scale[kScoreBlock];
  int32_t uni[kMaxWidth];
};

__attribute__((noinline)) ScoreScratch& score_scratch() {
  static thread_local ScoreScratch scratch;
  return scratch;
}

// 2: the page maxima of one (batch, kv head) over one split of the positions.
template <typename T, typename C>
void score_task(void* data, size_t index) {
  const auto& j = *static_cast<const PageJob<T, C>*>(data);
  const int64_t split = static_cast<int64_t>(index) % j.score_splits, bh = static_cast<int64_t>(index) / j.score_splits;
  const int64_t o = origin_of(j, bh);  // splits and pages from the origin: no page straddles two splits
  const int64_t p0 = o + split * j.score_len, p1 = std::min(j.len, p0 + j.score_len);
  if (p0 >= p1) return;
  float* best = j.best + bh * j.pages;
  std::fill(best + (p0 - o) / kPage, best + (p1 - o + kPage - 1) / kPage, -INFINITY);
  const Seen seen = seen_by(j, bh);
  constexpr int64_t extra = kScaleSlots<C>;  // an int8 cache: K^'s scale-code row after its r rows
  const C* key = j.key + bh * (j.r + extra) * j.key_stride;
  ScoreScratch& sc = score_scratch();
  float *wbuf = sc.wbuf, *s = sc.s, *scale = sc.scale;
  int32_t* uni = sc.uni;
  for (int64_t tile = 0; tile * kRows < j.g; ++tile) {
    const int nr = static_cast<int>(std::min<int64_t>(kRows, j.g - tile * kRows));
    const int64_t nu = tile_weights<T>(j, j.k, bh, tile, nr, wbuf, uni);
    for (int64_t s0 = p0; s0 < p1; s0 += kScoreBlock) {
      const int64_t n = std::min(kScoreBlock, p1 - s0);
      accumulate_rows(nr, key + s0, j.key_stride, uni, nu, wbuf, n, s, kScoreBlock);
      if constexpr (extra > 0) scales_of(key + j.r * j.key_stride + s0, n, 1, scale);
      page_maxima(s, nr, n, extra > 0 ? scale : nullptr, j.softcap, seen, s0, best + (s0 - o) / kPage);
    }
  }
}

// Per attention_mask row: its origin, which pages are forced and how many pages a step attends. Only the ends are
// scanned for the forced tokens (the count is one vectorised pass), so a row costs O(L / 16), not a branch per slot.
void forced_pages(const Seen& seen, int64_t len, int64_t pages, const TokenRule& rule, char* forced, int64_t& want,
                  int64_t& origin) {
  int64_t n = 0;
  for (int64_t i = seen.lo; i <= seen.hi; ++i) n += seen.am[i] != 0;
  origin = seen.lo;
  while (origin < len && !seen(origin)) ++origin;
  std::fill(forced, forced + pages, 0);
  int64_t n_forced = 0;
  const auto force = [&](int64_t i) {
    const int64_t p = (i - origin) / kPage;
    if (!forced[p]) forced[p] = 1, ++n_forced;
  };
  const int64_t sink = std::min(rule.sink, n), window = std::min(rule.window, n);
  for (int64_t i = seen.lo, found = 0; found < sink; ++i) {
    if (seen(i)) force(i), ++found;
  }
  for (int64_t i = len - 1, found = 0; found < window; --i) {
    if (seen(i)) force(i), ++found;
  }
  const double x = static_cast<double>(n);
  const int64_t by_ratio = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(rule.ratio * x - 1e-6 * x - 1e-9)));
  const int64_t attended = std::min(n, rule.budget > 0 ? rule.budget : by_ratio);
  want = std::max((attended + kPage - 1) / kPage, n_forced);
}

// Per (batch, kv head) bh: the forced pages and the best-scored others, ascending, into chosen; returns their
// count.
template <typename T, typename C>
int64_t choose_pages(const PageJob<T, C>& j, int64_t bh, int32_t* chosen) {
  const int64_t row = j.mask.rows == 1 ? 0 : bh / j.heads;
  const float* best = j.best + bh * j.pages;
  const char* forced = j.forced + row * j.pages;
  static thread_local std::vector<std::pair<float, int32_t>> free_pages;  // (-score, page): ascending = best first
  free_pages.clear();
  int64_t n = 0;
  const int64_t pages = (j.len - origin_of(j, bh) + kPage - 1) / kPage;  // the row's: best is not written past them
  for (int64_t p = 0; p < pages; ++p) {
    if (forced[p]) {
      chosen[n++] = static_cast<int32_t>(p);
    } else if (best[p] > -INFINITY) {  // a page with a visible token (NaN: none)
      free_pages.emplace_back(-best[p], static_cast<int32_t>(p));
    }
  }
  const int64_t more = std::min<int64_t>(std::max<int64_t>(j.want[row] - n, 0), free_pages.size());
  if (more < static_cast<int64_t>(free_pages.size())) {
    // pairs compare by score, then page: ties go to the lower page
    std::nth_element(free_pages.begin(), free_pages.begin() + more, free_pages.end());
  }
  for (int64_t i = 0; i < more; ++i) chosen[n + i] = free_pages[i].second;
  std::sort(chosen, chosen + n + more);
  return n + more;
}

// Up to kPos positions of a row's chosen pages, adjacent pages merged into runs (n positions from slot `start`,
// at `at` in the chunk's score rows, `last` the index after the run's last page in the chosen list).
struct Chunk {
  struct Run { int64_t start, n, at, last; };
  Run runs[kPos / kPage];
  int nruns = 0;
  int64_t filled = 0, end = 0;  // positions in the chunk; the next chosen page after it
};

inline Chunk gather_chunk(const int32_t* chosen, int64_t c, int64_t c1, int64_t len, int64_t origin) {
  Chunk ch;
  for (; c < c1 && ch.filled + kPage <= kPos; ++c) {
    const int64_t start = origin + chosen[c] * kPage, n = std::min(kPage, len - start);
    if (ch.nruns > 0 && ch.runs[ch.nruns - 1].start + ch.runs[ch.nruns - 1].n == start) {
      ch.runs[ch.nruns - 1].n += n, ch.runs[ch.nruns - 1].last = c + 1;
    } else {
      ch.runs[ch.nruns++] = {start, n, ch.filled, c + 1};
    }
    ch.filled += n;
  }
  ch.end = c;
  return ch;
}

// Chosen pages are scattered, so the hardware prefetcher cannot see them coming: K^ has one line per coordinate
// row and page, r lines in r places, each a full miss unless requested ahead. The page kAheadPages on in the chosen
// order is requested while one is scored (enough misses in flight to cover memory latency; 1 and 4 measured slower
// at batch 16, 1k context), each page's V rows while its keys are (PageRequests: both spread over the loads).
constexpr int64_t kAheadPages = 2;

template <typename T>
void prefetch_keys(const int32_t* chosen, int64_t from, int64_t to, const T* key, int64_t key_stride, int64_t r) {
  for (int64_t c = from; c < to; ++c) {
    const T* k0 = key + chosen[c] * kPage;  // key: at the row's origin
    for (int64_t row = 0; row < r; ++row) __builtin_prefetch(k0 + row * key_stride, 0, 0);
  }
}

// A run's PageRequests (the run ending at chosen index run.last; c1 the split's end; key at the row's origin): for
// each of its pages the keys of the page kAheadPages on and its own V rows (vs elements a row).
template <typename C>
struct RunRequests {
  const C* key[kPos / kPage];
  const char* value[kPos / kPage];
  PageRequests<C> req;

  RunRequests(const Chunk::Run& run, const int32_t* chosen, int64_t c1, const C* key_origin, const C* values,
              int64_t vs, int64_t extra_row) {
    const int64_t np = (run.n + kPage - 1) / kPage, first = run.last - np;
    for (int64_t p = 0; p < np; ++p) {
      const int64_t c = first + p + kAheadPages;
      key[p] = c < c1 ? key_origin + chosen[c] * kPage : nullptr;
      value[p] = reinterpret_cast<const char*>(values + (run.start + p * kPage) * vs);
    }
    req = {key, extra_row, value, (kPage * vs * static_cast<int64_t>(sizeof(C)) + 63) / 64};
  }
  RunRequests(const RunRequests&) = delete;  // req points into this object
};

// 3: one tile of the group's rows over one split of the chosen pages, all r coordinates.
template <typename T, typename C>
void attend_task(void* data, size_t task_index) {
  const auto& j = *static_cast<const PageJob<T, C>*>(data);
  const int64_t task = static_cast<int64_t>(task_index);
  const int64_t split = task % j.splits, tile = (task / j.splits) % j.tiles, bh = task / (j.splits * j.tiles);
  const int nr = static_cast<int>(std::min<int64_t>(kRows, j.g - tile * kRows));
  TileScratch& sc = tile_scratch();  // one mask row: every row of a decode step sees the same keys
  float *wbuf = sc.wbuf, *s = sc.s, *o = sc.o, *mg = sc.mask, *scale = sc.scale;
  int32_t* uni = sc.uni;
  const int64_t nu = tile_weights<T>(j, j.r, bh, tile, nr, wbuf, uni);
  float m[kRows], l[kRows];
  const float* mb[kRows];
  for (int rr = 0; rr < nr; ++rr) {
    m[rr] = -INFINITY, l[rr] = 0.0f, mb[rr] = mg;
    std::fill(o + rr * kMaxWidth, o + rr * kMaxWidth + j.rv, 0.0f);
  }
  int32_t* chosen = call_buffer<int32_t, Buffer::kPageChosen>(static_cast<size_t>(j.pages)).data();
  const int64_t count = choose_pages(j, bh, chosen), per = (count + j.splits - 1) / j.splits;
  const int64_t c1 = std::min(count, (split + 1) * per);
  const Seen seen = seen_by(j, bh);
  constexpr int64_t extra = kScaleSlots<C>;  // an int8 cache: K^'s scale-code row, each V row's last element
  const int64_t vs = j.rv + extra, kr = j.r + extra;
  const C* key = j.key + bh * kr * j.key_stride;
  const C* value = j.value + bh * j.value_slots * vs;
  const int64_t c0 = split * per, org = origin_of(j, bh);
  prefetch_keys(chosen, c0, std::min(c1, c0 + kAheadPages), key + org, j.key_stride, kr);
  for (Chunk ch = gather_chunk(chosen, c0, c1, j.len, org); ch.nruns > 0;
       ch = gather_chunk(chosen, ch.end, c1, j.len, org)) {
    for (int i = 0; i < ch.nruns; ++i) {
      const auto& run = ch.runs[i];
      const RunRequests<C> ahead(run, chosen, c1, key + org, value, vs, extra > 0 ? j.r : -1);
      seen.block(run.start, run.n, mg + run.at);
      accumulate_page_rows(nr, key + run.start, j.key_stride, uni, nu, wbuf, run.n, s + run.at, kPos, ahead.req);
      if constexpr (extra > 0) {  // int8: the run's key scales on its scores
        scales_of(key + j.r * j.key_stride + run.start, run.n, 1, scale);
        scale_rows(nr, s + run.at, kPos, run.n, scale);
      }
    }
    online_softmax(nr, ch.filled, j.softcap, mb, s, m, l, o, j.rv);
    for (int i = 0; i < ch.nruns; ++i) {
      const auto& run = ch.runs[i];
      if constexpr (extra > 0) {  // and its value scales on its weights
        scales_of(value + run.start * vs + j.rv, run.n, vs, scale);
        scale_rows(nr, s + run.at, kPos, run.n, scale);
      }
      add_values_rows<false>(nr, s + run.at, kPos, value + run.start * vs, run.n, j.rv, vs, o, kMaxWidth);
    }
  }
  finish_rows<T>(j, j, task, bh, tile, nr, o, m, l);
}

}  // namespace

template <typename T, typename C>
void attend_pages(Ort::KernelContext& ctx, const QueryRows<T>& q, const C* key, const C* value, const MaskRows& mask,
                  T* out, int64_t batch, int64_t rv, int64_t key_stride, int64_t value_slots, float softcap,
                  const TokenRule& rule) {
  const int64_t len = mask.len, mask_rows = mask.rows;
  const int64_t bh = batch * q.heads, pages = (len + kPage - 1) / kPage, tiles = (q.g + kRows - 1) / kRows;
  if (len == 0) {
    std::fill(out, out + bh * q.g * rv, T(0.0f));
    return;
  }
  const int64_t score_splits =
      bh < kTasksWanted ? std::min((kTasksWanted + bh - 1) / bh, std::max<int64_t>(1, len / kScoreBlock)) : 1;
  const int64_t score_len = ((len + score_splits - 1) / score_splits + kPage - 1) / kPage * kPage;
  // score_task fills every page of best, forced_pages every row of forced and want
  auto& best = call_buffer<float, Buffer::kPageBest>(static_cast<size_t>(bh * pages));
  auto& forced = call_buffer<char, Buffer::kPageForced>(static_cast<size_t>(mask_rows * pages));
  auto& want = call_buffer<int64_t, Buffer::kPageWant>(static_cast<size_t>(mask_rows));
  auto& origin = call_buffer<int64_t, Buffer::kPageOrigin>(static_cast<size_t>(mask_rows));
  for (int64_t row = 0; row < mask_rows; ++row) {
    forced_pages(mask.at(row, 0), len, pages, rule, forced.data() + row * pages, want[row], origin[row]);
  }
  const int64_t most = *std::max_element(want.begin(), want.end());
  int64_t splits = 1;  // a split of at least one block of positions, so one sequence's heads keep both cores busy
  if (bh * tiles < kTasksWanted) {
    splits = std::min((kTasksWanted + bh * tiles - 1) / (bh * tiles), std::max<int64_t>(1, most * kPage / kPos));
  }
  const size_t n_part = splits > 1 ? static_cast<size_t>(bh * tiles * splits * kRows * (rv + 2)) : 0;
  auto& part = call_buffer<float, Buffer::kPagePartials>(n_part);
  PageJob<T, C> job{q, {out, part.data(), rv, tiles, splits}, key, value, mask, best.data(), forced.data(),
                 want.data(), origin.data(), len, key_stride, value_slots, pages, score_splits, score_len, softcap};
  ctx.ParallelFor(&score_task<T, C>, static_cast<size_t>(bh * score_splits), 0, &job);
  ctx.ParallelFor(&attend_task<T, C>, static_cast<size_t>(bh * tiles * splits), 0, &job);
  if (splits > 1) ctx.ParallelFor(&merge_task<T, PageJob<T, C>>, static_cast<size_t>(bh * tiles), 0, &job);
}

template void attend_pages<float, float>(Ort::KernelContext&, const QueryRows<float>&, const float*, const float*,
                                         const MaskRows&, float*, int64_t, int64_t, int64_t, int64_t, float,
                                         const TokenRule&);
template void attend_pages<Ort::Float16_t, Ort::Float16_t>(Ort::KernelContext&, const QueryRows<Ort::Float16_t>&,
                                                           const Ort::Float16_t*, const Ort::Float16_t*,
                                                           const MaskRows&, Ort::Float16_t*, int64_t, int64_t, int64_t,
                                                           int64_t, float, const TokenRule&);
template void attend_pages<float, Ort::Float16_t>(Ort::KernelContext&, const QueryRows<float>&, const Ort::Float16_t*,
                                                  const Ort::Float16_t*, const MaskRows&, float*, int64_t, int64_t,
                                                  int64_t, int64_t, float, const TokenRule&);
template void attend_pages<float, int8_t>(Ort::KernelContext&, const QueryRows<float>&, const int8_t*, const int8_t*,
                                          const MaskRows&, float*, int64_t, int64_t, int64_t, int64_t, float,
                                          const TokenRule&);

}  // namespace aqua
