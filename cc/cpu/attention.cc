// paged_attention (see cc/cpu/kernels.h): causal attention of each sequence's
// new tokens over its paged KV cache, for prefill, chunked prefill,
// prefix-cache hits and decode alike (everything is read from the cache).
//
// Work items. A sequence's new tokens are cut into chunks of a few tokens; a
// chunk together with one kv head is a tile of rows = tokens x the query heads
// of that kv head's GQA group, so every K and V row loaded serves the whole
// group. Where there are chunks enough to keep every thread busy, one item
// takes all kv heads of its chunk, head after head within each key tile: it
// then reads each cached token's row of all heads whole (contiguous, so the
// hardware prefetchers follow) instead of a head's slice of it per item (a
// batch-16 decode step reads its K/V from DRAM: 2.3x faster that way). The
// keys a chunk sees (positions 0 .. its last token) may further be split into
// ranges, each its own one-head work item (flash-decoding): then one long
// sequence next to short ones, or a batch of one, still spreads over all
// threads. Items run under OpenMP's dynamic schedule; items of split ranges
// leave an unnormalized partial result that a second pass merges.
//
// One item walks its keys in tiles of kKeyTile positions (the tile may span
// cache blocks; each key row is found through the block table):
//   scores S = Q K^T for the tile's keys (Q pre-scaled, fp32),
//   online softmax per row: m' = max(m, max S), P = exp(S - m'),
//     l = l * exp(m - m') + sum P, acc = acc * exp(m - m') + P V,
// and finally out = acc / l. Keys past a row's own position are masked (only
// tiles on the diagonal have any). K and V rows are read in place, or, for a
// head size that is not a whole number of vectors, converted once per tile to
// zero-padded fp32 rows. The cache holds the queries' dtype, or bf16 under
// fp32 queries (a 16-bit KV cache for an fp32 model: half the bytes from DRAM,
// widened in registers as for a bf16 model). Paged rows are scattered, and
// a kv head's rows are strided, so the hardware prefetchers miss them: a
// thread claims its next item as it starts one and, while it computes,
// requests that item's first rows (up to 128 KB) into L2, a few with each
// block of scores; the current item's further rows are requested a tile
// ahead, and its K rows a few keys ahead of the scores into L1.
#include "cc/cpu/kernels.h"
#include "cc/cpu/vec.h"

#include <atomic>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace pagoda {
namespace cpu {
namespace PAGODA_CPU_NS {
namespace {

using namespace vec;  // NOLINT

constexpr int L = kLanes;
constexpr DType F32 = DType::kFloat32;

// Keys per tile: a tile's scores (rows x kKeyTile) stay in L1.
constexpr int kKeyTile = 32;
static_assert(kKeyTile % 16 == 0, "tiles are whole vectors for both ISAs");
// Keys whose K/V rows are prefetched ahead of the tile being computed: one
// tile. Two tiles (48 KB of SmolLM2's batch-16 rows in flight) made its
// 30-layer decode call 10-15% slower, and requesting the next item's first
// tile all at once from the item before slower still: more requests than
// the core can keep in flight only queue behind one another (hence
// ItemCache::step's few at a time).
constexpr int64_t kPrefetchKeys = kKeyTile;
// An item's first K/V rows, up to this many bytes, are requested before its
// computation: while the item before computes, or else all at once as it
// starts (which alone took SmolLM2's 30 layers of batch-16 decode attention
// from cold K/V to 130 from 178 us a layer on Zen 4; 64 KB gained less,
// 256 KB no more, and the same held for requests paced over a share per tile).
constexpr int64_t kItemPrefetchBytes = 128 << 10;
// Keys ahead whose K rows tile_scores requests into L1 (see there).
constexpr int kNearKeys = 8;
// Query rows (tokens x heads of a GQA group) per chunk, when the group is
// smaller than this.
constexpr int64_t kTargetRows = 16;
// Key ranges of a split chunk are at least this long. Short enough that one
// decoding sequence of a few hundred keys splits: SmolLM2's 3 kv heads at 192
// keys make 9 items that 2 threads share 5:4, where 3 whole heads went 2:1.
constexpr int64_t kMinSplitKeys = 64;
// Aim for this many work items per thread (dynamic scheduling evens them out).
constexpr int64_t kItemsPerThread = 4;
// Below this much work (rows x keys x head_size), one thread does everything.
constexpr int64_t kParallelMinWork = int64_t{1} << 16;

constexpr float kNegInf = -__builtin_inff();

template <int N>
struct IntTag {
  static constexpr int value = N;
};

inline int64_t div_up(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

// ---------------------------------------------------------------------------
// The plan: chunks of query tokens, and the work items over them.

struct Chunk {
  int64_t seq;
  int64_t token0;     // its first query row (index into query and out)
  int64_t pos0;       // the position of that token in its sequence
  int64_t ntok;       // tokens in the chunk
  int64_t nsplit;     // key ranges (work items per kv head)
  int64_t split_len;  // keys per range, a multiple of kKeyTile
  int64_t partial;    // nsplit > 1: offset of its partial results, in floats
};

struct Item {
  int64_t chunk;
  int64_t kv_head;  // the first of its kv heads
  int64_t num_kv_heads;
  int64_t split;
};

// Everything an item needs, derived once per call.
struct Context {
  const PagedAttentionParams* p;
  int64_t group;        // query heads per kv head
  int64_t dp;           // head_size rounded up to whole vectors
  int64_t kv_row;       // elements between a kv head's rows in the cache
  int64_t max_rows;     // rows of the largest chunk
  int64_t max_heads;    // kv heads of the widest item
  float* partials;      // results of split items
};

// Per-thread buffers; all rows are dp floats apart. The rows of an item's
// kv heads follow one another (head after head, rows rows each).
struct Scratch {
  float* q;    // [heads x max_rows, dp] query rows x scale, zero-padded
  float* acc;  // [heads x max_rows, dp] sum of P V so far
  float* m;    // [heads x max_rows] running max of the scores
  float* l;    // [heads x max_rows] running sum of exp(score - m)
  float* s;    // [max_rows, kKeyTile] scores, then probabilities
  float* k;    // [kKeyTile, dp] the key tile in fp32 (when converted)
  float* v;    // [kKeyTile, dp] the value tile in fp32
  int* nv;     // [max_rows] keys of the current tile a row may see
  float* buffer;

  Scratch(int64_t max_rows, int64_t max_heads, int64_t dp) {
    const int64_t all_rows = max_rows * max_heads;
    buffer = new float[2 * all_rows * dp + 2 * all_rows + max_rows * kKeyTile +
                       2 * kKeyTile * dp + max_rows];
    q = buffer;
    acc = q + all_rows * dp;
    m = acc + all_rows * dp;
    l = m + all_rows;
    s = l + all_rows;
    k = s + max_rows * kKeyTile;
    v = k + kKeyTile * dp;
    nv = reinterpret_cast<int*>(v + kKeyTile * dp);
  }
  ~Scratch() { delete[] buffer; }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
};

// Walks a sequence's cache positions in order, giving each one's row offset
// (in elements, kv head 0) in a [num_blocks, block_size, num_kv_heads,
// head_size] cache.
class RowCursor {
 public:
  RowCursor(const int32_t* blocks, int64_t block_size, int64_t kv_row,
            int64_t pos)
      : blocks_(blocks),
        block_size_(block_size),
        kv_row_(kv_row),
        block_(pos / block_size),
        offset_(pos % block_size) {}

  int64_t next() {
    const int64_t row =
        (int64_t{blocks_[block_]} * block_size_ + offset_) * kv_row_;
    if (++offset_ == block_size_) {
      offset_ = 0;
      ++block_;
    }
    return row;
  }

 private:
  const int32_t* blocks_;
  int64_t block_size_, kv_row_, block_, offset_;
};

// Prefetches the cache lines of n > 0 bytes at p into L2, or with kL1 into
// L1. A batch's K/V rows a tile or two ahead are 24-48 KB, as much as L1
// holds, so they go to L2 (into L1, SmolLM2's decode call took 25-35% longer,
// the lines in use evicted by those ahead); only a few keys ahead go to L1.
template <bool kL1 = false>
inline void prefetch_bytes(const void* p, int64_t n) {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p);
  for (uintptr_t a = begin & ~uintptr_t{63}; a < begin + n; a += 64) {
    if constexpr (kL1) {
      prefetch(reinterpret_cast<const void*>(a));
    } else {
      prefetch_l2(reinterpret_cast<const void*>(a));
    }
  }
}

// One work item's view of the cache: kv heads [kv_head0, kv_head0 + heads)
// of one sequence, keys [begin, end). A key's rows of those heads lie side by
// side; they are requested into L2 in key order ahead of the computation
// (paged rows are scattered, and a batch's K/V comes from DRAM, so the
// hardware prefetchers miss them).
template <typename CT>
class ItemCache {
 public:
  ItemCache(const Context& c, const Chunk& ch, int64_t kv_head0,
            int64_t heads, int64_t begin, int64_t end)
      : keys_(static_cast<const CT*>(c.p->key_cache) +
              kv_head0 * c.p->head_size),
        values_(static_cast<const CT*>(c.p->value_cache) +
                kv_head0 * c.p->head_size),
        row_bytes_(heads * c.p->head_size * static_cast<int64_t>(sizeof(CT))),
        first_(c.p->block_tables + ch.seq * c.p->block_tables_stride,
               c.p->block_size, c.kv_row, begin),
        ahead_(first_),
        begin_(begin),
        requested_(begin),
        end_(min64(end, ch.pos0 + ch.ntok)),
        lead_(max64(1, kItemPrefetchBytes / (2 * row_bytes_))) {}

  const CT* keys() const { return keys_; }
  const CT* values() const { return values_; }
  int64_t begin() const { return begin_; }
  int64_t end() const { return end_; }
  RowCursor rows() const { return first_; }  // from key begin()
  // Keys requested before the item's computation starts.
  int64_t lead_keys() const { return lead_; }

  // Requests the rows of the keys before `key` not requested yet.
  void request_until(int64_t key) {
    for (key = min64(key, end_); requested_ < key; ++requested_) {
      const int64_t row = ahead_.next();
      prefetch_bytes(keys_ + row, row_bytes_);
      prefetch_bytes(values_ + row, row_bytes_);
    }
  }

  // Spreads the requests of the lead keys evenly over `steps` calls of
  // step(), made while the item before computes: a burst of them would stall
  // that computation once the core's queue of misses is full.
  void pace(int64_t steps) {
    steps_ = max64(1, steps);
    credit_ = 0;
  }
  void step() {
    int64_t keys = 0;
    for (credit_ += lead_; credit_ >= steps_; credit_ -= steps_) ++keys;
    request_until(requested_ + keys);
  }

 private:
  const CT* keys_;
  const CT* values_;
  int64_t row_bytes_;
  RowCursor first_, ahead_;
  int64_t begin_, requested_, end_, lead_;
  int64_t steps_ = 1, credit_ = 0;
};

// ---------------------------------------------------------------------------
// Row conversions.

// dst[0..dp) = src[0..n) * scale in fp32, zero past n (dp = n rounded up to
// whole vectors).
template <DType D>
inline void load_row(float* dst, const storage_t<D>* src, int64_t n,
                     float scale) {
  const Vec sc = set1(scale);
  int64_t i = 0;
  for (; i + L <= n; i += L) store<F32>(dst + i, load<D>(src + i) * sc);
  if (i < n) {
    store<F32>(dst + i, load_partial<D>(src + i, static_cast<int>(n - i)) * sc);
  }
}

// dst[0..n) = src[0..n) * scale, rounded to D.
template <DType D>
inline void store_row(storage_t<D>* dst, const float* src, int64_t n,
                      float scale) {
  const Vec sc = set1(scale);
  int64_t i = 0;
  for (; i + L <= n; i += L) store<D>(dst + i, load<F32>(src + i) * sc);
  if (i < n) {
    const int r = static_cast<int>(n - i);
    store_partial<D>(dst + i, load<F32>(src + i) * sc, r);
  }
}

// ---------------------------------------------------------------------------
// Micro-kernels. KD/VD is the storage type the key/value rows are read in:
// the cache dtype when read in place, fp32 when converted to a tile. Rows are
// dp elements long (whole vectors; padding is zero).
//
// Always inlined: called out of line, GCC kept the accumulator arrays on the
// stack (zeroed with rep stos, spilled before the reductions), which made
// SmolLM2's batch-16 decode call about 20% slower.
//
// Register blocking: R <= 4 query rows at a time (so a GQA group of up to four
// heads loads each K/V row once), each with C keys (scores) or NV vectors of
// the head (P V): 8 to 12 independent accumulators, enough to keep the FMA
// units busy, few enough for AVX2's 16 registers. Scores are reduced four at
// a time (hsum4), so R * C is a multiple of 4.
template <int R>
constexpr int kDotKeys = R == 1 ? 8 : R == 4 ? 2 : 4;
template <int R>
constexpr int kPvVectors = R == 1 ? 8 : R == 2 ? 4 : 2;

// Calls f(IntTag<R>(), r) for row blocks [r, r + R) covering [0, rows).
template <typename F>
inline void for_row_blocks(int64_t rows, const F& f) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) f(IntTag<4>(), r);
  switch (rows - r) {
    case 3: f(IntTag<3>(), r); break;
    case 2: f(IntTag<2>(), r); break;
    case 1: f(IntTag<1>(), r); break;
    default: break;
  }
}

// s[r * kKeyTile + c] = q[r] . k[c] for R query rows and C keys.
template <DType KD, int R, int C>
[[gnu::always_inline]] inline void dot_block(const float* q, int64_t dp,
                      const storage_t<KD>* const* k, float* s) {
  Vec acc[R * C];
  for (int i = 0; i < R * C; ++i) acc[i] = zero();
  for (int64_t d = 0; d < dp; d += L) {
    Vec qv[R];
    for (int r = 0; r < R; ++r) qv[r] = load<F32>(q + r * dp + d);
    for (int c = 0; c < C; ++c) {
      const Vec kv = load<KD>(k[c] + d);
      for (int r = 0; r < R; ++r) {
        acc[r * C + c] = fmadd(qv[r], kv, acc[r * C + c]);
      }
    }
  }
  float sums[R * C];
  if constexpr ((R * C) % 4 == 0) {
    for (int i = 0; i < R * C; i += 4) {
      hsum4(acc[i], acc[i + 1], acc[i + 2], acc[i + 3], sums + i);
    }
  } else {
    for (int i = 0; i < R * C; ++i) sums[i] = hsum(acc[i]);
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) s[r * kKeyTile + c] = sums[r * C + c];
}

// Scores of `rows` query rows against the tile's n keys. The K rows
// kNearKeys keys ahead are requested into L1 as each block of keys starts:
// the tile-ahead prefetch into L2 alone left each K load waiting on L3 or
// DRAM (SmolLM2's batch-16 decode, 30 layers from cold K/V, Zen 4: 184-191
// against 254-290 us a layer; 4 or 16 keys ahead gained less, the same for
// the V rows nothing). step() is called after each block of keys
// (score_blocks per row block and whole tile).
template <DType KD, typename Step>
void tile_scores(const float* q, int64_t rows, int64_t dp,
                 const storage_t<KD>* const* k, int n, float* s,
                 const Step& step) {
  const int64_t row_bytes = dp * static_cast<int64_t>(sizeof(storage_t<KD>));
  for_row_blocks(rows, [&](auto rows_tag, int64_t r) {
    constexpr int R = decltype(rows_tag)::value;
    constexpr int C = kDotKeys<R>;
    int j = 0;
    for (; j + C <= n; j += C) {
      for (int a = j + kNearKeys; a < j + kNearKeys + C && a < n; ++a) {
        prefetch_bytes<true>(k[a], row_bytes);
      }
      dot_block<KD, R, C>(q + r * dp, dp, k + j, s + r * kKeyTile + j);
      step();
    }
    for (; j < n; ++j) {
      dot_block<KD, R, 1>(q + r * dp, dp, k + j, s + r * kKeyTile + j);
    }
  });
}

// The blocks of keys tile_scores computes for `rows` rows over a whole tile.
inline int64_t score_blocks(int64_t rows) {
  int64_t blocks = 0;
  for_row_blocks(rows, [&](auto rows_tag, int64_t) {
    blocks += kKeyTile / kDotKeys<decltype(rows_tag)::value>;
  });
  return blocks;
}

// acc[r][d0 .. d0 + NV*L) += sum_j p[r * kKeyTile + j] * v[j][same] for R
// rows and keys j < n.
template <DType VD, int R, int NV>
[[gnu::always_inline]] inline void pv_block(float* acc, int64_t dp, const float* p,
                     const storage_t<VD>* const* v, int n, int64_t d0) {
  Vec a[R * NV];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NV; ++i) {
      a[r * NV + i] = load<F32>(acc + r * dp + d0 + i * L);
    }
  for (int j = 0; j < n; ++j) {
    Vec pj[R];
    for (int r = 0; r < R; ++r) pj[r] = set1(p[r * kKeyTile + j]);
    for (int i = 0; i < NV; ++i) {
      const Vec vv = load<VD>(v[j] + d0 + i * L);
      for (int r = 0; r < R; ++r) {
        a[r * NV + i] = fmadd(pj[r], vv, a[r * NV + i]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NV; ++i) {
      store<F32>(acc + r * dp + d0 + i * L, a[r * NV + i]);
    }
}

// acc += P V over the tile for `rows` rows; row r uses keys j < nv[r], and
// nv never decreases from one row to the next (later tokens see more), so a
// row block runs to its last row's count (the others have P = 0 there).
template <DType VD>
void tile_values(float* acc, int64_t rows, int64_t dp, const float* p,
                 const storage_t<VD>* const* v, const int* nv) {
  for_row_blocks(rows, [&](auto rows_tag, int64_t r) {
    constexpr int R = decltype(rows_tag)::value;
    constexpr int NV = kPvVectors<R>;
    const int n = nv[r + R - 1];
    int64_t d = 0;
    for (; d + NV * L <= dp; d += NV * L) {
      pv_block<VD, R, NV>(acc + r * dp, dp, p + r * kKeyTile, v, n, d);
    }
    for (; d < dp; d += L) {
      pv_block<VD, R, 1>(acc + r * dp, dp, p + r * kKeyTile, v, n, d);
    }
  });
}

// One row's online softmax step over a tile whose first nv (>= 1) keys it may
// see: s (kKeyTile scores) becomes exp(s - m') with zeros past nv; m and l are
// updated. Returns exp(m - m'), the factor for the row's accumulator.
inline float softmax_step(float* s, int nv, float* m, float* l) {
  for (int j = nv; j < kKeyTile; ++j) s[j] = kNegInf;
  Vec mx = load<F32>(s);
  for (int j = L; j < kKeyTile; j += L) mx = vmax(mx, load<F32>(s + j));
  const float tile_max = hmax(mx);
  const float m_new = tile_max > *m ? tile_max : *m;
  const Vec mv = set1(m_new);
  for (int j = 0; j < kKeyTile; j += L) {
    store<F32>(s + j, vec::exp(load<F32>(s + j) - mv));
  }
  for (int j = nv; j < kKeyTile; ++j) s[j] = 0.0f;
  Vec sum = zero();
  for (int j = 0; j < kKeyTile; j += L) sum = sum + load<F32>(s + j);
  const float correction = __builtin_expf(*m - m_new);  // 0 on the first tile
  *l = *l * correction + hsum(sum);
  *m = m_new;
  return correction;
}

// ---------------------------------------------------------------------------
// One work item: one chunk, kv heads [kv_head0, kv_head0 + heads), the keys
// of its `cache`, while requesting the first rows of `upcoming` (the
// thread's next item, if any). A split range (partial != null) has one head.
// D is the dtype of query and out, C the caches'.

template <DType D, DType C, bool kInPlace>
void attend(const Context& c, const Chunk& ch, int64_t kv_head0, int64_t heads,
            ItemCache<storage_t<C>>& cache, ItemCache<storage_t<C>>* upcoming,
            Scratch& w, float* partial) {
  using T = storage_t<D>;
  constexpr DType KD = kInPlace ? C : F32;  // how K/V rows are read
  using KT = storage_t<KD>;
  const PagedAttentionParams& p = *c.p;
  const int64_t head_size = p.head_size, dp = c.dp, group = c.group;
  const int64_t rows = ch.ntok * group;
  const auto* key_cache = cache.keys();
  const auto* value_cache = cache.values();
  const int64_t k_begin = cache.begin(), k_end = cache.end();

  // The item's first rows are requested as it starts (unless the item before
  // did), the rest a tile ahead of the computation; the next item's first
  // rows a few with each block of scores, so that they are on their way
  // while this item computes. SmolLM2's 30 layers of batch-16 decode
  // attention from cold K/V, Zen 4: 102-139 against 192-269 us a layer (a
  // share with each tile instead: 137-171 us; docs/BENCHMARKS.md).
  cache.request_until(k_begin + cache.lead_keys());
  if (upcoming != nullptr) {
    upcoming->pace(div_up(k_end - k_begin, kKeyTile) * heads *
                   score_blocks(rows));
  }
  auto step = [upcoming] {
    if (upcoming != nullptr) upcoming->step();
  };

  // Row r of head i: token r / group of the chunk, query head
  // (kv_head0 + i) * group + r % group; scratch row i * rows + r.
  const T* query = static_cast<const T*>(p.query);
  for (int64_t i = 0; i < heads; ++i) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t row = i * rows + r;
      const T* src = query + (ch.token0 + r / group) * p.query_stride +
                     ((kv_head0 + i) * group + r % group) * head_size;
      load_row<D>(w.q + row * dp, src, head_size, p.scale);
      w.m[row] = kNegInf;
      w.l[row] = 0.0f;
      for (int64_t d = 0; d < dp; d += L) {
        store<F32>(w.acc + row * dp + d, zero());
      }
    }
  }

  RowCursor cursor = cache.rows();
  int64_t cache_row[kKeyTile];
  const KT* kp[kKeyTile];
  const KT* vp[kKeyTile];
  for (int64_t t0 = k_begin; t0 < k_end; t0 += kKeyTile) {
    const int n = static_cast<int>(min64(kKeyTile, k_end - t0));
    for (int j = 0; j < n; ++j) cache_row[j] = cursor.next();
    cache.request_until(t0 + n + kPrefetchKeys);
    // Rows of tokens before the tile see none of it; the others see its
    // first nv keys, the same for every head.
    const int64_t r0 = max64(0, t0 - ch.pos0) * group;
    for (int64_t r = r0; r < rows; ++r) {
      w.nv[r] = static_cast<int>(min64(n, ch.pos0 + r / group - t0 + 1));
    }
    for (int64_t i = 0; i < heads; ++i) {
      // The tile's key and value rows of head i.
      for (int j = 0; j < n; ++j) {
        const int64_t row = cache_row[j] + i * head_size;
        if constexpr (kInPlace) {
          kp[j] = key_cache + row;
          vp[j] = value_cache + row;
        } else {
          load_row<C>(w.k + j * dp, key_cache + row, head_size, 1.0f);
          load_row<C>(w.v + j * dp, value_cache + row, head_size, 1.0f);
          kp[j] = w.k + j * dp;
          vp[j] = w.v + j * dp;
        }
      }
      float* q = w.q + i * rows * dp;
      float* acc = w.acc + i * rows * dp;
      tile_scores<KD>(q + r0 * dp, rows - r0, dp, kp, n, w.s + r0 * kKeyTile,
                      step);
      for (int64_t r = r0; r < rows; ++r) {
        const float correction =
            softmax_step(w.s + r * kKeyTile, w.nv[r], w.m + i * rows + r,
                         w.l + i * rows + r);
        if (correction != 1.0f) {
          const Vec cv = set1(correction);
          float* a = acc + r * dp;
          for (int64_t d = 0; d < dp; d += L) {
            store<F32>(a + d, load<F32>(a + d) * cv);
          }
        }
      }
      tile_values<KD>(acc + r0 * dp, rows - r0, dp, w.s + r0 * kKeyTile, vp,
                      w.nv + r0);
    }
  }

  if (partial == nullptr) {
    T* out = static_cast<T*>(p.out);
    for (int64_t i = 0; i < heads; ++i) {
      for (int64_t r = 0; r < rows; ++r) {
        T* dst = out + (ch.token0 + r / group) * p.out_stride +
                 ((kv_head0 + i) * group + r % group) * head_size;
        store_row<D>(dst, w.acc + (i * rows + r) * dp, head_size,
                     1.0f / w.l[i * rows + r]);
      }
    }
  } else {  // [rows, dp] acc, then m[rows], l[rows]
    for (int64_t i = 0; i < rows * dp; ++i) partial[i] = w.acc[i];
    for (int64_t r = 0; r < rows; ++r) {
      partial[rows * dp + r] = w.m[r];
      partial[rows * dp + rows + r] = w.l[r];
    }
  }
}

// Combines the partial results of a split chunk's ranges for one kv head:
// out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s with M = max_s m_s.
// A range a row cannot see has m_s = -inf, l_s = 0 and weight 0.
template <DType D>
void merge(const Context& c, const Chunk& ch, int64_t kv_head) {
  using T = storage_t<D>;
  const PagedAttentionParams& p = *c.p;
  const int64_t head_size = p.head_size, dp = c.dp, group = c.group;
  const int64_t rows = ch.ntok * group;
  const int64_t part_size = rows * (dp + 2);
  float* parts = c.partials + ch.partial + kv_head * ch.nsplit * part_size;
  T* out = static_cast<T*>(p.out);
  for (int64_t r = 0; r < rows; ++r) {
    float m_max = kNegInf;
    for (int64_t s = 0; s < ch.nsplit; ++s) {
      const float m = parts[s * part_size + rows * dp + r];
      m_max = m > m_max ? m : m_max;
    }
    float l_sum = 0.0f;
    for (int64_t s = 0; s < ch.nsplit; ++s) {
      const float* part = parts + s * part_size;
      l_sum += __builtin_expf(part[rows * dp + r] - m_max) *
               part[rows * dp + rows + r];
    }
    // Accumulate into the first range's acc row (owned by this merge alone).
    float* acc = parts + r * dp;
    const Vec w0 = set1(__builtin_expf(parts[rows * dp + r] - m_max));
    for (int64_t d = 0; d < dp; d += L) {
      store<F32>(acc + d, load<F32>(acc + d) * w0);
    }
    for (int64_t s = 1; s < ch.nsplit; ++s) {
      const float* part = parts + s * part_size;
      const Vec ws = set1(__builtin_expf(part[rows * dp + r] - m_max));
      for (int64_t d = 0; d < dp; d += L) {
        store<F32>(acc + d, fmadd(ws, load<F32>(part + r * dp + d),
                                  load<F32>(acc + d)));
      }
    }
    T* dst = out + (ch.token0 + r / group) * p.out_stride +
             (kv_head * group + r % group) * head_size;
    store_row<D>(dst, acc, head_size, 1.0f / l_sum);
  }
}

template <DType D, DType C>
void paged_attention_impl(const PagedAttentionParams& p) {
  const int64_t group = p.num_heads / p.num_kv_heads;
  const int64_t tokens_per_chunk = max64(1, kTargetRows / group);

  int threads = 1;
#ifdef _OPENMP
  threads = omp_get_max_threads();
#endif

  // Chunks, each sequence's last (costliest) first.
  int64_t num_chunks = 0, work = 0;
  for (int64_t s = 0; s < p.num_seqs; ++s) {
    const int64_t q_len = p.query_start_loc[s + 1] - p.query_start_loc[s];
    num_chunks += div_up(q_len, tokens_per_chunk);
    work += q_len * group * p.num_kv_heads * p.seq_lens[s];
  }
  if (num_chunks == 0) return;
  Chunk* chunks = new Chunk[num_chunks];
  int64_t n = 0;
  for (int64_t s = 0; s < p.num_seqs; ++s) {
    const int64_t token0 = p.query_start_loc[s];
    const int64_t q_len = p.query_start_loc[s + 1] - token0;
    const int64_t context = p.seq_lens[s] - q_len;  // positions before them
    for (int64_t i = div_up(q_len, tokens_per_chunk) - 1; i >= 0; --i) {
      const int64_t first = i * tokens_per_chunk;
      chunks[n++] = Chunk{s, token0 + first, context + first,
                          min64(tokens_per_chunk, q_len - first), 1, 0, 0};
    }
  }

  Context c;
  c.p = &p;
  c.group = group;
  c.dp = div_up(p.head_size, L) * L;
  c.kv_row = p.num_kv_heads * p.head_size;
  c.max_rows = tokens_per_chunk * group;
  c.partials = nullptr;
  // One item per chunk (all kv heads) where the chunks alone give every
  // thread kItemsPerThread items; else one per chunk and kv head.
  const int64_t heads_per_item =
      num_chunks >= int64_t{threads} * kItemsPerThread ? p.num_kv_heads : 1;
  c.max_heads = heads_per_item;

  // Split the keys of chunks that are much more work than an even share.
  const bool parallel = threads > 1 && work * p.head_size >= kParallelMinWork;
  const int64_t share = max64(1, work / (int64_t{threads} * kItemsPerThread));
  int64_t num_items = 0, partial_floats = 0;
  for (int64_t i = 0; i < num_chunks; ++i) {
    Chunk& ch = chunks[i];
    const int64_t keys = ch.pos0 + ch.ntok;
    const int64_t chunk_work = ch.ntok * group * keys;
    int64_t nsplit = 1;
    if (parallel) {
      nsplit = min64(div_up(chunk_work, share), max64(1, keys / kMinSplitKeys));
    }
    ch.split_len = div_up(div_up(keys, nsplit), kKeyTile) * kKeyTile;
    ch.nsplit = div_up(keys, ch.split_len);
    if (ch.nsplit > 1) {
      ch.partial = partial_floats;
      partial_floats +=
          p.num_kv_heads * ch.nsplit * ch.ntok * group * (c.dp + 2);
    }
    num_items += ch.nsplit > 1 ? p.num_kv_heads * ch.nsplit
                               : p.num_kv_heads / heads_per_item;
  }
  Item* items = new Item[num_items];
  n = 0;
  for (int64_t i = 0; i < num_chunks; ++i) {
    if (chunks[i].nsplit == 1) {
      for (int64_t h = 0; h < p.num_kv_heads; h += heads_per_item) {
        items[n++] = Item{i, h, heads_per_item, 0};
      }
      continue;
    }
    for (int64_t h = 0; h < p.num_kv_heads; ++h) {
      for (int64_t s = 0; s < chunks[i].nsplit; ++s) items[n++] = Item{i, h, 1, s};
    }
  }
  if (partial_floats > 0) c.partials = new float[partial_floats];

  // K/V rows are read in place (bf16/fp16 widened on the fly, which costs
  // less than a converted copy even for 16 rows) unless the head size is not
  // a whole number of vectors.
  const bool in_place = p.head_size % L == 0;
  using CT = storage_t<C>;
  auto cache_of = [&](int64_t i) {
    const Item& it = items[i];
    const Chunk& ch = chunks[it.chunk];
    const int64_t begin = it.split * ch.split_len;
    return ItemCache<CT>(c, ch, it.kv_head, it.num_kv_heads, begin,
                         begin + ch.split_len);
  };
  auto run_item = [&](int64_t i, ItemCache<CT>& cache,
                      ItemCache<CT>* upcoming, Scratch& w) {
    const Item& it = items[i];
    const Chunk& ch = chunks[it.chunk];
    float* partial = nullptr;
    if (ch.nsplit > 1) {
      const int64_t part_size = ch.ntok * group * (c.dp + 2);
      partial = c.partials + ch.partial +
                (it.kv_head * ch.nsplit + it.split) * part_size;
    }
    if (in_place) {
      attend<D, C, true>(c, ch, it.kv_head, it.num_kv_heads, cache, upcoming,
                         w, partial);
    } else {
      attend<D, C, false>(c, ch, it.kv_head, it.num_kv_heads, cache, upcoming,
                          w, partial);
    }
  };
  // Runs the items claim() hands out until it returns one past the last.
  // A thread claims its next item before it runs the current one, which
  // requests the next one's first rows (the cost: a thread may hold the last
  // item while another idles).
  auto run_items = [&](Scratch& w, const auto& claim) {
    int64_t i = claim();
    if (i >= num_items) return;
    ItemCache<CT> cache = cache_of(i);
    for (;;) {
      const int64_t next = claim();
      if (next >= num_items) {
        run_item(i, cache, nullptr, w);
        return;
      }
      ItemCache<CT> upcoming = cache_of(next);
      run_item(i, cache, &upcoming, w);
      cache = upcoming;
      i = next;
    }
  };
  auto run_merge = [&](int64_t i) {
    const Item& it = items[i];
    if (it.split == 0 && chunks[it.chunk].nsplit > 1) {
      merge<D>(c, chunks[it.chunk], it.kv_head);
    }
  };

  if (!parallel) {
    Scratch w(c.max_rows, c.max_heads, c.dp);
    int64_t claimed = 0;
    run_items(w, [&] { return claimed++; });
  } else {
    // A shared counter hands out the items (dynamic scheduling).
    std::atomic<int64_t> claimed{0};
#ifdef _OPENMP
#pragma omp parallel
#endif
    {
      Scratch w(c.max_rows, c.max_heads, c.dp);
      run_items(w, [&] {
        return claimed.fetch_add(1, std::memory_order_relaxed);
      });
      if (partial_floats > 0) {
#ifdef _OPENMP
#pragma omp barrier
#pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t i = 0; i < num_items; ++i) run_merge(i);
      }
    }
  }

  delete[] c.partials;
  delete[] items;
  delete[] chunks;
}

}  // namespace

void paged_attention(const PagedAttentionParams& p) {
  if (p.num_seqs <= 0 || p.num_heads <= 0 || p.num_kv_heads <= 0 ||
      p.head_size <= 0 || p.block_size <= 0) {
    return;
  }
  switch (p.dtype) {
    case DType::kFloat32:
      if (p.kv_dtype == DType::kBFloat16) {
        return paged_attention_impl<DType::kFloat32, DType::kBFloat16>(p);
      }
      return paged_attention_impl<DType::kFloat32, DType::kFloat32>(p);
    case DType::kBFloat16:
      return paged_attention_impl<DType::kBFloat16, DType::kBFloat16>(p);
    case DType::kFloat16:
      return paged_attention_impl<DType::kFloat16, DType::kFloat16>(p);
  }
}

}  // namespace PAGODA_CPU_NS
}  // namespace cpu
}  // namespace pagoda
